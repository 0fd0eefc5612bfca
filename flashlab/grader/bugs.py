"""The library of known mistakes, as runnable NumPy code.

Each function computes what a candidate *with that mistake* returns, on one
(batch, head) slice, so the grader can say "this looks like ..." when a
learner's output matches.  These are deliberately wrong; the right versions
live in :mod:`flashlab.reference`.
"""
from __future__ import annotations

import math

import numpy as np

from .. import reference as R

LOG2E = 1.0 / math.log(2.0)


def masked_attention(q, k, v, keep, scale, subtract_max=True, normalise=True):
    """Attention with an arbitrary boolean mask ``keep`` (Nq, Nk); returns (o, lse)."""
    s = scale * (q @ k.T)
    s = np.where(keep, s, -np.inf)
    with np.errstate(all="ignore"):
        m = s.max(axis=1, keepdims=True) if subtract_max else np.zeros((s.shape[0], 1))
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True)
        o = (p / l) @ v if normalise else p @ v
        lse = (m + np.log(l))[:, 0]
    return o, lse


def keep_mask(nq, nk, causal, kind="top_left"):
    if not causal:
        return np.ones((nq, nk), dtype=bool)
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    return {"top_left": j <= i, "strict": j < i, "upper": j >= i,
            "bottom_right": j <= i + (nk - nq)}[kind]


def fa2_mutant(q, k, v, causal, block_k, scale, rescale="mul", rescale_l=True, phantom_tail=False):
    """The FA2 inner loop over key tiles with one mistake switched on.

    rescale: how the accumulator is corrected when the max grows:
        "mul" (right), "none" (forgot alpha), "div" (divided by alpha: the paper's
        diag(...)^-1 typo taken literally).
    phantom_tail: the last tile is padded with zero keys that are not masked (score 0).
    """
    nq, nk = q.shape[0], k.shape[0]
    keep_all = keep_mask(nq, nk, causal)
    m = np.full(nq, -np.inf)
    l = np.zeros(nq)
    acc = np.zeros((nq, v.shape[1]))
    with np.errstate(all="ignore"):
        for j0 in range(0, nk, block_k):
            kj, vj = k[j0:j0 + block_k], v[j0:j0 + block_k]
            s = np.where(keep_all[:, j0:j0 + block_k], scale * (q @ kj.T), -np.inf)
            if phantom_tail and kj.shape[0] < block_k:
                extra = block_k - kj.shape[0]
                s = np.concatenate([s, np.zeros((nq, extra))], axis=1)
                vj = np.concatenate([vj, np.zeros((extra, v.shape[1]))], axis=0)
            m_new = np.maximum(m, s.max(axis=1))
            p = np.exp(s - m_new[:, None])
            alpha = np.exp(m - m_new)
            l = (alpha if rescale_l else 1.0) * l + p.sum(axis=1)
            if rescale == "mul":
                acc = alpha[:, None] * acc
            elif rescale == "div":
                acc = acc / alpha[:, None]
            acc = acc + p @ vj
            m = m_new
        return acc / l[:, None], m + np.log(l)


def attention_bugs():
    """(key, title, hint, fn(q, k, v, causal, scale, block_k) -> (o, lse) or None)."""
    def sc(q):
        return 1.0 / math.sqrt(q.shape[1])

    return [
        ("no_scale", "missing softmax scale",
         "scores must be multiplied by s = 1/sqrt(D) before the softmax.",
         lambda q, k, v, c, s, bk: masked_attention(q, k, v, keep_mask(len(q), len(k), c), 1.0)),
        ("scale_1_over_d", "scale 1/D instead of 1/sqrt(D)",
         "the softmax scale is 1/sqrt(D), not 1/D.",
         lambda q, k, v, c, s, bk: masked_attention(q, k, v, keep_mask(len(q), len(k), c), 1.0 / q.shape[1])),
        ("causal_ignored", "causal mask not applied",
         "with causal=True, query i may only see keys j <= i.",
         lambda q, k, v, c, s, bk: masked_attention(q, k, v, keep_mask(len(q), len(k), False), s) if c else None),
        ("causal_strict", "causal mask off by one (j < i)",
         "a query sees its own key: keep j <= i, not j < i (row 0 then sees nothing and becomes NaN).",
         lambda q, k, v, c, s, bk: masked_attention(q, k, v, keep_mask(len(q), len(k), c, "strict"), s) if c else None),
        ("causal_upper", "causal mask reversed",
         "keep the lower triangle (keys j <= i), not the upper one.",
         lambda q, k, v, c, s, bk: masked_attention(q, k, v, keep_mask(len(q), len(k), c, "upper"), s) if c else None),
        ("causal_bottom_right", "causal mask aligned bottom-right",
         "this course aligns the causal mask top-left, like SDPA's is_causal: query i sees keys j <= i "
         "even when Nq != Nk.",
         lambda q, k, v, c, s, bk: (masked_attention(q, k, v, keep_mask(len(q), len(k), c, "bottom_right"), s)
                                    if c and len(q) != len(k) else None)),
        ("no_max", "no max subtraction",
         "e^S overflows for large scores: subtract the (running) row maximum before exponentiating.",
         lambda q, k, v, c, s, bk: masked_attention(q, k, v, keep_mask(len(q), len(k), c), s, subtract_max=False)),
        ("no_normalise", "output not normalised",
         "divide the accumulator by the row sum l once at the end: O = diag(l)^-1 O~.",
         lambda q, k, v, c, s, bk: masked_attention(q, k, v, keep_mask(len(q), len(k), c), s, normalise=False)),
        ("forgot_alpha", "accumulator not rescaled when the max grows",
         "when m grows, multiply the accumulator (and l) by alpha = e^(m_old - m_new) before adding P~ V.",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, rescale="none")),
        ("forgot_alpha_l", "running sum l not rescaled",
         "l must be rescaled too: l_new = alpha * l + rowsum(P~).",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, rescale="mul", rescale_l=False)),
        ("divide_alpha", "divided by alpha instead of multiplying",
         "the rescale is O~ <- diag(alpha) O~ with alpha = e^(m_old - m_new) <= 1. The FA2 paper's "
         "Algorithm 1 prints diag(...)^-1 there; taken literally it divides, which is wrong.",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, rescale="div")),
        ("unmasked_tail", "ragged tail not masked",
         "past the last key, scores must be -inf (not 0): set s = -inf where j >= Nk.",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, phantom_tail=True) if len(k) % bk else None),
    ]


def lse_bugs():
    """Mistakes in the LSE alone (the output O is right)."""
    return [
        ("lse_base2", "LSE in base 2",
         "the LSE is a natural log: if you worked with exp2, convert back with L = (m2 + log2 l) * ln 2.",
         lambda o, lse, m: (o, lse * LOG2E)),
        ("lse_no_max", "LSE without the max",
         "L = m + log(l): the running max must be added back.",
         lambda o, lse, m: (o, lse - m)),
    ]


def row_max(q, k, causal, scale):
    s = np.where(keep_mask(len(q), len(k), causal), scale * (q @ k.T), -np.inf)
    return s.max(axis=1)


def online_softmax_update_bugs():
    def no_alpha(m, l, x):
        m_new = np.maximum(m, x.max(1))
        return m_new, l + np.exp(x - m_new[:, None]).sum(1)

    def div_alpha(m, l, x):
        m_new = np.maximum(m, x.max(1))
        with np.errstate(all="ignore"):
            return m_new, l / np.exp(m - m_new) + np.exp(x - m_new[:, None]).sum(1)

    def old_max(m, l, x):
        m_new = np.maximum(m, x.max(1))
        with np.errstate(all="ignore"):
            return m_new, np.exp(m - m_new) * l + np.exp(x - m[:, None]).sum(1)

    def block_max_only(m, l, x):
        mb = x.max(1)
        return mb, np.exp(x - mb[:, None]).sum(1)

    return [
        ("no_alpha", "old sum not rescaled",
         "when the max grows, the old sum was computed against the old max: l_new = e^(m - m_new) l + ...", no_alpha),
        ("div_alpha", "alpha upside down (divided by alpha)",
         "alpha = e^(m - m_new) <= 1 multiplies the old sum; dividing by it (or multiplying by "
         "e^(m_new - m)) inflates the sum every time the max grows.", div_alpha),
        ("old_max", "new block exponentiated against the old max",
         "exponentiate the new block against m_new, the max after seeing it.", old_max),
        ("block_max_only", "state reset on every block",
         "m_new is the max of the old m and the block's max, and the old sum must be carried over.", block_max_only),
    ]


def online_softmax_bugs():
    def no_rescale(x, b):
        m = np.full(x.shape[0], -np.inf)
        l = np.zeros(x.shape[0])
        for j in range(0, x.shape[1], b):
            m_new = np.maximum(m, x[:, j:j + b].max(1))
            l = l + np.exp(x[:, j:j + b] - m_new[:, None]).sum(1)
            m = m_new
        return np.exp(x - m[:, None]) / l[:, None]

    def last_block_max(x, b):
        m = np.full(x.shape[0], -np.inf)
        l = np.zeros(x.shape[0])
        for j in range(0, x.shape[1], b):
            m, l = R.online_softmax_update(m, l, x[:, j:j + b])
        mb = x[:, ((x.shape[1] - 1) // b) * b:].max(1)
        with np.errstate(all="ignore"):
            return np.exp(x - mb[:, None]) / l[:, None]

    def unsafe(x, b):
        with np.errstate(all="ignore"):
            e = np.exp(x)
            return e / e.sum(1, keepdims=True)

    def wrong_axis(x, b):
        with np.errstate(all="ignore"):
            e = np.exp(x - x.max(0, keepdims=True))
            return e / e.sum(0, keepdims=True)

    return [
        ("no_rescale", "running sum not rescaled", "multiply l by alpha = e^(m_old - m_new) whenever m grows.",
         no_rescale),
        ("last_block_max", "normalised with the wrong max",
         "the final e^(x - m) must use the max over the whole row, which is the running m after the last block.",
         last_block_max),
        ("unsafe", "no max subtraction", "e^x overflows for large x: subtract the row max.", unsafe),
        ("wrong_axis", "softmax along the wrong axis", "normalise each row (axis=-1), not each column.", wrong_axis),
    ]


def backward_bugs():
    """(key, title, hint, fn(q, k, v, do, causal, scale) -> (dq, dk, dv)): the backward's mistakes live in
    :mod:`flashlab.grader.bugs_backward` (with their tile-size variants)."""
    from .bugs_backward import backward_bugs as _backward_bugs
    return _backward_bugs()
