"""The backward with an atomic dQ: one pass over (K/V tile, Q tile) pairs instead of two (teaching only).

The canonical backward (:mod:`flashlab.kernels.backward`) computes S and P twice, once in a
K/V-stationary kernel for dK, dV and once in a Q-stationary kernel for dQ, so that every program
owns the rows it writes.  The alternative here (FlashAttention-2's original backward) keeps only
the K/V-stationary loop and adds each tile's share of dQ into a float32 buffer in HBM:

    for each K/V tile j (one program):          for each Q tile i:
        dV_j += P_ij^T dO_i,  dK_j += s dS_ij^T Q_i     (on chip, as before)
        dQ_i += s dS_ij K_j                             tl.atomic_add into HBM (float32)

Several programs add into the same dQ_i at the same time; the GPU serialises the atomic adds in
whatever order the programs arrive, and float addition is not associative, so dQ's last bits change
from run to run.  In the interpreter programs run one after another in a fixed order, so the result
is always the same there: nondeterminism is a property of the parallel hardware, not of the code.

Not used by ``flashlab.flash_attention``.  Same contract as the ``flash_backward`` exercise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import device  # noqa: F401  (settles TRITON_INTERPRET before the kernel is defined)
from ..kernels import backward_config
from ..kernels.backward import flash_bwd_preprocess
from ..kernels.common import LOG2E_K as LOG2E



@triton.jit
def flash_bwd_atomic_dq_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQ_ACC,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, SEM: tl.constexpr = "relaxed",
):
    """dK_j, dV_j for one K/V tile, and its share of every dQ_i, added atomically into DQ_ACC
    ((B, H, Nq, HEAD_DIM) float32, contiguous, zeroed by the launcher).  ``SEM``: the atomics' memory
    ordering ("relaxed", as backward v3 / v4 use, or Triton's default "acq_rel")."""
    start_n = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < Nk

    k = tl.load(K + off_b * stride_kb + off_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=col_ok[:, None], other=0.0)                                    # K_j (BLOCK_N, D)
    v = tl.load(V + off_b * stride_vb + off_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=col_ok[:, None], other=0.0)                                    # V_j (BLOCK_N, D)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dq_base = DQ_ACC + off_bh.to(tl.int64) * Nq * HEAD_DIM

    lo = (start_n * BLOCK_N) // BLOCK_M * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, Nq, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < Nq
        q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=row_ok[:, None], other=0.0)                                # Q_i (BLOCK_M, D)
        do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows[:, None] * stride_dom
                     + offs_d[None, :] * stride_dod, mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + off_b * stride_lb + off_h * stride_lh + rows * stride_lm, mask=row_ok, other=0.0)
        delta = tl.load(Delta + off_bh * Nq + rows, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale        # S_ij (BLOCK_M, BLOCK_N)
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= rows[:, None])
        s = tl.where(keep, s, float("-inf"))
        p = tl.math.exp2((s - lse[:, None]) * LOG2E)                                # P_ij = e^(S - L)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)  # dV_j += P^T dO_i
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)                 # dP_ij = dO_i V_j^T
        ds = p * (dp - delta[:, None])                                              # dS_ij
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PRECISION)  # dK_j += dS^T Q_i
        dq_part = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION) * sm_scale  # s dS_ij K_j
        tl.atomic_add(dq_base + rows[:, None] * HEAD_DIM + offs_d[None, :], dq_part,
                      mask=row_ok[:, None], sem=SEM)                                # dQ_i += ..., in HBM
    dk = dk * sm_scale
    tl.store(DK + off_b * stride_dkb + off_h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + off_b * stride_dvb + off_h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


SEMANTICS = ("relaxed", "acq_rel")


def launch_backward_atomic(q, k, v, o, lse, do, dq, dk, dv, causal: bool, scale: float, *, config=None,
                           sem: str = "relaxed"):
    """Write dQ, dK, dV into ``dq``, ``dk``, ``dv``: the Delta kernel, then one K/V-stationary kernel
    with an atomic dQ.  ``config``: the dK/dV kernel's :class:`flashlab.kernels.Config` (default: the
    canonical backward's).  fp16/bf16/fp32 (fp32 as IEEE); head dims 16..128.

    ``sem``: the memory ordering of the atomic adds.  "relaxed" (the default, and what backward v3 / v4
    use) only promises that each add happens once, whole: all a sum of partial tiles needs, since no
    program reads dQ before the last kernel has finished.  "acq_rel", ``tl.atomic_add``'s own default,
    also orders every other memory access of the thread around each add (a fence on each side): correct
    here too, but it asks for an ordering nothing reads.  The H200 recording of 2026-11-30
    (scripts/record_part3.py, "3.6x slower than two kernels") ran "acq_rel"."""
    if sem not in SEMANTICS:
        raise ValueError(f"sem must be one of {SEMANTICS}, got {sem!r}")
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cfg = config or backward_config(D, q.dtype)[0]
    delta = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    pre_m = 32 if device.INTERPRET else 64
    flash_bwd_preprocess[(triton.cdiv(Nq, pre_m) * B * H,)](   # 1-D grid, tile index fastest
        o, do, delta, *o.stride(), *do.stride(), H, Nq, BLOCK_M=pre_m, HEAD_DIM=D)
    dq_acc = torch.zeros((B, H, Nq, D), device=q.device, dtype=torch.float32)
    flash_bwd_atomic_dq_kernel[(triton.cdiv(Nk, cfg.block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, dq_acc,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *lse.stride(),
        H, Nq, Nk, scale, CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D,
        DOT_PRECISION="ieee", SEM=sem, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    dq.copy_(dq_acc)
