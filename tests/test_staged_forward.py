"""Notebook 05's staged build: the lecture's one-head kernel, the answers to flash_forward_tails and
flash_forward_causal, and their grading (hidden cases, named mistakes, the traced block-skipping rule)."""
import math

import numpy as np
import pytest
import torch

import flashlab  # noqa: F401  (device first)
from flashlab import reference

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from flashlab.grader import grade  # noqa: E402
from flashlab.teaching import one_head, staged_forward as S  # noqa: E402


def test_one_head_matches_float64():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(96, 32, generator=g) * m for m in (3.0, 3.0, 1.0))
    o = one_head.one_head_forward(q, k, v)
    ref = reference.attention_naive_torch(q.double()[None, None], k.double()[None, None], v.double()[None, None],
                                          False)[0][0, 0]
    assert (o.double() - ref).abs().max().item() < 1e-5


def test_one_head_refuses_what_it_cannot_do():
    x = torch.randn(100, 32)
    with pytest.raises(ValueError, match="multiple"):
        one_head.one_head_forward(x, x, x)
    y = torch.randn(32, 64).t()
    with pytest.raises(ValueError, match="contiguous"):
        one_head.one_head_forward(y, y, y)


def test_answers_pass_their_exercises():
    assert grade("flash_forward_tails", S.flash_forward_tails).passed
    assert grade("flash_forward_causal", S.flash_forward_causal).passed


@triton.jit
def _mutant(Q, K, V, O, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
            H, Nq, Nk, qk_scale, CAUSAL: tl.constexpr, SKIP: tl.constexpr, MASK_SCORES: tl.constexpr,
            BLOCK: tl.constexpr, D: tl.constexpr):
    start_m = tl.program_id(0)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    rows = start_m * BLOCK + tl.arange(0, BLOCK)
    offs = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :] * sqd, mask=rows[:, None] < Nq, other=0.0)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    hi = Nk
    if CAUSAL and SKIP:
        hi = tl.minimum((start_m + 1) * BLOCK, Nk)
    for start_n in range(0, hi, BLOCK):
        cols = start_n + offs
        k = tl.load(K + b * skb + h * skh + cols[:, None] * skn + d[None, :] * skd, mask=cols[:, None] < Nk, other=0.0)
        v = tl.load(V + b * svb + h * svh + cols[:, None] * svn + d[None, :] * svd, mask=cols[:, None] < Nk, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        keep = cols[None, :] >= 0
        if MASK_SCORES:
            keep = cols[None, :] < Nk
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = alpha * l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    tl.store(O + b * sob + h * soh + rows[:, None] * som + d[None, :] * sod, (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=rows[:, None] < Nq)


def _launcher(skip=True, mask_scores=True, with_causal=True):
    def f(q, k, v, o, causal=False):
        B, H, Nq, D = q.shape
        _mutant[(triton.cdiv(Nq, 32), B * H)](q, k, v, o, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                                              H, Nq, k.shape[2], math.log2(math.e) / math.sqrt(D),
                                              CAUSAL=causal, SKIP=skip, MASK_SCORES=mask_scores, BLOCK=32, D=D)
    return f if with_causal else (lambda q, k, v, o: f(q, k, v, o, False))


def _text(r):
    return "\n".join([" ".join(map(str, c.details)) + " " + str(c.message) for c in r.cases] + list(map(str, r.hints)))


def test_no_skipping_is_a_named_requirement():
    r = grade("flash_forward_causal", _launcher(skip=False))
    assert not r.passed
    assert "above the diagonal are loaded" in _text(r)


def test_skipping_kernel_meets_the_requirement():
    case = next(c for c in __import__("flashlab.grader.exercises.part2", fromlist=["x"])._staged_causal_cases(
        np.random.default_rng(0)) if c.params["Nk"] > 500)
    from flashlab.grader.exercises.part2 import skipping_violations
    assert skipping_violations(_launcher(skip=True), case) == []
    assert skipping_violations(_launcher(skip=False), case)


def test_scores_past_nk_unmasked_is_named():
    r = grade("flash_forward_tails", _launcher(mask_scores=False, with_causal=False))
    assert not r.passed
    assert "scores must be -inf" in _text(r)


def test_tails_answer_fails_causal():
    r = grade("flash_forward_causal", lambda q, k, v, o, causal: S.flash_forward_tails(q, k, v, o))
    assert not r.passed
