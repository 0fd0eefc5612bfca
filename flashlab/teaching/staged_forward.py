"""The answers to notebook 05's staged exercises, each one change from the one before.

    one_head.py         one head, contiguous, N a multiple of the tiles, no mask, no LSE (the lecture)
    tails_kernel        + (B, H) in the grid, every tensor's own strides, ragged Nq and Nk
                          (answer to ``flash_forward_tails``)
    causal_kernel       + the top-left causal mask, and key tiles above the diagonal never loaded
                          (answer to ``flash_forward_causal``)
    kernels/forward.py  + the log-sum-exp, a 1-D grid, 64-bit bases, two stages (answer to
                          ``flash_forward``: forward v1)

The exercise notebook shows each answer after its exercise (``inspect.getsource``); ``diff`` two
neighbours to see the one idea.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from .. import device  # noqa: F401  (settles TRITON_INTERPRET before the kernels are defined)

LOG2E = math.log2(math.e)


def _tiles(q):
    return (64, 64) if q.is_cuda else (32, 32)


@triton.jit
def tails_kernel(Q, K, V, O,
                 stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                 H, Nq, Nk, qk_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    b = tl.program_id(1) // H                                        # new: (b, h) from the grid's axis 1
    h = tl.program_id(1) % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + d[None, :] * stride_qd,
                mask=rows[:, None] < Nq, other=0.0)                  # new: rows past Nq masked
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, Nk, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(K + b * stride_kb + h * stride_kh + cols[:, None] * stride_kn + d[None, :] * stride_kd,
                    mask=cols[:, None] < Nk, other=0.0)              # new: keys past Nk load as 0 ...
        v = tl.load(V + b * stride_vb + h * stride_vh + cols[:, None] * stride_vn + d[None, :] * stride_vd,
                    mask=cols[:, None] < Nk, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(cols[None, :] < Nk, s, float("-inf"))           # ... and score -inf (the second mask)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = alpha * l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    tl.store(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + d[None, :] * stride_od,
             (acc / l_i[:, None]).to(O.dtype.element_ty), mask=rows[:, None] < Nq)   # new: no store past Nq


def flash_forward_tails(q, k, v, o):
    """The ``flash_forward_tails`` contract: O of non-causal attention into ``o``; any strides, ragged N."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    BLOCK_M, BLOCK_N = _tiles(q)
    tails_kernel[(triton.cdiv(Nq, BLOCK_M), B * H)](
        q, k, v, o, *q.stride(), *k.stride(), *v.stride(), *o.stride(), H, Nq, Nk, LOG2E / math.sqrt(D),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D)


@triton.jit
def causal_kernel(Q, K, V, O,
                  stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                  H, Nq, Nk, qk_scale,
                  CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    start_m = tl.program_id(0)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + d[None, :] * stride_qd,
                mask=rows[:, None] < Nq, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = Nk
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, Nk)                 # new: the last key this tile's rows see
    for start_n in range(0, hi, BLOCK_N):                            # tiles past hi are never loaded
        cols = start_n + offs_n
        k = tl.load(K + b * stride_kb + h * stride_kh + cols[:, None] * stride_kn + d[None, :] * stride_kd,
                    mask=cols[:, None] < Nk, other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + cols[:, None] * stride_vn + d[None, :] * stride_vd,
                    mask=cols[:, None] < Nk, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        keep = cols[None, :] < Nk
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])           # new: query i sees keys j <= i
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = alpha * l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    tl.store(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + d[None, :] * stride_od,
             (acc / l_i[:, None]).to(O.dtype.element_ty), mask=rows[:, None] < Nq)


def flash_forward_causal(q, k, v, o, causal):
    """The ``flash_forward_causal`` contract: O into ``o``, causal (top-left) or not."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    BLOCK_M, BLOCK_N = _tiles(q)
    causal_kernel[(triton.cdiv(Nq, BLOCK_M), B * H)](
        q, k, v, o, *q.stride(), *k.stride(), *v.stride(), *o.stride(), H, Nq, Nk, LOG2E / math.sqrt(D),
        CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D)


__all__ = ["tails_kernel", "flash_forward_tails", "causal_kernel", "flash_forward_causal"]
