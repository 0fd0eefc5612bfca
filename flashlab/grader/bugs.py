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


def fa2_mutant(q, k, v, causal, block_k, scale, rescale="mul", rescale_l=True, phantom_tail=False, m0=-np.inf):
    """The FA2 inner loop over key tiles with one mistake switched on.

    rescale: how the accumulator is corrected when the max grows:
        "mul" (right), "none" (forgot alpha), "div" (divided by alpha: the paper's
        diag(...)^-1 misprint taken literally; alpha = e^(-inf) = 0 on the first tile, so 0/0 = NaN),
        "div_guarded" (divided by alpha, with the first tile special-cased so that it is not NaN),
        "norm_inside" (O~ divided by l at every step, not once at the end),
        "norm_twice" (as "norm_inside", and divided by l once more at the end).
    phantom_tail: the last tile is padded with zero keys that are not masked (score 0).
    m0: the running max's starting value (right: -inf; 0 is a mistake that gives 0/0 for
        rows whose scores are all below about -745).
    """
    nq, nk = q.shape[0], k.shape[0]
    keep_all = keep_mask(nq, nk, causal)
    m = np.full(nq, float(m0))
    l = np.zeros(nq)
    acc = np.zeros((nq, v.shape[1]))
    with np.errstate(all="ignore"):
        for j0 in range(0, nk, block_k):
            kj, vj = k[j0:j0 + block_k], v[j0:j0 + block_k]
            s = np.where(keep_all[:, j0:j0 + block_k], scale * (q @ kj.T), -np.inf)
            if phantom_tail and kj.shape[0] < block_k:
                extra = block_k - kj.shape[0]
                # a phantom key j >= Nk scores 0 (K loaded with other=0), but a causal mask still hides it
                # from queries i < j, as it would in the kernel
                js = np.arange(j0 + kj.shape[0], j0 + block_k)
                seen = np.ones((nq, extra), bool) if not causal else np.arange(nq)[:, None] >= js[None, :]
                s = np.concatenate([s, np.where(seen, 0.0, -np.inf)], axis=1)
                vj = np.concatenate([vj, np.zeros((extra, v.shape[1]))], axis=0)
            m_new = np.maximum(m, s.max(axis=1))
            p = np.exp(s - m_new[:, None])
            alpha = np.exp(m - m_new)
            l = (alpha if rescale_l else 1.0) * l + p.sum(axis=1)
            if rescale in ("mul", "norm_inside", "norm_twice"):
                acc = alpha[:, None] * acc
            elif rescale == "div":
                acc = acc / alpha[:, None]
            elif rescale == "div_guarded":
                acc = acc / np.where(np.isneginf(m), 1.0, alpha)[:, None]
            acc = acc + p @ vj
            if rescale in ("norm_inside", "norm_twice"):
                acc = acc / l[:, None]
            m = m_new
        o = acc if rescale == "norm_inside" else acc / l[:, None]
        return o, m + np.log(l)


def tiled_skip(q, k, v, causal, block_q, block_k, scale, skip):
    """FA2 with Q tiles whose causal tile skipping uses ``skip(i, j, i0, j0) -> bool`` (True: skip)."""
    nq, nk = q.shape[0], k.shape[0]
    o, lse = np.zeros((nq, v.shape[1])), np.zeros(nq)
    with np.errstate(all="ignore"):
        for i, i0 in enumerate(range(0, nq, block_q)):
            qi = q[i0:i0 + block_q]
            br = qi.shape[0]
            m, l, acc = np.full(br, -np.inf), np.zeros(br), np.zeros((br, v.shape[1]))
            for j, j0 in enumerate(range(0, nk, block_k)):
                if causal and skip(i, j, i0, j0):
                    continue
                kj, vj = k[j0:j0 + block_k], v[j0:j0 + block_k]
                s = scale * (qi @ kj.T)
                if causal:
                    s = np.where(R.causal_mask(br, kj.shape[0], i0, j0), s, -np.inf)
                m_new = np.maximum(m, s.max(axis=1))
                p = np.exp(s - m_new[:, None])
                alpha = np.exp(m - m_new)
                l = alpha * l + p.sum(axis=1)
                acc = alpha[:, None] * acc + p @ vj
                m = m_new
            o[i0:i0 + br], lse[i0:i0 + br] = acc / l[:, None], m + np.log(l)
    return o, lse


def tile_skip_bugs():
    """Causal tile skipping with a wrong test; only wrong when block_q != block_k.
    (key, title, hint, fn(q, k, v, causal, scale, block_q, block_k) -> (o, lse) or None)."""
    hint = ("a key tile may be skipped only when its first key comes after the query tile's last query: "
            "skip K tile j (first key j·block_k) for Q tile i when j·block_k > min((i+1)·block_q, Nq) − 1. "
            "Comparing tile numbers (j > i) or tile starts (j·block_k > i·block_q) is right only when "
            "block_q = block_k.")

    def by_index(q, k, v, c, s, bq, bk):
        return tiled_skip(q, k, v, c, bq, bk, s, lambda i, j, i0, j0: j > i) if c and bq != bk else None

    def by_start(q, k, v, c, s, bq, bk):
        return tiled_skip(q, k, v, c, bq, bk, s, lambda i, j, i0, j0: j0 > i0) if c and bq != bk else None

    return [
        ("skip_by_index", "causal tiles skipped by comparing tile numbers (j > i)", hint, by_index),
        ("skip_by_start", "causal tiles skipped by comparing tile starts (j·block_k > i·block_q)", hint, by_start),
    ]


# Which attention mistakes need tiles (not named for naive attention), which may be named for an
# all-NaN output, and the hints naive attention gets instead of the tiled ones.
TILE_ONLY = {"forgot_alpha", "forgot_alpha_l", "divide_alpha", "divide_alpha_guarded", "unmasked_tail",
             "normalise_inside", "normalise_twice", "m_init_zero"}
NAN_OK = {"divide_alpha"}
NAIVE_HINTS = {
    "no_normalise": "divide each row of e^(S − m) by its sum before multiplying by V: "
                    "P = e^(S − m)/rowsum(e^(S − m)).",
    "no_max": "e^S overflows for large scores: subtract each row's maximum before exponentiating.",
}


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
        ("divide_alpha_guarded", "divided by alpha instead of multiplying (first tile special-cased)",
         "the rescale is O~ <- diag(alpha) O~ with alpha = e^(m_old - m_new) <= 1: when the max grows the old "
         "sum shrinks. Dividing inflates it by 1/alpha instead (special-casing the first tile, where "
         "alpha = e^(-inf) = 0, only hides the 0/0 there). The FA2 paper's Algorithm 1 prints diag(...)^-1 "
         "at this step; taken literally it divides, which is wrong.",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, rescale="div_guarded")),
        ("normalise_inside", "output normalised inside the loop",
         "O~ stays unnormalised during the loop over key tiles (rescaled by alpha only); divide by l once, "
         "after the last tile: O = diag(l)^-1 O~. Dividing at every step mixes normalised and unnormalised "
         "sums (FA1 keeps O normalised, but then rescales it by l_old/l_new, not by alpha).",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, rescale="norm_inside")),
        ("normalise_twice", "output normalised inside the loop (and again at the end)",
         "O~ stays unnormalised during the loop over key tiles (rescaled by alpha only); divide by l once, "
         "after the last tile: O = diag(l)^-1 O~.",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, rescale="norm_twice")),
        ("mask_after_softmax", "causal mask applied after the softmax",
         "mask the scores (S_ij = -inf where j > i) before the softmax; zeroing probabilities after it leaves "
         "rows that no longer sum to 1.",
         lambda q, k, v, c, s, bk: _mask_after(q, k, v, c, s) if c else None),
        ("m_init_zero", "running max started at 0",
         "start the running max at m = -inf, not 0: for a row whose scores are all below about -745, "
         "e^(S - 0) underflows to 0, l = 0 and O = 0/0 = NaN.",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, m0=0.0)),
        ("unmasked_tail", "ragged tail not masked",
         "past the last key, scores must be -inf (not 0): set s = -inf where j >= Nk.",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, phantom_tail=True) if len(k) % bk else None),
        ("divide_alpha", "divided by alpha (the diag(alpha)^-1 misprint, taken literally)",
         "an output that is NaN everywhere is what dividing the accumulator by alpha gives: on the first tile "
         "m_old = -inf, so alpha = e^(m_old - m_new) = e^(-inf) = 0 and O~/alpha = 0/0 = NaN, which then "
         "spreads to every later tile. The rescale multiplies: O~ <- diag(alpha) O~ + P~ V_j (alpha <= 1 "
         "shrinks the old sum when the max grows). The FA2 paper's Algorithm 1 prints diag(...)^-1 there.",
         lambda q, k, v, c, s, bk: fa2_mutant(q, k, v, c, bk, s, rescale="div")),
    ]


def _mask_after(q, k, v, causal, scale):
    """Softmax over all keys, then the causal mask applied to P (not renormalised)."""
    s = scale * (q @ k.T)
    with np.errstate(all="ignore"):
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True)
        p = np.where(keep_mask(len(q), len(k), causal), p / l, 0.0)
        return p @ v, (m + np.log(l))[:, 0]


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
         "e^(m_new - m)) inflates the sum every time the max grows. On the first block m = -inf, so "
         "alpha = e^(-inf) = 0 and l/alpha = 0/0 = NaN.", div_alpha),
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

    def m_init_zero(x, b):
        m, l = np.zeros(x.shape[0]), np.zeros(x.shape[0])
        with np.errstate(all="ignore"):
            for j in range(0, x.shape[1], b):
                m, l = R.online_softmax_update(m, l, x[:, j:j + b])
            return np.exp(x - m[:, None]) / l[:, None]

    def div_alpha(x, b):
        m, l = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
        with np.errstate(all="ignore"):
            for j in range(0, x.shape[1], b):
                m_new = np.maximum(m, x[:, j:j + b].max(1))
                l = l / np.exp(m - m_new) + np.exp(x[:, j:j + b] - m_new[:, None]).sum(1)
                m = m_new
            return np.exp(x - m[:, None]) / l[:, None]

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
        ("m_init_zero", "running max started at 0",
         "start from m = -inf, not 0: for a row whose values are all below about -745, e^(x - 0) underflows "
         "to 0, l = 0 and p = 0/0 = NaN.", m_init_zero),
        ("div_alpha", "divided by alpha",
         "an output that is NaN everywhere is what dividing the running sum by alpha gives: on the first "
         "block m = -inf, so alpha = e^(m - m_new) = e^(-inf) = 0 and l/alpha = 0/0 = NaN. alpha "
         "multiplies: l_new = alpha l + rowsum(e^(x - m_new)).", div_alpha),
    ]


ONLINE_SOFTMAX_NAN_OK = {"div_alpha"}


def backward_bugs():
    """(key, title, hint, fn(q, k, v, do, causal, scale) -> (dq, dk, dv)): the backward's mistakes live in
    :mod:`flashlab.grader.bugs_backward` (with their tile-size variants)."""
    from .bugs_backward import backward_bugs as _backward_bugs
    return _backward_bugs()
