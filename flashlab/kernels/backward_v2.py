"""FlashAttention-2 backward, v2: v1 with the diagonal split and base 2 inside.

Diff this file against backward.py.  Same three kernels, same math, no atomics; changed:

1. **Diagonal and off-diagonal tiles split.**  v1 masks every tile it visits.  v2 runs
   each loop in stages: the tiles the causal diagonal crosses (mask j <= i), the full
   tiles wholly on the visible side (no mask, plain loads), and the ragged last tile
   (masked loads only).  Rows past Nq or keys past Nk are loaded as zeros, and zeros
   contribute nothing to the rows that are stored (dO = 0 makes dV's and dS's terms
   vanish; K = V = 0 makes dQ's), so only the diagonal needs a score mask.
   Prediction: like the forward's split, a few per cent; more for causal, where v1
   masks the whole lower triangle.
2. **Base 2 inside.**  v1 evaluates P = 2^((S*s - L) * log2 e): a multiply, a subtract,
   a multiply per score.  v2 converts L to base 2 once per row (L2 = L log2 e) and
   computes 2^(S * (s log2 e) - L2): one fused multiply-add per score.  (Pre-scaling K
   by s log2 e, as some kernels do, saves the same multiply but rounds K to fp16
   again; with the FMA there is nothing left for it to save.)
3. **Tile shapes by autotuning** (in the launcher, keyed by head dim and sequence
   length), with the v1 sweep's choices as the hand-picked configs.
"""
import triton
import triton.language as tl

from . import backward, tiles
from .common import LOG2E, LOG2E_K, head_base, program_tile, tile_ptrs


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, q_offs, do_offs, lse_ptrs, delta_ptrs, stride_qm, stride_dom, stride_lm,
                offs_n, offs_m, Nq, qk_scale, lo, hi,
                MASK_ROWS: tl.constexpr, MASK_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        row0 = tl.cast(start_m, tl.int64)
        rows = start_m + offs_m
        if MASK_ROWS:
            row_ok = rows < Nq
            q = tl.load(q_base + row0 * stride_qm + q_offs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_base + row0 * stride_dom + do_offs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(lse_ptrs + row0 * stride_lm, mask=row_ok, other=0.0) * LOG2E_K
            delta = tl.load(delta_ptrs + start_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_base + row0 * stride_qm + q_offs)                                  # Q_i (BLOCK_M, D)
            do = tl.load(do_base + row0 * stride_dom + do_offs)                               # dO_i
            lse2 = tl.load(lse_ptrs + row0 * stride_lm) * LOG2E_K                   # L_i in base 2
            delta = tl.load(delta_ptrs + start_m)                                   # D_i
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)                 # S^T / s (BLOCK_N, BLOCK_M)
        if MASK_CAUSAL:
            s_t = tl.where(offs_n[:, None] <= rows[None, :], s_t, float("-inf"))    # j <= i
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])                          # P^T: one FMA, exp2
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)        # dV_j += P^T dO_i
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)               # dP^T = V_j dO_i^T
        ds_t = p_t * (dp_t - delta[None, :])                                        # dS^T
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)         # dK_j += dS^T Q_i
    return dk, dv


@triton.jit
def flash_bwd_dkdv_kernel_v2(
    Q, K, V, DO, LSE, Delta, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, sm_scale, qk_scale, N_KEY,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK_j, dV_j for one K/V tile (v1's contract; qk_scale = sm_scale * log2 e)."""
    start_n, off_b, off_h = program_tile(tl.cdiv(Nk, BLOCK_N), H)
    offs_c = tl.arange(0, BLOCK_N)
    offs_n = start_n * BLOCK_N + offs_c
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < Nk

    k = tl.load(tile_ptrs(head_base(K, off_b, off_h, stride_kb, stride_kh), start_n * BLOCK_N, offs_c, offs_d,
                          stride_kn, stride_kd), mask=col_ok[:, None], other=0.0)
    v = tl.load(tile_ptrs(head_base(V, off_b, off_h, stride_vb, stride_vh), start_n * BLOCK_N, offs_c, offs_d,
                          stride_vn, stride_vd), mask=col_ok[:, None], other=0.0)
    q_base = head_base(Q, off_b, off_h, stride_qb, stride_qh)          # 64-bit (batch, head) bases
    do_base = head_base(DO, off_b, off_h, stride_dob, stride_doh)
    q_offs = offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd    # 32-bit, inside one Q tile
    do_offs = offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod
    lse_ptrs = head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm
    delta_ptrs = head_base(Delta, off_b, off_h, H * Nq, Nq) + offs_m

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    full = Nq // BLOCK_M * BLOCK_M                                   # Q rows in full tiles
    if CAUSAL:
        lo = (start_n * BLOCK_N) // BLOCK_M * BLOCK_M                # first Q tile that sees this K tile
        diag = tl.minimum(tl.cdiv((start_n + 1) * BLOCK_N, BLOCK_M) * BLOCK_M, Nq)   # past it: all visible
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, q_offs, do_offs, lse_ptrs, delta_ptrs, stride_qm, stride_dom, stride_lm,
                             offs_n, offs_m, Nq, qk_scale, lo, diag,
                             True, True, BLOCK_M, DOT_PRECISION)     # stage 1: the diagonal
    else:
        diag = 0
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, q_offs, do_offs, lse_ptrs, delta_ptrs, stride_qm, stride_dom, stride_lm,
                         offs_n, offs_m, Nq, qk_scale, diag, full,
                         False, False, BLOCK_M, DOT_PRECISION)       # stage 2: full tiles, no masks
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, q_offs, do_offs, lse_ptrs, delta_ptrs, stride_qm, stride_dom, stride_lm,
                         offs_n, offs_m, Nq, qk_scale, tl.maximum(diag, full), Nq,
                         True, False, BLOCK_M, DOT_PRECISION)        # stage 3: the ragged last Q tile
    dk = dk * sm_scale
    tl.store(tile_ptrs(head_base(DK, off_b, off_h, stride_dkb, stride_dkh), start_n * BLOCK_N, offs_c, offs_d,
                       stride_dkn, stride_dkd), dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(tile_ptrs(head_base(DV, off_b, off_h, stride_dvb, stride_dvh), start_n * BLOCK_N, offs_c, offs_d,
                       stride_dvn, stride_dvd), dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn, offs_m, offs_n, Nk, qk_scale, lo, hi,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        row0 = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        if MASKED:
            k = tl.load(k_base + row0 * stride_kn + k_offs, mask=cols[:, None] < Nk, other=0.0)
            v = tl.load(v_base + row0 * stride_vn + v_offs, mask=cols[:, None] < Nk, other=0.0)
        else:
            k = tl.load(k_base + row0 * stride_kn + k_offs)                                  # K_j
            v = tl.load(v_base + row0 * stride_vn + v_offs)                                  # V_j
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            keep = cols[None, :] < Nk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
        p = tl.math.exp2(s * qk_scale - lse2[:, None])                              # P_ij: one FMA, exp2
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)                 # dP_ij
        ds = p * (dp - delta[:, None])                                              # dS_ij
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)           # dQ_i += dS_ij K_j
    return dq


@triton.jit
def flash_bwd_dq_kernel_v2(
    Q, K, V, DO, LSE, Delta, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, sm_scale, qk_scale, N_KEY,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dQ_i for one Q tile (v1's contract; qk_scale = sm_scale * log2 e)."""
    n_tiles = tl.cdiv(Nq, BLOCK_M)
    start_m, off_b, off_h = program_tile(n_tiles, H)
    if CAUSAL:
        start_m = n_tiles - 1 - start_m                              # longest tiles first
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq

    q = tl.load(tile_ptrs(head_base(Q, off_b, off_h, stride_qb, stride_qh), start_m * BLOCK_M, offs_r, offs_d,
                          stride_qm, stride_qd), mask=row_ok[:, None], other=0.0)
    do = tl.load(tile_ptrs(head_base(DO, off_b, off_h, stride_dob, stride_doh), start_m * BLOCK_M, offs_r, offs_d,
                           stride_dom, stride_dod), mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm,
                   mask=row_ok, other=0.0) * LOG2E_K
    delta = tl.load(head_base(Delta, off_b, off_h, H * Nq, Nq) + offs_m, mask=row_ok, other=0.0)
    k_base = head_base(K, off_b, off_h, stride_kb, stride_kh)          # 64-bit (batch, head) bases
    v_base = head_base(V, off_b, off_h, stride_vb, stride_vh)
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd    # 32-bit, inside one K tile
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full = Nk // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, Nk)
        unmasked = tl.minimum((start_m * BLOCK_M) // BLOCK_N * BLOCK_N, full)
    else:
        hi = Nk
        unmasked = full
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn, offs_m, offs_n, Nk, qk_scale,
                   0, unmasked, False, CAUSAL, BLOCK_N, DOT_PRECISION)          # stage 1: no masks
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn, offs_m, offs_n, Nk, qk_scale,
                   unmasked, hi, True, CAUSAL, BLOCK_N, DOT_PRECISION)          # stage 2: diagonal, ragged tail
    dq = dq * sm_scale
    tl.store(tile_ptrs(head_base(DQ, off_b, off_h, stride_dqb, stride_dqh), start_m * BLOCK_M, offs_r, offs_d,
                       stride_dqm, stride_dqd), dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------- configs and launcher

# Autotuning candidates (block_m, block_n, warps, stages) of the dK/dV kernel and of the dQ kernel.
AUTOTUNE_DKDV = [(32, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 5),
                 (64, 128, 8, 2), (64, 64, 4, 4), (32, 64, 4, 4)]
AUTOTUNE_DQ = [(64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 5),
               (128, 64, 8, 2), (64, 64, 4, 4), (64, 32, 4, 4)]

SUPPORTS = frozenset()


def config_lists(head_dim, dtype, limit, cc) -> dict:
    """Hand-picked: v1's pairs (backward.backward_configs); autotuned: AUTOTUNE_DKDV, AUTOTUNE_DQ."""
    return backward.config_lists(head_dim, dtype, limit, cc, (AUTOTUNE_DKDV, AUTOTUNE_DQ))


def launch(plan, q, k, v, o, lse, do, dq, dk, dv, scale: float, runners=None):
    """v1's three steps with v2's two kernels (they also take scale * log2 e and the length bucket)."""
    delta = backward.preprocess(plan, o, do, runners)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    tail = (*lse.stride(), plan.H, plan.Nq, plan.Nk, scale, scale * LOG2E, plan.n_key)
    kw = plan.constexprs
    s_kv, s_q = plan.backward[1], plan.backward[2]
    tiles.run(s_kv, flash_bwd_dkdv_kernel_v2,
              (q, k, v, do, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(), *tail), kw, s_kv.grid_for,
              runners, "dkdv",
              lambda: tiles.tuned("dkdvv2", flash_bwd_dkdv_kernel_v2, "dkdv", AUTOTUNE_DKDV, plan.D, plan.dtype))
    tiles.run(s_q, flash_bwd_dq_kernel_v2, (q, k, v, do, lse, delta, dq, *common, *dq.stride(), *tail),
              kw, s_q.grid_for, runners, "dq",
              lambda: tiles.tuned("dqv2", flash_bwd_dq_kernel_v2, "dq", AUTOTUNE_DQ, plan.D, plan.dtype))
