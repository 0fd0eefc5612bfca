"""FlashAttention-1's loop order in Triton, and FA2's forward with its programs in another order (teaching only).

**FA1 order** (FlashAttention, Dao et al. 2022, Algorithm 1).  The outer loop runs over K/V tiles
j, the inner loop over Q tiles i; the output O_i and the per-row statistics m_i (running max) and
l_i (running sum) live in HBM and are read and rewritten once per outer step:

    for each K/V tile j:                       host loop: one kernel launch per K/V tile
        for each Q tile i (in parallel):       the launch's programs, one per (Q tile, batch, head)
            read Q_i, O_i, m_i, l_i            from HBM
            S = s Q_i K_j^T;  m~ = rowmax(S);  P~ = e^(S - m~);  l~ = rowsum(P~)
            m_new = max(m_i, m~);  l_new = e^(m_i - m_new) l_i + e^(m~ - m_new) l~
            O_i = diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~ - m_new) P~ V_j)
            write O_i, m_i = m_new, l_i = l_new    back to HBM

FA2 swaps the loops: one program keeps Q_i, its accumulator and (m_i, l_i) on chip for the whole
key loop and writes O_i and one number per row, L_i = m_i + log l_i, once.  FA1 keeps O normalised
after every step (a division per step), and needs both m and l between steps.

Which form, and why.  Two faithful forms exist: (a) a host loop over K/V tiles launching a kernel
whose programs are Q tiles, or (b) one program per (batch, head) running both loops inside.
FA1's own CUDA kernel parallelised over batch x heads only, like (b); with 16k tokens that is 16
or 32 programs on a GPU of 132 SMs, so (b) would measure mostly idle SMs, a difference FA2 also
removed, but not the loop order.  This file takes (a): every launch has as many programs as FA2's
grid, so a timing against FA2 at the same tiles measures what the loop order costs: the HBM round
trips of O, m and l (and the re-read of Q) once per K/V tile, plus one launch per K/V tile (time
it with CUDA graphs to leave the launches' CPU cost out).  The inner loop of Algorithm 1 is
sequential in the paper only because one thread block runs it; its iterations are independent.
One rearrangement of Algorithm 1's arithmetic, the same numbers: P~ is exponentiated against m_new
directly, e^(S - m_new) = e^(m~ - m_new) P~, so one float32 tile (the rescaled O plus P~ V) is
live instead of two (with two, the kernel spilled registers at v1's tiles).

O is kept between steps in a float32 buffer (FA1's CUDA code also accumulated in a float32
temporary when the keys do not fit one block); the last step of each Q tile writes O in the
output dtype and the natural-log LSE, L = m + log l.  Causal (top-left, query i sees keys j <= i):
the launch for K/V tile j only has programs for the Q tiles that see some key of it (block
skipping); every row sees key 0, so m is finite after the first step and no row is left empty.

**Program order** (:func:`ordered_forward`): flashlab's v1 forward, the same kernel, launched with
a choice of which index runs fastest along the 1-D grid (its constexpr ``HEAD_FASTEST``, off by
default, only changes :func:`flashlab.kernels.common.program_tile`).  ``HEAD_FASTEST=False`` is v1's order (the Q tile index fastest:
programs that run together share one (batch, head) and stream the same K/V tiles at the same time,
so one HBM read can serve many of them from L2); ``HEAD_FASTEST=True`` puts the (batch, head) index
fastest, so programs that run together belong to different heads and a K/V tile is needed again
only when the next wave of Q tiles of that head starts: by then it survived in L2 only if the K/V
of every head fit there.  scripts/record_part2b.py times the two orders (notebook 06).

Not used by ``flashlab.flash_attention``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import device  # noqa: F401  (settles TRITON_INTERPRET before the kernels are defined)
from ..kernels import Config, forward_config
from ..kernels.common import LN2_K, LOG2E, head_base, tile_ptrs
from ..kernels.forward import flash_fwd_kernel

__all__ = ["fa1_config", "fa1_forward", "flash_fwd_fa1_step", "ordered_forward"]


@triton.jit(do_not_specialize=["start_n", "first_tile"])   # one compiled kernel for every step
def flash_fwd_fa1_step(
    Q, K, V, O, LSE, O_ACC, M, L,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, qk_scale, start_n, first_tile,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One step of FA1's outer loop: K/V tile ``start_n`` into every Q tile from ``first_tile`` on.

    O_ACC (B, H, Nq, HEAD_DIM) float32, M and L (B, H, Nq) float32: contiguous scratch holding the
    normalised O, the running max (log2 domain) and the running sum between steps.  Grid:
    (n_q_tiles - first_tile) * B * H programs, Q tile index fastest.
    """
    n_tiles = tl.cdiv(Nq, BLOCK_M) - first_tile
    pid = tl.program_id(0)
    start_m = first_tile + pid % n_tiles
    off_bh = pid // n_tiles
    off_b = off_bh // H
    off_h = off_bh % H

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + offs_r                       # query rows i
    offs_n = tl.arange(0, BLOCK_N)
    cols = start_n + offs_n                                   # key indices j of this K/V tile
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq

    q = tl.load(tile_ptrs(head_base(Q, off_b, off_h, stride_qb, stride_qh), start_m * BLOCK_M, offs_r, offs_d,
                          stride_qm, stride_qd), mask=row_ok[:, None], other=0.0)          # Q_i, again each step
    k = tl.load(tile_ptrs(head_base(K, off_b, off_h, stride_kb, stride_kh), start_n, offs_n, offs_d,
                          stride_kn, stride_kd), mask=(cols < Nk)[:, None], other=0.0)     # K_j
    v = tl.load(tile_ptrs(head_base(V, off_b, off_h, stride_vb, stride_vh), start_n, offs_n, offs_d,
                          stride_vn, stride_vd), mask=(cols < Nk)[:, None], other=0.0)     # V_j

    # the state of rows i in HBM (contiguous scratch: row stride HEAD_DIM, head stride Nq * HEAD_DIM)
    bh64 = off_bh.to(tl.int64)
    acc_ptrs = tile_ptrs(O_ACC + bh64 * Nq * HEAD_DIM, start_m * BLOCK_M, offs_r, offs_d, HEAD_DIM, 1)
    ml_off = bh64 * Nq + offs_m
    m_old = tl.load(M + ml_off, mask=row_ok, other=0.0)
    l_old = tl.load(L + ml_off, mask=row_ok, other=0.0)
    o_old = tl.load(acc_ptrs, mask=row_ok[:, None], other=0.0)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale        # S (log2 domain)
    keep = cols[None, :] < Nk
    if CAUSAL:
        keep = keep & (cols[None, :] <= offs_m[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_old, tl.max(s, 1))                  # m_new = max(m_i, m~); finite: every row saw key 0
    p = tl.math.exp2(s - m_new[:, None])                      # e^(m~ - m_new) P~, in one exponent
    a_old = tl.math.exp2(m_old - m_new) * l_old               # e^(m_i - m_new) l_i  (0 at the first step)
    l_new = a_old + tl.sum(p, 1)                              # l_new = e^(m_i - m_new) l_i + e^(m~ - m_new) l~
    acc = o_old * a_old[:, None]                              # diag(l_i) e^(m_i - m_new) O_i
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)    # + e^(m~ - m_new) P~ V_j
    o_new = acc / l_new[:, None]                              # normalised at every step

    # the last step for this Q tile writes O and L; the others write the state back
    if CAUSAL:
        last_key = tl.minimum((start_m + 1) * BLOCK_M, Nk)
    else:
        last_key = Nk
    is_last = start_n + BLOCK_N >= last_key
    if is_last:
        o_ptrs = tile_ptrs(head_base(O, off_b, off_h, stride_ob, stride_oh), start_m * BLOCK_M, offs_r, offs_d,
                           stride_om, stride_od)
        tl.store(o_ptrs, o_new.to(O.dtype.element_ty), mask=row_ok[:, None])
        lse = (m_new + tl.math.log2(l_new)) * LN2_K
        tl.store(head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm, lse, mask=row_ok)
    else:
        tl.store(acc_ptrs, o_new, mask=row_ok[:, None])
        tl.store(M + ml_off, m_new, mask=row_ok)
        tl.store(L + ml_off, l_new, mask=row_ok)


def fa1_config(cfg: Config) -> Config:
    """FA1's config for FA2's tiles ``cfg``: the same BLOCK_M x BLOCK_N, at least 8 warps, one stage.

    One step holds the float32 O tile, the scores and the pointers of five tiles at once.  Compiled
    for sm_90 (scripts/sass_stats.py's method, triton 3.9, 128 x 64 tiles), D = 64: 156-227 spill
    stores at v1's 4 warps, 0-6 at 8; D = 128 at 8 warps: 53-58 (v1's loop there: 23).  There is no
    loop to pipeline, so one stage.
    """
    return Config(cfg.block_m, cfg.block_n, max(8, cfg.num_warps), 1)


def fa1_forward(q, k, v, o, lse, causal: bool, scale: float | None = None, *, config: Config | None = None,
                allow_tf32: bool = False):
    """FA1-order forward: write O into ``o`` (B, H, Nq, D) and the natural-log LSE into ``lse`` (B, H, Nq).

    Same contract as :func:`flashlab.kernels.launch_forward` (any strides; causal top-left; D a power
    of two >= 16).  ``config``: tiles and warps, used as given (default: :func:`fa1_config` of the
    forward's hand-picked config).  Launches one
    kernel per K/V tile; the scratch (O in float32, m, l) is allocated here, part of the cost.
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cfg = config or fa1_config(forward_config(D, q.dtype))
    bm, bn = cfg.block_m, cfg.block_n
    o_acc = torch.zeros((B, H, Nq, D), device=q.device, dtype=torch.float32)   # O = 0, m = -inf, l = 0 (line 2)
    m = torch.full((B, H, Nq), float("-inf"), device=q.device, dtype=torch.float32)
    l_ = torch.zeros((B, H, Nq), device=q.device, dtype=torch.float32)
    prec = "tf32" if (q.dtype == torch.float32 and allow_tf32) else "ieee"
    n_q = triton.cdiv(Nq, bm)
    for start_n in range(0, Nk, bn):
        first = min(start_n // bm, n_q) if causal else 0       # Q tiles that see no key of this tile: skipped
        if first >= n_q:
            break
        flash_fwd_fa1_step[((n_q - first) * B * H,)](
            q, k, v, o, lse, o_acc, m, l_, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
            H, Nq, Nk, scale * LOG2E, start_n, first,
            CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, DOT_PRECISION=prec,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def ordered_forward(q, k, v, o, lse, causal: bool, scale: float | None = None, *, head_fastest: bool = False,
                    config: Config | None = None):
    """flashlab's v1 forward (the same kernel) launched with the (batch, head) index fastest in the grid
    (``head_fastest``) or the Q tile's (v1's own order)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cfg = config or forward_config(D, q.dtype)
    flash_fwd_kernel[(triton.cdiv(Nq, cfg.block_m) * B * H,)](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        H, Nq, Nk, scale * LOG2E,
        CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D, DOT_PRECISION="ieee",
        HEAD_FASTEST=head_fastest, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
