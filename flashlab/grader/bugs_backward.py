"""Known mistakes in a FlashAttention-2 backward, as runnable NumPy code (one (batch, head) slice).

Each mistake is written as what the two kernels of notebook 07 would compute with it:

    dK/dV kernel (K_j, V_j stationary)    dV = P^T dO,          dK = s dS^T Q
    dQ kernel    (Q_i stationary)         dQ = s dS K
    with P = e^(S - L), dP = dO V^T, dS = P o (dP - D), D_i = rowsum(dO_i o O_i)

Several mistakes depend on the tile sizes the learner picked (which tiles a kernel visits,
which columns a per-tile sum covers), so :func:`backward_bug_variants` returns every
variant for tile sizes 16..128; the grader names a mistake when the learner's output
matches any of them.  :func:`backward_bugs` gives one representative per mistake (what a
test can feed the grader as a "learner" with that mistake).
"""
from __future__ import annotations

import math

import numpy as np

BLOCKS = (16, 32, 64, 128)


def _lse(s):
    with np.errstate(all="ignore"):
        m = s.max(1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        return (m + np.log(np.exp(s - m).sum(1, keepdims=True)))[:, 0]


def causal_keep(nq, nk):
    """Top-left causal mask: query i sees key j <= i."""
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None]


def dq_tiles_visited(nq, nk, bm, bn):
    """Scores the dQ kernel treats as visible if it skips key tiles past the diagonal but forgets
    the elementwise mask: key tiles j0 < min((i // bm + 1) * bm, Nk), whole tiles."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    hi = np.minimum((i // bm + 1) * bm, nk)
    return (j // bn) * bn < hi


def dkdv_tiles_visited(nq, nk, bm, bn):
    """Same for the dK/dV kernel: it starts at Q tile (j0 // bm) * bm for key tile j0."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    lo = ((j // bn) * bn // bm) * bm
    return i >= lo


def grads(q, k, v, do, causal, scale, *, delta="right", block_n=None, scale_dq=True, scale_dk=True,
          see_dq=None, see_dkdv=None, lse_factor=1.0):
    """(dq, dk, dv) of one slice, with the given mistakes.

    delta:      "right" D_i = rowsum(dO o O); "none" D = 0; "do_only" D_i = rowsum(dO_i);
                "p_tile" D_i = rowsum(P_ij o dP_ij) over the current key tile only (width block_n).
    see_dq, see_dkdv: (Nq, Nk) masks of the scores each kernel treats as visible
                (default: the right causal mask).
    lse_factor: P = exp(S - lse_factor * L) (ln 2: the LSE read as if it were base 2).
    """
    nq, nk = len(q), len(k)
    keep = causal_keep(nq, nk) if causal else np.ones((nq, nk), bool)
    s = scale * (q @ k.T)
    lse = _lse(np.where(keep, s, -np.inf))
    with np.errstate(all="ignore"):
        p_right = np.exp(np.where(keep, s, -np.inf) - lse[:, None])
        o = p_right @ v
        dp = do @ v.T
        out = {}
        for kernel, see in (("dq", see_dq), ("dkdv", see_dkdv)):
            see = keep if see is None else see
            p = np.where(see, np.exp(s - lse_factor * lse[:, None]), 0.0)
            if delta == "right":
                d = (do * o).sum(1, keepdims=True)
            elif delta == "none":
                d = 0.0
            elif delta == "do_only":
                d = do.sum(1, keepdims=True)
            elif delta == "p_tile":
                pdp = p * dp
                d = np.zeros_like(pdp)
                for j0 in range(0, nk, block_n):
                    d[:, j0:j0 + block_n] = pdp[:, j0:j0 + block_n].sum(1, keepdims=True)
            else:
                raise ValueError(delta)
            ds = p * (dp - d)
            if kernel == "dq":
                out["dq"] = (scale if scale_dq else 1.0) * ds @ k
            else:
                out["dk"] = (scale if scale_dk else 1.0) * ds.T @ q
                out["dv"] = p.T @ do
    return out["dq"], out["dk"], out["dv"]


def _unseen_unwritten(q, k, v, do, causal, scale, rows):
    """The right gradients, with dK and dV rows ``rows`` never written (NaN stands for 'unwritten')."""
    dq, dk, dv = grads(q, k, v, do, causal, scale)
    dk, dv = dk.copy(), dv.copy()
    dk[rows], dv[rows] = np.nan, np.nan
    return dq, dk, dv


def _unseen_variants(q, k, v, do, causal, scale):
    nq, nk = len(q), len(k)
    if not causal or nk <= nq:
        return None
    masks, seen = [], set()
    j = np.arange(nk)
    cands = [j >= nq]                                            # the store masked with j < Nq
    for bn in BLOCKS:
        cands.append((j // bn) * bn >= nq)                       # "my key tile starts past the last query"
        for bm in BLOCKS:
            cands.append(((j // bn) * bn // bm) * bm >= nq)      # the Q loop starts past Nq: no store
    for m in cands:
        key = m.tobytes()
        if key not in seen:   # an empty mask too: with that tile shape the bug has no effect here
            seen.add(key)
            masks.append(m)
    return [_unseen_unwritten(q, k, v, do, causal, scale, m) for m in masks]


def backward_bug_variants():
    """(key, title, hint, variants(q, k, v, do, causal, scale) -> list of (dq, dk, dv) or None)."""
    def one(**kw):
        return lambda q, k, v, do, c, s: [grads(q, k, v, do, c, s, **kw)]

    def p_tile(q, k, v, do, c, s):
        return [grads(q, k, v, do, c, s, delta="p_tile", block_n=bn) for bn in BLOCKS if bn < len(k)]

    def mask_missing(which):
        def variants(q, k, v, do, c, s):
            if not c:
                return None
            nq, nk = len(q), len(k)
            full = np.ones((nq, nk), bool)
            out, seen = [], set()
            masks = [full] + [(dq_tiles_visited if which == "dq" else dkdv_tiles_visited)(nq, nk, bm, bn)
                              for bm in BLOCKS for bn in BLOCKS]
            for m in masks:
                if m.tobytes() in seen:
                    continue
                seen.add(m.tobytes())
                kw = {"see_dq": m} if which == "dq" else {"see_dkdv": m}
                if which == "both":
                    kw = {"see_dq": m, "see_dkdv": m}
                out.append(grads(q, k, v, do, c, s, **kw))
            return out
        return variants

    return [
        ("no_delta", "D not subtracted in dS",
         "dS = P o (dP - D) with D_i = rowsum(dO_i o O_i): the softmax's Jacobian subtracts, from each dP_ij, "
         "the P-weighted mean of its row.",
         one(delta="none")),
        ("delta_from_p", "D computed from P instead of O",
         "D_i = rowsum(P o dP) summed over the WHOLE row i, which no tile sees; that is why it is computed "
         "first, as rowsum(dO_i o O_i), in its own kernel, before the tile loops.",
         p_tile),
        ("delta_no_o", "D computed without O",
         "D_i = rowsum(dO_i o O_i): multiply dO by O elementwise before summing over the head dim.",
         one(delta="do_only")),
        ("no_scale_dqdk", "scale forgotten in dQ and dK",
         "S = s Q K^T, so dQ = s dS K and dK = s dS^T Q: multiply both by the softmax scale.",
         one(scale_dq=False, scale_dk=False)),
        ("no_scale_dq", "scale forgotten in dQ",
         "S = s Q K^T, so dQ = s dS K: multiply dQ by the softmax scale (your dK has it).",
         one(scale_dq=False)),
        ("no_scale_dk", "scale forgotten in dK",
         "S = s Q K^T, so dK = s dS^T Q: multiply dK by the softmax scale (your dQ has it).",
         one(scale_dk=False)),
        ("causal_missing_bwd", "causal mask missing in both backward kernels",
         "recompute P with the forward's causal mask (P_ij = 0 where j > i) in the dK/dV kernel and in the "
         "dQ kernel; skipping tiles is not enough, the tiles on the diagonal need the mask.",
         mask_missing("both")),
        ("causal_missing_dq", "causal mask missing in the dQ kernel",
         "your dK and dV are right, dQ is not: in the dQ kernel set S_ij = -inf where j > i before P = e^(S - L) "
         "(the diagonal tiles need the elementwise mask even when later tiles are skipped).",
         mask_missing("dq")),
        ("causal_missing_dkdv", "causal mask missing in the dK/dV kernel",
         "your dQ is right, dK and dV are not: in the dK/dV kernel set S_ij = -inf where j > i before "
         "P = e^(S - L) (on the diagonal tiles the mask is needed even when earlier Q tiles are skipped).",
         mask_missing("dkdv")),
        ("lse_base2_bwd", "LSE used as if it were base 2",
         "the saved LSE is a natural log: P = exp(S - L), or exp2((S - L) * log2(e)).",
         one(lse_factor=math.log(2.0))),
        ("unseen_keys_unwritten", "dK/dV of keys no query sees left unwritten",
         "with causal masking and Nk > Nq, keys j > Nq - 1 are seen by no query: their dK and dV are 0, and 0 "
         "must still be written. Let every dK/dV program store its (zero) accumulators, even when its Q loop "
         "runs no iteration.",
         _unseen_variants),
    ]


def backward_bugs():
    """(key, title, hint, fn(q, k, v, do, causal, scale) -> (dq, dk, dv)): one representative per mistake
    (where a mistake has no effect on a case, e.g. a causal mask on a non-causal case, the right gradients)."""
    out = []
    for key, title, hint, variants in backward_bug_variants():
        def fn(q, k, v, do, c, s, variants=variants):
            alts = variants(q, k, v, do, c, s)
            return alts[0] if alts else grads(q, k, v, do, c, s)
        out.append((key, title, hint, fn))
    return out
