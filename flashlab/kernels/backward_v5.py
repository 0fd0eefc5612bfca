"""FlashAttention-2 backward, v5: backward v2 with the attention variants as constexpr branches.

Diff this file against backward_v2.py (its parent: two kernels, plain pointers, no atomics, so it
runs everywhere and is deterministic).  The same dK/dV and dQ kernels; what changed:

1. **Scores through forward v4's ``variant_scores``** (soft-cap, ALiBi, masks, the band), in either
   orientation: the dK/dV kernel passes rows and columns transposed.  With every flag off it is
   v2's single multiply.  Soft-cap's chain rule multiplies dS by 1 - tanh^2 (from the same call).
2. **The band decides which tiles are visited**, in both kernels: the dQ program of query tile i
   visits the key tiles the forward visited; the dK/dV program of key tile j visits the query
   tiles whose band reaches it (rows j - right ... j + left).  Three stages each (masked edge,
   unmasked inside, masked edge), v2's diagonal split generalised.
3. **GQA without atomics.**  The dK/dV program of a K/V head loops over the GROUP query heads
   that read it and sums their dK, dV in registers: one program owns each dK/dV row, so the
   result does not depend on scheduling.  The dQ program of a query head reads its K/V head.
4. **Rows that see no key** have LSE = -inf in the forward; here it is taken as +inf, so their
   P = 0 and they add nothing: zero gradients, no NaN.
5. **Dropout.**  The mask is regenerated with forward v4's ``dropout_keep`` on the same
   (seed, batch * H + head, row, column), never stored:  dV += (P o Z)^T dO / (1 - p),
   dP = (dO V^T) o Z / (1 - p), dS = P o (dP - Delta) with Delta = rowsum(dO o O) (O dropped).
6. **Packed sequences (varlen)**: the sequence's rows start at CU_Q[b] / CU_K[b]; Delta and the
   LSE have strides of their own (the packed LSE is (H, total_q)).
7. **Tensor descriptors on Hopper**, as in forward v4 (``use_descriptors``): the dQ kernel streams
   K/V tiles, the dK/dV kernel each query head's Q/dO tiles, through descriptors made once per program
   (the dK/dV kernel's are 3-D, (heads, rows, HEAD_DIM), so the group's query heads share them).

Launch: ``launch`` at the end of the file runs the launch plan's backward steps; the dK/dV grid runs over
the K/V heads (B * H // GROUP programs per K/V tile).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import tiles
from .common import LOG2E_K, head_base, program_tile, tile_ptrs
from .forward_v4 import (band_tiles, dense_strides, dropout_keep, run_step, use_descriptors, variant_arguments,
                         variant_scores)
from .tiles import C


@triton.jit
def flash_bwd_delta_v5(O, DO, Delta,
                       stride_ob, stride_oh, stride_om, stride_od,
                       stride_dob, stride_doh, stride_dom, stride_dod,
                       stride_lb, stride_lh, stride_lm,
                       H, N, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Delta_i = rowsum(dO_i o O_i) into a (B, H, N) array of any strides (packed: B = 1, N = total)."""
    start_m, off_b, off_h = program_tile(tl.cdiv(N, BLOCK_M), H)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + offs_r
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    o = tl.load(tile_ptrs(head_base(O, off_b, off_h, stride_ob, stride_oh), start_m * BLOCK_M, offs_r, offs_d,
                          stride_om, stride_od), mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(tile_ptrs(head_base(DO, off_b, off_h, stride_dob, stride_doh), start_m * BLOCK_M, offs_r, offs_d,
                           stride_dom, stride_dod), mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(head_base(Delta, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm, tl.sum(o * do, 1),
             mask=row_ok)


@triton.jit
def _lse2(lse):
    """The LSE in base 2, with -inf (a row that saw no key) as +inf: its P = 2^(s - inf) = 0."""
    l2 = lse * LOG2E_K
    return tl.where(l2 == float("-inf"), float("inf"), l2)


@triton.jit
def _dkdv_inner_v5(dk, dv, k, v, q_base, do_base, q_offs, do_offs, off_h, lse_ptrs, delta_ptrs,
                   stride_qm, stride_dom, stride_lm, stride_dlm,
                   offs_n, offs_m, Nq, Nk, sm_scale, softcap, left, right, slope,
                   mask_base, stride_mm, stride_mn, seed, bh, p_drop, col0, lo, hi,
                   MASKED: tl.constexpr, BAND: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
                   ALIBI: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Stream the Q / dO tiles lo ... < hi of query head ``off_h`` (TMA: q_base, do_base are descriptors of
    the (heads, rows, HEAD_DIM) Q and dO of this sequence)."""
    for start_m in range(lo, hi, BLOCK_M):
        row0 = tl.cast(start_m, tl.int64)
        rows = start_m + offs_m
        if TMA:
            q = q_base.load([off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)   # rows past Nq load as zeros
            do = do_base.load([off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        if MASKED:
            row_ok = rows < Nq
            if not TMA:
                q = tl.load(q_base + row0 * stride_qm + q_offs, mask=row_ok[:, None], other=0.0)
                do = tl.load(do_base + row0 * stride_dom + do_offs, mask=row_ok[:, None], other=0.0)
            lse2 = _lse2(tl.load(lse_ptrs + row0 * stride_lm, mask=row_ok, other=0.0))
            delta = tl.load(delta_ptrs + row0 * stride_dlm, mask=row_ok, other=0.0)
        else:
            if not TMA:
                q = tl.load(q_base + row0 * stride_qm + q_offs)
                do = tl.load(do_base + row0 * stride_dom + do_offs)
            lse2 = _lse2(tl.load(lse_ptrs + row0 * stride_lm))
            delta = tl.load(delta_ptrs + row0 * stride_dlm)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)                 # S^T (BLOCK_N, BLOCK_M)
        x_t, t_t = variant_scores(s_t, rows[None, :], offs_n[:, None], Nq, Nk, sm_scale, softcap, left, right, slope,
                                  mask_base, stride_mm, stride_mn, MASKED, BAND, MASK_KIND, SOFTCAP, ALIBI)
        p_t = tl.math.exp2(x_t - lse2[None, :])                                     # P^T
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)               # (dO V^T)^T
        if DROPOUT:
            z = tl.where(dropout_keep(seed, bh, rows, col0, p_drop, BLOCK_M, BLOCK_N), 1.0 / (1.0 - p_drop), 0.0)
            z_t = tl.trans(z)                                                       # Z^T / (1 - p) (BLOCK_N, BLOCK_M)
            dv = tl.dot((p_t * z_t).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dp_t = dp_t * z_t
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)    # dV_j += P^T dO_i
        ds_t = p_t * (dp_t - delta[None, :])                                        # dS^T
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)         # dK_j += dS^T Q_i
    return dk, dv


@triton.jit(do_not_specialize=["seed"])
def flash_bwd_dkdv_kernel_v5(
    Q, K, V, DO, LSE, Delta, DK, DV, MASK, SLOPES, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dlm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_sb, stride_sh,
    H, GROUP, Nq, Nk, sm_scale, softcap, left, right, p_drop, seed,
    BAND: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """dK_j, dV_j of one K/V tile of K/V head h_kv, summed over its GROUP query heads (grid over H // GROUP)."""
    start_n, off_b, off_hk = program_tile(tl.cdiv(Nk, BLOCK_N), H // GROUP)
    if VARLEN:
        q_start = tl.load(CU_Q + off_b)
        k_start = tl.load(CU_K + off_b)
        Nq = tl.load(CU_Q + off_b + 1) - q_start
        Nk = tl.load(CU_K + off_b + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    offs_c = tl.arange(0, BLOCK_N)
    offs_n = start_n * BLOCK_N + offs_c
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < Nk

    k_base = head_base(K, off_b, off_hk, stride_kb, stride_kh) + tl.cast(k_start, tl.int64) * stride_kn
    v_base = head_base(V, off_b, off_hk, stride_vb, stride_vh) + tl.cast(k_start, tl.int64) * stride_vn
    k = tl.load(tile_ptrs(k_base, start_n * BLOCK_N, offs_c, offs_d, stride_kn, stride_kd), mask=col_ok[:, None],
                other=0.0)
    v = tl.load(tile_ptrs(v_base, start_n * BLOCK_N, offs_c, offs_d, stride_vn, stride_vd), mask=col_ok[:, None],
                other=0.0)
    q_offs = offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_offs = offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod
    lo, full_lo, full_hi, hi = band_tiles(start_n * BLOCK_N, BLOCK_N, BLOCK_M, Nq, right, left,
                                          start_n * BLOCK_N < Nk)

    if TMA:   # Q and dO of this (batch or sequence) as (heads, rows, HEAD_DIM), made once: tiles of (1, BLOCK_M, D)
        q_src = tl.make_tensor_descriptor(
            Q + off_b.to(tl.int64) * stride_qb + tl.cast(q_start, tl.int64) * stride_qm,
            shape=[H, tl.maximum(Nq, 1), HEAD_DIM], strides=[stride_qh, stride_qm, 1], block_shape=[1, BLOCK_M, HEAD_DIM])
        do_src = tl.make_tensor_descriptor(
            DO + off_b.to(tl.int64) * stride_dob + tl.cast(q_start, tl.int64) * stride_dom,
            shape=[H, tl.maximum(Nq, 1), HEAD_DIM], strides=[stride_doh, stride_dom, 1],
            block_shape=[1, BLOCK_M, HEAD_DIM])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(0, GROUP):                                          # the query heads that read this K/V head
        off_h = off_hk * GROUP + g
        q_base = head_base(Q, off_b, off_h, stride_qb, stride_qh) + tl.cast(q_start, tl.int64) * stride_qm
        do_base = head_base(DO, off_b, off_h, stride_dob, stride_doh) + tl.cast(q_start, tl.int64) * stride_dom
        lse_ptrs = (head_base(LSE, off_b, off_h, stride_lb, stride_lh) + tl.cast(q_start, tl.int64) * stride_lm
                    + offs_m * stride_lm)
        delta_ptrs = (head_base(Delta, off_b, off_h, stride_db, stride_dh) + tl.cast(q_start, tl.int64) * stride_dlm
                      + offs_m * stride_dlm)
        mask_base = head_base(MASK, off_b, off_h, stride_mb, stride_mh)
        slope = 0.0
        if ALIBI:
            slope = tl.load(SLOPES + off_b * stride_sb + off_h * stride_sh).to(tl.float32)
        bh = off_b * H + off_h
        if not TMA:
            q_src = q_base
            do_src = do_base
        dk, dv = _dkdv_inner_v5(dk, dv, k, v, q_src, do_src, q_offs, do_offs, off_h, lse_ptrs, delta_ptrs,
                                stride_qm, stride_dom, stride_lm, stride_dlm, offs_n, offs_m, Nq, Nk,
                                sm_scale, softcap, left, right, slope, mask_base, stride_mm, stride_mn,
                                seed, bh, p_drop, start_n * BLOCK_N, lo, full_lo,
                                True, BAND, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA, HEAD_DIM)
        dk, dv = _dkdv_inner_v5(dk, dv, k, v, q_src, do_src, q_offs, do_offs, off_h, lse_ptrs, delta_ptrs,
                                stride_qm, stride_dom, stride_lm, stride_dlm, offs_n, offs_m, Nq, Nk,
                                sm_scale, softcap, left, right, slope, mask_base, stride_mm, stride_mn,
                                seed, bh, p_drop, start_n * BLOCK_N, full_lo, full_hi,
                                False, BAND, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA, HEAD_DIM)
        dk, dv = _dkdv_inner_v5(dk, dv, k, v, q_src, do_src, q_offs, do_offs, off_h, lse_ptrs, delta_ptrs,
                                stride_qm, stride_dom, stride_lm, stride_dlm, offs_n, offs_m, Nq, Nk,
                                sm_scale, softcap, left, right, slope, mask_base, stride_mm, stride_mn,
                                seed, bh, p_drop, start_n * BLOCK_N, full_hi, hi,
                                True, BAND, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA, HEAD_DIM)
    dk = dk * sm_scale
    dk_base = head_base(DK, off_b, off_hk, stride_dkb, stride_dkh) + tl.cast(k_start, tl.int64) * stride_dkn
    dv_base = head_base(DV, off_b, off_hk, stride_dvb, stride_dvh) + tl.cast(k_start, tl.int64) * stride_dvn
    tl.store(tile_ptrs(dk_base, start_n * BLOCK_N, offs_c, offs_d, stride_dkn, stride_dkd),
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(tile_ptrs(dv_base, start_n * BLOCK_N, offs_c, offs_d, stride_dvn, stride_dvd),
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_inner_v5(dq, q, do, lse2, delta, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn,
                 offs_m, offs_n, Nq, Nk, sm_scale, softcap, left, right, slope,
                 mask_base, stride_mm, stride_mn, seed, bh, p_drop, lo, hi,
                 MASKED: tl.constexpr, BAND: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Stream the K/V tiles lo ... < hi (TMA: k_base, v_base are tensor descriptors)."""
    for start_n in range(lo, hi, BLOCK_N):
        row0 = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        if TMA:
            k = k_base.load([start_n, 0])
            v = v_base.load([start_n, 0])
        elif MASKED:
            k = tl.load(k_base + row0 * stride_kn + k_offs, mask=cols[:, None] < Nk, other=0.0)
            v = tl.load(v_base + row0 * stride_vn + v_offs, mask=cols[:, None] < Nk, other=0.0)
        else:
            k = tl.load(k_base + row0 * stride_kn + k_offs)
            v = tl.load(v_base + row0 * stride_vn + v_offs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        x, t = variant_scores(s, offs_m[:, None], cols[None, :], Nq, Nk, sm_scale, softcap, left, right, slope,
                              mask_base, stride_mm, stride_mn, MASKED, BAND, MASK_KIND, SOFTCAP, ALIBI)
        p = tl.math.exp2(x - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = dropout_keep(seed, bh, offs_m, start_n, p_drop, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp * (1.0 / (1.0 - p_drop)), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["seed"])
def flash_bwd_dq_kernel_v5(
    Q, K, V, DO, LSE, Delta, DQ, MASK, SLOPES, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dlm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_sb, stride_sh,
    H, GROUP, Nq, Nk, sm_scale, softcap, left, right, p_drop, seed,
    BAND: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """dQ_i of one query tile (v2's contract plus the variants; query head h reads K/V head h // GROUP)."""
    n_tiles = tl.cdiv(Nq, BLOCK_M)
    start_m, off_b, off_h = program_tile(n_tiles, H)
    if BAND:
        start_m = n_tiles - 1 - start_m
    off_hk = off_h // GROUP
    if VARLEN:
        q_start = tl.load(CU_Q + off_b)
        k_start = tl.load(CU_K + off_b)
        Nq = tl.load(CU_Q + off_b + 1) - q_start
        Nk = tl.load(CU_K + off_b + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq

    q_base = head_base(Q, off_b, off_h, stride_qb, stride_qh) + tl.cast(q_start, tl.int64) * stride_qm
    do_base = head_base(DO, off_b, off_h, stride_dob, stride_doh) + tl.cast(q_start, tl.int64) * stride_dom
    q = tl.load(tile_ptrs(q_base, start_m * BLOCK_M, offs_r, offs_d, stride_qm, stride_qd), mask=row_ok[:, None],
                other=0.0)
    do = tl.load(tile_ptrs(do_base, start_m * BLOCK_M, offs_r, offs_d, stride_dom, stride_dod),
                 mask=row_ok[:, None], other=0.0)
    l_base = head_base(LSE, off_b, off_h, stride_lb, stride_lh) + tl.cast(q_start, tl.int64) * stride_lm
    lse2 = _lse2(tl.load(l_base + offs_m * stride_lm, mask=row_ok, other=0.0))
    d_base = head_base(Delta, off_b, off_h, stride_db, stride_dh) + tl.cast(q_start, tl.int64) * stride_dlm
    delta = tl.load(d_base + offs_m * stride_dlm, mask=row_ok, other=0.0)
    k_base = head_base(K, off_b, off_hk, stride_kb, stride_kh) + tl.cast(k_start, tl.int64) * stride_kn
    v_base = head_base(V, off_b, off_hk, stride_vb, stride_vh) + tl.cast(k_start, tl.int64) * stride_vn
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    mask_base = head_base(MASK, off_b, off_h, stride_mb, stride_mh)
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + off_b * stride_sb + off_h * stride_sh).to(tl.float32)
    bh = off_b * H + off_h

    if TMA:   # the K/V tiles of the loop through descriptors of this (sequence, K/V head); >= 1 row
        k_src = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(Nk, 1), HEAD_DIM], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(Nk, 1), HEAD_DIM], strides=[stride_vn, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
    else:
        k_src = k_base
        v_src = v_base

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, full_hi, hi = band_tiles(start_m * BLOCK_M, BLOCK_M, BLOCK_N, Nk, left, right,
                                          start_m * BLOCK_M < Nq)
    dq = _dq_inner_v5(dq, q, do, lse2, delta, k_src, v_src, k_offs, v_offs, stride_kn, stride_vn, offs_m, offs_n,
                      Nq, Nk, sm_scale, softcap, left, right, slope, mask_base, stride_mm, stride_mn,
                      seed, bh, p_drop, lo, full_lo,
                      True, BAND, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA)
    dq = _dq_inner_v5(dq, q, do, lse2, delta, k_src, v_src, k_offs, v_offs, stride_kn, stride_vn, offs_m, offs_n,
                      Nq, Nk, sm_scale, softcap, left, right, slope, mask_base, stride_mm, stride_mn,
                      seed, bh, p_drop, full_lo, full_hi,
                      False, BAND, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA)
    dq = _dq_inner_v5(dq, q, do, lse2, delta, k_src, v_src, k_offs, v_offs, stride_kn, stride_vn, offs_m, offs_n,
                      Nq, Nk, sm_scale, softcap, left, right, slope, mask_base, stride_mm, stride_mn,
                      seed, bh, p_drop, full_hi, hi,
                      True, BAND, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA)
    dq = dq * sm_scale
    dq_base = head_base(DQ, off_b, off_h, stride_dqb, stride_dqh) + tl.cast(q_start, tl.int64) * stride_dqm
    tl.store(tile_ptrs(dq_base, start_m * BLOCK_M, offs_r, offs_d, stride_dqm, stride_dqd),
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------- configs and launcher

SUPPORTS = frozenset({"gqa", "window", "softcap", "alibi", "mask", "dropout", "varlen"})


def backward_v5_configs(head_dim: int, dtype) -> list:
    """Hand-picked (dK/dV config, dQ config) pairs, best first: backward v2's hand-picked list (v5 does not
    autotune)."""
    import torch
    if dtype == torch.float32 or head_dim > 128:
        return [(C(32, 32, 4, 1), C(32, 32, 4, 1)), (C(16, 32, 4, 1), C(32, 16, 4, 1)),
                (C(16, 16, 4, 1), C(16, 16, 4, 1))]
    if head_dim <= 64:
        return [(C(32, 64, 4, 3), C(64, 32, 4, 3)), (C(32, 64, 4, 2), C(64, 32, 4, 2)),
                (C(32, 32, 4, 1), C(32, 32, 4, 1))]
    return [(C(64, 128, 8, 3), C(128, 64, 8, 3)), (C(64, 64, 4, 2), C(64, 64, 4, 2)),
            (C(32, 64, 4, 2), C(64, 32, 4, 2)), (C(32, 32, 4, 1), C(32, 32, 4, 1))]


def config_lists(head_dim, dtype, limit, cc) -> dict:
    """{"dkdv": ..., "dq": ...}: the pairs of which both fit ``limit``, split by kernel; no autotuning."""
    pairs = tiles.fitting_pairs(backward_v5_configs(head_dim, dtype), head_dim, dtype, limit, cc)
    return {"dkdv": ([p[0] for p in pairs], []), "dq": ([p[1] for p in pairs], [])}


def launch(plan, q, k, v, o, lse, do, dq, dk, dv, scale: float, runners=None, *, mask=None, slopes=None,
           cu_q=None, cu_k=None, softcap=None, dropout_p: float = 0.0, seed: int = 0):
    """Run the plan's backward steps (Delta, dK/dV, dQ) into dq, dk, dv (shaped like q, k, v); the arguments
    mean what they mean in forward_v4.launch (the same plan, the same ``variant_args``)."""
    import torch
    varlen = plan.variant.varlen
    H = plan.H
    if varlen:
        total = q.shape[0]
        lse_strides = (0, lse.stride(0), lse.stride(1))
        delta = torch.empty((H, total), device=q.device, dtype=torch.float32)
        d_strides = (0, delta.stride(0), delta.stride(1))
        pre_rows, pre_b = total, 1
    else:
        lse_strides = tuple(lse.stride())
        delta = torch.empty((plan.B, H, plan.Nq), device=q.device, dtype=torch.float32)
        d_strides = tuple(delta.stride())
        pre_rows, pre_b = plan.Nq, plan.B
    s_pre, s_kv, s_q = plan.backward
    tiles.run(s_pre, flash_bwd_delta_v5,
              (o, do, delta, *dense_strides(o, varlen), *dense_strides(do, varlen), *d_strides, H, pre_rows),
              dict(HEAD_DIM=plan.D), lambda cfg: tiles.grid_1d(triton.cdiv(pre_rows, cfg.block_m), pre_b * H),
              runners, "pre")

    ptrs, strides, scalars, consts = variant_arguments(plan, q, lse, mask, slopes, cu_q, cu_k, softcap,
                                                       dropout_p, seed)
    consts["TMA"] = use_descriptors(plan, q, k, v, do)
    if consts["TMA"]:
        tiles.ensure_allocator()
    H, group, Nq, Nk, cap, left, right, p_drop, seed_ = scalars
    common = (*dense_strides(q, varlen), *dense_strides(k, varlen), *dense_strides(v, varlen),
              *dense_strides(do, varlen))
    tail = (*lse_strides, *d_strides, *strides, H, group, Nq, Nk, float(scale), cap, left, right, p_drop, seed_)
    run_step(s_kv, flash_bwd_dkdv_kernel_v5,
             (q, k, v, do, lse, delta, dk, dv, *ptrs, *common, *dense_strides(dk, varlen),
              *dense_strides(dv, varlen), *tail), consts, runners, "dkdv")
    run_step(s_q, flash_bwd_dq_kernel_v5,
             (q, k, v, do, lse, delta, dq, *ptrs, *common, *dense_strides(dq, varlen), *tail),
             consts, runners, "dq")
