"""FlashAttention-2 backward in Triton: three kernels, no atomics, deterministic.

Given O, the saved LSE L and dO, with P_ij = exp(S_ij - L_i) recomputed tile by tile:

    D_i  = rowsum(dO_i o O_i)                     flash_bwd_preprocess   grid (cdiv(Nq, BLOCK_M), B*H)
    dV_j = sum_i P_ij^T dO_i                      flash_bwd_dkdv_kernel  grid (cdiv(Nk, BLOCK_N), B*H)
    dK_j = s sum_i dS_ij^T Q_i                      (K_j, V_j stationary; loop over Q tiles)
    dQ_i = s sum_j dS_ij K_j                      flash_bwd_dq_kernel    grid (cdiv(Nq, BLOCK_M), B*H)
    with dP_ij = dO_i V_j^T and dS_ij = P_ij o (dP_ij - D_i)   (Q_i stationary; loop over K/V tiles)

Each program owns the rows it writes, so no atomic adds: the result does not
depend on scheduling.  The price is computing S and P twice (once per kernel).

Causal: the dK/dV program for key tile j starts at the first Q tile that can see
it; the dQ program for query tile i stops at the diagonal (block skipping).  This
readable version applies the mask on every tile it visits; splitting the loop into
unmasked and diagonal stages, as the forward does, is a later optimisation.

P = e^(S - L) is evaluated as 2^((S - L) log2 e): subtracting first keeps the error
small when S and L are large (|S| ~ 1e3 costs 1e-4 in the exponent if S and L are
converted to base 2 separately).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def flash_bwd_preprocess(O, DO, Delta,
                         stride_ob, stride_oh, stride_om, stride_od,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         H, Nq, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Delta (B, H, Nq) float32 contiguous: D_i = rowsum(dO_i o O_i)."""
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(Delta + off_bh * Nq + offs_m, tl.sum(o * do, 1), mask=row_ok)


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
    start_n = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)   # key rows j of this tile
    offs_m = tl.arange(0, BLOCK_M)                       # query offsets inside a Q tile
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < Nk

    k = tl.load(K + off_b * stride_kb + off_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=col_ok[:, None], other=0.0)                         # K_j (BLOCK_N, D), stays on chip
    v = tl.load(V + off_b * stride_vb + off_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=col_ok[:, None], other=0.0)                         # V_j (BLOCK_N, D), stays on chip
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod
    lse_ptrs = LSE + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm
    delta_ptrs = Delta + off_bh * Nq + offs_m

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Causal: rows i < start_n * BLOCK_N cannot see any key of this tile; start at the Q tile
    # that holds row start_n * BLOCK_N.  Q tiles that end before the tile's last key cross
    # the diagonal and need the mask; the ones after are fully visible.
    lo = (start_n * BLOCK_N) // BLOCK_M * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, Nq, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < Nq
        q = tl.load(q_ptrs + start_m * stride_qm, mask=row_ok[:, None], other=0.0)    # Q_i (BLOCK_M, D)
        do = tl.load(do_ptrs + start_m * stride_dom, mask=row_ok[:, None], other=0.0)  # dO_i (BLOCK_M, D)
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

    tl.store(DK + off_b * stride_dkb + off_h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + off_b * stride_dvb + off_h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


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
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)   # query rows i of this tile
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq

    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)                          # Q_i, stays on chip
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=row_ok[:, None], other=0.0)                         # dO_i
    lse = tl.load(LSE + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm, mask=row_ok, other=0.0)  # L_i
    delta = tl.load(Delta + off_bh * Nq + offs_m, mask=row_ok, other=0.0)
    k_ptrs = K + off_b * stride_kb + off_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + off_b * stride_vb + off_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = tl.minimum((start_m + 1) * BLOCK_M, Nk) if CAUSAL else Nk        # block skipping
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_ptrs + start_n * stride_kn, mask=cols[:, None] < Nk, other=0.0)   # K_j
        v = tl.load(v_ptrs + start_n * stride_vn, mask=cols[:, None] < Nk, other=0.0)   # V_j
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
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])
