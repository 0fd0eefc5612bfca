"""FlashAttention-2 forward, v3: v2 with tensor descriptors (TMA on Hopper).

Diff against forward_v2.py: the pointer tensors are gone.  Each program describes
its (batch, head)'s Q, K, V and O as 2-D tensors (rows x HEAD_DIM) with
``tl.make_tensor_descriptor`` (``common.head_desc``: 64-bit base, unit last stride) and loads
whole tiles by their first row:

    k = k_desc.load([start_n, 0])        # K_j (BLOCK_N, D)

On Hopper (sm_90) the compiler turns these into the Tensor Memory Accelerator's bulk
copies: one thread issues a tile copy, no per-element address arithmetic in
registers, and rows past the end of the tensor come back as zeros (so the loads need
no mask; only the scores of a ragged last tile are masked).  Stores through a
descriptor drop rows past the end.  Prediction: fewer registers spent on addresses
and cheaper loads, most visible at D = 128 where v2's pointer tensors are largest.

Requires: last stride 1, every other stride and the base 16-byte aligned (the
launcher checks and otherwise runs v2), and ``triton.set_allocator`` (descriptors
made on the device need a scratch buffer; the launcher sets one).
"""
import triton
import triton.language as tl

from . import forward_v2, tiles
from .common import LN2_K, LOG2E, head_base, head_desc, program_tile


@triton.jit
def _fwd_inner_v3(acc, l_i, m_i, q, k_desc, v_desc, offs_m, offs_n, Nk, qk_scale, lo, hi,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k = k_desc.load([start_n, 0])                                     # K_j (BLOCK_N, D), zero past Nk
        v = v_desc.load([start_n, 0])                                     # V_j (BLOCK_N, D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            cols = start_n + offs_n
            keep = cols[None, :] < Nk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel_v3(
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
    """v2's contract; stride_qd, stride_kd, stride_vd, stride_od must be 1."""
    n_tiles = tl.cdiv(Nq, BLOCK_M)
    start_m, off_b, off_h = program_tile(n_tiles, H)
    if CAUSAL:
        start_m = n_tiles - 1 - start_m

    q_desc = head_desc(Q, off_b, off_h, stride_qb, stride_qh, Nq, stride_qm, BLOCK_M, HEAD_DIM)
    k_desc = head_desc(K, off_b, off_h, stride_kb, stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM)
    v_desc = head_desc(V, off_b, off_h, stride_vb, stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM)
    o_desc = head_desc(O, off_b, off_h, stride_ob, stride_oh, Nq, stride_om, BLOCK_M, HEAD_DIM)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([start_m * BLOCK_M, 0])                             # Q_i, zero past Nq

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
    acc, l_i, m_i = _fwd_inner_v3(acc, l_i, m_i, q, k_desc, v_desc, offs_m, offs_n, Nk, qk_scale, 0, unmasked,
                                  False, CAUSAL, BLOCK_N, DOT_PRECISION)
    acc, l_i, m_i = _fwd_inner_v3(acc, l_i, m_i, q, k_desc, v_desc, offs_m, offs_n, Nk, qk_scale, unmasked, hi,
                                  True, CAUSAL, BLOCK_N, DOT_PRECISION)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2_K
    tl.store(head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm, lse, mask=offs_m < Nq)
    o_desc.store([start_m * BLOCK_M, 0], acc.to(O.dtype.element_ty))   # rows past Nq are dropped


# ------------------------------------------------------------------------------------- configs and launcher

SUPPORTS = frozenset()


def config_lists(head_dim, dtype, limit, cc) -> dict:
    """v2's lists (forward.forward_configs by hand, forward_v2.AUTOTUNE_CONFIGS autotuned)."""
    return forward_v2.config_lists(head_dim, dtype, limit, cc)


def launch(plan, q, k, v, o, lse, scale: float, runners=None):
    """v2's launch, with the allocator that descriptors made on the device need."""
    tiles.ensure_allocator()
    step = plan.forward[0]
    args = (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
            plan.H, plan.Nq, plan.Nk, scale * LOG2E, plan.n_key)
    tiles.run(step, flash_fwd_kernel_v3, args, plan.constexprs,
              step.grid_for, runners, "fwd",
              lambda: tiles.tuned("fwdv3", flash_fwd_kernel_v3, "fwd", forward_v2.AUTOTUNE_CONFIGS, plan.D,
                                  plan.dtype))
