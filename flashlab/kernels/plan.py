"""Which kernels, tiles and grids run for a call, and why: one launch plan per kind of call.

    >>> from flashlab.kernels import plan
    >>> p = plan.plan(1, 16, 4096, 4096, 64, torch.float16, causal=True)
    >>> print(p)                      # python -m flashlab plan --shape 1,16,4096,64 --causal

A :class:`Plan` is computed once per (shapes, stride class, dtype, flags, device) and cached
(:func:`plan`, :func:`plan_for`).  It holds the forward and backward kernel versions, each
launch as a :class:`Step` (kernel, tiles, warps, stages, grid, the reason for each choice)
and the flags the kernels take (dot precision, TMA reduce, spread adds).  The launchers at the end
of each kernel file take a plan and do what it says, nothing else.  Two choices can only be
made by running: an autotuned step says so until it has run, then says what autotuning picked; a
hand-picked config that runs out of resources when compiled hands over to the step's next
candidate, and the step records it.

The stride class (:class:`Layout`) is what the versions need of the strides: tensor descriptors
(forward v3, backward v3 / v4) need a unit last stride and 16-byte aligned base and strides;
backward v4's host descriptors also need no stride 0 (K, V expanded over heads).

Device facts (:class:`DeviceFacts`: compute capability, shared memory per block, interpreter or
GPU) come from :func:`device_facts`; tests replace it to plan for a T4, an L4 or an H200 on any
machine.

Extension point: a call's variant (:class:`Variant`: grouped K/V heads, a sliding window, soft-capping,
ALiBi, a mask, dropout, packed sequences) is a field of the plan key.  Each kernel module declares the
variant features its kernel implements in ``SUPPORTS``; :func:`choose_versions` keeps only the versions
whose ``SUPPORTS`` covers the call's features (forward v4 and backward v5 implement them all; forward and
backward v6 GQA, windows and soft-cap; the other plain versions none).  A kernel file joins by adding its module to ``FORWARD`` / ``BACKWARD`` here, its
``SUPPORTS``, its ``config_lists`` and its ``launch(plan, ..., runners=None, **variant_args)``; what
decides the compiled kernel (which features, the window) is in the :class:`Variant`, what only its
arguments carry (the mask and slope tensors, the soft-cap value, dropout's p and seed, cumulative
lengths) travels as ``variant_args`` (:func:`flashlab.kernels.launch_forward` / ``launch_backward``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import triton
import triton.language as tl

from .. import device
from . import (backward, backward_v2, backward_v3, backward_v4, backward_v5, backward_v6, forward, forward_v2,
               forward_v3, forward_v4, forward_v5, forward_v6, forward_fp8, tiles)
from .tiles import C, Config

FORWARD = {"v1": forward, "v2": forward_v2, "v3": forward_v3, "v4": forward_v4, "v5": forward_v5, "v6": forward_v6,
           "fp8": forward_fp8}
BACKWARD = {"v1": backward, "v2": backward_v2, "v3": backward_v3, "v4": backward_v4, "v5": backward_v5,
            "v6": backward_v6}
# The FP8 forward takes e4m3 inputs: the dtype chooses it (torch.float8_e4m3fn), never a variant feature, and it
# has no backward (inference only).
FP8 = "fp8"
FP8_DTYPE = forward_fp8.FP8_DTYPE
# The versions of plain attention (no variant feature in SUPPORTS): the ones the policy picks for a plain call
# and the ones scripts compare.  Forward v4 and backward v5 run the variants (any version may be forced).
# Forward and backward v6 are left out of them too: written in Gluon for sm_90 only, they have no interpreter and
# no other GPU.
FORWARD_VERSIONS = tuple(v for v, m in FORWARD.items() if not m.SUPPORTS and v != FP8 and not getattr(m, "ONLY_ON", None))
BACKWARD_VERSIONS = tuple(v for v, m in BACKWARD.items() if not m.SUPPORTS and not getattr(m, "ONLY_ON", None))
ONE_PASS = ("v3", "v4", "v6")   # one backward kernel after Delta (dQ added into a float32 buffer)

V3_FROM = 2048   # forward v3 from this sequence-length bucket on (below it v2 is as fast or faster)
V5_FROM = 1024   # forward v5 (host descriptors) on Hopper from this bucket up to V3_FROM (below it: v1 / v2)

# (head dim, causal) where the one-pass backward (v4) measured faster than v2; None: both modes.  At D = 128
# causal it spills registers and v2's two kernels are faster.
ONE_PASS_BWD = ((64, None), (128, False))

# Backward v4 from this many K/V rows (B * H * Nk; a GQA call counts its query heads) on: below it a call's time
# is mostly the host's, and v4 has more host work than v2 (seven descriptors encoded per launch, a zero fill and a
# scale).  At the README demo's shape (B 1, H 16, D 64, causal; scripts/demo_backward.py, docs/BENCHMARKS.md 2026-12-02) the host took 217-504
# us a backward call with v4 and 167-366 with v2; v2 was faster at N = 2048 (32,768 rows) in every run, v4 at
# N = 8192 and 16384; at N = 4096 (65,536 rows) each won one of two runs, whose host time drifted by half.
ONE_PASS_MIN_ROWS = 1 << 16

# The variant features the plan runs backward v6 for (where v6 runs at all): every one it implements.  Windows
# joined the others once backward v6 copied LSE and Delta into shared memory with Q and dO (its loops stopped
# spilling): a window of 1024 then measured 1.25-1.30x backward v5 (scripts/v6_variant_probe.py --only window,
# H100, docs/BENCHMARKS.md 2026-12-05, fifth entry; before, on the H200, 0.97-1.05x, and the plan kept v5, which is
# deterministic).  Packed sequences: forward v6 measured 1.06-1.32x v4 (8 documents of 2048 rows)
# and 1.14-1.21x (2 of 8192), backward v6 1.03-1.05x and 1.06-1.08x v5 (docs/BENCHMARKS.md 2026-12-03, "packed
# sequences in backward v6"); the spread at 2048 rows is not fully explained (a packed call's host time is close to
# v6's GPU time there).
# Dropout in v6 (its Philox bits the same as v4 / v5's) measured 1.18-1.43x v4 / v5 with dropout
# (scripts/dropout_v6_probe.py).
V6_PLANNED = frozenset({"gqa", "softcap", "dropout", "varlen", "window"})
# Windows' forward: v6 on a persistent grid (forward_v6.PERSIST_FOR; one program a multiprocessor taking Q tiles in
# turn, the next tile's copies issued while the last one's products finish), which measured 1.2-1.3x forward v4 at a
# window of 1024 and 1.7-2.1x at 256 (docs/BENCHMARKS.md, 2026-12-04).
V6_PLANNED_FORWARD = V6_PLANNED | {"window"}

INTERPRETER_TILE = C(32, 32)   # the interpreter runs one program at a time: fewer, smaller programs


# ---------------------------------------------------------------------------------------------- the facts

@dataclass(frozen=True)
class DeviceFacts:
    """What the plan needs to know about where the kernels run."""
    name: str
    cc: tuple | None              # compute capability; None in the interpreter
    shared_memory: int | None     # bytes one program may use; None in the interpreter
    interpret: bool
    index: int | None = None
    host_descriptors: bool = True   # triton.tools.tensor_descriptor (backward v4) is importable
    device_descriptors: bool = True   # tl.make_tensor_descriptor (forward v3, backward v3, v4 / v5's TMA loads)
    sms: int | None = None        # streaming multiprocessors (autotuning's grid class); None in the interpreter
    warp_specialize: bool = forward_v6.AVAILABLE   # Gluon with gl.warp_specialize (forward v6) is importable

    @property
    def hopper(self) -> bool:
        return self.cc is not None and self.cc[0] >= 9

    @property
    def sm90(self) -> bool:
        """Hopper itself (H100, H200): warpgroup MMAs and register reallocation, which forward v6 is written in."""
        return self.cc is not None and tuple(self.cc) == (9, 0)


def v6_runs(dtype, head_dim: int, facts: DeviceFacts, layout=None) -> str | None:
    """None if forward v6 (and backward v6: the same conditions) can run this call here, else why not."""
    if not facts.sm90:
        return "it is written for Hopper (sm_90: warpgroup MMAs, register reallocation)"
    if not facts.warp_specialize:
        return f"this Triton ({triton.__version__}) has no Gluon warp specialisation"
    if dtype not in (torch.float16, torch.bfloat16) or head_dim not in forward_v6.HEAD_DIMS:
        return "it runs fp16 / bf16 at D = 128 only"
    if layout is not None and not (layout.tma and layout.no_zero_stride):
        return "its TMA copies need a unit last stride, 16-byte aligned base and strides, and no stride 0"
    return None


# Tensor descriptors made in a kernel (tl.make_tensor_descriptor, with triton.set_allocator's scratch buffer) and
# on the host (triton.tools.tensor_descriptor) both arrive in Triton 3.4; with an older Triton the plan runs the
# pointer versions and says why.
DEVICE_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
NO_DESCRIPTORS = f"this Triton ({triton.__version__}) has no tensor descriptors (Triton >= 3.4)"


@functools.lru_cache(maxsize=None)
def _facts_of(index) -> DeviceFacts:
    host = backward_v4.TensorDescriptor is not None
    if index is None:
        return DeviceFacts("Triton interpreter (CPU)", None, None, True, None, host, DEVICE_DESCRIPTORS)
    return DeviceFacts(torch.cuda.get_device_name(index), device._capability_of(index), device._shared_memory_of(index),
                       False, index, host, DEVICE_DESCRIPTORS, torch.cuda.get_device_properties(index).multi_processor_count)


def device_facts() -> DeviceFacts:
    """This process's device: the current GPU, or the interpreter."""
    return _facts_of(torch.cuda.current_device() if device.DEVICE.type == "cuda" else None)


T4 = DeviceFacts("Tesla T4 (simulated)", (7, 5), 64 * 1024, False, 0, sms=40)
L4 = DeviceFacts("NVIDIA L4 (simulated)", (8, 9), 99 * 1024, False, 0, sms=58)
A100 = DeviceFacts("NVIDIA A100 (simulated)", (8, 0), 163 * 1024, False, 0, sms=108)
H200 = DeviceFacts("NVIDIA H200 (simulated)", (9, 0), 227 * 1024, False, 0, sms=132)
SIMULATED = {"t4": T4, "l4": L4, "a100": A100, "h200": H200}


@dataclass(frozen=True)
class Layout:
    """The stride class: what the versions need of the tensors' strides."""
    tma: bool = True           # unit last stride, base and other strides 16-byte aligned (tensor descriptors)
    no_zero_stride: bool = True   # no stride 0 (backward v4's descriptors span the whole tensor)


def tma_ok(*tensors) -> bool:
    """Tensor descriptors need the last stride 1 and 16-byte aligned base and strides."""
    for t in tensors:
        e = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * e) % 16 for s in t.stride()[:-1]):
            return False
    return True


def host_desc_ok(*tensors) -> bool:
    """Host descriptors span the whole tensor: no dimension may have stride 0 (K, V expanded over heads).

    v3 folds the batch and head strides into each program's base address, so it takes those."""
    return all(s > 0 for t in tensors for s in t.stride())


def layout_of(*tensors) -> Layout:
    return Layout(tma_ok(*tensors), host_desc_ok(*tensors))


@dataclass(frozen=True)
class Variant:
    """Attention variants beyond plain (causal or not) attention: the plan's extension point.

    The defaults are plain attention; a field set to anything else is a feature (:meth:`features`)
    that only versions declaring it in their module's ``SUPPORTS`` may run."""
    kv_groups: int = 1             # grouped-query attention: query heads per K/V head
    window: tuple | None = None    # sliding window (left, right), -1 unbounded, top-left aligned like causal
    softcap: bool = False          # scores soft-capped, c * tanh(s / c) (c travels as variant_args["softcap"])
    alibi: bool = False            # ALiBi biases (the slopes travel as variant_args["slopes"])
    mask: str | None = None        # "bool" or "additive" attention mask (the tensor: variant_args["mask"])
    dropout: bool = False          # (p and seed: variant_args["dropout_p"], ["seed"])
    varlen: bool = False           # packed sequences (variant_args["cu_q"], ["cu_k"]; Nq, Nk: the longest)

    def __post_init__(self):
        if self.mask not in (None, "bool", "additive"):
            raise ValueError(f"Variant.mask must be None, 'bool' or 'additive', got {self.mask!r}")
        if self.window is not None:
            object.__setattr__(self, "window", tuple(int(x) for x in self.window))

    def band(self, causal: bool):
        """(left, right) of the band the kernels visit (-1 unbounded), or None: no band."""
        if self.window is None:
            return (-1, 0) if causal else None
        left, right = self.window
        if causal:
            right = 0 if right < 0 else min(right, 0)
        return None if (left < 0 and right < 0) else (left, right)

    def describe(self, causal: bool = False) -> list:
        """The features in words, for the printed plan."""
        out = []
        for f in sorted(self.features()):
            if f == "gqa":
                f = f"gqa ({self.kv_groups} query heads per K/V head)"
            elif f == "window":
                f = f"window (left, right) = {self.band(causal)}"
            elif f == "mask":
                f = f"{self.mask} mask"
            out.append(f)
        return out

    def features(self) -> frozenset:
        f = set()
        if self.kv_groups != 1:
            f.add("gqa")
        if self.window is not None:
            f.add("window")
        if self.softcap:
            f.add("softcap")
        if self.alibi:
            f.add("alibi")
        if self.mask is not None:
            f.add("mask")
        if self.dropout:
            f.add("dropout")
        if self.varlen:
            f.add("varlen")
        return frozenset(f)


PLAIN = Variant()


# ----------------------------------------------------------------------------------------------- the plan

@dataclass(eq=False)
class Step:
    """One kernel launch of a plan: which kernel, with which tiles, on which grid, and why."""
    kernel: str                   # e.g. "fwd v2", "dkdv v2", "bwd v4", "preprocess"
    kind: str                     # "fwd", "dkdv", "dq", "bwd" (the estimate's kernel kinds), "pre"
    version: str
    head_dim: int
    rows: int                     # the rows its tiles split: Nq (a Q-tile grid) or Nk (a K/V-tile grid)
    bh: int                       # B * H
    config: Config | None         # the tiles that run; None while autotuning has not picked
    fallbacks: tuple = ()         # hand-picked configs to try next if ``config`` runs out of resources
    autotune: bool = False
    candidates: int = 0           # how many configs autotuning times
    tune_key: tuple | None = None
    reason: str = ""
    verified: bool = False        # the config compiled and ran (or was forced)
    history: list = field(default_factory=list)
    chosen_key: tuple | None = None   # where tiles.CHOSEN remembers the config that compiled (hand-picked steps)
    persistent: int = 0           # a persistent grid of at most this many programs (the GPU's multiprocessors)

    def grid_for(self, cfg: Config) -> tuple:
        block = cfg.block_n if self.kind in ("dkdv", "bwd") else cfg.block_m
        grid = tiles.grid_1d(-(-self.rows // block), self.bh)
        return (min(grid[0], self.persistent),) if self.persistent else grid

    @property
    def grid(self) -> tuple | None:
        return None if self.config is None else self.grid_for(self.config)

    def picked(self, cfg: Config) -> None:
        self.config, self.verified = cfg, True
        self.history.append(f"autotuning picked {cfg}")

    def fell_back(self, cfg: Config, errors: list) -> None:
        if cfg != self.config:
            self.history.append(f"{self.config} ran out of resources; {cfg} compiled")
        self.config, self.verified = cfg, True
        key = self.chosen_key or (self.kind, self.version, self.head_dim, self.tune_key[2] if self.tune_key else None,
                                  self.tune_key[3] if self.tune_key else None)
        tiles.CHOSEN[key] = cfg

    def describe(self) -> str:
        if self.config is None:
            tiles_ = f"autotuned over {self.candidates} configs (not yet run)"
        elif self.kind == "pre":
            tiles_ = f"{self.config.block_m}-row tiles, {self.config.num_warps} warps, grid {self.grid[0]}"
        else:
            tiles_ = f"{self.config}, grid {self.grid[0]}"
        more = "" if not self.history else "; " + "; ".join(self.history)
        return f"{self.kernel:<12} {tiles_}\n{'':<14}{self.reason}{more}"


@dataclass(eq=False)
class Plan:
    B: int
    H: int
    Nq: int
    Nk: int
    D: int                       # the kernels' head dim (a power of two >= 16)
    dtype: torch.dtype           # the kernels' dtype
    causal: bool
    allow_tf32: bool
    layout: Layout
    deterministic: bool
    facts: DeviceFacts
    variant: Variant
    fwd_version: str
    bwd_version: str
    reasons: dict                 # {"fwd": why this version, "bwd": why}
    forward: tuple                # Steps
    backward: tuple               # Steps: preprocess, then dK/dV and dQ (v1, v2) or one pass (v3, v4)
    n_key: int
    dot_precision: str
    tma_reduce: bool              # backward v3 / v4 add dQ through TMA (Hopper) instead of pointer atomics
    spread: bool                  # backward v3 / v4 start each program's Q tiles at its own tile

    def __post_init__(self):
        # the constexprs every launch of this plan sets besides its tiles (made once: launchers only read them)
        self.constexprs = dict(CAUSAL=self.causal, HEAD_DIM=self.D, DOT_PRECISION=self.dot_precision)
        self.one_pass_constexprs = dict(self.constexprs, TMA_REDUCE=self.tma_reduce, SPREAD=self.spread)

    def step(self, name: str) -> Step:
        return next(s for s in self.forward + self.backward if s.kind == name or s.kernel == name)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        feats = ", ".join(self.variant.describe(self.causal)) or "none"
        lines = [f"plan for B={self.B} H={self.H} Nq={self.Nq} Nk={self.Nk} D={self.D} {dt} "
                 f"causal={self.causal} on {self.facts.name}"
                 + (f" (cc {self.facts.cc[0]}.{self.facts.cc[1]}, {self.facts.shared_memory // 1024} KB shared memory)"
                    if self.facts.cc else ""),
                 f"  layout: tensor descriptors {'ok' if self.layout.tma else 'no'}, "
                 f"stride 0 {'none' if self.layout.no_zero_stride else 'present'}; variant features: {feats}; "
                 f"length bucket {self.n_key}; dot precision {self.dot_precision}",
                 f"  forward  {self.fwd_version}: {self.reasons['fwd']}"]
        lines += ["    " + s.describe().replace("\n", "\n    ") for s in self.forward]
        lines += [f"  backward {self.bwd_version}: {self.reasons['bwd']}"]
        if self.bwd_version in ("v3", "v4"):
            lines[-1] += (f" (dQ added {'by TMA reduce' if self.tma_reduce else 'by pointer atomics'}"
                          f"{', spread over rows' if self.spread else ''})")
        elif self.bwd_version == "v6":
            lines[-1] += " (dQ added by TMA reduce, 64 columns a consumer warpgroup)"
        lines += ["    " + s.describe().replace("\n", "\n    ") for s in self.backward]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the choices

def choose_versions(dtype, head_dim: int, bucket: int | None, causal: bool | None, facts: DeviceFacts,
                    deterministic: bool = False, variant: Variant = PLAIN, rows: int | None = None) -> tuple:
    """({"fwd": version, "bwd": version}, {"fwd": reason, "bwd": reason}) before the layout is considered.

    Chosen by the H200 measurements in docs/BENCHMARKS.md (2026-11-30):

    * forward v3 (tensor descriptors) on Hopper (compute capability 9.0) for sequences of more
      than 1024 (``bucket``, the autotuning bucket, at least V3_FROM): each v3 program builds its
      descriptors first, which short sequences, with few K/V tiles per program, do not earn back
      (at N = 256-1024 v3 measured 0.5-0.95x v2);
    * forward v6 (FlashAttention-3's warp specialisation, in Gluon) instead of v3 where it runs
      (:func:`v6_runs`: sm_90 exactly, fp16 / bf16, D = 128, a Triton with ``gl.warp_specialize``, strides
      a TMA copy takes), and instead of v5 in the 1024 bucket when not causal: at N = 1024 it measured
      1.05-1.07x v5 non-causal and 0.91-0.93x causal (docs/BENCHMARKS.md, 2026-12-02);
    * forward v5 (v3 with its descriptors made on the host) on Hopper in the 1024 bucket (V5_FROM up to
      V3_FROM): there v3's per-program descriptors do not pay, and Triton's tutorial 06, which loads through
      host descriptors, measured 1.2x v2 at D = 128 (docs/BENCHMARKS.md, 2026-12-02);
    * below the 1024 bucket, where no version autotunes, v1 for non-causal attention (at the same
      hand-picked tiles v2's second copy of the loop costs more than the masks it removes: v1
      measured 1.07-1.11x v2 at N = 256 and 512) and v2 for causal (its ordering and unmasked
      tiles win there);
    * backward v4 (one pass, dQ reduced through TMA, descriptors made on the host) on Hopper at
      head dim 64 and at head dim 128 non-causal (ONE_PASS_BWD), at the same sequence lengths as
      forward v3; v2 otherwise.  At D = 128 causal the one-pass kernel's two (BLOCK_N, 128) float32
      accumulators plus the dQ tile spill registers and v2 is faster.  The one-pass dQ is not bitwise
      reproducible (the adds arrive in any order): with ``torch.use_deterministic_algorithms(True)``
      the backward is v2, which is.  And only from ONE_PASS_MIN_ROWS K/V rows (``rows`` = B * H * Nk)
      on: a small problem (the README demo's B 1, H 16 at N = 2048) measured faster with v2.

    * backward v6 (v4's one pass with forward v6's warp specialisation, in Gluon) instead of v4 or v2 where
      :func:`v6_runs` allows, from the 2048 bucket on, both causal modes, unless deterministic or small: it measured
      1.16-1.25x v4 and 1.04-1.09x v2 causal (docs/BENCHMARKS.md, 2026-12-03).

    A call with variant features (:class:`Variant`) runs the newest versions whose module's ``SUPPORTS``
    covers them and that run here (:func:`_variant_versions`): forward and backward v6 for GQA, windows, soft-cap,
    dropout and packed sequences where the plain policy runs v6 (the backward not when deterministic); elsewhere, and
    for ALiBi and masks, forward v4 and backward v5, whose hand-picked tiles are forward v2's and backward v2's.

    fp32 and head dims above 128 keep v1: their dot products run on FMA units, where the masks
    v2 removes cost nothing noticeable, and v2's extra loop copies multiply the compile time.

    e4m3 inputs (``dtype`` torch.float8_e4m3fn) run the FP8 forward, on GPUs of compute capability
    8.9 and newer only (a ValueError elsewhere), and have no backward.
    """
    feats = variant.features()
    if dtype == FP8_DTYPE:
        return _fp8_versions(facts, feats)
    if feats:
        return _variant_versions(dtype, head_dim, bucket, facts, deterministic, variant, rows)
    if dtype == torch.float32 or head_dim > 128:
        why = ("fp32 and head dims above 128 run their dot products on FMA units, where v2's unmasked tiles "
               "gain nothing measurable and its extra loop copies multiply the compile time")
        return {"fwd": "v1", "bwd": "v1"}, {"fwd": why, "bwd": why}
    long_enough = bucket is None or bucket >= V3_FROM
    hopper = facts.hopper
    one_pass = any(d == head_dim and (c is None or c == causal) for d, c in ONE_PASS_BWD)
    small = rows is not None and rows < ONE_PASS_MIN_ROWS
    if hopper and long_enough and one_pass and not deterministic and not small:
        bwd, bwhy = "v4", (f"Hopper, length bucket >= {V3_FROM}, D = {head_dim}"
                           f"{' non-causal' if head_dim == 128 else ''}: one pass measured fastest")
    elif deterministic:
        bwd, bwhy = "v2", "deterministic algorithms requested: v2's dQ is bitwise reproducible (no adds in any order)"
    elif not hopper:
        bwd, bwhy = "v2", "not Hopper: v2's two kernels (the one-pass dQ reduce is a TMA bulk add on Hopper only)"
    elif not long_enough:
        bwd, bwhy = "v2", f"length bucket < {V3_FROM}: v2 measured as fast or faster"
    elif one_pass and small:
        bwd, bwhy = "v2", (f"B * H * Nk = {rows} < {ONE_PASS_MIN_ROWS} K/V rows: v2 measured faster on small problems "
                           "(host-bound there, and v4 has more host work: descriptors, a zero fill, a scale)")
    else:
        bwd, bwhy = "v2", (f"D = {head_dim}{' causal' if causal else ''}: the one-pass kernel "
                           + ("spills registers there" if head_dim == 128 else "was not measured faster"))
    if (hopper and long_enough and not deterministic and not small and bwd in ("v2", "v4")
            and v6_runs(dtype, head_dim, facts) is None):
        bwd, bwhy = "v6", (f"Hopper (sm_90), D = 128, length bucket >= {V3_FROM}: backward v4's one pass with "
                           "FlashAttention-3's warp specialisation in Gluon (measured 1.16-1.25x v4; 0.88-0.91x cuDNN at "
                           "N >= 4096, both causal modes, docs/BENCHMARKS.md 2026-12-03)")
    if bucket is not None and bucket < 1024 and causal is False:
        return ({"fwd": "v1", "bwd": bwd},
                {"fwd": "short, non-causal: v1's masks cost less than v2's second loop copy (1.07-1.11x)",
                 "bwd": bwhy})
    if hopper and long_enough and v6_runs(dtype, head_dim, facts) is None:
        return {"fwd": "v6", "bwd": bwd}, {
            "fwd": f"Hopper (sm_90), D = 128, length bucket >= {V3_FROM}: FlashAttention-3's warp specialisation "
                   "written in Gluon (a producer warp, two consumer warpgroups)", "bwd": bwhy}
    if hopper and long_enough:
        return {"fwd": "v3", "bwd": bwd}, {"fwd": f"Hopper, length bucket >= {V3_FROM}: tensor descriptors (TMA)",
                                           "bwd": bwhy}
    if hopper and bucket is not None and bucket >= V5_FROM and causal is False and v6_runs(dtype, head_dim, facts) is None:
        return {"fwd": "v6", "bwd": bwd}, {
            "fwd": f"Hopper (sm_90), D = 128, non-causal, length bucket {bucket}: FlashAttention-3's warp "
                   "specialisation written in Gluon (measured faster than v5 here; causal, v5 is)", "bwd": bwhy}
    if hopper and bucket is not None and bucket >= V5_FROM:
        return {"fwd": "v5", "bwd": bwd}, {
            "fwd": f"Hopper, length bucket {bucket} (from {V5_FROM}, below {V3_FROM}): tensor descriptors made on "
                   "the host (v3's, made in every program, cost more than short programs earn back)", "bwd": bwhy}
    fwhy = ("not Hopper: v2 (no TMA)" if not hopper else f"length bucket < {V3_FROM}: v2 measured as fast as v3 "
            "or faster (v3's descriptors are built per program)")
    if bucket is not None and bucket < 1024:
        fwhy = "short, causal: v2's longest-tiles-first order and unmasked tiles win"
    return {"fwd": "v2", "bwd": bwd}, {"fwd": fwhy, "bwd": bwhy}


def _variant_versions(dtype, head_dim: int, bucket, facts: DeviceFacts, deterministic: bool, variant: Variant,
                      rows) -> tuple:
    """The newest versions whose ``SUPPORTS`` covers the call's features.  Forward and backward v6 (GQA, windows,
    soft-cap, dropout, packed sequences) for the features in V6_PLANNED_FORWARD and V6_PLANNED (today both every
    feature v6 implements), where the plain policy runs v6 (Hopper sm_90, D = 128, fp16 / bf16, length bucket >=
    V3_FROM; the backward also not deterministic and not small); forward v4 and backward v5 otherwise (they implement
    every feature, run everywhere, and backward v5 is deterministic)."""
    feats = variant.features()
    names = ", ".join(sorted(feats))
    not_v6 = v6_runs(dtype, head_dim, facts)
    if not_v6 is None and bucket is not None and bucket < V3_FROM:
        not_v6 = f"the length bucket is below {V3_FROM}"
    chosen, reasons = {}, {}
    for d, table, word in (("fwd", FORWARD, "forward"), ("bwd", BACKWARD, "backward")):
        ok = [v for v, m in table.items() if v != FP8 and feats <= getattr(m, "SUPPORTS", frozenset())]
        if not ok:
            raise ValueError(f"no kernel version implements {names} yet ({word}: none)")
        why_not = not_v6
        planned = V6_PLANNED_FORWARD if d == "fwd" else V6_PLANNED
        if why_not is None and not feats <= planned:
            why_not = (f"the plan runs it for {', '.join(sorted(planned))} only (force {word}_version='v6' to "
                       "run it)")
        if why_not is None and d == "bwd" and deterministic:
            why_not = "deterministic algorithms requested (its dQ adds arrive in any order)"
        elif why_not is None and d == "bwd" and rows is not None and rows < ONE_PASS_MIN_ROWS:
            why_not = f"B * H * Nk = {rows} is a small problem (below {ONE_PASS_MIN_ROWS}: the host's time)"
        kept = [v for v in ok if not getattr(table[v], "ONLY_ON", None) or why_not is None]
        if not kept:
            raise ValueError(f"no {word} version that runs here implements {names} ({word} v6 does, but {why_not})")
        chosen[d] = kept[-1]
        if chosen[d] == "v6":
            reasons[d] = (f"variant features ({names}): {word} v6, which implements them as constexpr branches "
                          f"(Hopper sm_90, D = 128, length bucket >= {V3_FROM})")
            if d == "fwd" and "window" in feats:
                reasons[d] += "; a window's short programs on a persistent grid (one a multiprocessor)"
        else:
            reasons[d] = f"variant features ({names}): the newest {word} that implements them"
            if ok[-1] != chosen[d]:
                reasons[d] += f" and runs here ({word} v6 does too, but {why_not})"
            if chosen[d] == "v5":
                reasons[d] += " (its dK/dV sums the query heads of a K/V group in one program: no atomics, deterministic)"
    return chosen, reasons


def _fp8_versions(facts: DeviceFacts, feats: frozenset) -> tuple:
    """The FP8 forward for e4m3 inputs, or a ValueError saying why it cannot run here."""
    if facts.cc is not None and tuple(facts.cc) < forward_fp8.MIN_CC:
        raise ValueError(f"the FP8 forward needs FP8 tensor cores, compute capability >= 8.9 (L4, H100, H200); "
                         f"{facts.name} has {facts.cc[0]}.{facts.cc[1]}: use fp16 or bf16 there")
    extra = feats - forward_fp8.SUPPORTS
    if extra:
        raise ValueError(f"the FP8 forward runs plain or causal attention (and GQA) only, not "
                         f"{', '.join(sorted(extra))}")
    where = "in the interpreter" if facts.interpret else f"here cc {facts.cc[0]}.{facts.cc[1]}"
    return {"fwd": FP8, "bwd": "none"}, {
        "fwd": f"e4m3 inputs: the FP8 forward (FP8 tensor cores, compute capability >= 8.9; {where})",
        "bwd": "the FP8 forward is inference only"}


def _hand_step(kernel, kind, version, D, rows, bh, dtype, cands, facts, reason, tune_key, variant=None,
               causal=False):
    """A step with hand-picked tiles: the first that fits, the rest as fallbacks (or a remembered pick).
    The pick is remembered per variant and causal mode too: a mask's or dropout's tiles take shared memory
    that the plain kernel's do not, so a config that compiled for one need not compile for another."""
    key = (kind, version, D, dtype, facts.index, variant or PLAIN, bool(causal))
    chosen = tiles.CHOSEN.get(key)
    if chosen is not None:
        return Step(kernel, kind, version, D, rows, bh, chosen, (), False, 0, tune_key,
                    reason + "; this config compiled and ran before here", True, chosen_key=key)
    return Step(kernel, kind, version, D, rows, bh, cands[0], tuple(cands[1:]), False, 0, tune_key,
                reason, False, chosen_key=key)


def _steps(kind_list, version, p, facts, forced, forward_lists):
    """The steps of one pass.  ``kind_list``: ((kind, rows, programs per tile row: B * heads), ...); ``forward_lists``: kind -> (hand-picked configs
    that fit this GPU, autotuning candidates) for this version (its module's ``config_lists``)."""
    steps = []
    D, dtype = p["D"], p["dtype"]
    bucket, prec, causal = p["n_key"], p["prec"], p["causal"]
    for i, (kind, rows, bh) in enumerate(kind_list):
        name = f"{kind} {version}"
        waves = tiles.grid_class(bh, rows, facts.sms)
        tune_key = (kind, version, dtype, facts.index, bucket, D, causal, prec, waves)
        hand, auto = forward_lists[kind]
        if forced is not None:
            cfg = forced[i] if isinstance(forced, tuple) else forced
            steps.append(Step(name, kind, version, D, rows, bh, cfg, (), False, 0, tune_key,
                              "tiles forced by the caller", True))
        elif facts.interpret:
            steps.append(Step(name, kind, version, D, rows, bh, INTERPRETER_TILE, (), False, 0, tune_key,
                              "interpreter: 32x32 tiles (fewer, smaller programs)", True))
        elif auto and tiles.autotune_applies(dtype, D, bucket, facts.interpret):
            best = tiles.BEST.get(tune_key)
            st = Step(name, kind, version, D, rows, bh, None, (), True, len(auto), tune_key,
                      f"autotuned (fp16/bf16, D 64/128, bucket >= {tiles.AUTOTUNE_FROM}) over the configs "
                      f"the estimate keeps of {len(auto)}, keyed by bucket {bucket}, D, causal, precision and "
                      f"grid class {waves} ({tiles.GRID_CLASSES[waves]})")
            if best is not None:
                st.picked(C(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages))
            steps.append(st)
        else:
            cands = hand
            limit = f"{facts.shared_memory // 1024} KB" if facts.shared_memory else "?"
            why = (f"hand-picked: the first config whose shared-memory estimate fits {limit} "
                   f"(sm_{facts.cc[0]}{facts.cc[1]}), {len(cands) - 1} more to fall back on")
            if not auto and not facts.interpret and tiles.autotune_applies(dtype, D, bucket, False):
                why += f"; {version} never autotunes"
            elif not tiles.AUTOTUNE:
                why += "; FLASHLAB_AUTOTUNE=0"
            steps.append(_hand_step(name, kind, version, D, rows, bh, dtype, cands, facts, why, tune_key,
                                    p.get("variant"), causal))
    return tuple(steps)


_PLANS: dict = {}


def plan(B: int, H: int, Nq: int, Nk: int | None, D: int, dtype: torch.dtype = torch.float16, causal: bool = False,
         *, allow_tf32: bool = False, layout: Layout = Layout(), deterministic: bool | None = None,
         variant: Variant = PLAIN, forward_version: str | None = None, backward_version: str | None = None,
         forward_config: Config | None = None, backward_config=None, facts: DeviceFacts | None = None) -> Plan:
    """The launch plan for one kind of call (cached).  ``D``: the kernels' head dim (a power of two >= 16);
    ``dtype``: the kernels' dtype.  ``*_version`` / ``*_config`` force a version or tiles (scripts, tests);
    the layout still decides whether a descriptor version can run."""
    Nk = Nq if Nk is None else Nk
    facts = device_facts() if facts is None else facts
    det = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
    key = (B, H, Nq, Nk, D, dtype, bool(causal), bool(allow_tf32), layout, det, variant, forward_version,
           backward_version, forward_config, backward_config, facts, tiles.AUTOTUNE)
    p = _PLANS.get(key)
    if p is None:
        if len(_PLANS) >= 4096:      # many shapes: start over rather than grow without bound
            _PLANS.clear()
        p = _PLANS[key] = _make(*key[:-1])
    return p


def _make(B, H, Nq, Nk, D, dtype, causal, allow_tf32, layout, det, variant, fv, bv, fcfg, bcfg, facts) -> Plan:
    for name, v, ok in (("forward", fv, tuple(FORWARD)), ("backward", bv, tuple(BACKWARD))):
        if v is not None and v not in ok:
            raise ValueError(f"version must be one of {ok}, got {v!r} ({name})")
    bucket = tiles.n_key(Nq, Nk)
    versions, reasons = choose_versions(dtype, D, bucket, causal, facts, det, variant, B * H * Nk)
    if fv is not None and (fv == FP8) != (dtype == FP8_DTYPE):
        raise ValueError(f"forward version {fv!r} cannot run {dtype} inputs: the FP8 forward takes e4m3 "
                         "(torch.float8_e4m3fn) and only it does")
    feats = variant.features()
    for name, v, table in (("forward", fv, FORWARD), ("backward", bv, BACKWARD)):
        if v is not None and not feats <= getattr(table[v], "SUPPORTS", frozenset()):
            raise ValueError(f"{name} {v} does not implement {', '.join(sorted(feats - table[v].SUPPORTS))}: "
                             "force a version that does, or leave the choice to the plan")
    if fv is not None:
        versions["fwd"], reasons["fwd"] = fv, "forced by the caller"
    if versions["bwd"] == "none" and bv is not None:
        raise ValueError("the FP8 forward has no backward (inference only): do not force a backward version")
    if bv is not None:
        versions["bwd"], reasons["bwd"] = bv, "forced by the caller"
    if versions["fwd"] == "v6" and v6_runs(dtype, D, facts, layout) is not None:
        # what the policy picks without v6 (v5 in the 1024 bucket, v3 from 2048; their own layout rules follow)
        alt, why = choose_versions(dtype, D, bucket, causal, replace(facts, warp_specialize=False), det, variant)
        versions["fwd"], reasons["fwd"] = alt["fwd"], f"v6 wanted, but {v6_runs(dtype, D, facts, layout)}: {why['fwd']}"
    if versions["bwd"] == "v6" and v6_runs(dtype, D, facts, layout) is not None:
        alt, why = choose_versions(dtype, D, bucket, causal, replace(facts, warp_specialize=False), det, variant,
                                   B * H * Nk)
        versions["bwd"], reasons["bwd"] = alt["bwd"], f"v6 wanted, but {v6_runs(dtype, D, facts, layout)}: {why['bwd']}"
    if versions["fwd"] == "v3" and not facts.device_descriptors:
        versions["fwd"], reasons["fwd"] = "v2", f"v3 wanted, but {NO_DESCRIPTORS}: v2"
    if versions["fwd"] == "v3" and not layout.tma:
        versions["fwd"], reasons["fwd"] = "v2", ("v3 wanted, but tensor descriptors need a unit last stride and "
                                                 "16-byte aligned base and strides: v2")
    if versions["fwd"] == "v5" and not (facts.host_descriptors and layout.no_zero_stride and layout.tma):
        versions["fwd"], reasons["fwd"] = "v2", ("v5 wanted, but host tensor descriptors need Triton >= 3.4, no "
                                                 "stride 0, a unit last stride and 16-byte aligned base and strides: v2")
    if versions["bwd"] == "v4" and (not facts.host_descriptors or not layout.no_zero_stride):
        if facts.host_descriptors:
            versions["bwd"], reasons["bwd"] = "v3", ("v4 wanted, but a tensor has stride 0 (K, V expanded over heads): "
                                                     "host descriptors span whole tensors, so v3 (descriptors per "
                                                     "program) runs")
        else:
            versions["bwd"], reasons["bwd"] = "v2", ("v4 wanted, but this Triton has no host tensor descriptors "
                                                     "(triton.tools.tensor_descriptor, Triton >= 3.4): v2")
    if versions["bwd"] == "v3" and not facts.device_descriptors:
        versions["bwd"], reasons["bwd"] = "v2", f"v3 wanted, but {NO_DESCRIPTORS}: v2"
    if (versions["fwd"] == "v4" or versions["bwd"] == "v5") and facts.hopper and not facts.device_descriptors:
        for d, ver in (("fwd", "v4"), ("bwd", "v5")):
            if versions[d] == ver:
                reasons[d] += f"; {NO_DESCRIPTORS}: its streamed tiles load through pointers, not TMA"
    if versions["bwd"] in ("v3", "v4") and not layout.tma:
        versions["bwd"], reasons["bwd"] = "v2", (f"{versions['bwd']} wanted, but tensor descriptors need a unit last "
                                                 "stride and 16-byte aligned base and strides: v2")
    prec = tiles.dot_precision(dtype, allow_tf32)
    p = dict(B=B, H=H, Nq=Nq, Nk=Nk, D=D, dtype=dtype, n_key=bucket, prec=prec, causal=causal, variant=variant)
    if H % variant.kv_groups:
        raise ValueError(f"H = {H} query heads is not a multiple of Variant.kv_groups = {variant.kv_groups}")
    f_mod = FORWARD[versions["fwd"]]
    fwd = _steps((("fwd", Nq, B * H),), versions["fwd"], p, facts, fcfg,
                 f_mod.config_lists(D, dtype, facts.shared_memory, facts.cc))
    band = variant.window is not None
    if versions["fwd"] == "v6" and forward_v6.persistent_for(band, variant.varlen, causal and not band):
        fwd[0].persistent = facts.sms      # forward v6 decides the same at its launch (forward_v6.persistent)
        fwd[0].reason += f"; a persistent grid: at most one program per multiprocessor ({facts.sms})"
    if versions["bwd"] == "none":   # the FP8 forward: inference only
        return Plan(B, H, Nq, Nk, D, dtype, causal, allow_tf32, layout, det, facts, variant, versions["fwd"],
                    versions["bwd"], reasons, fwd, (), bucket, prec, tma_reduce=False, spread=False)
    b_mod = BACKWARD[versions["bwd"]]
    pre_m = INTERPRETER_TILE.block_m if facts.interpret else 64
    pre = Step("preprocess", "pre", "v1", D, Nq, B * H, C(pre_m, pre_m), (), False, 0, None,
               "Delta = rowsum(dO * O): one pass over O and dO, 64-row tiles (32 in the interpreter)", True)
    # one dK/dV program per K/V head's tile, summing the group's query heads (GQA: B * H / kv_groups of them)
    b_kinds = ((("bwd", Nk, B * (H // variant.kv_groups)),) if versions["bwd"] in ONE_PASS
               else (("dkdv", Nk, B * (H // variant.kv_groups)), ("dq", Nq, B * H)))
    if isinstance(bcfg, Config) and len(b_kinds) == 2:
        bcfg = (bcfg, bcfg)
    bwd = (pre,) + _steps(b_kinds, versions["bwd"], p, facts, bcfg, b_mod.config_lists(D, dtype, facts.shared_memory, facts.cc))
    if variant.varlen:
        pre.reason += "; packed: the grid runs over every packed row (total_q), not B x max_seqlen_q"
    return Plan(B, H, Nq, Nk, D, dtype, causal, allow_tf32, layout, det, facts, variant, versions["fwd"],
                versions["bwd"], reasons, fwd, bwd, bucket, prec,
                tma_reduce=not facts.interpret and facts.hopper, spread=D > 64)


def kernel_head_dim(d: int) -> int:
    """The head dim the kernels run at: the next power of two, at least 16 (the op pads with zeros)."""
    return max(16, 1 << (d - 1).bit_length())


def plan_for(q, k, v, causal: bool, *, allow_tf32: bool = False, extra=(), **kw) -> Plan:
    """The plan for kernel-ready tensors q (B, H, Nq, D), k, v (B, H, Nk, D) (``extra``: more tensors whose
    strides the descriptor versions would see: o, dO, the gradients)."""
    B, H, Nq, D = q.shape
    return plan(B, H, Nq, k.shape[2], D, q.dtype, causal, allow_tf32=allow_tf32,
                layout=layout_of(q, k, v, *extra), **kw)


FORGET_HOOKS: list = []   # what else forget() clears: caches of plans made elsewhere (flashlab.variants' calls)


def forget() -> None:
    """Drop every cached plan, remembered config and autotuning choice (tests; a changed environment)."""
    _PLANS.clear()
    tiles.CHOSEN.clear()
    tiles.BEST.clear()
    for hook in FORGET_HOOKS:
        hook()


__all__ = ["Plan", "Step", "Layout", "Variant", "PLAIN", "DeviceFacts", "plan", "plan_for", "device_facts",
           "choose_versions", "v6_runs", "layout_of", "tma_ok", "host_desc_ok", "kernel_head_dim", "SIMULATED",
           "FORWARD", "BACKWARD", "FORWARD_VERSIONS", "BACKWARD_VERSIONS", "V3_FROM", "V5_FROM", "ONE_PASS_BWD", "ONE_PASS_MIN_ROWS", "FP8",
           "FP8_DTYPE"]
