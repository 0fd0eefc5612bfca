"""FlashAttention-2 backward, v3: one pass over the tile pairs, dQ reduced in bulk.

Diff this file against backward_v2.py.  v2 computes S and P twice: once in the dK/dV kernel
(K/V stationary) and once in the dQ kernel (Q stationary), seven matrix products per tile
pair where the FLOP count credits five.  v3 keeps only the K/V-stationary loop and adds each
tile's share of dQ into a float32 buffer:

    for each K/V tile j (one program):          for each Q tile i:
        dV_j += P_ij^T dO_i,  dK_j += dS_ij^T Q_i       (on chip, as in v2)
        dQacc_i += dS_ij K_j                            one bulk add of a (BLOCK_M, D) tile

then dQ = s * dQacc in the dtype of Q (the launcher).  Changed against v2:

1. **Five products instead of seven.**  Prediction: up to 7/5 = 1.4x if the products were
   all that counted; less, since the dQ tile now travels to L2 once per pair.
2. **The add is one bulk reduction, not one atomic per element.**  On Hopper
   ``dq_desc.atomic_add([row, 0], tile)`` through a tensor descriptor becomes one TMA
   reduce of the whole tile (``cp.reduce.async.bulk.tensor``): the tile goes to shared
   memory, and the TMA unit and L2 do the adds asynchronously.  The teaching kernel (flashlab.teaching.atomic_dq) issues
   one fp32 ``atomic_add`` per element (acq_rel ordering, Triton's default) and measured 3.6x slower than v2.  Triton's
   interpreter has no descriptor reduce, so ``TMA_REDUCE=False`` (the interpreter's and
   pre-Hopper GPUs' path) adds through pointers instead; both are tested.
3. **The adds can be spread over rows** (``SPREAD``).  All programs of a head start together;
   if every one walked the Q tiles from the first, all would add into the same dQ rows at
   the same moment and queue at the same L2 lines.  With SPREAD each program starts its full
   tiles at a different Q tile (its own K tile index, modulo the count) and wraps around.
   Prediction: fewer adds queued at the same L2 lines; where programs reading the same Q tile
   together share it in L2 (D = 64) it may cost.  The plan spreads only above D = 64, as
   measured (docs/BENCHMARKS.md).
4. **Loads through tensor descriptors** for Q, K, V and dO, as in forward v3: rows past the
   end come back as zeros, so v2's masked copy of the loop for the ragged last Q tile is gone.
   Keys past Nk are zeros too, but their scores (0) would still give P = e^(-L_i), which
   can overflow fp16 in dS = P (dP - D) when L_i is very negative (e^(-L_i) alone passes fp16's
   65504 once L_i < -11.1), and inf * 0 in dS K is NaN.  On
   paper no real P exceeds 1 (L_i is at least every score of row i), so the exponent is clamped
   at 0: for a real key that only trims rounding (the recomputed score and the stored L_i can
   differ in their last bits: P = 1 + 1e-4 becomes 1); a padded key's P becomes at most 1 (not
   0), its dS finite, and its dS K zero since its K row is zero; its dK and dV rows are never
   stored (NaN still propagates: ``propagate_nan``).  (A copy of the loop that masked j >= Nk
   did the same, but the compiler gave it pipeline buffers of its own: 89 -> 146 KiB of shared
   memory at D = 64, one program per SM instead of two, and 210 -> 322 KiB at D = 128, more
   than an SM has, so autotuning fell back to smaller tiles: slower, docs/BENCHMARKS.md.)

Like the teaching kernel, dQ's last bits now depend on the order the adds arrive in, which
changes from run to run on a GPU (float addition is not associative); dK and dV do not.
Memory: the float32 buffer holds B*H*Nq*D*4 bytes during the backward (twice an fp16 dQ),
still O(N).
Same contract as v2; strides of the last dim must be 1 and the others 16-byte aligned.
"""
import torch
import triton
import triton.language as tl

from . import backward, tiles
from .common import LOG2E, LOG2E_K, head_base, head_desc, program_tile
from .tiles import C


@triton.jit
def _bwd_inner_v3(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_ptrs, lse_base, delta_base, stride_lm,
                  offs_n, offs_m, Nq, qk_scale, first, n_iter, lo, n_tiles,
                  MASK_CAUSAL: tl.constexpr, TMA_REDUCE: tl.constexpr,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """n_iter Q tiles, starting at tile ``first`` of the n_tiles tiles from row ``lo`` on, wrapping."""
    for it in range(n_iter):
        start_m = lo + ((first + it) % n_tiles) * BLOCK_M
        rows = start_m + offs_m
        row_ok = rows < Nq
        q = q_desc.load([start_m, 0])                                               # Q_i, zero past Nq
        do = do_desc.load([start_m, 0])                                             # dO_i
        lse2 = tl.load(lse_base + rows * stride_lm, mask=row_ok, other=0.0) * LOG2E_K   # L_i in base 2
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)                  # D_i
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)                 # S^T / s (BLOCK_N, BLOCK_M)
        if MASK_CAUSAL:
            s_t = tl.where(offs_n[:, None] <= rows[None, :], s_t, float("-inf"))    # j <= i
        p_t = tl.math.exp2(tl.minimum(s_t * qk_scale - lse2[None, :], 0.0,          # P^T <= 1 (keys past Nk too)
                                      propagate_nan=tl.PropagateNan.ALL))
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)        # dV_j += P^T dO_i
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)               # dP^T = V_j dO_i^T
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)                          # dS^T
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)                     # dK_j += dS^T Q_i
        dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION)               # dS_ij K_j (BLOCK_M, D)
        if TMA_REDUCE:
            dq_desc.atomic_add([start_m, 0], dq)                                    # one bulk add; rows past Nq dropped
        else:
            tl.atomic_add(DQ_ptrs + rows[:, None] * HEAD_DIM, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def flash_bwd_kernel_v3(
    Q, K, V, DO, LSE, Delta, DK, DV, DQ_ACC,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, sm_scale, qk_scale, N_KEY,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA_REDUCE: tl.constexpr, SPREAD: tl.constexpr = True,
):
    """dK_j, dV_j for one K/V tile, and its share of dQ added into DQ_ACC ((B, H, Nq, D) float32, contiguous)."""
    start_n, off_b, off_h = program_tile(tl.cdiv(Nk, BLOCK_N), H)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    k_desc = head_desc(K, off_b, off_h, stride_kb, stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM)
    v_desc = head_desc(V, off_b, off_h, stride_vb, stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM)
    q_desc = head_desc(Q, off_b, off_h, stride_qb, stride_qh, Nq, stride_qm, BLOCK_M, HEAD_DIM)
    do_desc = head_desc(DO, off_b, off_h, stride_dob, stride_doh, Nq, stride_dom, BLOCK_M, HEAD_DIM)
    if TMA_REDUCE:
        dq_desc = head_desc(DQ_ACC, off_b, off_h, H * Nq * HEAD_DIM, Nq * HEAD_DIM, Nq, HEAD_DIM, BLOCK_M, HEAD_DIM)
    else:
        dq_desc = k_desc                                             # unused on this path
    dq_ptrs = head_base(DQ_ACC, off_b, off_h, H * Nq * HEAD_DIM, Nq * HEAD_DIM) + offs_d[None, :]   # + row * HEAD_DIM
    lse_base = head_base(LSE, off_b, off_h, stride_lb, stride_lh)
    delta_base = head_base(Delta, off_b, off_h, H * Nq, Nq)

    k = k_desc.load([start_n * BLOCK_N, 0])                          # K_j, zero past Nk
    v = v_desc.load([start_n * BLOCK_N, 0])                          # V_j
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    n_q = tl.cdiv(Nq, BLOCK_M)                                       # Q tiles, the ragged last one included
    if CAUSAL:
        lo = (start_n * BLOCK_N) // BLOCK_M                          # first Q tile that sees this K tile
        diag = tl.cdiv((start_n + 1) * BLOCK_N, BLOCK_M)             # from this Q tile on: all visible
        n_diag = tl.maximum(tl.minimum(diag, n_q) - lo, 0)
        dk, dv = _bwd_inner_v3(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, lse_base, delta_base, stride_lm,
                               offs_n, offs_m, Nq, qk_scale, 0, n_diag, lo * BLOCK_M, tl.maximum(n_diag, 1),
                               True, TMA_REDUCE, BLOCK_M, HEAD_DIM, DOT_PRECISION)   # stage 1: the diagonal
    else:
        diag = 0
    n_rest = tl.maximum(n_q - diag, 0)                               # tiles wholly visible (zeros past Nq)
    first = 0
    if SPREAD:
        first = start_n % tl.maximum(n_rest, 1)                      # each program starts at its own tile
    dk, dv = _bwd_inner_v3(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, lse_base, delta_base, stride_lm,
                           offs_n, offs_m, Nq, qk_scale, first, n_rest, diag * BLOCK_M, tl.maximum(n_rest, 1),
                           False, TMA_REDUCE, BLOCK_M, HEAD_DIM, DOT_PRECISION)   # stage 2: no masks

    dk_desc = head_desc(DK, off_b, off_h, stride_dkb, stride_dkh, Nk, stride_dkn, BLOCK_N, HEAD_DIM)
    dv_desc = head_desc(DV, off_b, off_h, stride_dvb, stride_dvh, Nk, stride_dvn, BLOCK_N, HEAD_DIM)
    dk_desc.store([start_n * BLOCK_N, 0], (dk * sm_scale).to(DK.dtype.element_ty))   # rows past Nk dropped
    dv_desc.store([start_n * BLOCK_N, 0], dv.to(DV.dtype.element_ty))


# ------------------------------------------------------------------------------------- configs and launcher

def backward_v3_configs(head_dim: int, dtype: torch.dtype) -> list:
    """Hand-picked configs of backward v3 and v4 (one kernel: K/V tiles of block_n rows, Q tiles of block_m), best first."""
    if head_dim <= 64:
        return [C(64, 64, 4, 3), C(64, 64, 4, 2), C(32, 64, 4, 2), C(32, 32, 4, 1)]
    return [C(64, 128, 8, 3), C(32, 64, 4, 3), C(64, 64, 4, 2), C(32, 32, 4, 1)]


def autotune_configs(head_dim: int) -> list:
    """Autotuning candidates of v3 and v4 (the H200's best at D = 64 in docs/BENCHMARKS.md, and neighbours)."""
    if head_dim <= 64:
        return [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 128, 8, 3), (32, 64, 4, 3), (128, 64, 4, 3)]
    return [(64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3)]


SUPPORTS = frozenset()


def config_lists(head_dim, dtype, limit, cc) -> dict:
    return {"bwd": (tiles.fitting(backward_v3_configs(head_dim, dtype), "bwd", head_dim, dtype, limit, cc),
                    autotune_configs(head_dim))}


def launch(plan, q, k, v, o, lse, do, dq, dk, dv, scale: float, runners=None):
    """Delta, then the one pass adding dQ into a float32 buffer; dQ = scale * buffer."""
    delta = backward.preprocess(plan, o, do, runners)
    dq_acc = torch.zeros((plan.B, plan.H, plan.Nq, plan.D), device=q.device, dtype=torch.float32)
    tiles.ensure_allocator()     # v3 builds its descriptors in every program, from a scratch buffer
    args = (q, k, v, do, lse, delta, dk, dv, dq_acc, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *dk.stride(), *dv.stride(), *lse.stride(), plan.H, plan.Nq, plan.Nk, scale, scale * LOG2E, plan.n_key)
    step = plan.backward[1]
    tiles.run(step, flash_bwd_kernel_v3, args, plan.one_pass_constexprs,
              step.grid_for, runners, "bwd",
              lambda: tiles.tuned("bwdv3", flash_bwd_kernel_v3, "bwd", autotune_configs(plan.D), plan.D, plan.dtype))
    torch.mul(dq_acc, scale, out=dq)   # scaled and cast in one kernel
