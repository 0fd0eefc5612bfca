"""Tile configs: the shared-memory estimate, fitting a list to a GPU, autotuning, and the launch itself.

The config lists live beside the kernels they tune (``forward.FORWARD_CONFIGS``,
``forward_v2.AUTOTUNE_CONFIGS``, ...); this module has what they share:

* :class:`Config` and :func:`estimate_shared_memory`, an upper estimate of a config's shared memory;
  :func:`fitting` keeps the configs of a list that fit a GPU's limit (T4 64 KB, L4 99 KB,
  A100 163 KB, H100 / H200 227 KB);
* autotuning (GPU only): :func:`tuned` wraps a kernel in ``triton.autotune`` once per (kernel,
  head dim, dtype); :func:`launch_tuned` tunes on first use and remembers the choice in ``BEST``;
* :func:`run`, the one place a kernel is launched: a plan's :class:`~flashlab.kernels.plan.Step`
  says which config (or autotuning) and grid; a config that runs out of resources at compile time
  hands over to the step's next candidate, and the step records what ran.  After the first launch
  of a specialisation the compiled kernel is called through its own runner (``CompiledKernel[grid]``),
  skipping ``JITFunction.run``'s per-call binding and cache lookup (tens of microseconds).
"""
from __future__ import annotations

import inspect
import os
import threading
from dataclasses import dataclass

import torch

from .. import device  # first: settles TRITON_INTERPRET before the kernels are defined

device.require_triton("flashlab.kernels")
import triton  # noqa: E402


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __str__(self):
        return f"{self.block_m}x{self.block_n}, {self.num_warps} warps, {self.num_stages} stages"


C = Config


def estimate_shared_memory(kernel: str, cfg: Config, head_dim: int, elt: int, cc: tuple | None = None) -> int:
    """An upper estimate of the shared memory (bytes) a config needs: the tiles that go through it.

    ``kernel``: "fwd" (Q tile + K, V tiles per pipeline stage), "dkdv" or "dq" (the
    stationary tiles plus the streamed pair per stage), "bwd" (backward v3 / v4).  ``cc``: the
    compute capability; before Ampere (sm_75, no asynchronous copies) Triton stages every operand
    tile and converts layouts through shared memory: there the estimate is twice the operand tiles.
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


def elt(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fitting(cands, kernel, head_dim, dtype, limit, cc=None) -> list:
    """The candidates whose estimate fits the shared memory ``limit`` (None: all; none fit: the last)."""
    if limit is None:
        return list(cands)
    fit = [c for c in cands if estimate_shared_memory(kernel, c, head_dim, elt(dtype), cc) <= limit]
    return fit or [cands[-1]]


def fitting_pairs(pairs, head_dim, dtype, limit, cc=None) -> list:
    """(dK/dV, dQ) pairs of which both fit ``limit``."""
    if limit is None:
        return list(pairs)
    e = elt(dtype)
    fit = [p for p in pairs if estimate_shared_memory("dkdv", p[0], head_dim, e, cc) <= limit
           and estimate_shared_memory("dq", p[1], head_dim, e, cc) <= limit]
    return fit or [pairs[-1]]


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    return "tf32" if (dtype == torch.float32 and allow_tf32) else "ieee"


def grid_1d(n_tiles: int, bh: int) -> tuple:
    n = n_tiles * bh
    if n >= 2**31:
        raise ValueError(f"{n} programs ({n_tiles} tiles x B*H = {bh}) exceed the grid limit 2^31 - 1; "
                         "split the batch")
    return (n,)


HEAD_GROUP = None       # a fixed head_group (timing scripts compare them); None: the rule below


def head_group(bh: int, n_tiles: int, sms: int | None) -> int:
    """Causal grids of forward and backward v6 run their tiles longest first over sections of this many heads:
    about one wave of programs (the multiprocessors over the tiles of a head), and at least two heads.
    bh: the grid's B * H; n_tiles: its tiles a head; sms: the GPU's multiprocessors (None: an H200's 132).

    Longest first because a causal tile's work grows along the sequence (from 1 to N / 128 key tiles): in
    launch order a head's longest tiles came together, and when the grid's last head started them the other
    multiprocessors soon had nothing left to run.  Sections because the programs running together then read
    only the section's heads, which stay in L2.  Timed on the H200 (16k tokens, H 16, D 128, causal; sections of
    1 head are the launch order before): at N = 4096, 4 heads beat 1, 2, 9 and all 64 (backward +6-8 %, forward
    +2-10 % over 1); at N = 16384, 2 beat 1, 3, 4 and all 16 (backward +4 %, forward +0-2 %); all heads in one
    section lost 1-8 % to 1.  Once backward v6's diagonal had a loop of its own (+17-19 % by itself), the
    sections gave the backward +0-2 % at N = 4096 and nothing measurable at 16384 (docs/BENCHMARKS.md,
    2026-12-03)."""
    if HEAD_GROUP is not None:
        return max(1, min(bh, HEAD_GROUP))
    return max(1, min(bh, max(2, round((sms or 132) / max(n_tiles, 1)))))


def n_key(nq: int, nk: int) -> int:
    """Autotuning bucket: the next power of two of the longer sequence (at least 256)."""
    return max(256, 1 << (max(nq, nk) - 1).bit_length())


def grid_class(bh: int, rows: int, sms: int | None) -> int:
    """Autotuning's second key: how full the grid keeps this GPU, in waves of 128-row tiles over its
    multiprocessors: 0 below one wave, 1 up to four, 2 beyond (:data:`GRID_CLASSES`).

    Without it the first call of a length bucket chose the tiles for every later one: tuned on B 2, H 3 at
    N = 4096 (1.5 waves), 128 x 128 tiles lost to smaller ones and the forward then ran B 4, H 16 (15 waves)
    at 410 TFLOP/s where 128 x 128 gives 500 (docs/BENCHMARKS.md, 2026-12-02)."""
    if not sms:
        return 0
    waves = bh * -(-rows // 128) / sms
    return 0 if waves < 1 else 1 if waves <= 4 else 2


GRID_CLASSES = ("less than one wave of 128-row tiles", "one to four waves", "more than four waves")


# ----------------------------------------------------------------------------------------- autotuning

AUTOTUNE = os.environ.get("FLASHLAB_AUTOTUNE", "1") not in ("0", "", "false", "False")
AUTOTUNE_FROM = 1024   # sequence-length bucket from which v2 and later autotune (below: hand-picked tiles)


def autotune_applies(dtype, head_dim: int, bucket: int, interpret: bool) -> bool:
    """Autotune on a GPU, for fp16/bf16 at head dims 64 and 128 and sequences of 1024 or more.

    Smaller problems (and fp32, other head dims) take the hand-picked configs: autotuning
    compiles every candidate, which costs more than it can save there.  FLASHLAB_AUTOTUNE=0
    turns it off everywhere."""
    return (AUTOTUNE and not interpret and bucket >= AUTOTUNE_FROM
            and dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128))


def triton_configs(shapes, pre_hook=None) -> list:
    """(block_m, block_n, warps, stages) tuples as triton.Configs (``pre_hook``: backward v4's descriptor tiles)."""
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


TUNED: dict = {}   # (kernel name, head dim, dtype) -> triton.autotune wrapper
KEY = ["N_KEY", "HEAD_DIM", "CAUSAL", "DOT_PRECISION"]


def tuned(name: str, kernel, kind: str, candidates: list, head_dim: int, dtype, pre_hook=None):
    """``kernel`` wrapped in triton.autotune over ``candidates`` (built on first use, on a GPU only)."""
    k = (name, head_dim, dtype)
    if k not in TUNED:
        TUNED[k] = triton.autotune(configs=triton_configs(candidates, pre_hook), key=KEY,
                                   prune_configs_by={"early_config_prune": _prune(kind)},
                                   reset_to_zero=["DQ_ACC"] if kind == "bwd" else None,   # v3 and v4 add into it
                                   do_bench=_quick_bench)(kernel)
    return TUNED[k]


CHOSEN: dict = {}   # (kind, version, head_dim, dtype, device index, variant, causal) -> hand-picked Config that compiled and ran
BEST: dict = {}   # (kernel, version, dtype, device, N_KEY, HEAD_DIM, CAUSAL, DOT_PRECISION, grid class) -> triton.Config


def tuned_configs() -> list:
    """What autotuning chose so far in this process: one dict per (kernel, version, dtype, N_KEY,
    HEAD_DIM, CAUSAL, grid class) with the tile shape, warps and pipeline stages (notebook 06 shows them vs N)."""
    out = []
    for (kind, version, dtype, _dev, nk, head_dim, causal, prec, waves), cfg in BEST.items():
        out.append({"kernel": f"{kind} {version}", "dtype": str(dtype).replace("torch.", ""), "n_key": nk,
                    "head_dim": head_dim, "causal": causal, "precision": prec, "grid_class": waves,
                    "block_m": cfg.kwargs["BLOCK_M"], "block_n": cfg.kwargs["BLOCK_N"],
                    "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return out


# ----------------------------------------------------------------------------------------- the launch

def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device=device.DEVICE, dtype=torch.int8)


def ensure_allocator():
    """Descriptors built on the device (forward v3, backward v3) need a global scratch buffer from an allocator.

    Set on every launch that needs it: Triton keeps the allocator in a context variable, which
    a new thread does not inherit (autograd runs the backward on a thread of its own).
    """
    triton.set_allocator(_alloc)


_DEFAULTS: dict = {}   # kernel -> {constexpr name: default} of the parameters a launch may leave out


def _defaults(kern) -> dict:
    d = _DEFAULTS.get(kern)
    if d is None:
        sig = inspect.signature(kern.fn)
        d = _DEFAULTS[kern] = {n: p.default for n, p in sig.parameters.items() if p.default is not p.empty}
    return d


FAST = os.environ.get("FLASHLAB_FAST_LAUNCH", "1") not in ("0", "", "false", "False")
STATS = {"fast": 0, "jit": 0}   # launches through the compiled kernel's runner / through JITFunction.run

try:   # the stream Triton's own launcher asks for: torch's current stream on this device
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover
    _raw_stream = None


class _Runner:
    """A compiled kernel bound to one grid and config: ``runner(args)`` launches it on the current stream."""
    __slots__ = ("go", "tail", "device", "config")

    def __init__(self, compiled, grid, tail, device_index, config):
        g = tuple(grid) + (1,) * (3 - len(grid))
        self.go = compiled[g]
        self.tail = tail          # the constexpr values, in parameter order (the runner takes every parameter)
        self.device = device_index
        self.config = config

    def __call__(self, args):
        self.go(*args, *self.tail, stream=_raw_stream(self.device))


# Autotuning from several threads at once (a grader timing a class with --jobs N computes its references so)
# broke inside triton.autotune, which keeps the arguments of the call being tuned on the shared wrapper
# ("'NoneType' object is not a mapping" when another thread's tuning ended first): one tuning at a time.
_TUNING = threading.RLock()


def run(step, kern, args, consts: dict, grid_of, runners: dict | None = None, key=None, tuned_fn=None):
    """Launch ``kern`` as the plan's ``step`` says.

    ``args``: the non-constexpr arguments in order, or ``args(cfg)`` giving them for a config (backward v4's
    descriptors carry the tile shape); ``consts``: the constexprs the launcher sets (the tiles excepted);
    ``grid_of(cfg)``: the grid for a :class:`Config`.  ``runners`` / ``key``: where the compiled kernel's
    runner for this exact specialisation (the caller's key: shapes, strides, alignment) is kept.
    ``tuned_fn()``: the triton.autotune wrapper, for a step that autotunes and has not picked yet.
    """
    if runners is not None:
        r = runners.get(key)
        if r is not None:
            try:
                r(args(r.config) if callable(args) else args)
                STATS["fast"] += 1
                return
            except TypeError:      # pragma: no cover - this Triton's runner takes other arguments: use run()
                global FAST
                FAST = False
                runners.clear()
    if step.config is None and step.autotune:
        best = BEST.get(step.tune_key)
        if best is None:
            with _TUNING:          # triton.autotune keeps the call's arguments on itself: one tuning at a time
                best = BEST.get(step.tune_key)
                if best is None:   # first call for this autotuning key: tune, and note the pick in the plan
                    tuned = tuned_fn()
                    if isinstance(getattr(tuned, "cache", None), dict):   # BEST is the cache: Triton's own is keyed
                        tuned.cache.clear()                               # without the grid class, so time anew
                    tuned[lambda m: grid_of(C(m["BLOCK_M"], m["BLOCK_N"]))](
                        *(args(None) if callable(args) else args), **consts)
                    best = BEST[step.tune_key] = tuned.best_config
                    step.picked(C(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps,
                                  best.num_stages))
                    return
        step.picked(C(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages))
    if step.verified:
        return _launch(kern, args, consts, step.config, grid_of, runners, key)
    errors = []
    for cand in (step.config,) + tuple(step.fallbacks):   # hand-picked: the first that compiles is kept
        try:
            _launch(kern, args, consts, cand, grid_of, runners, key)
        except triton.runtime.errors.OutOfResources as e:   # shared memory or registers
            errors.append(f"{cand}: {e}")
            continue
        step.fell_back(cand, errors)
        return
    raise RuntimeError(f"no tile config fits this GPU for {step.kernel} (head dim {step.head_dim}):\n"
                       + "\n".join(errors))


_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def launch_cached(kern, grid, args, consts: dict, runners: dict | None, key):
    """``kern[grid](*args, **consts)`` for a kernel whose launcher picks its own config (split-KV decoding, its
    merge, forward and backward v6);
    after the first launch of a specialisation (``runners[key]``: the caller's key must hold everything Triton
    specialises on, i.e. the integer arguments' values or strides and the tensors' 16-byte alignment)
    through the compiled kernel's runner, as :func:`run` does.  ``consts``: the constexprs and launch options."""
    if runners is not None:
        r = runners.get(key)
        if r is not None:
            try:
                r(args)
                STATS["fast"] += 1
                return
            except TypeError:      # pragma: no cover - this Triton's runner takes other arguments: as run() does
                global FAST
                FAST = False
                runners.clear()
    compiled = kern[grid](*args, **consts)
    STATS["jit"] += 1
    if runners is None or compiled is None or not FAST or _raw_stream is None:
        return
    full = {n: v for n, v in consts.items() if n not in _LAUNCH_OPTIONS}
    defaults = _defaults(kern)
    try:
        tail = tuple(full[n] if n in full else defaults[n] for n in kern.arg_names[len(args):])
        runners[key] = _Runner(compiled, grid, tail, torch.cuda.current_device(), None)
    except Exception:   # pragma: no cover - a Triton whose compiled kernels cannot be called so
        pass


def _launch(kern, args, consts, cfg, grid_of, runners, key):
    grid = grid_of(cfg)
    a = args(cfg) if callable(args) else args
    full = dict(consts, BLOCK_M=cfg.block_m)
    if "BLOCK_N" in kern.arg_names:
        full["BLOCK_N"] = cfg.block_n
    compiled = kern[grid](*a, **full, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    STATS["jit"] += 1
    if runners is None or compiled is None or not FAST or _raw_stream is None:
        return                                 # the interpreter returns no compiled kernel
    defaults = _defaults(kern)
    try:
        tail = tuple(full[n] if n in full else defaults[n] for n in kern.arg_names[len(a):])
        runners[key] = _Runner(compiled, grid, tail, torch.cuda.current_device(), cfg)
    except Exception:   # pragma: no cover - a Triton whose compiled kernels cannot be called so: stay on run()
        pass
