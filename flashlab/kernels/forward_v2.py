"""FlashAttention-2 forward, v2: v1 with masks only where they can matter.

Diff this file against forward.py: the algorithm is the same; three things changed.

1. **Unmasked full tiles.**  v1 masks every K/V load and every score tile against
   ``j < Nk``, although only the last tile can be ragged.  v2 splits the key loop in two:
   full tiles (no mask at all, loads are plain) and the masked rest (the ragged last
   tile, and for causal the tiles the diagonal crosses).  Prediction: the masked path
   costs a compare, a select per score and predicated loads; removing them from all but
   one or two tiles should give a few per cent (the loop is matmul-bound).
2. **One FMA in the exponent.**  v1 scales S (a multiply) and subtracts the max (a
   subtract); v2 keeps S unscaled and computes ``S * qk_scale - m`` as one fused
   multiply-add, with the row max taken on the unscaled S (qk_scale > 0).
3. **Heaviest causal tiles first.**  With causal masking, Q tile i does i + 1 tiles of
   work.  v2 hands the last (longest) Q tiles to the first programs, so the short ones
   fill the gaps at the end instead of one long tile running alone.

Launch: grid (cdiv(Nq, BLOCK_M) * B * H,), like v1.  The launcher autotunes this
kernel on a GPU (tile shapes keyed by head dim and sequence length); in the
interpreter it runs with one hand-picked config.
"""
import triton
import triton.language as tl

from . import tiles
from .common import LN2_K, LOG2E, head_base, program_tile, tile_ptrs
from .forward import forward_configs


@triton.jit
def _fwd_inner_v2(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn,
                  offs_m, offs_n, Nk, qk_scale, lo, hi,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Stream K/V tiles lo, lo + BLOCK_N, ... < hi.  MASKED: ragged tail (and the diagonal if CAUSAL)."""
    for start_n in range(lo, hi, BLOCK_N):
        row0 = tl.cast(start_n, tl.int64)
        if MASKED:
            cols = start_n + offs_n
            k = tl.load(k_base + row0 * stride_kn + k_offs, mask=cols[:, None] < Nk, other=0.0)
            v = tl.load(v_base + row0 * stride_vn + v_offs, mask=cols[:, None] < Nk, other=0.0)
        else:
            k = tl.load(k_base + row0 * stride_kn + k_offs)               # K_j (BLOCK_N, D): a full tile
            v = tl.load(v_base + row0 * stride_vn + v_offs)               # V_j (BLOCK_N, D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)         # S_ij / scale, unscaled
        if MASKED:
            keep = cols[None, :] < Nk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)                  # m_i^(j), log2 domain
        p = tl.math.exp2(s * qk_scale - m_new[:, None])                   # P~_ij: one FMA, then exp2
        alpha = tl.math.exp2(m_i - m_new)                                 # 2^(m_old - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # O~_i += P~_ij V_j
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel_v2(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, qk_scale, N_KEY,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Same contract as v1's flash_fwd_kernel.  N_KEY (a power of two >= max(Nq, Nk)) is only the autotuning key."""
    n_tiles = tl.cdiv(Nq, BLOCK_M)
    start_m, off_b, off_h = program_tile(n_tiles, H)
    if CAUSAL:
        start_m = n_tiles - 1 - start_m                                 # longest tiles first

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_ptrs = tile_ptrs(head_base(Q, off_b, off_h, stride_qb, stride_qh), start_m * BLOCK_M, offs_r, offs_d,
                       stride_qm, stride_qd)
    k_base = head_base(K, off_b, off_h, stride_kb, stride_kh)
    v_base = head_base(V, off_b, off_h, stride_vb, stride_vh)
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    q = tl.load(q_ptrs, mask=offs_m[:, None] < Nq, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    full = Nk // BLOCK_N * BLOCK_N                                      # keys in full tiles
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, Nk)
        unmasked = tl.minimum((start_m * BLOCK_M) // BLOCK_N * BLOCK_N, full)   # below the diagonal, full
    else:
        hi = Nk
        unmasked = full
    acc, l_i, m_i = _fwd_inner_v2(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn,
                                  offs_m, offs_n, Nk, qk_scale, 0, unmasked,
                                  False, CAUSAL, BLOCK_N, DOT_PRECISION)      # stage 1: no masks
    acc, l_i, m_i = _fwd_inner_v2(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn,
                                  offs_m, offs_n, Nk, qk_scale, unmasked, hi,
                                  True, CAUSAL, BLOCK_N, DOT_PRECISION)       # stage 2: diagonal, ragged tail

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2_K
    row_ok = offs_m < Nq
    tl.store(head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm, lse, mask=row_ok)
    o_ptrs = tile_ptrs(head_base(O, off_b, off_h, stride_ob, stride_oh), start_m * BLOCK_M, offs_r, offs_d,
                       stride_om, stride_od)
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------- configs and launcher

# Autotuning candidates of v2 and v3 (block_m, block_n, warps, stages).  (128, 64, 4, 2): two 4-warp programs per
# SM at D = 128 (96 KiB), the config tutorial 06's own autotuning picks on the H200 (docs/BENCHMARKS.md).
AUTOTUNE_CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3),
                    (128, 32, 4, 3), (128, 64, 8, 4), (128, 64, 4, 2), (64, 128, 4, 3)]

SUPPORTS = frozenset()


def config_lists(head_dim, dtype, limit, cc) -> dict:
    """Hand-picked: v1's list (forward.forward_configs); autotuned: AUTOTUNE_CONFIGS."""
    return {"fwd": (tiles.fitting(forward_configs(head_dim, dtype), "fwd", head_dim, dtype, limit, cc),
                    AUTOTUNE_CONFIGS)}


def launch(plan, q, k, v, o, lse, scale: float, runners=None):
    step = plan.forward[0]
    args = (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
            plan.H, plan.Nq, plan.Nk, scale * LOG2E, plan.n_key)
    tiles.run(step, flash_fwd_kernel_v2, args, plan.constexprs,
              step.grid_for, runners, "fwd",
              lambda: tiles.tuned("fwdv2", flash_fwd_kernel_v2, "fwd", AUTOTUNE_CONFIGS, plan.D, plan.dtype))
