"""FlashAttention-2 backward, v4: v3 with its tensor descriptors made on the host.

Diff against backward_v3.py.  v3 builds seven descriptors in every program (Q, K, V, dO, dK, dV
and the float32 dQ buffer) with ``tl.make_tensor_descriptor``: each is a 128-byte "tensor map"
written to global memory and fenced before the TMA unit may read it, and the code that builds
them is 17-30 % of the kernel's SASS (D = 64).  v4 receives the seven as kernel arguments, made once
by the launcher (``triton.tools.tensor_descriptor.TensorDescriptor``) over the whole (B, H, N, D)
tensors, strides as they are, in tiles of (1, 1, BLOCK, D).  A program names its (batch, head) in
the first two coordinates of each load and reshapes the tile to 2-D:

    q = q_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)

The TMA unit checks each coordinate against its own bound, so rows past N still load as zeros
and stores there are still dropped; the loop is v3's.

Prediction: a few per cent, most where programs are short (N = 4096) -- the same change in the
forward measured -2 to +4 %.  What it measured, and its registers and SASS lines against v3's as
compiled for sm_90: docs/BENCHMARKS.md ("Descriptors made on the host").

The interpreter and pre-Hopper GPUs (``TMA_REDUCE=False``) still add dQ through pointers into
DQ_ACC, the buffer dq_desc describes.
"""
import threading

import torch
import triton
import triton.language as tl

from . import backward, backward_v3, tiles
from .common import LOG2E, LOG2E_K, head_base, program_tile


@triton.jit
def _bwd_inner_v4(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_ptrs, off_b, off_h, lse_base, delta_base, stride_lm,
                  offs_n, offs_m, Nq, qk_scale, first, n_iter, lo, n_tiles,
                  MASK_CAUSAL: tl.constexpr, TMA_REDUCE: tl.constexpr,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """n_iter Q tiles, starting at tile ``first`` of the n_tiles tiles from row ``lo`` on, wrapping."""
    for it in range(n_iter):
        start_m = lo + ((first + it) % n_tiles) * BLOCK_M
        rows = start_m + offs_m
        row_ok = rows < Nq
        q = q_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)     # Q_i, zero past Nq
        do = do_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)   # dO_i
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
            dq_desc.atomic_add([off_b, off_h, start_m, 0], dq.reshape(1, 1, BLOCK_M, HEAD_DIM))   # rows past Nq dropped
        else:
            tl.atomic_add(DQ_ptrs + rows[:, None] * HEAD_DIM, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def flash_bwd_kernel_v4(
    q_desc, k_desc, v_desc, do_desc, LSE, Delta, dk_desc, dv_desc, dq_desc, DQ_ACC,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, sm_scale, qk_scale, N_KEY,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA_REDUCE: tl.constexpr, SPREAD: tl.constexpr = True,
):
    """v3's contract, with Q, K, V, dO, dK, dV and the dQ buffer (DQ_ACC) passed as descriptors."""
    start_n, off_b, off_h = program_tile(tl.cdiv(Nk, BLOCK_N), H)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    dq_ptrs = head_base(DQ_ACC, off_b, off_h, H * Nq * HEAD_DIM, Nq * HEAD_DIM) + offs_d[None, :]   # + row * HEAD_DIM
    lse_base = head_base(LSE, off_b, off_h, stride_lb, stride_lh)
    delta_base = head_base(Delta, off_b, off_h, H * Nq, Nq)

    k = k_desc.load([off_b, off_h, start_n * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)   # K_j, zero past Nk
    v = v_desc.load([off_b, off_h, start_n * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)   # V_j
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    n_q = tl.cdiv(Nq, BLOCK_M)                                       # Q tiles, the ragged last one included
    if CAUSAL:
        lo = (start_n * BLOCK_N) // BLOCK_M                          # first Q tile that sees this K tile
        diag = tl.cdiv((start_n + 1) * BLOCK_N, BLOCK_M)             # from this Q tile on: all visible
        n_diag = tl.maximum(tl.minimum(diag, n_q) - lo, 0)
        dk, dv = _bwd_inner_v4(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, off_b, off_h, lse_base, delta_base,
                               stride_lm, offs_n, offs_m, Nq, qk_scale, 0, n_diag, lo * BLOCK_M,
                               tl.maximum(n_diag, 1), True, TMA_REDUCE, BLOCK_M, HEAD_DIM,
                               DOT_PRECISION)   # stage 1: the diagonal
    else:
        diag = 0
    n_rest = tl.maximum(n_q - diag, 0)                               # tiles wholly visible (zeros past Nq)
    first = 0
    if SPREAD:
        first = start_n % tl.maximum(n_rest, 1)                      # each program starts at its own tile
    dk, dv = _bwd_inner_v4(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, off_b, off_h, lse_base, delta_base,
                           stride_lm, offs_n, offs_m, Nq, qk_scale, first, n_rest, diag * BLOCK_M,
                           tl.maximum(n_rest, 1), False, TMA_REDUCE, BLOCK_M, HEAD_DIM, DOT_PRECISION)

    dk = (dk * sm_scale).to(dk_desc.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM)
    dk_desc.store([off_b, off_h, start_n * BLOCK_N, 0], dk)             # rows past Nk dropped
    dv_desc.store([off_b, off_h, start_n * BLOCK_N, 0], dv.to(dv_desc.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM))


# ------------------------------------------------------------------------------------- configs and launcher
# v4's one idea on the host: the seven descriptors over the whole tensors, made here once per kind of call and
# thread, then re-pointed at each call's tensors (descriptors()).

try:   # descriptors made on the host; older Triton releases lack them (the plan then runs v2)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

SUPPORTS = frozenset()
M_DESCS = ("q_desc", "do_desc", "dq_desc", "o_desc")   # descriptors in tiles of BLOCK_M rows; the rest BLOCK_N


def config_lists(head_dim, dtype, limit, cc) -> dict:
    """v3's lists (backward_v3.backward_v3_configs by hand, backward_v3.autotune_configs autotuned)."""
    return backward_v3.config_lists(head_dim, dtype, limit, cc)


def host_desc(t, rows: int = 16):
    """A (B, H, N, D) tensor's descriptor, over the whole tensor as its strides are, in tiles of (1, 1, rows, D)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])


def descriptors(runners, cfg, tensors, m_rows=(0, 3, 6)) -> list:
    """Host descriptors of q, k, v, dO, dK, dV and the dQ buffer (``tensors``, in that order) in the tiles of
    ``cfg``: BLOCK_M rows for q, dO and dQ (the positions ``m_rows``), BLOCK_N for the rest.  Forward v5
    passes (q, k, v, o) with m_rows (0, 3).

    Made once per kind of call and thread, then re-pointed: the call's runners are kept per exact shapes,
    strides and alignment, so from the second call on only each descriptor's base changes, and setting it
    skips the constructor's checks (7 descriptors, tens of microseconds a call).  Per thread, because a
    descriptor re-pointed by one thread must not be launched by another."""
    keep = cfg is not None and runners is not None   # not while autotuning (its pre-hook sets the tiles) or one-off
    key = ("descriptors", threading.get_ident(), cfg)
    made = runners.get(key) if keep else None
    if made is not None:
        for d, t in zip(made, tensors):
            d.base = t
        return made
    bm, bn = (16, 16) if cfg is None else (cfg.block_m, cfg.block_n)
    made = [host_desc(t, bm if i in m_rows else bn) for i, t in enumerate(tensors)]
    if keep:
        runners[key] = made
    return made


def release(runners) -> None:
    """Point this thread's kept descriptors at nothing once their launch is queued: otherwise each would hold
    its last call's tensor (and its memory: dQ's float32 buffer, a forward's output) until the next call of the
    kind.  The launch already encoded the addresses; :func:`descriptors` re-points them on the next call."""
    if runners:
        me = threading.get_ident()
        for key, made in runners.items():
            if isinstance(key, tuple) and key[:2] == ("descriptors", me):
                for d in made:
                    d.base = None


def desc_blocks(nargs: dict):
    """Give each descriptor among a kernel's arguments its config's tile: (1, 1, BLOCK_M or BLOCK_N, D).

    The autotuner's pre-hook: every config it times needs the descriptors in its own tiles."""
    for name, d in nargs.items():
        if TensorDescriptor is not None and isinstance(d, TensorDescriptor):
            rows = nargs["BLOCK_M"] if name in M_DESCS else nargs["BLOCK_N"]
            d.block_shape = [1, 1, rows, d.block_shape[-1]]


def launch(plan, q, k, v, o, lse, do, dq, dk, dv, scale: float, runners=None):
    """v3's launch with the descriptors made here, in the tiles of the config that runs."""
    delta = backward.preprocess(plan, o, do, runners)
    dq_acc = torch.zeros((plan.B, plan.H, plan.Nq, plan.D), device=q.device, dtype=torch.float32)
    tail = (*lse.stride(), plan.H, plan.Nq, plan.Nk, scale, scale * LOG2E, plan.n_key)

    def args(cfg):   # None: autotuning (its pre-hook sets each config's tiles)
        d = descriptors(runners, cfg, (q, k, v, do, dk, dv, dq_acc))
        return (*d[:4], lse, delta, *d[4:], dq_acc, *tail)

    step = plan.backward[1]
    tiles.run(step, flash_bwd_kernel_v4, args, plan.one_pass_constexprs,
              step.grid_for, runners, "bwd",
              lambda: tiles.tuned("bwdv4", flash_bwd_kernel_v4, "bwd", backward_v3.autotune_configs(plan.D), plan.D,
                                  plan.dtype, pre_hook=desc_blocks))
    release(runners)
    torch.mul(dq_acc, scale, out=dq)   # scaled and cast in one kernel
