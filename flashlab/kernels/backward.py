"""FlashAttention-2 backward in Triton: three kernels, no atomics, deterministic.

Given O, the saved LSE L and dO, with P_ij = exp(S_ij - L_i) recomputed tile by tile:

    D_i  = rowsum(dO_i o O_i)                     flash_bwd_preprocess   grid (cdiv(Nq, BLOCK_M) * B*H,)
    dV_j = sum_i P_ij^T dO_i                      flash_bwd_dkdv_kernel  grid (cdiv(Nk, BLOCK_N) * B*H,)
    dK_j = s sum_i dS_ij^T Q_i                      (K_j, V_j stationary; loop over Q tiles)
    dQ_i = s sum_j dS_ij K_j                      flash_bwd_dq_kernel    grid (cdiv(Nq, BLOCK_M) * B*H,)
    with dP_ij = dO_i V_j^T and dS_ij = P_ij o (dP_ij - D_i)   (Q_i stationary; loop over K/V tiles)

Each program owns the rows it writes, so no atomic adds: the result does not
depend on scheduling.  The price is computing S and P twice (once per kernel).

Causal: the dK/dV program for key tile j starts at the first Q tile that can see
it; the dQ program for query tile i stops at the diagonal (block skipping).  This
readable version applies the mask (causal and ragged tail) on every tile it visits,
also on the tiles wholly below the diagonal that need none; splitting the loop into
unmasked and diagonal stages, as the forward does, is backward_v2.py's first change.

Grids are one-dimensional (common.program_tile) and every (batch, head) base is
addressed in 64 bits (common.head_base, common.tile_ptrs).

P = e^(S - L) is evaluated as 2^((S - L) log2 e): subtracting first keeps the error
small when S and L are large (|S| ~ 1e3 costs 1e-4 in the exponent if S and L are
converted to base 2 separately).
"""
import torch
import triton
import triton.language as tl

from . import tiles
from .common import LOG2E_K as LOG2E
from .tiles import C
from .common import head_base, program_tile, tile_ptrs


@triton.jit
def flash_bwd_preprocess(O, DO, Delta,
                         stride_ob, stride_oh, stride_om, stride_od,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         H, Nq, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Delta (B, H, Nq) float32 contiguous: D_i = rowsum(dO_i o O_i)."""
    start_m, off_b, off_h = program_tile(tl.cdiv(Nq, BLOCK_M), H)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + offs_r
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq
    o = tl.load(tile_ptrs(head_base(O, off_b, off_h, stride_ob, stride_oh), start_m * BLOCK_M, offs_r, offs_d,
                          stride_om, stride_od), mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(tile_ptrs(head_base(DO, off_b, off_h, stride_dob, stride_doh), start_m * BLOCK_M, offs_r, offs_d,
                           stride_dom, stride_dod), mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(head_base(Delta, off_b, off_h, H * Nq, Nq) + offs_m, tl.sum(o * do, 1), mask=row_ok)


@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK_j and dV_j for one K/V tile; everything is computed transposed, (BLOCK_N, BLOCK_M)."""
    start_n, off_b, off_h = program_tile(tl.cdiv(Nk, BLOCK_N), H)

    offs_c = tl.arange(0, BLOCK_N)                       # key rows inside this K/V tile
    offs_n = start_n * BLOCK_N + offs_c                  # key rows j of this tile
    offs_m = tl.arange(0, BLOCK_M)                       # query offsets inside a Q tile
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < Nk

    k = tl.load(tile_ptrs(head_base(K, off_b, off_h, stride_kb, stride_kh), start_n * BLOCK_N, offs_c, offs_d,
                          stride_kn, stride_kd), mask=col_ok[:, None], other=0.0)   # K_j (BLOCK_N, D), stays on chip
    v = tl.load(tile_ptrs(head_base(V, off_b, off_h, stride_vb, stride_vh), start_n * BLOCK_N, offs_c, offs_d,
                          stride_vn, stride_vd), mask=col_ok[:, None], other=0.0)   # V_j (BLOCK_N, D), stays on chip
    q_base = head_base(Q, off_b, off_h, stride_qb, stride_qh)          # 64-bit (batch, head) bases
    do_base = head_base(DO, off_b, off_h, stride_dob, stride_doh)
    q_offs = offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd    # 32-bit, inside one Q tile
    do_offs = offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod
    lse_ptrs = head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm
    delta_ptrs = head_base(Delta, off_b, off_h, H * Nq, Nq) + offs_m

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Causal: rows i < start_n * BLOCK_N cannot see any key of this tile; start at the Q tile
    # that holds row start_n * BLOCK_N.  (Only the Q tiles the diagonal crosses need the causal
    # mask; this version masks every tile anyway.)
    lo = (start_n * BLOCK_N) // BLOCK_M * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, Nq, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < Nq
        row0 = tl.cast(start_m, tl.int64)                                             # 64-bit tile start
        q = tl.load(q_base + row0 * stride_qm + q_offs, mask=row_ok[:, None], other=0.0)       # Q_i (BLOCK_M, D)
        do = tl.load(do_base + row0 * stride_dom + do_offs, mask=row_ok[:, None], other=0.0)    # dO_i (BLOCK_M, D)
        lse = tl.load(lse_ptrs + start_m * stride_lm, mask=row_ok, other=0.0)         # L_i (natural log)
        delta = tl.load(delta_ptrs + start_m, mask=row_ok, other=0.0)                # D_i
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * sm_scale       # S_ij^T (BLOCK_N, BLOCK_M)
        keep = row_ok[None, :] & col_ok[:, None]
        if CAUSAL:
            keep = keep & (offs_n[:, None] <= rows[None, :])                          # j <= i
        s_t = tl.where(keep, s_t, float("-inf"))
        p_t = tl.math.exp2((s_t - lse[None, :]) * LOG2E)                             # P_ij^T = e^(S - L), recomputed
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)         # dV_j += P^T dO_i
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)                # dP_ij^T = V_j dO_i^T
        ds_t = p_t * (dp_t - delta[None, :])                                         # dS_ij^T = P o (dP - D)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)          # dK_j += dS^T Q_i
    dk = dk * sm_scale                                                               # the s of S = s Q K^T

    tl.store(tile_ptrs(head_base(DK, off_b, off_h, stride_dkb, stride_dkh), start_n * BLOCK_N, offs_c, offs_d,
                       stride_dkn, stride_dkd), dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(tile_ptrs(head_base(DV, off_b, off_h, stride_dvb, stride_dvh), start_n * BLOCK_N, offs_c, offs_d,
                       stride_dvn, stride_dvd), dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def flash_bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dQ_i for one Q tile, streaming K/V tiles."""
    start_m, off_b, off_h = program_tile(tl.cdiv(Nq, BLOCK_M), H)

    offs_r = tl.arange(0, BLOCK_M)                       # rows inside this Q tile
    offs_m = start_m * BLOCK_M + offs_r                  # query rows i of this tile
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq

    q = tl.load(tile_ptrs(head_base(Q, off_b, off_h, stride_qb, stride_qh), start_m * BLOCK_M, offs_r, offs_d,
                          stride_qm, stride_qd), mask=row_ok[:, None], other=0.0)     # Q_i, stays on chip
    do = tl.load(tile_ptrs(head_base(DO, off_b, off_h, stride_dob, stride_doh), start_m * BLOCK_M, offs_r, offs_d,
                           stride_dom, stride_dod), mask=row_ok[:, None], other=0.0)  # dO_i
    lse = tl.load(head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm, mask=row_ok, other=0.0)  # L_i
    delta = tl.load(head_base(Delta, off_b, off_h, H * Nq, Nq) + offs_m, mask=row_ok, other=0.0)
    k_base = head_base(K, off_b, off_h, stride_kb, stride_kh)          # 64-bit (batch, head) bases
    v_base = head_base(V, off_b, off_h, stride_vb, stride_vh)
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd    # 32-bit, inside one K tile
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = tl.minimum((start_m + 1) * BLOCK_M, Nk) if CAUSAL else Nk        # block skipping
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        row0 = tl.cast(start_n, tl.int64)                                               # 64-bit tile start
        k = tl.load(k_base + row0 * stride_kn + k_offs, mask=cols[:, None] < Nk, other=0.0)      # K_j
        v = tl.load(v_base + row0 * stride_vn + v_offs, mask=cols[:, None] < Nk, other=0.0)      # V_j
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale            # S_ij
        keep = row_ok[:, None] & (cols[None, :] < Nk)
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        p = tl.math.exp2((s - lse[:, None]) * LOG2E)                                    # P_ij = e^(S - L)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)                     # dP_ij = dO_i V_j^T
        ds = p * (dp - delta[:, None])                                                  # dS_ij
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)               # dQ_i += dS_ij K_j
    dq = dq * sm_scale
    tl.store(tile_ptrs(head_base(DQ, off_b, off_h, stride_dqb, stride_dqh), start_m * BLOCK_M, offs_r, offs_d,
                       stride_dqm, stride_dqd), dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------- configs and launcher

def backward_configs(head_dim: int, dtype: torch.dtype) -> list:
    """Hand-picked (dK/dV config, dQ config) pairs, best first (v1, and v2 where it does not autotune).

    The dK/dV kernel keeps a K/V tile of block_n rows and streams Q tiles of block_m rows;
    the dQ kernel keeps a Q tile of block_m rows and streams K/V tiles of block_n rows.
    The first pairs for fp16/bf16 were picked by scripts/sweep_backward.py on an H200.
    """
    if dtype == torch.float32 or head_dim > 128:
        return [(C(32, 32, 4, 1), C(32, 32, 4, 1)),
                (C(16, 32, 4, 1), C(32, 16, 4, 1)), (C(16, 16, 4, 1), C(16, 16, 4, 1))]
    if head_dim <= 64:
        return [(C(32, 64, 4, 3), C(64, 32, 4, 3)), (C(32, 64, 4, 2), C(64, 32, 4, 2)),
                (C(32, 32, 4, 1), C(32, 32, 4, 1))]
    return [(C(64, 128, 8, 3), C(128, 64, 8, 3)), (C(64, 64, 4, 2), C(64, 64, 4, 2)),
            (C(32, 64, 4, 2), C(64, 32, 4, 2)), (C(32, 32, 4, 1), C(32, 32, 4, 1))]


SUPPORTS = frozenset()


def config_lists(head_dim, dtype, limit, cc, auto=((), ())) -> dict:
    """{"dkdv": ..., "dq": ...}: the pairs of which both fit ``limit``, split by kernel (``auto``: v2's lists)."""
    pairs = tiles.fitting_pairs(backward_configs(head_dim, dtype), head_dim, dtype, limit, cc)
    return {"dkdv": ([p[0] for p in pairs], list(auto[0])), "dq": ([p[1] for p in pairs], list(auto[1]))}


def preprocess(plan, o, do, runners=None):
    """The plan's first backward step: Delta (B, H, Nq) float32 = rowsum(dO * O)."""
    delta = torch.empty((plan.B, plan.H, plan.Nq), device=o.device, dtype=torch.float32)
    step = plan.backward[0]
    tiles.run(step, flash_bwd_preprocess, (o, do, delta, *o.stride(), *do.stride(), plan.H, plan.Nq),
              dict(HEAD_DIM=plan.D), step.grid_for, runners, "pre")
    return delta


def launch(plan, q, k, v, o, lse, do, dq, dk, dv, scale: float, runners=None):
    """Run the plan's backward steps: Delta, then dK/dV, then dQ, into ``dq``, ``dk``, ``dv``."""
    delta = preprocess(plan, o, do, runners)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    tail = (*lse.stride(), plan.H, plan.Nq, plan.Nk, scale)
    kw = plan.constexprs
    s_kv, s_q = plan.backward[1], plan.backward[2]
    tiles.run(s_kv, flash_bwd_dkdv_kernel, (q, k, v, do, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(), *tail),
              kw, s_kv.grid_for, runners, "dkdv")
    tiles.run(s_q, flash_bwd_dq_kernel, (q, k, v, do, lse, delta, dq, *common, *dq.stride(), *tail),
              kw, s_q.grid_for, runners, "dq")
