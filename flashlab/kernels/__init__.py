"""Triton kernels: the registry of versions, and the launch entry points.

Versions (each file diffs against the one before it, and ends with its configs and its launcher;
docs/BENCHMARKS.md has what each was predicted to gain and what it measured):

    forward    v1 forward.py      readable FA2: masks on every tile, hand-picked tiles
               v2 forward_v2.py   unmasked full tiles, FMA exponent, longest causal tiles first; autotuned
               v3 forward_v3.py   v2 through tensor descriptors (TMA on Hopper); autotuned
               v4 forward_v4.py   v2 with the variants as constexpr branches (GQA, windows, soft-cap, ALiBi,
                                  masks, dropout, packed sequences); v3's descriptor loads on Hopper; hand-picked
                                  tiles; flashlab.variants runs it
               v5 forward_v5.py   v3 with its descriptors made on the host (backward v4's idea): Hopper's 1024
                                  bucket, where v3's per-program descriptors do not pay; autotuned
               v6 forward_v6.py   FlashAttention-3's warp specialisation in Gluon (sm_90, D = 128): a producer warp,
                                  two consumer warpgroups; GQA, windows and soft-cap as constexpr branches
               fp8 forward_fp8.py v2's loop on e4m3 Q, K, V^T with per-(batch, head) scales, P in e4m3; chosen by the
                                  dtype (torch.float8_e4m3fn), cc >= 8.9, no backward; flashlab.fp8 runs it
    backward   v1 backward.py     three kernels (Delta, dK/dV, dQ), masks on every tile
               v2 backward_v2.py  diagonal / off-diagonal split, base-2 LSE inside; autotuned
               v3 backward_v3.py  one pass: five products per tile pair, dQ added in bulk (TMA reduce); autotuned
               v4 backward_v4.py  v3 with its descriptors made on the host, not in every program; autotuned
               v5 backward_v5.py  v2 with the variants' branches; GQA's dK/dV summed over the group in one program
                                  (no atomics); dropout's mask regenerated; descriptor loads on Hopper;
                                  flashlab.variants runs it
               v6 backward_v6.py  v4's algorithm with forward v6's warp specialisation (Gluon, sm_90, D = 128);
                                  GQA, windows and soft-cap as constexpr branches, as forward v6

Beside them, quantize_fp8.py: the e4m3 quantisation (per-(batch, head) maxima, then scale, cast and store,
V^T written transposed) that ``flashlab.quantize_fp8`` runs before the FP8 forward; a helper, not a version.

Forward v4 and backward v5 (and v6 for its features) go through the same plan: a call with a
:class:`~flashlab.kernels.plan.Variant`
(``launch_forward(..., variant=...)``, as :mod:`flashlab.variants` calls it) is planned and launched like
any other, its features choosing the versions whose ``SUPPORTS`` covers them.

Which version, tiles and grid run for a call is the launch plan's choice (:mod:`.plan`:
``python -m flashlab plan --shape B,H,N,D`` prints it); :mod:`.tiles` has the shared-memory
estimate, autotuning and the launch itself.  ``launch_forward`` / ``launch_backward`` write into
tensors the caller allocated (the same contract as the ``flash_forward`` / ``flash_backward``
exercises): they make (or take) the plan and call the launcher of the plan's version;
:mod:`flashlab.attention` does validation, allocation and autograd on top.
"""
from __future__ import annotations

import dataclasses

from .. import device  # first: settles TRITON_INTERPRET before the kernels are defined

device.require_triton("flashlab.kernels")  # a clear message (and Colab) instead of "No module named 'triton'"
import torch  # noqa: E402

from . import plan, tiles  # noqa: E402
from .backward import backward_configs, flash_bwd_dkdv_kernel, flash_bwd_dq_kernel, flash_bwd_preprocess  # noqa: E402
from .backward_v2 import flash_bwd_dkdv_kernel_v2, flash_bwd_dq_kernel_v2  # noqa: E402
from .backward_v3 import backward_v3_configs, flash_bwd_kernel_v3  # noqa: E402
from .backward_v4 import TensorDescriptor, flash_bwd_kernel_v4  # noqa: E402
from .common import LOG2E  # noqa: E402
from .forward import flash_fwd_kernel, forward_configs  # noqa: E402
from .forward_v2 import flash_fwd_kernel_v2  # noqa: E402
from .forward_v3 import flash_fwd_kernel_v3  # noqa: E402
from .plan import (BACKWARD, BACKWARD_VERSIONS, FORWARD, FORWARD_VERSIONS, ONE_PASS_BWD, V3_FROM,  # noqa: E402
                   DeviceFacts, Plan)
from .tiles import C, Config, estimate_shared_memory, tuned_configs  # noqa: E402

__all__ = ["Config", "forward_configs", "backward_configs", "backward_v3_configs", "forward_config",
           "backward_config", "launch_forward", "launch_backward", "version_op", "FORWARD_VERSIONS", "BACKWARD_VERSIONS",
           "FORWARD", "BACKWARD", "default_versions", "estimate_shared_memory", "tuned_configs", "LOG2E", "plan",
           "tiles", "Plan"]

# Names older scripts and notebooks use (the machinery now lives in .plan and .tiles).
_n_key, _grid_1d, _tma_ok, _host_desc_ok = tiles.n_key, tiles.grid_1d, plan.tma_ok, plan.host_desc_ok
_TUNED, _BEST, _CHOSEN = tiles.TUNED, tiles.BEST, tiles.CHOSEN


def _here() -> DeviceFacts:
    """This device's facts as :mod:`flashlab.device` reports them now (tests replace device.capability)."""
    f = plan.device_facts()
    cc = device.capability()
    return f if cc == f.cc else dataclasses.replace(f, cc=cc)


def default_versions(dtype: torch.dtype = torch.float16, head_dim: int = 64, n_key: int | None = None,
                     causal: bool | None = None) -> dict:
    """The versions the plan picks before the layout is considered: {"fwd": ..., "bwd": ...}
    (:func:`flashlab.kernels.plan.choose_versions` has the measurements behind them)."""
    return plan.choose_versions(dtype, head_dim, n_key, causal, _here(),
                                torch.are_deterministic_algorithms_enabled())[0]


def autotune_enabled(q, n_key: int) -> bool:
    """Whether a call with q's dtype and head dim, in length bucket ``n_key``, autotunes here (GPU only)."""
    return device.DEVICE.type == "cuda" and tiles.autotune_applies(q.dtype, q.shape[-1], n_key, device.INTERPRET)


def _fitting(cands, kernel, head_dim, dtype, limit=None, cc=None):
    if limit is None:
        limit, cc = device.shared_memory_per_block(), device.capability()
    return tiles.fitting(cands, kernel, head_dim, dtype, limit, cc)


def _fitting_pairs(pairs, head_dim, dtype, limit=None, cc=None):
    if limit is None:
        limit, cc = device.shared_memory_per_block(), device.capability()
    return tiles.fitting_pairs(pairs, head_dim, dtype, limit, cc)


def forward_config(head_dim: int, dtype: torch.dtype) -> Config:
    """The config the forward's hand-picked path uses here (interpreter: 32 x 32; GPU: the first that fits)."""
    if device.INTERPRET:
        return plan.INTERPRETER_TILE
    return _fitting(forward_configs(head_dim, dtype), "fwd", head_dim, dtype)[0]


def backward_config(head_dim: int, dtype: torch.dtype) -> tuple:
    if device.INTERPRET:
        return plan.INTERPRETER_TILE, plan.INTERPRETER_TILE
    return _fitting_pairs(backward_configs(head_dim, dtype), head_dim, dtype)[0]


_RUNNERS: dict = {}   # (plan, exact tensor specialisation) -> {step: compiled kernel's runner}


def _specialisation(variant_args: dict) -> tuple:
    """What of a variant's arguments decides the compiled kernel: each tensor's shape, strides, dtype and alignment,
    and whether an int needs 64 bits (the dropout seed); floats are never specialised on."""
    out = []
    for name in sorted(variant_args):
        a = variant_args[name]
        if isinstance(a, torch.Tensor):
            out.append((name, a.shape, a.stride(), a.dtype, a.data_ptr() & 15))
        elif isinstance(a, bool) or a is None:
            out.append((name, a))
        elif isinstance(a, int):
            out.append((name, not -2**31 <= a < 2**31))
        else:
            out.append((name, type(a).__name__))
    return tuple(out)


def _runners(p, tensors, variant_args=None) -> dict:
    key = (p, tuple((t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in tensors),
           _specialisation(variant_args) if variant_args else ())
    r = _RUNNERS.get(key)
    if r is None:
        if len(_RUNNERS) >= 4096:
            _RUNNERS.clear()
        r = _RUNNERS[key] = {}
    return r


def launch_forward(q, k, v, o, lse, causal: bool, scale: float, *, allow_tf32: bool = False,
                   config: Config | None = None, version: str | None = None, plan_: Plan | None = None,
                   variant: plan.Variant = plan.PLAIN, runners: dict | None = None, **variant_args):
    """Write O into ``o`` (B, H, Nq, D) and the natural-log LSE into ``lse`` (B, H, Nq) float32.

    Every tensor may have any strides (views into larger buffers work).  ``version``: one of
    FORWARD_VERSIONS (default: the plan's).  ``config`` forces one tile config (no autotuning,
    no fallback).  ``plan_``: a plan made already (:func:`flashlab.kernels.plan.plan_for`).
    ``variant`` (:class:`flashlab.kernels.plan.Variant`) and ``variant_args`` (its tensors and
    numbers: a mask, a dropout seed, cumulative lengths) go to a version that implements them
    (forward v4: :func:`flashlab.kernels.forward_v4.launch`).  A packed (varlen) call takes its plan
    from :func:`flashlab.kernels.plan.plan` (q is (total, H, D), not (B, H, N, D)).  ``runners``: the compiled
    kernels' runners of this plan and exactly these tensors' specialisation, kept by a caller that has its own key
    for them (flashlab.variants); otherwise looked up here.
    """
    p = plan_ or plan.plan_for(q, k, v, causal, allow_tf32=allow_tf32, extra=(o,), forward_version=version,
                               forward_config=config, variant=variant)
    if runners is None:
        runners = _runners(p, (q, k, v, o, lse), variant_args)
    FORWARD[p.fwd_version].launch(p, q, k, v, o, lse, scale, runners, **variant_args)


def launch_backward(q, k, v, o, lse, do, dq, dk, dv, causal: bool, scale: float, *,
                    allow_tf32: bool = False, config=None, version: str | None = None, plan_: Plan | None = None,
                    variant: plan.Variant = plan.PLAIN, **variant_args):
    """Write dQ, dK, dV into ``dq``, ``dk``, ``dv`` (shaped like q, k, v).

    ``config``: (dK/dV config, dQ config), or one config for backward v3 / v4, forces the tiles (no
    autotuning, no fallback).  ``version``: one of BACKWARD_VERSIONS (default: the plan's).
    ``variant``, ``variant_args``: as for :func:`launch_forward`.
    """
    p = plan_ or plan.plan_for(q, k, v, causal, allow_tf32=allow_tf32, extra=(do, dk, dv), backward_version=version,
                               backward_config=config, variant=variant)
    BACKWARD[p.bwd_version].launch(p, q, k, v, o, lse, do, dq, dk, dv, scale,
                                   _runners(p, (q, k, v, o, lse, do, dq, dk, dv), variant_args), **variant_args)


def version_op(fwd_version=None, bwd_version=None, fwd_cfg=None, bwd_cfg=None):
    """fn(q, k, v, causal, scale) -> (o, lse), differentiable, through the launchers of one forward and one backward
    version (None: the plan's) and, optionally, forced tiles: how tests and scripts compare versions."""
    import math

    import torch

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            launch_forward(q, k, v, o, lse, causal, scale, version=fwd_version, config=fwd_cfg)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.args = (causal, scale)
            return o, lse

        @staticmethod
        def backward(ctx, do, _dlse):
            q, k, v, o, lse = ctx.saved_tensors
            grads = [torch.empty_like(t) for t in (q, k, v)]
            launch_backward(q, k, v, o, lse, do.contiguous(), *grads, *ctx.args, version=bwd_version,
                            config=bwd_cfg)
            return (*grads, None, None)

    def fn(q, k, v, causal, scale=None):
        return Op.apply(q, k, v, causal, q.shape[-1] ** -0.5 if scale is None else scale)
    return fn
