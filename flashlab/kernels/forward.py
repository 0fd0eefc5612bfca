"""FlashAttention-2 forward in Triton: the readable version the course teaches.

One program computes one tile of Q_i (BLOCK_M rows) for one (batch, head):

    grid = (cdiv(Nq, BLOCK_M) * B * H,)     one axis, tile index fastest (common.program_tile)

It loads Q_i once, streams K_j, V_j (BLOCK_N rows each) through on-chip memory
while keeping the online-softmax state (m_i, l_i, acc) in registers, and writes
O_i = acc / l_i and the LSE L_i = m_i + log l_i once at the end.

Causal (top-left, query i sees keys j <= i) is done in two stages:
  1. key tiles entirely at or below the diagonal: no mask needed;
  2. the tiles the diagonal crosses: mask S_ij where j > i.
Key tiles entirely above the diagonal are never loaded (block skipping).

Scores are kept in the log2 domain: qk_scale = s * log2(e), so that
e^(x) = 2^(x log2 e) and the kernel can use the cheaper ``exp2``.
The LSE is converted back to natural log before it is written.

Every (batch, head) base and every tile's first row is addressed in 64 bits
(common.head_base, common.tile_ptrs): tensors past 2^31 elements work.

Limits (honest): head dim must be a power of two >= 16 here (the host wrapper
pads other sizes); no dropout, no GQA, no attention bias.  Raw pointers with
masks on every tile, no tensor descriptors: the faster versions (forward_v2.py,
forward_v3.py) come beside this one.
"""
import torch
import triton
import triton.language as tl

from . import tiles
from .common import LN2_K, LOG2E, head_base, program_tile, tile_ptrs
from .tiles import C


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn,
               offs_m, offs_n, Nk, qk_scale, lo, hi,
               DIAGONAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Stream the K/V tiles starting at keys lo, lo + BLOCK_N, ... < hi into (acc, l_i, m_i).

    k_base, v_base: the (batch, head) base pointers; k_offs, v_offs: 32-bit offsets inside one tile.
    Each tile's start is added to the base as one 64-bit scalar, so no tensor of 64-bit pointers
    stays alive across iterations (registers: see docs/BENCHMARKS.md, 2026-11-30).
    """
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                          # key indices j
        row0 = tl.cast(start_n, tl.int64)                                # 64-bit tile start
        k = tl.load(k_base + row0 * stride_kn + k_offs, mask=cols[:, None] < Nk, other=0.0)  # K_j (BLOCK_N, D)
        v = tl.load(v_base + row0 * stride_vn + v_offs, mask=cols[:, None] < Nk, other=0.0)  # V_j (BLOCK_N, D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # S_ij (BLOCK_M, BLOCK_N), log2 domain
        keep = cols[None, :] < Nk                                        # ragged tail
        if DIAGONAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])             # causal: j <= i
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))                            # m_i^(j)
        p = tl.math.exp2(s - m_new[:, None])                             # P~_ij
        alpha = tl.math.exp2(m_i - m_new)                                # alpha = 2^(m_old - m_new) = e^(old - new) in natural units
        l_i = l_i * alpha + tl.sum(p, 1)                                 # l_i^(j) = alpha l_i + rowsum(P~_ij)
        acc = acc * alpha[:, None]                                       # diag(alpha) O~_i
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # O~_i += P~_ij V_j
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, qk_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_FASTEST: tl.constexpr = False,
):
    """O (B, H, Nq, D) and LSE (B, H, Nq) float32, from Q (B, H, Nq, D), K, V (B, H, Nk, D); any strides.

    HEAD_FASTEST (default off) only changes the grid order, for notebook 06's L2 experiment."""
    start_m, off_b, off_h = program_tile(tl.cdiv(Nq, BLOCK_M), H, HEAD_FASTEST)   # which Q tile, batch, head

    offs_r = tl.arange(0, BLOCK_M)                       # rows inside the Q tile
    offs_m = start_m * BLOCK_M + offs_r                  # query rows i of this tile
    offs_n = tl.arange(0, BLOCK_N)                       # key offsets inside a K/V tile
    offs_d = tl.arange(0, HEAD_DIM)

    q_ptrs = tile_ptrs(head_base(Q, off_b, off_h, stride_qb, stride_qh), start_m * BLOCK_M, offs_r, offs_d,
                       stride_qm, stride_qd)
    k_base = head_base(K, off_b, off_h, stride_kb, stride_kh)
    v_base = head_base(V, off_b, off_h, stride_vb, stride_vh)
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd          # inside one K tile, 32-bit
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    q = tl.load(q_ptrs, mask=offs_m[:, None] < Nq, other=0.0)     # Q_i (BLOCK_M, D): loaded once, stays on chip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)      # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                    # running sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)          # O~_i, unnormalised

    if CAUSAL:
        # Keys some row of this tile may see: j < (start_m + 1) * BLOCK_M.  Tiles past that
        # are never loaded.  Tiles starting before diag_lo are fully visible: no mask.
        hi = tl.minimum((start_m + 1) * BLOCK_M, Nk)
        diag_lo = tl.minimum((start_m * BLOCK_M) // BLOCK_N * BLOCK_N, hi)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn,
                                   offs_m, offs_n, Nk, qk_scale, 0, diag_lo,
                                   False, BLOCK_N, DOT_PRECISION)     # stage 1: below the diagonal
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn,
                                   offs_m, offs_n, Nk, qk_scale, diag_lo, hi,
                                   True, BLOCK_N, DOT_PRECISION)      # stage 2: on the diagonal
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn,
                                   offs_m, offs_n, Nk, qk_scale, 0, Nk,
                                   False, BLOCK_N, DOT_PRECISION)

    acc = acc / l_i[:, None]                                      # deferred normalisation, once
    lse = (m_i + tl.math.log2(l_i)) * LN2_K                       # L_i = m_i + log l_i, natural log
    row_ok = offs_m < Nq
    tl.store(head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm, lse, mask=row_ok)
    o_ptrs = tile_ptrs(head_base(O, off_b, off_h, stride_ob, stride_oh), start_m * BLOCK_M, offs_r, offs_d,
                       stride_om, stride_od)
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------- configs and launcher

def forward_configs(head_dim: int, dtype: torch.dtype) -> list:
    """Hand-picked forward configs, best first (tiles 128x64 were the H200's choice for v1); v2 and v3 use
    them too where they do not autotune."""
    if dtype == torch.float32:
        return [C(64, 32, 4, 2), C(32, 32, 4, 2), C(32, 16, 4, 1), C(16, 16, 4, 1)]
    if head_dim <= 64:
        return [C(128, 64, 4, 3), C(128, 64, 4, 2), C(64, 64, 4, 2), C(64, 32, 4, 2), C(32, 32, 4, 1)]
    if head_dim <= 128:
        return [C(128, 64, 8, 3), C(128, 64, 8, 2), C(64, 64, 4, 2), C(64, 32, 4, 2), C(32, 32, 4, 1)]
    return [C(64, 32, 4, 2), C(32, 32, 4, 2), C(32, 16, 4, 1), C(16, 16, 4, 1)]


SUPPORTS = frozenset()   # variant features this kernel implements (flashlab.kernels.plan.Variant)


def config_lists(head_dim, dtype, limit, cc) -> dict:
    """{kind: (hand-picked configs that fit ``limit``, autotuning candidates)}: v1 never autotunes."""
    return {"fwd": (tiles.fitting(forward_configs(head_dim, dtype), "fwd", head_dim, dtype, limit, cc), [])}


def launch(plan, q, k, v, o, lse, scale: float, runners=None):
    """Run the plan's forward step: O into ``o``, the natural-log LSE into ``lse``."""
    step = plan.forward[0]
    args = (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
            plan.H, plan.Nq, plan.Nk, scale * LOG2E)
    tiles.run(step, flash_fwd_kernel, args, plan.constexprs,
              step.grid_for, runners, "fwd")
