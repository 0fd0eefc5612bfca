"""The part-1 (NumPy) exercises check the algorithm, not only the answer: right variants written in
different styles pass; each false pass of the past fails with a message naming what is wrong; type,
dtype and time-limit problems are reported, never raised."""
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashlab import reference as R
from flashlab.grader import bugs as B
from flashlab.grader import grade


def _mask(nq, nk, i0=0, j0=0):
    return (j0 + np.arange(nk))[None, :] <= (i0 + np.arange(nq))[:, None]


# ---------------------------------------------------------------- attention_tiled: right variants

def tiled_loops(q, k, v, causal, bq, bk):
    """The solution's style: slices, @, np.where mask, skip bound computed from the tile's last row."""
    nq, d = q.shape
    nk = k.shape[0]
    o, lse = np.empty((nq, v.shape[1])), np.empty(nq)
    for i0 in range(0, nq, bq):
        qi = q[i0:i0 + bq]
        m, l, acc = np.full(len(qi), -np.inf), np.zeros(len(qi)), np.zeros((len(qi), v.shape[1]))
        for j0 in range(0, min(nk, i0 + len(qi)) if causal else nk, bk):
            s = qi @ k[j0:j0 + bk].T / np.sqrt(d)
            if causal:
                s = np.where(_mask(len(qi), s.shape[1], i0, j0), s, -np.inf)
            m_new = np.maximum(m, s.max(1))
            p = np.exp(s - m_new[:, None])
            alpha = np.exp(m - m_new)
            l = alpha * l + p.sum(1)
            acc = alpha[:, None] * acc + p @ v[j0:j0 + bk]
            m = m_new
        o[i0:i0 + bq], lse[i0:i0 + bq] = acc / l[:, None], m + np.log(l)
    return o, lse


def tiled_einsum_bias(q, k, v, causal, bq, bk):
    """np.einsum, an additive -inf bias for the mask, a `continue` past the diagonal, kT = k.T sliced by columns."""
    nq, d = q.shape
    nk = k.shape[0]
    kT = k.T
    o, lse = np.zeros((nq, d)), np.zeros(nq)
    for i0 in range(0, nq, bq):
        i1 = min(i0 + bq, nq)
        m = np.full(i1 - i0, -np.inf)
        l = np.zeros(i1 - i0)
        acc = np.zeros((i1 - i0, d))
        for j0 in range(0, nk, bk):
            if causal and j0 > i1 - 1:
                continue
            s = np.einsum("id,dj->ij", q[i0:i1], kT[:, j0:j0 + bk]) * (1 / math.sqrt(d))
            if causal:
                s = s + np.where(_mask(i1 - i0, s.shape[1], i0, j0), 0.0, -np.inf)
            m_new = np.maximum(m, np.max(s, axis=1))
            p = np.exp(s - m_new[:, None])
            alpha = np.exp(m - m_new)
            l = l * alpha + np.sum(p, axis=1)
            acc = acc * alpha[:, None] + np.einsum("ij,jd->id", p, v[j0:j0 + bk])
            m = m_new
        o[i0:i1] = acc / l[:, None]
        lse[i0:i1] = m + np.log(l)
    return o, lse


def tiled_boolean_assign_large_negative(q, k, v, causal, bq, bk):
    """m starts at a large negative number (with alpha guarded), the mask by boolean assignment, break."""
    nq, d = q.shape
    nk = k.shape[0]
    o, lse = np.zeros((nq, d)), np.zeros(nq)
    for i0 in range(0, nq, bq):
        qi = q[i0:i0 + bq] / math.sqrt(d)
        r = len(qi)
        m = np.full(r, -1e300)
        l = np.zeros(r)
        acc = np.zeros((r, d))
        for j0 in range(0, nk, bk):
            if causal and j0 >= i0 + r:
                break
            s = np.dot(qi, k[j0:j0 + bk].T)
            if causal:
                s[~_mask(r, s.shape[1], i0, j0)] = -np.inf
            m_new = np.maximum(m, s.max(axis=1))
            alpha = np.where(m == -1e300, 0.0, np.exp(m - m_new))
            p = np.exp(s - m_new[:, None])
            l = alpha * l + p.sum(axis=1)
            acc = alpha[:, None] * acc + p.dot(v[j0:j0 + bk])
            m = m_new
        o[i0:i0 + r] = acc / l[:, None]
        lse[i0:i0 + r] = m + np.log(l)
    return o, lse


def tiled_exp2(q, k, v, causal, bq, bk):
    """Base 2 inside (as GPU kernels do), converted at the end."""
    log2e = 1 / math.log(2)
    nq, d = q.shape
    nk = k.shape[0]
    o, lse = np.empty((nq, d)), np.empty(nq)
    for i0 in range(0, nq, bq):
        qi = q[i0:i0 + bq] * (log2e / math.sqrt(d))
        m, l, acc = np.full(len(qi), -np.inf), np.zeros(len(qi)), np.zeros((len(qi), d))
        for j0 in range(0, nk, bk):
            if causal and j0 > i0 + len(qi) - 1:
                break
            s = qi @ k[j0:j0 + bk].T
            if causal:
                s = np.where(_mask(len(qi), s.shape[1], i0, j0), s, -np.inf)
            m_new = np.maximum(m, s.max(1))
            alpha = np.exp2(m - m_new)
            p = np.exp2(s - m_new[:, None])
            l = alpha * l + p.sum(1)
            acc = alpha[:, None] * acc + p @ v[j0:j0 + bk]
            m = m_new
        o[i0:i0 + bq], lse[i0:i0 + bq] = acc / l[:, None], (m + np.log2(l)) / log2e
    return o, lse


def tiled_row_loops(q, k, v, causal, bq, bk):
    """Scalar-minded: one query row at a time inside each tile (slow, but the same algorithm)."""
    nq, d = q.shape
    nk = k.shape[0]
    o, lse = np.zeros((nq, d)), np.zeros(nq)
    for i0 in range(0, nq, bq):
        rows = range(i0, min(i0 + bq, nq))
        state = {i: [-math.inf, 0.0, np.zeros(d)] for i in rows}
        last = rows[-1]
        for j0 in range(0, nk, bk):
            if causal and j0 > last:
                break
            kj, vj = k[j0:j0 + bk], v[j0:j0 + bk]
            for i in rows:
                s = kj @ q[i] / math.sqrt(d)
                if causal:
                    s = np.where(j0 + np.arange(len(s)) <= i, s, -np.inf)
                m, l, a = state[i]
                m_new = max(m, float(s.max()))
                if m_new == -math.inf:
                    continue
                p = np.exp(s - m_new)
                alpha = math.exp(m - m_new)
                state[i] = [m_new, alpha * l + p.sum(), alpha * a + p @ vj]
        for i in rows:
            m, l, a = state[i]
            o[i], lse[i] = a / l, m + math.log(l)
    return o, lse


def fa1_own(q, k, v, causal, bq, bk):
    """The other loop order (K/V outer, O kept normalised in 'HBM'), written out."""
    nq, d = q.shape
    nk = k.shape[0]
    o, m, l = np.zeros((nq, d)), np.full(nq, -np.inf), np.zeros(nq)
    for j0 in range(0, nk, bk):
        kj, vj = k[j0:j0 + bk], v[j0:j0 + bk]
        for i0 in range(0, nq, bq):
            if causal and j0 > min(i0 + bq, nq) - 1:
                continue
            s = q[i0:i0 + bq] @ kj.T / math.sqrt(d)
            if causal:
                s = np.where(_mask(s.shape[0], s.shape[1], i0, j0), s, -np.inf)
            mt = s.max(1)
            p = np.exp(s - np.where(np.isneginf(mt), 0, mt)[:, None])
            mi, li = m[i0:i0 + bq], l[i0:i0 + bq]
            mn = np.maximum(mi, mt)
            a_old, a_new = np.exp(mi - mn), np.exp(mt - mn)
            ln = a_old * li + a_new * p.sum(1)
            o[i0:i0 + bq] = ((li * a_old)[:, None] * o[i0:i0 + bq] + a_new[:, None] * (p @ vj)) / ln[:, None]
            m[i0:i0 + bq], l[i0:i0 + bq] = mn, ln
    return o, m + np.log(l)


def tiled_split(q, k, v, causal, bq, bk):
    """Tiles from np.split / np.array_split views (no slicing by hand)."""
    nq, d = q.shape
    nk = k.shape[0]
    cuts = list(range(bk, nk, bk))
    ktiles, vtiles = np.split(k, cuts), np.split(v, cuts)
    o, lse = np.zeros((nq, d)), np.zeros(nq)
    for i0 in range(0, nq, bq):
        qi = q[i0:i0 + bq]
        m, l, acc = np.full(len(qi), -np.inf), np.zeros(len(qi)), np.zeros((len(qi), d))
        for j, (kj, vj) in enumerate(zip(ktiles, vtiles)):
            j0 = j * bk
            if causal and j0 > i0 + len(qi) - 1:
                break
            s = np.matmul(qi, kj.T) / math.sqrt(d)
            if causal:
                s = np.where(_mask(len(qi), len(kj), i0, j0), s, -np.inf)
            m_new = np.maximum(m, s.max(1))
            p, alpha = np.exp(s - m_new[:, None]), np.exp(m - m_new)
            l, acc, m = alpha * l + p.sum(1), alpha[:, None] * acc + p @ vj, m_new
        o[i0:i0 + bq], lse[i0:i0 + bq] = acc / l[:, None], m + np.log(l)
    return o, lse


def tiled_prescaled_k(q, k, v, causal, bq, bk):
    """K scaled once up front (and copied), the rest as in the solution."""
    k = k.copy() / math.sqrt(q.shape[1])
    return tiled_loops(q * math.sqrt(q.shape[1]), k, v, causal, bq, bk)


def tiled_while_tril(q, k, v, causal, bq, bk):
    """while loops, np.copy / astype copies of k and v, np.tril masks, k[j0:j0 + bk, :]."""
    nq, d = q.shape; nk = k.shape[0]
    o = np.zeros_like(q); lse = np.zeros(nq)
    k = np.copy(k); v = v.astype(np.float64)
    i0 = 0
    while i0 < nq:
        qi = q[i0:i0 + bq]; br = qi.shape[0]
        m = np.full(br, -np.inf); l = np.zeros(br); acc = np.zeros((br, d))
        j0 = 0
        while j0 < nk and (not causal or j0 <= i0 + br - 1):
            kj = k[j0:j0 + bk, :]; vj = v[j0:j0 + bk, :]
            s = (qi @ kj.T) * (1.0 / math.sqrt(d))
            if causal:
                keep = np.tril(np.ones((br, kj.shape[0])), k=i0 - j0).astype(bool)
                s = np.where(keep, s, -np.inf)
            m_new = np.maximum(m, s.max(axis=1)); p = np.exp(s - m_new[:, None]); a = np.exp(m - m_new)
            l = a * l + p.sum(axis=1); acc = acc * a[:, None] + p @ vj; m = m_new
            j0 += bk
        o[i0:i0 + br] = acc / l[:, None]; lse[i0:i0 + br] = np.log(l) + m
        i0 += bq
    return o, lse


RIGHT_TILED = [tiled_while_tril, tiled_prescaled_k, tiled_loops, tiled_einsum_bias,
               tiled_boolean_assign_large_negative, tiled_exp2, tiled_row_loops, fa1_own, tiled_split]


@pytest.mark.parametrize("fn", RIGHT_TILED, ids=lambda f: f.__name__)
def test_right_tiled_variants_pass(fn):
    for seed in (0, 1):
        r = grade("attention_tiled", fn, seed=seed)
        assert r.passed, str(r)


# ---------------------------------------------------------------- attention_tiled: the false passes

def _skip_variant(rule):
    def cand(q, k, v, causal, bq, bk):
        nq, d = q.shape
        o, lse = np.zeros((nq, d)), np.zeros(nq)
        for i, i0 in enumerate(range(0, nq, bq)):
            qi = q[i0:i0 + bq]
            m, l, acc = np.full(len(qi), -np.inf), np.zeros(len(qi)), np.zeros((len(qi), d))
            for j, j0 in enumerate(range(0, k.shape[0], bk)):
                if causal and rule(i, j, i0, j0):
                    continue
                s = qi @ k[j0:j0 + bk].T / math.sqrt(d)
                if causal:
                    s = np.where(_mask(len(qi), s.shape[1], i0, j0), s, -np.inf)
                m_new = np.maximum(m, s.max(1))
                p, alpha = np.exp(s - m_new[:, None]), np.exp(m - m_new)
                l, acc, m = alpha * l + p.sum(1), alpha[:, None] * acc + p @ v[j0:j0 + bk], m_new
            with np.errstate(all="ignore"):
                o[i0:i0 + bq], lse[i0:i0 + bq] = acc / l[:, None], m + np.log(l)
        return o, lse
    return cand


def _m_init_zero(q, k, v, causal, bq, bk):
    nq, d = q.shape
    o, lse = np.zeros((nq, d)), np.zeros(nq)
    with np.errstate(all="ignore"):
        for i0 in range(0, nq, bq):
            qi = q[i0:i0 + bq]
            m, l, acc = np.zeros(len(qi)), np.zeros(len(qi)), np.zeros((len(qi), d))
            for j0 in range(0, min(k.shape[0], i0 + len(qi)) if causal else k.shape[0], bk):
                s = qi @ k[j0:j0 + bk].T / math.sqrt(d)
                if causal:
                    s = np.where(_mask(len(qi), s.shape[1], i0, j0), s, -np.inf)
                m_new = np.maximum(m, s.max(1))
                p, alpha = np.exp(s - m_new[:, None]), np.exp(m - m_new)
                l, acc, m = alpha * l + p.sum(1), alpha[:, None] * acc + p @ v[j0:j0 + bk], m_new
            o[i0:i0 + bq], lse[i0:i0 + bq] = acc / l[:, None], m + np.log(l)
    return o, lse


def _naive_plus_lse(q, k, v, causal, bq, bk):
    s = q @ k.T / math.sqrt(q.shape[1])
    if causal:
        s = np.where(_mask(*s.shape), s, -np.inf)
    m = s.max(1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(1, keepdims=True)
    return (p / l) @ v, (m + np.log(l))[:, 0]


def _sdpa(q, k, v, causal, bq, bk):
    t = [torch.from_numpy(x)[None] for x in (q, k, v)]
    o = F.scaled_dot_product_attention(*t, is_causal=causal)[0].numpy()
    s = np.where(_mask(len(q), len(k)) | (not causal), q @ k.T / math.sqrt(q.shape[1]), -np.inf)
    m = s.max(1)
    return o, m + np.log(np.exp(s - m[:, None]).sum(1))


def _msgs(r):
    return "\n".join(d for c in r.cases for d in c.details) + "\n" + "\n".join(r.hints)


@pytest.mark.parametrize("cand,expect", [
    (_skip_variant(lambda i, j, i0, j0: j > i), "tile numbers"),            # wrong when block_q > block_k
    (_skip_variant(lambda i, j, i0, j0: j0 > i0), "tile starts"),
    (_m_init_zero, "running max started at 0"),
    (_naive_plus_lse, "never forms the"),
    (R.attention_fa2, "calls flashlab.reference.attention_fa2"),
    (lambda q, k, v, c, bq, bk: R.attention_fa1(q, k, v, c, bq, bk), "calls flashlab.reference.attention_fa1"),
    (lambda q, k, v, c, bq, bk: R.attention_naive(q, k, v, c), "calls flashlab.reference.attention_naive"),
    (_sdpa, "scaled_dot_product_attention"),
], ids=["skip_by_index", "skip_by_start", "m_init_zero", "naive_plus_lse", "reference_fa2", "reference_fa1",
        "reference_naive", "torch_sdpa"])
def test_tiled_false_passes_now_fail_with_a_reason(cand, expect):
    for seed in (0, 1, 2):
        r = grade("attention_tiled", cand, seed=seed)
        assert not r.passed
        assert expect in _msgs(r), str(r)


def test_skip_by_index_with_small_query_tiles_is_caught_by_the_read_check():
    """block_q < block_k: comparing tile numbers loads tiles above the diagonal (the answer stays right)."""
    r = grade("attention_tiled", _skip_variant(lambda i, j, i0, j0: j > i), seed=3)
    case = [c for c in r.cases if "block_q=8, block_k=16" in c.params][0]
    assert case.status == "fail" and case.message == "right answer, wrong algorithm"
    assert "above the" in "\n".join(case.details) and "loaded" in "\n".join(case.details)


def test_memory_bound_catches_a_full_score_matrix_behind_np_asarray():
    """np.asarray strips the instrumentation; the memory bound still sees the Nq x Nk matrix."""
    def cand(q, k, v, causal, bq, bk):
        return _naive_plus_lse(np.asarray(q), np.asarray(k), np.asarray(v), causal, bq, bk)
    r = grade("attention_tiled", cand, seed=4)
    mem = [c for c in r.cases if "peak memory" in c.params][0]
    assert mem.status == "fail" and "score matrix" in "\n".join(mem.details), str(r)


@pytest.mark.parametrize("rescale,title", [("div", "taken literally"), ("div_guarded", "first tile special-cased"),
                                           ("norm_inside", "normalised inside the loop")])
def test_divide_by_alpha_both_forms_and_normalise_inside_are_named(rescale, title):
    def cand(q, k, v, causal, bq, bk):           # own code: per Q tile, the mistake in the rescale
        nq, d = q.shape
        o, lse = np.zeros((nq, d)), np.zeros(nq)
        with np.errstate(all="ignore"):
            for i0 in range(0, nq, bq):
                qi = q[i0:i0 + bq]
                m, l, acc = np.full(len(qi), -np.inf), np.zeros(len(qi)), np.zeros((len(qi), d))
                for j0 in range(0, min(k.shape[0], i0 + len(qi)) if causal else k.shape[0], bk):
                    s = qi @ k[j0:j0 + bk].T / math.sqrt(d)
                    if causal:
                        s = np.where(_mask(len(qi), s.shape[1], i0, j0), s, -np.inf)
                    m_new = np.maximum(m, s.max(1))
                    p, alpha = np.exp(s - m_new[:, None]), np.exp(m - m_new)
                    l = alpha * l + p.sum(1)
                    if rescale == "div":
                        acc = acc / alpha[:, None]
                    elif rescale == "div_guarded":
                        acc = acc / np.where(np.isneginf(m), 1.0, alpha)[:, None]
                    else:
                        acc = alpha[:, None] * acc
                    acc = acc + p @ v[j0:j0 + bk]
                    if rescale == "norm_inside":
                        acc = acc / l[:, None]
                    m = m_new
                o[i0:i0 + bq] = acc if rescale == "norm_inside" else acc / l[:, None]
                lse[i0:i0 + bq] = m + np.log(l)
        return o, lse
    r = grade("attention_tiled", cand, seed=5)
    assert not r.passed and any(title in h for h in r.hints), str(r)
    if rescale.startswith("div"):
        assert any("e^(-inf) = 0" in h for h in r.hints)


# ---------------------------------------------------------------- online_softmax

def os_own(x, b):
    m, l = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
    for j in range(0, x.shape[1], b):
        blk = x[:, j:j + b]
        m_new = np.maximum(m, blk.max(axis=1))
        l = np.exp(m - m_new) * l + np.exp(blk - m_new[:, None]).sum(axis=1)
        m = m_new
    return np.exp(x - m[:, None]) / l[:, None]


def os_split_blockwise_writeout(x, b):
    """np.split into blocks, a guarded large-negative start, and the write-out block by block too."""
    blocks = np.split(x, range(b, x.shape[1], b), axis=1)
    m, l = np.full(x.shape[0], -1e300), np.zeros(x.shape[0])
    for blk in blocks:
        m_new = np.maximum(m, np.max(blk, axis=1))
        l = np.where(m == -1e300, 0.0, np.exp(m - m_new)) * l + np.sum(np.exp(blk - m_new[:, None]), axis=1)
        m = m_new
    return np.concatenate([np.exp(blk - m[:, None]) / l[:, None] for blk in blocks], axis=1)


def os_per_row(x, b):
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        m, l = -math.inf, 0.0
        for j in range(0, x.shape[1], b):
            blk = x[r, j:j + b]
            m_new = max(m, float(blk.max()))
            l = math.exp(m - m_new) * l + float(np.exp(blk - m_new).sum())
            m = m_new
        out[r] = np.exp(x[r] - m) / l
    return out


def os_copy(x, b):
    """np.copy, np.empty_like, blocks taken from x.T, np.maximum.reduce."""
    x = np.copy(x)
    p = np.empty_like(x)
    m, l = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
    xt = x.T
    for j in range(0, x.shape[1], b):
        blk = xt[j:j + b].T
        m_new = np.maximum.reduce([m, blk.max(axis=1)])
        l = np.exp(m - m_new) * l + np.exp(blk - m_new[:, None]).sum(axis=1)
        m = m_new
    p[:] = np.exp(x - m[:, None]) / l[:, None]
    return p
def os_array_split(x, b):
    """np.array_split into ceil(N / b) blocks."""
    n = -(-x.shape[1] // b)
    m, l = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
    for blk in np.array_split(x, n, axis=1):
        m_new = np.maximum(m, blk.max(1)); l = np.exp(m - m_new) * l + np.exp(blk - m_new[:, None]).sum(1); m = m_new
    return np.exp(x - m[:, None]) / l[:, None]
@pytest.mark.parametrize("fn", [os_own, os_split_blockwise_writeout, os_per_row, os_copy, os_array_split],
                         ids=lambda f: f.__name__)
def test_right_online_softmax_variants_pass(fn):
    for seed in (0, 1):
        r = grade("online_softmax", fn, seed=seed)
        assert r.passed, str(r)


def _two_pass(x, b):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _three_pass_blocked(x, b):
    m = np.full(x.shape[0], -np.inf)
    for j in range(0, x.shape[1], b):
        m = np.maximum(m, x[:, j:j + b].max(1))
    l = np.zeros(x.shape[0])
    for j in range(0, x.shape[1], b):
        l = l + np.exp(x[:, j:j + b] - m[:, None]).sum(1)
    return np.exp(x - m[:, None]) / l[:, None]


def _os_m_zero(x, b):
    m, l = np.zeros(x.shape[0]), np.zeros(x.shape[0])
    with np.errstate(all="ignore"):
        for j in range(0, x.shape[1], b):
            blk = x[:, j:j + b]
            m_new = np.maximum(m, blk.max(axis=1))
            l = np.exp(m - m_new) * l + np.exp(blk - m_new[:, None]).sum(axis=1)
            m = m_new
        return np.exp(x - m[:, None]) / l[:, None]


@pytest.mark.parametrize("cand,expect", [
    (_two_pass, "columns at a time"),
    (_three_pass_blocked, "separate passes"),
    (R.online_softmax, "calls flashlab.reference.online_softmax"),
    (_os_m_zero, "running max started at 0"),
], ids=["two_pass", "three_pass_blocked", "reference", "m_init_zero"])
def test_online_softmax_false_passes_now_fail(cand, expect):
    r = grade("online_softmax", cand, seed=0)
    assert not r.passed and expect in _msgs(r), str(r)


def test_online_softmax_update_reference_is_refused():
    r = grade("online_softmax_update", R.online_softmax_update, seed=0)
    assert not r.passed and "calls flashlab.reference.online_softmax_update" in _msgs(r)


# ---------------------------------------------------------------- attention_naive

def naive_own(q, k, v, causal):
    s = q @ k.T / np.sqrt(q.shape[1])
    if causal:
        s[np.triu_indices(s.shape[0], 1, s.shape[1])] = -np.inf
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


def test_naive_own_code_passes_and_reference_is_refused():
    assert grade("attention_naive", naive_own, seed=0).passed
    r = grade("attention_naive", lambda q, k, v, c: R.attention_naive(q, k, v, c)[0], seed=0)
    assert not r.passed and "asks for your own" in _msgs(r)


def test_mask_after_softmax_is_named_with_a_naive_hint():
    def cand(q, k, v, causal):
        s = q @ k.T / np.sqrt(q.shape[1])
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p = p / p.sum(axis=1, keepdims=True)
        if causal:
            p = np.where(_mask(*p.shape), p, 0.0)
        return p @ v
    r = grade("attention_naive", cand, seed=1)
    assert not r.passed and any("mask applied after the softmax" in h for h in r.hints), str(r)
    assert not any("tile" in h for h in r.hints), r.hints


def test_naive_hints_do_not_talk_about_tiles_or_triton():
    def causal_wrong(q, k, v, causal):          # masks j < i (strict) only for Nq != Nk: no known bug
        s = q @ k.T / np.sqrt(q.shape[1])
        if causal:
            s = np.where(_mask(*s.shape), s, -np.inf)
            if len(q) != len(k):
                s[:, -1] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        return (p / p.sum(axis=1, keepdims=True)) @ v
    r = grade("attention_naive", causal_wrong, seed=2)
    assert not r.passed
    text = " ".join(r.hints)
    assert "tl." not in text and "other=0" not in text and "tile" not in text, text


# ---------------------------------------------------------------- types, dtypes, exits

def test_float32_result_says_the_dtype_is_the_problem():
    r = grade("attention_naive", lambda q, k, v, c: naive_own(q, k, v, c).astype(np.float32), seed=0)
    fail = r.first_failure()
    assert not r.passed and "float32" in fail.message and "dtype" in "\n".join(fail.details), str(r)


def test_tuple_where_o_is_expected_is_explained():
    r = grade("attention_naive", lambda q, k, v, c: (naive_own(q, k, v, c), np.zeros(len(q))), seed=0)
    fail = r.first_failure()
    assert fail.status == "fail" and "returns only o" in "\n".join(fail.details), str(r)
    assert "traceback" not in " ".join(r.hints)


def test_complex_result_is_rejected():
    r = grade("attention_naive", lambda q, k, v, c: naive_own(q, k, v, c) + 1e-3j, seed=0)
    assert not r.passed and "complex" in r.first_failure().message, str(r)


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
def test_system_exit_and_keyboard_interrupt_are_reported(exc):
    def cand(x, b):
        raise exc()
    r = grade("online_softmax", cand, seed=0)
    assert not r.passed and r.cases[0].status == "error" and exc.__name__ in "\n".join(r.cases[0].details)


# ---------------------------------------------------------------- time limits

def test_a_600_second_candidate_is_stopped_within_two_minutes():
    def slow(q, k, v, causal, bq, bk):
        time.sleep(600)
    t0 = time.monotonic()
    r = grade("attention_tiled", slow, seed=0)
    took = time.monotonic() - t0
    assert took < 120, took
    assert [c.status for c in r.cases if c.status != "not run"] == ["timeout"]   # stopped at the first timed-out case
    assert r.incomplete == (1, len(r.cases)) and "incomplete: 1 of" in str(r)     # the rest: not run, never a pass
    assert any("Grading stopped" in h for h in r.hints), str(r)


def test_an_endless_python_loop_is_stopped_and_grading_stops_there():
    from dataclasses import replace

    from flashlab.grader.core import grade as core_grade
    from flashlab.grader.exercises import EXERCISES

    def spin(x, b):
        while True:
            pass
    ex = replace(EXERCISES["online_softmax"], timeout=2.0)
    t0 = time.monotonic()
    r = core_grade(ex, spin, seed=0)
    assert time.monotonic() - t0 < 10
    assert r.cases[0].status == "timeout" and all(c.status == "not run" for c in r.cases[1:])


@pytest.mark.parametrize("key,title", [(k, t) for k, t, _, _ in B.attention_bugs() if k not in B.TILE_ONLY])
def test_every_naive_attention_bug_is_named(key, title):
    fn = {k: f for k, _, _, f in B.attention_bugs()}[key]

    def cand(q, k, v, causal):
        with np.errstate(all="ignore"):
            return fn(q, k, v, causal, 1 / math.sqrt(q.shape[1]), 16)[0]
    r = grade("attention_naive", cand, seed=7)
    assert not r.passed and any(title in h for h in r.hints), str(r)


def test_kernel_exercise_stops_at_its_first_timed_out_case():
    """Kernel exercises used to keep going after a timed-out case (7 x 120 s); now grading stops there."""
    from dataclasses import replace

    from flashlab.grader.core import grade as core_grade
    from flashlab.grader.exercises import EXERCISES

    def hang(q, k, v, o, lse, causal):
        time.sleep(600)
    ex = replace(EXERCISES["flash_forward"], timeout=3.0)
    t0 = time.monotonic()
    r = core_grade(ex, hang, seed=0)
    assert time.monotonic() - t0 < 30
    assert [c.status for c in r.cases if c.status != "not run"] == ["timeout"] and "Grading stopped" in r.hints[0], \
        str(r)


def test_time_limit_holds_outside_the_main_thread_too():
    """No timer signal there: the case runs in a forked child that is killed at the limit."""
    import threading
    from dataclasses import replace

    from flashlab.grader.core import grade as core_grade
    from flashlab.grader.exercises import EXERCISES

    def slow(x, b):
        time.sleep(600)
    ex = replace(EXERCISES["online_softmax"], timeout=2.0)
    box = []
    t = threading.Thread(target=lambda: box.append(core_grade(ex, slow, seed=0)))
    t0 = time.monotonic()
    t.start()
    t.join(60)
    assert box and time.monotonic() - t0 < 30
    assert [c.status for c in box[0].cases if c.status != "not run"] == ["timeout"]


@pytest.mark.parametrize("key,title", [(k, t) for k, t, _, _ in B.lse_bugs()])
def test_every_lse_bug_is_named(key, title):
    fn = {k: f for k, _, _, f in B.lse_bugs()}[key]

    def cand(q, k, v, causal, bq, bk):
        o, lse = tiled_loops(q, k, v, causal, bq, bk)
        return fn(o, lse, B.row_max(q, np.array(k), causal, 1 / math.sqrt(q.shape[1])))
    r = grade("attention_tiled", cand, seed=8)
    assert not r.passed and any(title in h for h in r.hints), str(r)
