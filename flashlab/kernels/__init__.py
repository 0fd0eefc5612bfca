"""Triton kernels and their launchers.

``launch_forward`` / ``launch_backward`` write into tensors the caller allocated
(the same contract as the ``flash_forward`` / ``flash_backward`` exercises);
:mod:`flashlab.attention` does validation, allocation and autograd on top.

Versions (each file diffs against the one before it; docs/BENCHMARKS.md has what each
was predicted to gain and what it measured):

    forward    v1 forward.py      readable FA2: masks on every tile, hand-picked tiles
               v2 forward_v2.py   unmasked full tiles, FMA exponent, longest causal tiles first; autotuned
               v3 forward_v3.py   v2 through tensor descriptors (TMA on Hopper); autotuned
    backward   v1 backward.py     three kernels (Delta, dK/dV, dQ), masks on every tile
               v2 backward_v2.py  diagonal / off-diagonal split, base-2 LSE inside; autotuned
               v3 backward_v3.py  one pass: five products per tile pair, dQ added in bulk (TMA reduce); autotuned
               v4 backward_v4.py  v3 with its descriptors made on the host, not in every program; autotuned

Tile configs.  Each kernel has a list of hand-picked configs in order of preference.
A config whose estimated shared memory exceeds the GPU's (``device.shared_memory_per_block``:
64 KB on a T4, 99 KB on an L4 or RTX 4090, 163 KB on an A100, 227 KB on an H100 / H200)
is skipped, and if compiling one still runs out of resources the next is tried; the
one that worked is remembered.  In the interpreter the first config that fits a small
problem is used (32 x 32 by default: fewer, smaller programs).  Autotuning (versions
v2 and later, on a GPU) times a list of configs once per head dim, causal flag, dtype and
sequence-length bucket (the next power of two), pruned by the same estimate.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import device  # first: settles TRITON_INTERPRET before the kernels are defined

device.require_triton("flashlab.kernels")  # a clear message (and Colab) instead of "No module named 'triton'"
import triton  # noqa: E402
from .backward import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel, flash_bwd_preprocess
from .backward_v2 import flash_bwd_dkdv_kernel_v2, flash_bwd_dq_kernel_v2
from .backward_v3 import flash_bwd_kernel_v3
from .backward_v4 import flash_bwd_kernel_v4
from .common import LOG2E
from .forward import flash_fwd_kernel
from .forward_v2 import flash_fwd_kernel_v2
from .forward_v3 import flash_fwd_kernel_v3

try:   # descriptors made on the host (backward v4); older Triton releases lack them
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

__all__ = ["Config", "forward_configs", "backward_configs", "forward_config", "backward_config",
           "launch_forward", "launch_backward", "FORWARD_VERSIONS", "BACKWARD_VERSIONS",
           "default_versions", "estimate_shared_memory", "tuned_configs", "LOG2E"]

FORWARD_VERSIONS = ("v1", "v2", "v3")
BACKWARD_VERSIONS = ("v1", "v2", "v3", "v4")


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


C = Config


def estimate_shared_memory(kernel: str, cfg: Config, head_dim: int, elt: int, cc: tuple | None = None) -> int:
    """An upper estimate of the shared memory (bytes) a config needs: the tiles that go through it.

    ``kernel``: "fwd" (Q tile + K, V tiles per pipeline stage), "dkdv" or "dq" (the
    stationary tiles plus the streamed pair per stage).  ``cc``: the compute capability;
    before Ampere (sm_75, no asynchronous copies) Triton stages every operand tile and
    converts layouts through shared memory: there the estimate is twice the operand tiles.
    Checked against what Triton reports when compiling for sm_75 / sm_80 / sm_89 / sm_90
    (scripts/shared_memory.py, docs/BENCHMARKS.md); a config that still does not fit is
    caught at launch and the next one is tried.
    """
    stages = max(1, cfg.num_stages - 1)
    if kernel == "fwd":
        rows, streamed, extra = cfg.block_m, 2 * cfg.block_n, cfg.block_m * cfg.block_n
    elif kernel == "dkdv":   # stationary K, V (block_n rows); streamed Q, dO (block_m rows)
        rows, streamed, extra = 2 * cfg.block_n, 2 * cfg.block_m, 2 * cfg.block_m * cfg.block_n
    elif kernel == "dq":     # stationary Q, dO (block_m rows); streamed K, V (block_n rows)
        rows, streamed, extra = 2 * cfg.block_m, 2 * cfg.block_n, 2 * cfg.block_m * cfg.block_n
    elif kernel == "bwd":    # backward v3 and v4: dkdv's tiles plus the float32 dQ tile it reduces
        rows, streamed = 2 * cfg.block_n, 2 * cfg.block_m
        extra = 2 * cfg.block_m * cfg.block_n + (4 * cfg.block_m * head_dim) // elt
    else:
        raise ValueError(kernel)
    if cc is not None and tuple(cc) < (8, 0):
        return 2 * elt * head_dim * (rows + streamed)
    if kernel == "bwd" and (cc is None or tuple(cc) >= (9, 0)):
        stages = cfg.num_stages   # backward v3's TMA loads keep a buffer for every stage (compiled: 90 KB, 210 KB)
    return elt * head_dim * (rows + stages * streamed) + elt * extra


def forward_configs(head_dim: int, dtype: torch.dtype) -> list:
    """Hand-picked forward configs, best first (tiles 128x64 were the H200's choice for v1)."""
    if dtype == torch.float32:
        return [C(64, 32, 4, 2), C(32, 32, 4, 2), C(32, 16, 4, 1), C(16, 16, 4, 1)]
    if head_dim <= 64:
        return [C(128, 64, 4, 3), C(128, 64, 4, 2), C(64, 64, 4, 2), C(64, 32, 4, 2), C(32, 32, 4, 1)]
    if head_dim <= 128:
        return [C(128, 64, 8, 3), C(128, 64, 8, 2), C(64, 64, 4, 2), C(64, 32, 4, 2), C(32, 32, 4, 1)]
    return [C(64, 32, 4, 2), C(32, 32, 4, 2), C(32, 16, 4, 1), C(16, 16, 4, 1)]


def backward_configs(head_dim: int, dtype: torch.dtype) -> list:
    """Hand-picked (dK/dV config, dQ config) pairs, best first.

    The dK/dV kernel keeps a K/V tile of block_n rows and streams Q tiles of block_m rows;
    the dQ kernel keeps a Q tile of block_m rows and streams K/V tiles of block_n rows.
    The first pairs for fp16/bf16 were picked by scripts/sweep_backward.py on an H200.
    """
    if dtype == torch.float32 or head_dim > 128:
        return [(C(32, 32, 4, 1), C(32, 32, 4, 1)),
                (C(16, 32, 4, 1), C(32, 16, 4, 1)), (C(16, 16, 4, 1), C(16, 16, 4, 1))]
    if head_dim <= 64:
        return [(C(32, 64, 4, 3), C(64, 32, 4, 3)), (C(32, 64, 4, 2), C(64, 32, 4, 2)),
                (C(32, 32, 4, 1), C(32, 32, 4, 1))]
    return [(C(64, 128, 8, 3), C(128, 64, 8, 3)), (C(64, 64, 4, 2), C(64, 64, 4, 2)),
            (C(32, 64, 4, 2), C(64, 32, 4, 2)), (C(32, 32, 4, 1), C(32, 32, 4, 1))]


def backward_v3_configs(head_dim: int, dtype: torch.dtype) -> list:
    """Hand-picked configs of backward v3 and v4 (one kernel: K/V tiles of block_n rows, Q tiles of block_m), best first."""
    if head_dim <= 64:
        return [C(64, 64, 4, 3), C(64, 64, 4, 2), C(32, 64, 4, 2), C(32, 32, 4, 1)]
    return [C(64, 128, 8, 3), C(32, 64, 4, 3), C(64, 64, 4, 2), C(32, 32, 4, 1)]


def forward_config(head_dim: int, dtype: torch.dtype) -> Config:
    """The config the forward uses here (interpreter: 32 x 32; GPU: the first that fits)."""
    if device.INTERPRET:
        return C(32, 32)
    return _fitting(forward_configs(head_dim, dtype), "fwd", head_dim, dtype)[0]


def backward_config(head_dim: int, dtype: torch.dtype) -> tuple:
    if device.INTERPRET:
        return C(32, 32), C(32, 32)
    return _fitting_pairs(backward_configs(head_dim, dtype), head_dim, dtype)[0]


def _elt(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _fitting(cands, kernel, head_dim, dtype, limit=None, cc=None):
    """The candidates whose estimate fits the shared memory ``limit`` (default: this GPU's)."""
    if limit is None:
        limit, cc = device.shared_memory_per_block(), device.capability()
    if limit is None:
        return list(cands)
    fit = [c for c in cands if estimate_shared_memory(kernel, c, head_dim, _elt(dtype), cc) <= limit]
    return fit or [cands[-1]]


def _fitting_pairs(pairs, head_dim, dtype, limit=None, cc=None):
    if limit is None:
        limit, cc = device.shared_memory_per_block(), device.capability()
    if limit is None:
        return list(pairs)
    e = _elt(dtype)
    fit = [p for p in pairs if estimate_shared_memory("dkdv", p[0], head_dim, e, cc) <= limit
           and estimate_shared_memory("dq", p[1], head_dim, e, cc) <= limit]
    return fit or [pairs[-1]]


_CHOSEN: dict = {}   # (kernel, version, head_dim, dtype, device index) -> Config that compiled and ran


def _launch_first_that_fits(key, candidates, launch):
    """Launch with the remembered config, else with each of ``candidates()`` in turn until one fits.

    ``candidates`` is called only on the first launch for ``key``: later calls cost one dict lookup.
    """
    cfg = _CHOSEN.get(key)
    if cfg is not None:
        return launch(cfg)
    errors = []
    for cfg in candidates():
        try:
            launch(cfg)
        except triton.runtime.errors.OutOfResources as e:   # shared memory or registers
            errors.append(f"{cfg}: {e}")
            continue
        _CHOSEN[key] = cfg
        return
    raise RuntimeError(f"no tile config fits this GPU for {key[0]} (head dim {key[2]}, {key[3]}):\n"
                       + "\n".join(errors))


def _dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    return "tf32" if (dtype == torch.float32 and allow_tf32) else "ieee"


def _grid_1d(n_tiles: int, bh: int) -> tuple:
    n = n_tiles * bh
    if n >= 2**31:
        raise ValueError(f"{n} programs ({n_tiles} tiles x B*H = {bh}) exceed the grid limit 2^31 - 1; "
                         "split the batch")
    return (n,)


def _n_key(nq: int, nk: int) -> int:
    """Autotuning bucket: the next power of two of the longer sequence (at least 256)."""
    return max(256, 1 << (max(nq, nk) - 1).bit_length())


def _tma_ok(*tensors) -> bool:
    """Tensor descriptors need the last stride 1 and 16-byte aligned base and strides."""
    for t in tensors:
        e = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * e) % 16 for s in t.stride()[:-1]):
            return False
    return True


V3_FROM = 2048   # forward v3 from this sequence-length bucket on (below it v2 is as fast or faster)


# (head dim, causal) where the one-pass backward (v4) measured faster than v2; None: both modes.  At D = 128
# causal it spills registers and v2's two kernels are faster.
ONE_PASS_BWD = ((64, None), (128, False))


def default_versions(dtype: torch.dtype = torch.float16, head_dim: int = 64, n_key: int | None = None,
                     causal: bool | None = None) -> dict:
    """The fastest correct versions for this device and problem: {"fwd": ..., "bwd": ...}.

    Chosen by the H200 measurements in docs/BENCHMARKS.md (2026-11-30):

    * forward v3 (tensor descriptors) on Hopper (compute capability 9.0) for sequences of more
      than 1024 (``n_key``, the autotuning bucket, at least V3_FROM): each v3 program builds its
      descriptors first, which short sequences, with few K/V tiles per program, do not earn back
      (at N = 256-1024 v3 measured 0.5-0.95x v2);
    * below the 1024 bucket, where no version autotunes, v1 for non-causal attention (at the same
      hand-picked tiles v2's second copy of the loop costs more than the masks it removes: v1
      measured 1.07-1.11x v2 at N = 256 and 512) and v2 for causal (its ordering and unmasked
      tiles win there);
    * backward v4 (one pass, dQ reduced through TMA, descriptors made on the host) on Hopper at
      head dim 64 and at head dim 128 non-causal (ONE_PASS_BWD), at the same sequence lengths as
      forward v3; v2 otherwise.  At D = 128 causal the one-pass kernel's two (BLOCK_N, 128) float32
      accumulators plus the dQ tile spill registers and v2 is faster.  The one-pass dQ is not bitwise
      reproducible (the adds arrive in any order): with ``torch.use_deterministic_algorithms(True)``
      the backward is v2, which is.

    fp32 and head dims above 128 keep v1: their dot products run on FMA units, where the masks
    v2 removes cost nothing noticeable, and v2's extra loop copies multiply the compile time.
    """
    if dtype == torch.float32 or head_dim > 128:
        return {"fwd": "v1", "bwd": "v1"}
    cc = device.capability()
    long_enough = n_key is None or n_key >= V3_FROM
    hopper = cc is not None and cc[0] >= 9
    bwd = "v2"
    one_pass = any(d == head_dim and (c is None or c == causal) for d, c in ONE_PASS_BWD)
    if hopper and long_enough and one_pass and not torch.are_deterministic_algorithms_enabled():
        bwd = "v4"
    if n_key is not None and n_key < 1024 and causal is False:
        return {"fwd": "v1", "bwd": bwd}
    return {"fwd": "v3" if (hopper and long_enough) else "v2", "bwd": bwd}


_M_DESCS = ("q_desc", "do_desc", "dq_desc")   # descriptors in tiles of BLOCK_M rows; the rest BLOCK_N


def _host_desc_ok(*tensors) -> bool:
    """Host descriptors span the whole tensor: no dimension may have stride 0 (K, V expanded over heads).

    v3 folds the batch and head strides into each program's base address, so it takes those."""
    return all(s > 0 for t in tensors for s in t.stride())


def _host_desc(t):
    """A (B, H, N, D) tensor's descriptor for backward v4; its tile rows are set per config (_desc_blocks)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, t.shape[-1]])


def _desc_blocks(nargs: dict):
    """Give each descriptor among a kernel's arguments its config's tile: (1, 1, BLOCK_M or BLOCK_N, D).

    Also the autotuner's pre-hook: every config it times needs the descriptors in its own tiles.
    """
    for name, d in nargs.items():
        if TensorDescriptor is not None and isinstance(d, TensorDescriptor):
            rows = nargs["BLOCK_M"] if name in _M_DESCS else nargs["BLOCK_N"]
            d.block_shape = [1, 1, rows, d.block_shape[-1]]


def _with_blocks(kern, args: tuple, bm: int, bn: int) -> tuple:
    _desc_blocks(dict(zip(kern.arg_names, args), BLOCK_M=bm, BLOCK_N=bn))
    return args


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device=device.DEVICE, dtype=torch.int8)


def _ensure_allocator():
    """Descriptors built on the device need a global scratch buffer from an allocator.

    Set on every launch that needs it: Triton keeps the allocator in a context variable, which
    a new thread does not inherit (autograd runs the backward on a thread of its own).
    """
    triton.set_allocator(_alloc)


# ----------------------------------------------------------------------------------------- autotuning

def _autotune_list(kernel: str, head_dim: int, dtype: torch.dtype, pre_hook=None) -> list:
    """Autotuning candidates (GPU only: the interpreter has no driver to time with).

    Kept short: every candidate is compiled once per head dim, causal flag and dtype.
    ``pre_hook`` (backward v4): run before each config, to give the descriptors its tiles.
    """
    if kernel == "fwd":
        # (128, 64, 4, 2): two 4-warp programs per SM at D = 128 (96 KiB), the config tutorial 06's own
        # autotuning picks on the H200 (docs/BENCHMARKS.md)
        shapes = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3),
                  (128, 32, 4, 3), (128, 64, 8, 4), (128, 64, 4, 2), (64, 128, 4, 3)]
    elif kernel == "dkdv":
        shapes = [(32, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 5),
                  (64, 128, 8, 2), (64, 64, 4, 4), (32, 64, 4, 4)]
    elif kernel == "dq":
        shapes = [(64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 5),
                  (128, 64, 8, 2), (64, 64, 4, 4), (64, 32, 4, 4)]
    elif head_dim <= 64:   # backward v3 / v4 (the H200's best at D = 64 in docs/BENCHMARKS.md, and neighbours)
        shapes = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 128, 8, 3), (32, 64, 4, 3), (128, 64, 4, 3)]
    else:
        shapes = [(64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=pre_hook)
            for m, n, w, s in shapes]


def _prune(kernel):
    def prune(configs, named_args, **kwargs):
        limit, cc = device.shared_memory_per_block() or 0, device.capability()
        hd = named_args.get("HEAD_DIM", kwargs.get("HEAD_DIM"))
        q = named_args["Q"] if "Q" in named_args else named_args["q_desc"].base
        e = q.element_size()
        kept = [c for c in configs if estimate_shared_memory(
            kernel, C(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages), hd, e, cc) <= limit]
        return kept or configs[-1:]
    return prune


# Milliseconds each candidate is timed for, per key.  At 25 ms a 6 ms kernel (N = 16384) ran four times; the run
# that tuned so measured the forward at N = 16384 4-16 % below the runs before and after (docs/BENCHMARKS.md).
QUICK_REP_MS = 100


def _quick_bench(fn, quantiles=None, **kw):
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=QUICK_REP_MS, quantiles=quantiles)


_TUNED: dict = {}
_KEY = ["N_KEY", "HEAD_DIM", "CAUSAL", "DOT_PRECISION"]


def _tuned(name: str, kernel, kind: str, head_dim: int, dtype):
    """``kernel`` wrapped in triton.autotune (built on first use, on a GPU only)."""
    k = (name, head_dim, dtype)
    if k not in _TUNED:
        hook = _desc_blocks if "q_desc" in kernel.arg_names else None
        _TUNED[k] = triton.autotune(configs=_autotune_list(kind, head_dim, dtype, hook), key=_KEY,
                                    prune_configs_by={"early_config_prune": _prune(kind)},
                                    reset_to_zero=["DQ_ACC"] if kind == "bwd" else None,   # v3 and v4 add into it
                                    do_bench=_quick_bench)(kernel)
    return _TUNED[k]


_BEST: dict = {}   # (kernel, version, dtype, device, N_KEY, HEAD_DIM, CAUSAL, DOT_PRECISION) -> triton.Config


def _launch_tuned(kind: str, version: str, kern, q, grid, args: tuple, kw: dict):
    """Launch ``kern`` with the config triton.autotune picked for this key (tuning on first use).

    After the first call the launch goes straight to the kernel with the remembered config:
    triton.autotune's own per-call work (building its key from every argument) costs tens of
    microseconds, as much as a short kernel takes.  The key is the autotuner's own (N_KEY,
    HEAD_DIM, CAUSAL, DOT_PRECISION and the dtype), so the choice is the same.
    """
    key = (kind, version, q.dtype, q.device.index, args[-1], kw["HEAD_DIM"], kw["CAUSAL"], kw["DOT_PRECISION"])
    cfg = _BEST.get(key)
    if cfg is None:
        tuned = _tuned(kind + version, kern, kind, kw["HEAD_DIM"], q.dtype)
        tuned[grid](*args, **kw)
        _BEST[key] = tuned.best_config
        return
    if cfg.pre_hook is not None:
        cfg.pre_hook(dict(zip(kern.arg_names, args), **cfg.kwargs))
    kern[grid(cfg.kwargs)](*args, **kw, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def tuned_configs() -> list:
    """What autotuning chose so far in this process: one dict per (kernel, version, dtype, N_KEY,
    HEAD_DIM, CAUSAL) with the tile shape, warps and pipeline stages (notebook 06 shows them vs N)."""
    out = []
    for (kind, version, dtype, _dev, n_key, head_dim, causal, prec), cfg in _BEST.items():
        out.append({"kernel": f"{kind} {version}", "dtype": str(dtype).replace("torch.", ""), "n_key": n_key,
                    "head_dim": head_dim, "causal": causal, "precision": prec,
                    "block_m": cfg.kwargs["BLOCK_M"], "block_n": cfg.kwargs["BLOCK_N"],
                    "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return out


AUTOTUNE = os.environ.get("FLASHLAB_AUTOTUNE", "1") not in ("0", "", "false", "False")


def autotune_enabled(q, n_key: int) -> bool:
    """Autotune on a GPU, for fp16/bf16 at head dims 64 and 128 and sequences of 1024 or more.

    Smaller problems (and fp32, other head dims) take the hand-picked configs: autotuning
    compiles every candidate, which costs more than it can save there.  FLASHLAB_AUTOTUNE=0
    turns it off everywhere.
    """
    return (AUTOTUNE and not device.INTERPRET and device.DEVICE.type == "cuda" and n_key >= 1024
            and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128))


# ----------------------------------------------------------------------------------------- launchers

def launch_forward(q, k, v, o, lse, causal: bool, scale: float, *, allow_tf32: bool = False,
                   config: Config | None = None, version: str | None = None):
    """Write O into ``o`` (B, H, Nq, D) and the natural-log LSE into ``lse`` (B, H, Nq) float32.

    Every tensor may have any strides (views into larger buffers work).  ``version``:
    one of FORWARD_VERSIONS (default: :func:`default_versions`).  ``config`` forces one
    tile config (no autotuning, no fallback).
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    version = version or default_versions(q.dtype, D, _n_key(Nq, Nk), causal)["fwd"]
    if version not in FORWARD_VERSIONS:
        raise ValueError(f"version must be one of {FORWARD_VERSIONS}, got {version!r}")
    if version == "v3" and not _tma_ok(q, k, v, o):
        version = "v2"
    prec = _dot_precision(q.dtype, allow_tf32)
    args = (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(), H, Nq, Nk,
            scale * LOG2E)
    if version == "v1":
        kern = flash_fwd_kernel
    else:
        args = args + (_n_key(Nq, Nk),)
        kern = flash_fwd_kernel_v2 if version == "v2" else flash_fwd_kernel_v3
        if version == "v3":
            _ensure_allocator()

    if config is None and version != "v1" and autotune_enabled(q, _n_key(Nq, Nk)):
        return _launch_tuned("fwd", version, kern, q, lambda m: _grid_1d(triton.cdiv(Nq, m["BLOCK_M"]), B * H),
                             args, dict(CAUSAL=causal, HEAD_DIM=D, DOT_PRECISION=prec))

    def launch(cfg):
        kern[_grid_1d(triton.cdiv(Nq, cfg.block_m), B * H)](
            *args, CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D,
            DOT_PRECISION=prec, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    if config is not None:
        return launch(config)
    if device.INTERPRET:
        return launch(C(32, 32))
    _launch_first_that_fits(("fwd", version, D, q.dtype, q.device.index),
                            lambda: _fitting(forward_configs(D, q.dtype), "fwd", D, q.dtype), launch)


def launch_backward(q, k, v, o, lse, do, dq, dk, dv, causal: bool, scale: float, *,
                    allow_tf32: bool = False, config: tuple | None = None, version: str | None = None):
    """Write dQ, dK, dV into ``dq``, ``dk``, ``dv`` (shaped like q, k, v).

    ``config``: (dK/dV config, dQ config) forces the tiles (no autotuning, no fallback).
    ``version``: one of BACKWARD_VERSIONS (default: :func:`default_versions`).
    """
    version = version or default_versions(q.dtype, q.shape[-1], _n_key(q.shape[2], k.shape[2]), causal)["bwd"]
    if version not in BACKWARD_VERSIONS:
        raise ValueError(f"version must be one of {BACKWARD_VERSIONS}, got {version!r}")
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if version == "v4" and (TensorDescriptor is None or not _host_desc_ok(q, k, v, do, dk, dv)):
        version = "v3" if TensorDescriptor is not None else "v2"   # a Triton without host descriptors lacks v3's too
    if version in ("v3", "v4") and not _tma_ok(q, k, v, do, dk, dv):
        version = "v2"
    prec = _dot_precision(q.dtype, allow_tf32)
    delta = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    pre_m = 64 if not device.INTERPRET else 32
    flash_bwd_preprocess[_grid_1d(triton.cdiv(Nq, pre_m), B * H)](
        o, do, delta, *o.stride(), *do.stride(), H, Nq, BLOCK_M=pre_m, HEAD_DIM=D)

    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    if version in ("v3", "v4"):
        return _launch_backward_one_pass(version, q, k, v, do, lse, delta, dq, dk, dv, common, causal, scale, prec,
                                         config)
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(), *lse.stride(), H, Nq, Nk)
    dq_args = (q, k, v, do, lse, delta, dq, *common, *dq.stride(), *lse.stride(), H, Nq, Nk)
    if version == "v1":
        dkdv_kern, dq_kern = flash_bwd_dkdv_kernel, flash_bwd_dq_kernel
        dkdv_args, dq_args = dkdv_args + (scale,), dq_args + (scale,)
    else:
        dkdv_kern, dq_kern = flash_bwd_dkdv_kernel_v2, flash_bwd_dq_kernel_v2
        extra = (scale, scale * LOG2E, _n_key(Nq, Nk))
        dkdv_args, dq_args = dkdv_args + extra, dq_args + extra
    kw = dict(CAUSAL=causal, HEAD_DIM=D, DOT_PRECISION=prec)

    if config is None and version != "v1" and autotune_enabled(q, _n_key(Nq, Nk)):
        _launch_tuned("dkdv", version, dkdv_kern, q, lambda m: _grid_1d(triton.cdiv(Nk, m["BLOCK_N"]), B * H),
                      dkdv_args, kw)
        _launch_tuned("dq", version, dq_kern, q, lambda m: _grid_1d(triton.cdiv(Nq, m["BLOCK_M"]), B * H),
                      dq_args, kw)
        return

    def launch_dkdv(c):
        dkdv_kern[_grid_1d(triton.cdiv(Nk, c.block_n), B * H)](
            *dkdv_args, BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages, **kw)

    def launch_dq(c):
        dq_kern[_grid_1d(triton.cdiv(Nq, c.block_m), B * H)](
            *dq_args, BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages, **kw)

    if config is not None:
        launch_dkdv(config[0])
        launch_dq(config[1])
        return
    if device.INTERPRET:
        launch_dkdv(C(32, 32))
        launch_dq(C(32, 32))
        return
    def pairs():
        return _fitting_pairs(backward_configs(D, q.dtype), D, q.dtype)
    _launch_first_that_fits(("dkdv", version, D, q.dtype, q.device.index), lambda: [p[0] for p in pairs()], launch_dkdv)
    _launch_first_that_fits(("dq", version, D, q.dtype, q.device.index), lambda: [p[1] for p in pairs()], launch_dq)


def _launch_backward_one_pass(version, q, k, v, do, lse, delta, dq, dk, dv, common, causal, scale, prec, config):
    """Backward v3 / v4: one kernel adds dQ into a float32 buffer; dQ = scale * buffer."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dq_acc = torch.zeros((B, H, Nq, D), device=q.device, dtype=torch.float32)
    cc = device.capability()
    tail = (*lse.stride(), H, Nq, Nk, scale, scale * LOG2E, _n_key(Nq, Nk))
    if version == "v4":   # the descriptors, made here once
        kern = flash_bwd_kernel_v4
        args = (*map(_host_desc, (q, k, v, do)), lse, delta, *map(_host_desc, (dk, dv, dq_acc)), dq_acc, *tail)
    else:                 # v3 builds them in every program, from a scratch buffer the allocator gives
        _ensure_allocator()
        kern = flash_bwd_kernel_v3
        args = (q, k, v, do, lse, delta, dk, dv, dq_acc, *common, *dk.stride(), *dv.stride(), *tail)
    kw = dict(CAUSAL=causal, HEAD_DIM=D, DOT_PRECISION=prec,
              TMA_REDUCE=(not device.INTERPRET and cc is not None and cc[0] >= 9),
              SPREAD=D > 64)   # measured: spreading the adds gains 1-5 % at D = 128 and costs 0-3 % at D = 64

    def launch(c):
        kern[_grid_1d(triton.cdiv(Nk, c.block_n), B * H)](
            *_with_blocks(kern, args, c.block_m, c.block_n), BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            num_warps=c.num_warps, num_stages=c.num_stages, **kw)

    if config is not None:
        launch(config[0] if isinstance(config, tuple) else config)
    elif device.INTERPRET:
        launch(C(32, 32))
    elif autotune_enabled(q, _n_key(Nq, Nk)):
        _launch_tuned("bwd", version, kern, q, lambda m: _grid_1d(triton.cdiv(Nk, m["BLOCK_N"]), B * H),
                      args, kw)
    else:
        _launch_first_that_fits(("bwd", version, D, q.dtype, q.device.index),
                                lambda: _fitting(backward_v3_configs(D, q.dtype), "bwd", D, q.dtype), launch)
    dq.copy_(dq_acc.mul_(scale))
