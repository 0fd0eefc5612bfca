"""Mistakes specific to Triton kernels (pointers, strides, masks), as runnable code.

The NumPy bug library (:mod:`flashlab.grader.bugs`) covers the algorithm; these
cover what only a kernel can get wrong: addressing memory with the wrong strides
(reproduced by reading the grader's own padded buffers the way the faulty kernel
would) and a mask written on the wrong side of ``tl.where``.
"""
from __future__ import annotations

import numpy as np
import torch



def read_with_strides(buf, strides) -> np.ndarray | None:
    """float64 copy of what a kernel reads from the padded buffer ``buf`` when it walks
    ``buf.view``'s shape from the view's first element with ``strides`` instead of the view's own;
    None if that walks off the allocation (a crash or garbage, not a reproducible answer)."""
    view = buf.view
    start = (view.data_ptr() - buf.flat.data_ptr()) // view.element_size()
    lo = start + sum((s - 1) * st for s, st in zip(view.shape, strides) if st < 0)
    hi = start + sum((s - 1) * st for s, st in zip(view.shape, strides) if st > 0)
    if lo < 0 or hi >= buf.flat.numel():
        return None
    return torch.as_strided(buf.flat, view.shape, tuple(strides), start).double().cpu().numpy()


def streamed(q, k, v, keep, scale, block_k):
    """What a kernel streaming key tiles of ``block_k`` returns with the mask ``keep`` (Nq, Nk): like
    attention with that mask, except that a row whose first visited tiles are fully masked gets
    e^(-inf - (-inf)) = NaN, as in a kernel (the NumPy references never see such a tile)."""
    nq = q.shape[0]
    m, l, acc = np.full(nq, -np.inf), np.zeros(nq), np.zeros((nq, v.shape[1]))
    with np.errstate(all="ignore"):
        for j0 in range(0, k.shape[0], block_k):
            s = np.where(keep[:, j0:j0 + block_k], scale * (q @ k[j0:j0 + block_k].T), -np.inf)
            m_new = np.maximum(m, s.max(1))
            p = np.exp(s - m_new[:, None])
            alpha = np.exp(m - m_new)
            l = alpha * l + p.sum(1)
            acc = alpha[:, None] * acc + p @ v[j0:j0 + block_k]
            m = m_new
        return acc / l[:, None], m + np.log(l)


def causal_wrong_side(kind):
    """A streamed causal mask written wrongly: "reversed" keeps j >= i, "inverted" keeps j > i (the
    condition meant for the keys to hide, put where tl.where expects the keys to keep)."""
    def fn(q, k, v, causal, scale, block_k):
        if not causal:
            return None
        i = np.arange(len(q))[:, None]
        j = np.arange(len(k))[None, :]
        return streamed(q, k, v, (j >= i) if kind == "reversed" else (j > i), scale, block_k)
    return fn


CAUSAL_REVERSED = ("causal_reversed_kernel", "causal mask reversed",
                   "keep the keys a query may see, cols <= rows (j <= i), not j >= i.")
CAUSAL_INVERTED = ("causal_inverted", "causal mask on the wrong side of tl.where (keeps keys j > i)",
                   "tl.where(cond, s, -inf) keeps s where cond holds: the condition is the keys a query may "
                   "see, cols <= rows (j <= i), not the ones to hide.")
WRONG_STRIDE = ("wrong_stride", "wrong stride: K or V addressed with Q's strides",
                "each tensor has its own strides (here q, k and v have different sizes and padding): "
                "offset K with k.stride(...) and V with v.stride(...), not with Q's.")
