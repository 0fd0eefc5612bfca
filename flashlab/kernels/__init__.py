"""Triton kernels and their launchers.

``launch_forward`` / ``launch_backward`` write into tensors the caller allocated
(the same contract as the ``flash_forward`` / ``flash_backward`` exercises);
:mod:`flashlab.attention` does validation, allocation and autograd on top.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import device  # noqa: F401  (settles TRITON_INTERPRET before the kernels are defined)

device.require_triton("flashlab.kernels")  # a clear message (and Colab) instead of "No module named 'triton'"
import triton  # noqa: E402
from .backward import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel, flash_bwd_preprocess
from .forward import LOG2E, flash_fwd_kernel

__all__ = ["Config", "forward_config", "backward_config", "launch_forward", "launch_backward"]


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def forward_config(head_dim: int, dtype: torch.dtype) -> Config:
    """Tile sizes for the forward.  Hand-picked; autotuned versions come later in the course."""
    if device.INTERPRET:
        return Config(32, 32)                     # the interpreter: fewer, smaller programs
    if dtype == torch.float32:
        return Config(64, 32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return Config(128, 64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return Config(128, 64, num_warps=8, num_stages=3)
    return Config(64, 32, num_warps=4, num_stages=2)


def backward_config(head_dim: int, dtype: torch.dtype) -> tuple:
    """(dK/dV kernel config, dQ kernel config): each kernel has its own best tile shape.

    The dK/dV kernel keeps a K/V tile of block_n rows and streams Q tiles of block_m rows;
    the dQ kernel keeps a Q tile of block_m rows and streams K/V tiles of block_n rows.
    """
    if device.INTERPRET:
        return Config(32, 32), Config(32, 32)
    if dtype == torch.float32 or head_dim > 128:
        return Config(32, 32, num_warps=4, num_stages=1), Config(32, 32, num_warps=4, num_stages=1)
    # Picked by scripts/sweep_backward.py on an H200 (docs/BENCHMARKS.md): the dQ kernel wants the
    # transposed tile of the dK/dV kernel (its stationary side is the large one).
    if head_dim <= 64:
        return Config(32, 64, num_warps=4, num_stages=3), Config(64, 32, num_warps=4, num_stages=3)
    return Config(64, 128, num_warps=8, num_stages=3), Config(128, 64, num_warps=8, num_stages=3)


def _dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    return "tf32" if (dtype == torch.float32 and allow_tf32) else "ieee"


def launch_forward(q, k, v, o, lse, causal: bool, scale: float, *, allow_tf32: bool = False,
                   config: Config | None = None):
    """Write O into ``o`` (B, H, Nq, D) and the natural-log LSE into ``lse`` (B, H, Nq) float32.

    Every tensor may have any strides (views into larger buffers work).
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cfg = config or forward_config(D, q.dtype)
    grid = (triton.cdiv(Nq, cfg.block_m), B * H)
    flash_fwd_kernel[grid](
        q, k, v, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        H, Nq, Nk, scale * LOG2E,
        CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D,
        DOT_PRECISION=_dot_precision(q.dtype, allow_tf32),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def launch_backward(q, k, v, o, lse, do, dq, dk, dv, causal: bool, scale: float, *,
                    allow_tf32: bool = False, config: tuple | None = None):
    """Write dQ, dK, dV into ``dq``, ``dk``, ``dv`` (shaped like q, k, v).

    ``config``: (dK/dV config, dQ config), default :func:`backward_config`.
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    c1, c2 = config or backward_config(D, q.dtype)
    prec = _dot_precision(q.dtype, allow_tf32)
    delta = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    pre_m = 64 if not device.INTERPRET else 32
    flash_bwd_preprocess[(triton.cdiv(Nq, pre_m), B * H)](
        o, do, delta, *o.stride(), *do.stride(), H, Nq, BLOCK_M=pre_m, HEAD_DIM=D)
    flash_bwd_dkdv_kernel[(triton.cdiv(Nk, c1.block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *lse.stride(),
        H, Nq, Nk, scale, CAUSAL=causal, BLOCK_M=c1.block_m, BLOCK_N=c1.block_n, HEAD_DIM=D,
        DOT_PRECISION=prec, num_warps=c1.num_warps, num_stages=c1.num_stages)
    flash_bwd_dq_kernel[(triton.cdiv(Nq, c2.block_m), B * H)](
        q, k, v, do, lse, delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *lse.stride(),
        H, Nq, Nk, scale, CAUSAL=causal, BLOCK_M=c2.block_m, BLOCK_N=c2.block_n, HEAD_DIM=D,
        DOT_PRECISION=prec, num_warps=c2.num_warps, num_stages=c2.num_stages)
