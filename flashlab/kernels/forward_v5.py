"""FlashAttention-2 forward, v5: v3 with its tensor descriptors made on the host (backward v4's idea).

Diff against forward_v3.py.  v3 builds four descriptors in every program (Q, K, V, O) with
``tl.make_tensor_descriptor``: each is a 128-byte tensor map written to global memory and fenced
before the TMA unit may read it.  A program of a long sequence streams many K/V tiles and earns that
back; a program of a short one (N = 1024: at most 8 K/V tiles of 128) does not, which is why the plan
ran v2's pointer loads below V3_FROM.  v5 receives the four as kernel arguments, made once by the
launcher over the whole (B, H, N, D) tensors, strides as they are, in tiles of (1, 1, BLOCK, D)
(``backward_v4.descriptors``: made once per kind of call and thread, then re-pointed), and names its
(batch, head) in the first two coordinates of each load:

    k = k_desc.load([off_b, off_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)

Rows past N still load as zeros and stores there are still dropped (the TMA unit checks every
coordinate against its own bound); the loop is v3's.

Prediction.  Measured before: the same change at N = 4096 and 16384 gave -2 to +4 % (docs/BENCHMARKS.md,
2026-11-30, "Descriptors made on the host"), so v3 stays there.  At N = 1024 Triton's tutorial 06, whose
forward loads through host descriptors, ran 1.2x flashlab's v2 at D = 128 (445-456 against 369-371
TFLOP/s) and about as fast at D = 64: expect v5 to close most of that at D = 128, little at D = 64.
What it measured: docs/BENCHMARKS.md ("forward v5").

Requires what backward v4 requires: Triton >= 3.4 (``triton.tools.tensor_descriptor``), last strides 1,
16-byte aligned bases and strides, and no stride 0 (a descriptor spans the whole tensor); the plan checks
these, forced or not, and otherwise runs v2.  The plan picks v5 on Hopper only (TMA); forced on another GPU
it runs however that Triton lowers descriptor loads there (not measured).  The interpreter runs it anywhere.
"""
import triton
import triton.language as tl

from . import backward_v4, forward_v2, tiles
from .common import LN2_K, LOG2E, head_base, program_tile


@triton.jit
def _fwd_inner_v5(acc, l_i, m_i, q, k_desc, v_desc, off_b, off_h, offs_m, offs_n, Nk, qk_scale, lo, hi,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k = k_desc.load([off_b, off_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)   # K_j, zero past Nk
        v = v_desc.load([off_b, off_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)   # V_j
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
def flash_fwd_kernel_v5(
    q_desc, k_desc, v_desc, o_desc, LSE,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, qk_scale, N_KEY,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """v3's contract, with Q, K, V, O as host descriptors of the (B, H, N, D) tensors."""
    n_tiles = tl.cdiv(Nq, BLOCK_M)
    start_m, off_b, off_h = program_tile(n_tiles, H)
    if CAUSAL:
        start_m = n_tiles - 1 - start_m

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([off_b, off_h, start_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)   # Q_i, zero past Nq

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
    acc, l_i, m_i = _fwd_inner_v5(acc, l_i, m_i, q, k_desc, v_desc, off_b, off_h, offs_m, offs_n, Nk, qk_scale,
                                  0, unmasked, False, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION)
    acc, l_i, m_i = _fwd_inner_v5(acc, l_i, m_i, q, k_desc, v_desc, off_b, off_h, offs_m, offs_n, Nk, qk_scale,
                                  unmasked, hi, True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2_K
    tl.store(head_base(LSE, off_b, off_h, stride_lb, stride_lh) + offs_m * stride_lm, lse, mask=offs_m < Nq)
    o_desc.store([off_b, off_h, start_m * BLOCK_M, 0],
                 acc.to(o_desc.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))          # rows past Nq are dropped


# ------------------------------------------------------------------------------------- configs and launcher

SUPPORTS = frozenset()
# v2's autotuning list and the tiles Triton's tutorial 06 picks at N = 1024, D = 64 (64 x 64, 4 warps, 2 stages):
# v5 runs in the 1024 bucket only, where short programs favour fewer stages.
AUTOTUNE_CONFIGS = forward_v2.AUTOTUNE_CONFIGS + [(64, 64, 4, 2)]


def config_lists(head_dim, dtype, limit, cc) -> dict:
    """v2's hand-picked list (forward.forward_configs); autotuned: AUTOTUNE_CONFIGS."""
    hand, _ = forward_v2.config_lists(head_dim, dtype, limit, cc)["fwd"]
    return {"fwd": (hand, AUTOTUNE_CONFIGS)}


def launch(plan, q, k, v, o, lse, scale: float, runners=None):
    """v3's launch with the descriptors made here (backward v4's helper), in the tiles of the config that runs."""
    step = plan.forward[0]
    tail = (lse, *lse.stride(), plan.H, plan.Nq, plan.Nk, scale * LOG2E, plan.n_key)

    def args(cfg):   # None: autotuning (its pre-hook sets each config's tiles)
        return (*backward_v4.descriptors(runners, cfg, (q, k, v, o), m_rows=(0, 3)), *tail)

    tiles.run(step, flash_fwd_kernel_v5, args, plan.constexprs, step.grid_for, runners, "fwd",
              lambda: tiles.tuned("fwdv5", flash_fwd_kernel_v5, "fwd", AUTOTUNE_CONFIGS, plan.D,
                                  plan.dtype, pre_hook=backward_v4.desc_blocks))
    backward_v4.release(runners)
