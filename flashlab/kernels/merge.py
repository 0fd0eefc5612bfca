"""The log-sum-exp merge of two partial attention results, in place, in one kernel.

Ring attention (:mod:`flashlab.distributed`) keeps a running (O, LSE) per query row and, at every
step, merges in the step's part (O_p, L_p), computed over other keys: notebook 02's merge, written
for normalised parts,

    L' = log(e^L + e^(L_p)),        O' = e^(L - L') O + e^(L_p - L') O_p.

Written with PyTorch's element-wise ops (``flashlab.distributed.merge_attention``, the readable
copy) this is some ten kernels and as many round trips of the float32 O through memory; on the
H200 it took as long as the step's attention itself at 4096 rows per rank (the record in
``flashlab/data/h200_ring.json``).  Here it is one pass: each program reads a tile of rows of O
and O_p once and writes O once, so the merge moves 2·4 + 2 bytes per element of O (fp32 running
O, bf16/fp16 part) instead of several times that.

A part whose L_p = -inf (its rows saw no key) has weight 0, and its O_p is never read into the
result (0 · NaN would poison it); a row that has seen nothing at all stays O = 0, L = -inf.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def merge_into_kernel(
    O, L, OP, LP,
    s_ob, s_oh, s_on, s_lb, s_lh, s_ln,
    s_pb, s_ph, s_pn, s_qb, s_qh, s_qn,
    H, N, HEAD_DIM,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (i, b·H + h) merges rows i·BLOCK_M ... of head (b, h): O, L updated in place."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    r_ok = rows < N
    rc_ok = r_ok[:, None] & (cols < HEAD_DIM)[None, :]
    l_ptrs = L + b * s_lb + h * s_lh + rows * s_ln
    lse = tl.load(l_ptrs, mask=r_ok, other=float("-inf"))
    lse_p = tl.load(LP + b * s_qb + h * s_qh + rows * s_qn, mask=r_ok, other=float("-inf"))
    m = tl.maximum(lse, lse_p)
    m = tl.where(m == float("-inf"), 0.0, m)                 # both empty: weights e^(-inf) = 0, no NaN
    w = tl.exp(lse - m)
    w_p = tl.exp(lse_p - m)
    total = w + w_p
    seen = total > 0.0
    inv = 1.0 / tl.where(seen, total, 1.0)
    w = w * inv
    w_p = w_p * inv
    o_ptrs = O + b * s_ob + h * s_oh + rows[:, None] * s_on + cols[None, :]
    o = tl.load(o_ptrs, mask=rc_ok, other=0.0)
    o_p = tl.load(OP + b * s_pb + h * s_ph + rows[:, None] * s_pn + cols[None, :], mask=rc_ok, other=0.0)
    o_new = tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0) + tl.where(w_p[:, None] > 0.0, w_p[:, None] * o_p.to(tl.float32), 0.0)
    tl.store(o_ptrs, o_new, mask=rc_ok)
    tl.store(l_ptrs, tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf")), mask=r_ok)


def merge_into(o, lse, o_part, lse_part, block_m: int = 64):
    """Merge (o_part, lse_part) into (o, lse) in place; returns (o, lse).

    o (B, H, N, D) float32, lse (B, H, N) float32, o_part (B, H, N, D) any float dtype, lse_part
    (B, H, N) float32; any strides along B, H, N (views of a larger buffer are fine), D contiguous."""
    B, H, N, D = o.shape
    if o.dtype != torch.float32 or lse.dtype != torch.float32 or lse_part.dtype != torch.float32:
        raise TypeError("merge_into: o, lse and lse_part must be float32")
    if o.stride(-1) != 1 or o_part.stride(-1) != 1:
        raise ValueError("merge_into: the head dimension of o and o_part must be contiguous (stride 1)")
    if tuple(o_part.shape) != (B, H, N, D) or tuple(lse.shape) != (B, H, N) or tuple(lse_part.shape) != (B, H, N):
        raise ValueError(f"merge_into: shapes {tuple(o.shape)}, {tuple(lse.shape)}, {tuple(o_part.shape)}, "
                         f"{tuple(lse_part.shape)} do not match (B, H, N, D), (B, H, N)")
    block_d = triton.next_power_of_2(D)
    grid = (triton.cdiv(N, block_m), B * H)
    merge_into_kernel[grid](o, lse, o_part, lse_part, *o.stride()[:3], *lse.stride(), *o_part.stride()[:3],
                            *lse_part.stride(), H, N, D, BLOCK_M=block_m, BLOCK_D=block_d,
                            num_warps=4 if block_d <= 64 else 8)
    return o, lse
