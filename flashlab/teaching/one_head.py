"""The smallest FlashAttention-2 forward: one head, no mask, no LSE (notebook 05 builds it in the lecture).

Q (N, D), K, V (N, D), contiguous, N a multiple of both tile sizes, D a power of two >= 16:

    grid = (N // BLOCK_M,)          one program per Q tile (line 1 of notebook 05's table)

Everything the op needs beyond this is added by the graded exercises of ``exercises/05``, one thing
each: (B, H) and strides and ragged tails (``flash_forward_tails``), the causal mask and block
skipping (``flash_forward_causal``), the log-sum-exp (``flash_forward``).  Their answers are in
:mod:`flashlab.teaching.staged_forward` (shown after each exercise) and, the last one, in
:mod:`flashlab.kernels.forward` (forward v1).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import device  # noqa: F401  (settles TRITON_INTERPRET before the kernel is defined)


@triton.jit
def one_head_fwd_kernel(Q, K, V, O, N, qk_scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)      # (line 1) this program's query rows
    cols = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * HEAD_DIM + d[None, :])           # (line 2) Q_i (BLOCK_M, D), once
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)             # (line 3) the empty sum
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, N, BLOCK_N):                             # (line 4)
        k = tl.load(K + (start_n + cols)[:, None] * HEAD_DIM + d[None, :])   # (line 5) K_j (BLOCK_N, D)
        v = tl.load(V + (start_n + cols)[:, None] * HEAD_DIM + d[None, :])   #          V_j
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale       # (line 6) S_ij, base 2
        m_new = tl.maximum(m_i, tl.max(s, 1))                        # (line 7)
        p = tl.math.exp2(s - m_new[:, None])                         # (line 8) P~_ij
        alpha = tl.math.exp2(m_i - m_new)                            #          alpha
        l_i = alpha * l_i + tl.sum(p, 1)                             # (line 9)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")   # (line 10)
        m_i = m_new
    tl.store(O + rows[:, None] * HEAD_DIM + d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))  # (line 11)


def one_head_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 32,
                     block_n: int = 32) -> torch.Tensor:
    """O = softmax(Q K^T / sqrt(D)) V for one head: q, k, v (N, D) contiguous, N a multiple of the tiles."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous (N, D) tensor (one head), got shape {tuple(t.shape)}, "
                             f"strides {t.stride()}: the exercises add (B, H) and strides")
    N, D = q.shape
    if k.shape != (N, D) or v.shape != (N, D):
        raise ValueError(f"k and v must have q's shape {(N, D)}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if N % block_m or N % block_n:
        raise ValueError(f"N = {N} must be a multiple of block_m = {block_m} and block_n = {block_n}: "
                         "this kernel has no masks (ragged tails are the first exercise)")
    if D < 16 or D & (D - 1):
        raise ValueError(f"D = {D} must be a power of two >= 16 (tl.arange and tl.dot need it)")
    o = torch.empty_like(q)
    one_head_fwd_kernel[(N // block_m,)](q, k, v, o, N, math.log2(math.e) / math.sqrt(D),
                                         BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D)
    return o


__all__ = ["one_head_fwd_kernel", "one_head_forward"]
