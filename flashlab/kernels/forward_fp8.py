"""FlashAttention forward in FP8: forward v2's dense loop with e4m3 Q, K, V and an e4m3 P.

Diff this file against forward_v2.py (its parent; forward v4's dense path is the same loop).  The
online softmax is unchanged; what changed is the number format the two matrix products read.

1. **Inputs in e4m3, one scale per (batch, head).**  ``Q = Q8 * q_scale[b, h]``, likewise K and V:
   Q8, K8, V8 are ``torch.float8_e4m3fn`` (4 exponent bits, 3 mantissa bits, largest value 448) and
   the scales float32 (``flashlab.fp8.quantize_fp8`` makes them: scale = amax / 448).  One e4m3
   number has 3 mantissa bits, so rounding to it costs a relative error of at most 2^-4; the scale
   puts each (batch, head)'s largest element at 448, so the data uses the whole exponent range.
2. **Scores.**  ``S = tl.dot(q8, k8^T)`` multiplies e4m3 by e4m3 and accumulates in float32 (each
   product of two 4-bit significands is exact in float32).  The scales are applied once per score,
   folded into v2's single multiply: ``x = S * (q_scale * k_scale * softmax_scale * log2 e)``.
3. **P in e4m3.**  P~ = 2^(x - m) lies in [0, 1]; it is cast to e4m3 (``tl.float8e4nv``) for the
   second product, acc += P8 V8, still accumulated in float32 (on Hopper Triton leaves FP8 sums in the
   tensor core's accumulator, which keeps fewer bits than float32: negligible beside e4m3's 2^-4).  The row sum l uses the float32 P~
   (the weights before rounding), so rounding P costs each weight at most 2^-4 of itself (2^-10
   absolutely below 2^-6, e4m3's smallest normal number): tests/test_fp8.py derives its bound from that.
4. **V transposed.**  Hopper's FP8 tensor-core instruction (wgmma) wants its shared-memory operand
   "K-major": contiguous along the dimension the product sums over.  For S = Q K^T that is D, and K
   (N, D) with unit last stride already is.  For O = P V it is the key dimension N, so V must be
   stored as V^T, (B, H, D, Nk) with N contiguous (with fp16/bf16 the hardware transposes V for
   free; with FP8 it cannot).  FlashAttention-3 transposes each V tile inside the kernel (LDSM / STSM in
   its producer warpgroup, hidden behind the products), which ``tl`` cannot express; Triton's tutorial 06
   hands the kernel V^T, stored so before the call, and so does this one: ``quantize_fp8(v, transpose=True)`` writes it, the loop loads a
   (D, BLOCK_N) tile of V^T and computes ``tl.dot(p8, tl.trans(vt))``.
5. **V's scale on the output only.**  O = (P V8) * v_scale / l: one multiply per output element.
   O is written in bf16, fp16 or fp32 (the caller's tensor), the LSE in float32, natural log.
6. **GQA for free.**  Query head h reads K/V head h // GROUP (and its scales): only addresses change.

7. **Loads.**  On Hopper the K and V^T tiles of the loop come through tensor descriptors made in the
   kernel (forward v3's loads, TMA: ``TMA``, set by the launcher where forward v4 uses them); elsewhere, and
   in the interpreter, v2's pointer loads.  Q is loaded once per program through pointers.

Plain and causal (top-left) attention only: no masks, windows, dropout.  On a GPU: compute capability
8.9 or newer (L4, H100, H200), the GPUs with FP8 tensor cores; the plan refuses older ones with a message.

Prediction.  FP8 tensor cores run at twice the bf16 rate on H100 / H200 (and the tiles are half
the bytes), but the softmax (exp2, max, sum: one per score) is unchanged, and at D = 128 it is
already a large part of the forward's time.  So expect 1.3-1.6x the bf16 forward at long sequences
(N = 16k), not 2x.  The descriptor loads came after the first measurements (1.22-1.31x with pointer loads);
a reading made after they measured, not a prediction: an e4m3 tile is half the bytes, so the pointer
loads' per-element address arithmetic is a larger share of each tile's work than in bf16.  What it
measured: docs/BENCHMARKS.md (entries "the FP8 forward timed" and "the FP8 forward's loads through
descriptors") and flashlab/data/h200_fp8.json.

Interpreter fact (triton 3.9): the interpreter's float32 -> float8e4nv cast mishandles a carry out of
the mantissa (0.49 becomes 0.25, not 0.5) and truncates small numbers.  ``ROUND_P`` (set by the
launcher in the interpreter only) first rounds P to the e4m3 grid in float32 (round to nearest even),
so the cast that follows is exact and the interpreter computes what the GPU's conversion does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import forward_v4, tiles
from .common import LN2_K, LOG2E_K, head_base, program_tile, tile_ptrs
from .tiles import C

FP8_DTYPE = torch.float8_e4m3fn   # the inputs' format
FP8_MAX = 448.0                   # its largest finite value
MIN_CC = (8, 9)                   # FP8 tensor cores: Ada (L4, sm_89), Hopper (H100 / H200, sm_90) and later
MIN_HEAD_DIM = 32                 # an FP8 tensor-core product sums over at least 32 elements
MIN_BLOCK_N = 32                  # (P V sums over BLOCK_N keys)


@triton.jit
def round_to_e4m3(p):
    """p >= 0 (float32) rounded to the nearest e4m3 number, to even on ties, still in float32.

    Normal numbers (p >= 2^-6) keep 3 of float32's 23 mantissa bits: add half of the dropped part
    (minus one, plus the last kept bit: ties to even) to the bits and clear it; a carry moves into the
    exponent by itself.  Below 2^-6 e4m3's numbers are the multiples of 2^-9: adding 2^14 (float32's
    spacing there is 2^-9) rounds to one, to nearest even, and subtracting it again is exact."""
    bits = p.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    small = (p + 16384.0) - 16384.0
    return tl.where(p >= 0.015625, normal, small)


@triton.jit
def _fwd_inner_fp8(acc, l_i, m_i, q, k_base, vt_base, k_offs, vt_offs, stride_kn, stride_vn,
                   offs_m, offs_n, Nk, qk_scale, lo, hi,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_P: tl.constexpr,
                   TMA: tl.constexpr):
    """Stream K/V tiles lo, lo + BLOCK_N, ... < hi (v2's loop).  MASKED: the ragged tail and the diagonal.
    TMA: k_base, vt_base are tensor descriptors (keys past Nk load as zeros)."""
    for start_n in range(lo, hi, BLOCK_N):
        col0 = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        if TMA:
            k = k_base.load([start_n, 0])                               # K8_j through TMA
            vt = vt_base.load([0, start_n])                             # V8_j^T
        elif MASKED:
            k = tl.load(k_base + col0 * stride_kn + k_offs, mask=cols[:, None] < Nk, other=0.0)
            vt = tl.load(vt_base + col0 * stride_vn + vt_offs, mask=cols[None, :] < Nk, other=0.0)
        else:
            k = tl.load(k_base + col0 * stride_kn + k_offs)             # K8_j (BLOCK_N, D), e4m3
            vt = tl.load(vt_base + col0 * stride_vn + vt_offs)          # V8_j^T (D, BLOCK_N), e4m3, N contiguous
        s = tl.dot(q, tl.trans(k))                                      # Q8 K8_j^T, float32 accumulation
        if MASKED:
            keep = cols[None, :] < Nk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)                # qk_scale > 0: max of the unscaled S
        p = tl.math.exp2(s * qk_scale - m_new[:, None])                 # P~_ij in [0, 1], float32
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)                                # the row sum of the unrounded weights
        acc = acc * alpha[:, None]
        if ROUND_P:
            p = round_to_e4m3(p)                                        # the interpreter's cast does not round
        acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc)           # O~_i += P8_ij V8_j, float32 accumulation
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel_fp8(
    Q, K, VT, O, LSE, QS, KS, VS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vd, stride_vn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    H, GROUP, Nq, Nk, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROUND_P: tl.constexpr = False, TMA: tl.constexpr = False,
):
    """O (B, H, Nq, D) = softmax(sm_scale * Q K^T) V and LSE (B, H, Nq), from Q8 (B, H, Nq, D), K8 (B, H_kv, Nk, D)
    and V8^T (B, H_kv, D, Nk) in e4m3, with scales QS (B, H), KS, VS (B, H_kv) float32; any strides.
    GROUP = H // H_kv.  Plain or causal (top-left).  TMA: the K and V^T tiles of the loop through descriptors made
    here (forward v3's loads; unit last strides, 16-byte aligned)."""
    n_tiles = tl.cdiv(Nq, BLOCK_M)
    start_m, off_b, off_h = program_tile(n_tiles, H)
    if CAUSAL:
        start_m = n_tiles - 1 - start_m                                 # longest causal tiles first
    off_hk = off_h // GROUP

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(tile_ptrs(head_base(Q, off_b, off_h, stride_qb, stride_qh), start_m * BLOCK_M, offs_r, offs_d,
                          stride_qm, stride_qd), mask=offs_m[:, None] < Nq, other=0.0)
    k_base = head_base(K, off_b, off_hk, stride_kb, stride_kh)
    vt_base = head_base(VT, off_b, off_hk, stride_vb, stride_vh)
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd          # a (BLOCK_N, D) tile of K
    vt_offs = offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn         # a (D, BLOCK_N) tile of V^T
    if TMA:
        k_base = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(Nk, 1), HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        vt_base = tl.make_tensor_descriptor(vt_base, shape=[HEAD_DIM, tl.maximum(Nk, 1)], strides=[stride_vd, 1],
                                            block_shape=[HEAD_DIM, BLOCK_N])

    # The dequantisation of S, folded into v2's one multiply: q_scale * k_scale * softmax scale * log2 e.
    q_scale = tl.load(QS + off_b * stride_qsb + off_h * stride_qsh)
    k_scale = tl.load(KS + off_b * stride_ksb + off_hk * stride_ksh)
    v_scale = tl.load(VS + off_b * stride_vsb + off_hk * stride_vsh)
    qk_scale = q_scale * k_scale * (sm_scale * LOG2E_K)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    full = Nk // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, Nk)
        unmasked = tl.minimum((start_m * BLOCK_M) // BLOCK_N * BLOCK_N, full)
    else:
        hi = Nk
        unmasked = full
    acc, l_i, m_i = _fwd_inner_fp8(acc, l_i, m_i, q, k_base, vt_base, k_offs, vt_offs, stride_kn, stride_vn,
                                   offs_m, offs_n, Nk, qk_scale, 0, unmasked, False, CAUSAL, BLOCK_N, ROUND_P,
                                   TMA)
    acc, l_i, m_i = _fwd_inner_fp8(acc, l_i, m_i, q, k_base, vt_base, k_offs, vt_offs, stride_kn, stride_vn,
                                   offs_m, offs_n, Nk, qk_scale, unmasked, hi, True, CAUSAL, BLOCK_N, ROUND_P,
                                   TMA)

    acc = acc * (v_scale / l_i)[:, None]                               # V's scale and 1 / l: one multiply
    lse = (m_i + tl.math.log2(l_i)) * LN2_K
    row_ok = offs_m < Nq
    tl.store(head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm, lse, mask=row_ok)
    tl.store(tile_ptrs(head_base(O, off_b, off_h, stride_ob, stride_oh), start_m * BLOCK_M, offs_r, offs_d,
                       stride_om, stride_od), acc.to(O.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------- configs and launcher

TMA = None   # None: descriptor loads where forward v4 uses them (Hopper); True / False forces (scripts/bench_fp8.py)
SUPPORTS = frozenset({"gqa"})   # chosen by the dtype (e4m3), never by variant features: see plan.choose_versions


def forward_fp8_configs(head_dim: int, cc=None) -> list:
    """Hand-picked configs, best first; each is timed forced by scripts/bench_fp8.py (docs/BENCHMARKS.md).  Half the bytes of
    a bf16 tile per element, so a tile twice as wide fits the same shared memory: 128 x 128 where the bf16
    forwards take 128 x 64.  Every BLOCK_N is at least 32 (MIN_BLOCK_N)."""
    if head_dim <= 64:
        return [C(128, 128, 4, 3), C(128, 64, 4, 3), C(64, 64, 4, 2), C(32, 32, 4, 1)]
    if head_dim <= 128:
        hopper = [C(128, 128, 8, 3)] if cc is not None and tuple(cc) >= (9, 0) else []
        return hopper + [C(128, 64, 8, 3), C(128, 64, 4, 2), C(64, 64, 4, 2), C(32, 32, 4, 1)]
    return [C(64, 64, 4, 2), C(64, 32, 4, 2), C(32, 32, 4, 1)]


def config_lists(head_dim, dtype, limit, cc) -> dict:
    """{"fwd": (the hand-picked configs that fit ``limit``, no autotuning candidates)}."""
    return {"fwd": (tiles.fitting(forward_fp8_configs(head_dim, cc), "fwd", head_dim, FP8_DTYPE, limit, cc), [])}


def launch(plan, q, k, vt, o, lse, scale: float, runners=None, *, q_scale, k_scale, v_scale):
    """Run the plan's forward step: O into ``o`` (B, H, Nq, D; bf16, fp16 or fp32), the natural-log LSE into
    ``lse`` (B, H, Nq) float32.  q (B, H, Nq, D), k (B, H_kv, Nk, D), vt (B, H_kv, D, Nk): e4m3; q_scale (B, H),
    k_scale and v_scale (B, H_kv): float32.  The checks are the caller's (flashlab.fp8); this only launches."""
    from .. import device
    group = plan.H // k.shape[1]
    args = (q, k, vt, o, lse, q_scale, k_scale, v_scale,
            *q.stride(), *k.stride(), *vt.stride(), *o.stride(), *lse.stride(),
            *q_scale.stride(), *k_scale.stride(), *v_scale.stride(),
            plan.H, group, plan.Nq, plan.Nk, float(scale))
    consts = dict(CAUSAL=plan.causal, HEAD_DIM=plan.D, ROUND_P=device.INTERPRET,
                  TMA=TMA if TMA is not None else forward_v4.use_descriptors(plan, k, vt))
    if consts["TMA"]:
        tiles.ensure_allocator()
    forward_v4.run_step(plan.forward[0], flash_fwd_kernel_fp8, args, consts, runners,
                        "fwd tma" if consts["TMA"] else "fwd")   # a runner per load path (TMA may be forced)
