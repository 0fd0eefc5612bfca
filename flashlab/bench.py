"""Timing harness: flashlab against PyTorch's SDPA backends, by the course's protocol.

Protocol (see the README's benchmark record):
  * shapes keep 16k tokens: B = 16384 // N, H = 2048 // D;
  * FLOPs: forward 4 * B * H * Nq * Nk * D (half of it when causal), backward 2.5x forward;
  * every provider is first checked for correctness on the same inputs (one head
    against a float32 reference); a wrong provider is reported, never timed;
  * ``triton.testing.do_bench(..., return_mode="median")`` after a warm-up call.

Timings need a CUDA GPU; in the interpreter every timing function raises.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from . import device
from .attention import flash_attention
from .reference import attention_naive_torch

PROVIDERS = ("flashlab", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "naive")


def flops(B, H, Nq, Nk, D, causal: bool, mode: str = "fwd") -> float:
    """Matmul FLOPs of attention: 2 products of 2*Nq*Nk*D each; causal halves it, backward is 2.5x."""
    f = 4.0 * B * H * Nq * Nk * D
    if causal:
        f *= 0.5
    return f * (2.5 if mode == "bwd" else 1.0)


def _require_gpu():
    if device.DEVICE.type != "cuda":
        raise RuntimeError("timings need a CUDA GPU; in the interpreter only correctness is meaningful")


def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def provider_fn(name: str):
    """A callable ``f(q, k, v, causal) -> o`` for a provider name in PROVIDERS."""
    if name == "flashlab":
        return lambda q, k, v, causal: flash_attention(q, k, v, causal)
    if name == "naive":
        return lambda q, k, v, causal: attention_naive_torch(q, k, v, causal, return_lse=False)[0]
    return _sdpa({"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                  "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH"}[name])


@dataclass
class Row:
    provider: str
    mode: str
    dtype: str
    causal: bool
    B: int
    H: int
    N: int
    D: int
    ms: float = math.nan
    tflops: float = math.nan
    max_err: float = math.nan
    status: str = "ok"


def _one_head_reference(q, k, v, causal):
    o, _ = attention_naive_torch(q[:1, :1].float(), k[:1, :1].float(), v[:1, :1].float(), causal)
    return o


def run_case(providers, N, D, dtype=torch.float16, causal=False, mode="fwd", tokens=16384, hidden=2048,
             tol=None):
    """Check, then time, each provider on one shape. Returns a list of Row.

    A provider is a name in PROVIDERS or a pair (label, f(q, k, v, causal) -> o), e.g. a learner's kernel."""
    _require_gpu()
    from triton.testing import do_bench
    B, H = max(1, tokens // N), max(1, hidden // D)
    dev = device.DEVICE
    gen = torch.Generator(device=dev).manual_seed(N * 1000 + D)
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype, generator=gen) for _ in range(3))
    do = torch.randn_like(q)
    ref = _one_head_reference(q, k, v, causal)
    tol = tol if tol is not None else {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 1e-3}[dtype]
    rows = []
    for name in providers:
        name, fn = name if isinstance(name, tuple) else (name, provider_fn(name))  # (label, f(q, k, v, causal))
        row = Row(name, mode, str(dtype).replace("torch.", ""), causal, B, H, N, D)
        rows.append(row)
        try:
            if name == "naive" and B * H * N * N * 4 > 40e9:
                row.status = "skipped (S would not fit)"
                continue
            o = fn(q, k, v, causal)
            row.max_err = (o[:1, :1].float() - ref).abs().max().item()
            if not row.max_err <= tol:
                row.status = "WRONG"
                continue
            if mode == "fwd":
                ms = do_bench(lambda: fn(q, k, v, causal), return_mode="median")
            else:
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                out = fn(qg, kg, vg, causal)
                out.backward(do, retain_graph=True)   # warm-up (compiles the backward)
                ms = do_bench(lambda: out.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg],
                              return_mode="median")
            row.ms = ms
            row.tflops = flops(B, H, N, N, D, causal, mode) / (ms * 1e-3) / 1e12
        except Exception as e:  # a backend that does not support this shape/dtype/GPU
            row.status = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        finally:
            torch.cuda.empty_cache()
    return rows


def peak_memory(fn, N, D, dtype=torch.float16, B=1, H=16, causal=True):
    """Peak CUDA memory (bytes) of one forward + backward above its inputs, output and gradients."""
    _require_gpu()
    dev = device.DEVICE
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    fn(q, k, v, causal).backward(do)          # warm-up: compile, allocate grads
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()      # inputs, do, grads
    torch.cuda.reset_peak_memory_stats()
    o = fn(q, k, v, causal)
    o.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - o.numel() * o.element_size()
    return peak


def format_table(rows) -> str:
    head = f"{'provider':<15}{'mode':<5}{'dtype':<9}{'causal':<7}{'N':>6}{'D':>5}{'ms':>9}{'TFLOP/s':>9}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.provider:<15}{r.mode:<5}{r.dtype:<9}{str(r.causal):<7}{r.N:>6}{r.D:>5}"
                     f"{r.ms:>9.3f}{r.tflops:>9.1f}  {r.status}")
    return "\n".join(lines)


def as_dicts(rows):
    return [asdict(r) for r in rows]


# ----------------------------------------------------------------------------
# part 2 (notebooks 04-05): the forward alone
# ----------------------------------------------------------------------------

def peak_memory_forward(fn, N, D, dtype=torch.float16, B=1, H=16, causal=False):
    """Peak CUDA memory (bytes) of one forward ``fn(q, k, v)`` under no_grad, above its inputs and its output."""
    _require_gpu()
    dev = device.DEVICE
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype) for _ in range(3))
    with torch.no_grad():
        fn(q, k, v)                           # warm-up: compile
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = fn(q, k, v)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - o.numel() * o.element_size()
    del o
    torch.cuda.empty_cache()
    return peak


def contract_provider(fn):
    """A grader-contract forward ``fn(q, k, v, o, lse, causal)`` (the flash_forward exercise) as a provider
    ``f(q, k, v, causal) -> o`` for :func:`run_case`: it allocates o and lse, then calls ``fn``."""
    def provider(q, k, v, causal):
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        fn(q, k, v, o, lse, causal)
        return o
    return provider


def load_record(name: str):
    """A recorded GPU run from ``flashlab/data/`` (a dict; written by ``scripts/record_part*.py``), or None
    when it has not been recorded.  It is package data, so a Colab install has it too."""
    import json
    from importlib import resources
    path = resources.files("flashlab").joinpath("data", name)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


# ---------------------------------------------------------------- recorded runs (for notebooks on a CPU)

def _recorded_kernels():
    """flashlab/data/h200_kernels.json (see its README) as {(mode, D, causal): {name: TFLOP/s per N}}."""
    rec = load_record("h200_kernels.json")
    table = lambda rows: {(r["mode"], r["D"], r["causal"]): {k: tuple(v) for k, v in r["tflops"].items()}  # noqa: E731
                          for r in rows}
    return tuple(rec["seqlens"]), table(rec["providers"]), table(rec["versions"])


# fp16 TFLOP/s on one H200, 2026-11-30 (docs/BENCHMARKS.md): flashlab and SDPA's backends at
# RECORDED_H200_SEQLENS, and each kernel version at N = 4096 and 16384.
RECORDED_H200_SEQLENS, RECORDED_H200, RECORDED_H200_VERSIONS = _recorded_kernels()


# ---------------------------------------------------------------- host cost per call (python -m flashlab bench --overhead)

@dataclass
class OverheadRow:
    provider: str
    mode: str            # "fwd" (inputs without grad) or "fwd+bwd" (torch.autograd.grad of the output)
    dtype: str
    causal: bool
    B: int
    H: int
    N: int
    D: int
    us_per_call: float = math.nan   # wall clock per call, back to back (median of the repeats)
    gpu_us: float = math.nan        # do_bench's median of the same call: what the GPU needs when not host-bound
    ratio: float = math.nan         # us_per_call / SDPA's in the same run
    status: str = "ok"


def _wall_per_call(fn, calls: int) -> float:
    """Microseconds per call of ``calls`` back-to-back calls, the GPU drained before and after."""
    import time
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


class _PythonFloor(torch.autograd.Function):
    """The least a Python-level op pays: autograd's Python node, the outputs allocated, no kernel launched.
    ``overhead``'s "python floor" provider: what flashlab's op would cost if its kernels and its own host code
    took no time (SDPA's autograd node and launches are C++)."""

    @staticmethod
    def forward(ctx, q, k, v):
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


OVERHEAD_PROVIDERS = ("sdpa", "flashlab", "python floor")


def overhead(B=1, H=1, N=128, D=64, dtypes=(torch.float16, torch.bfloat16), causal=False, calls=2000, repeats=5,
             providers=OVERHEAD_PROVIDERS) -> list:
    """Per-call wall clock of back-to-back calls at a problem whose GPU work is a few microseconds, so what is
    measured is the host's work (validation, allocation, the launch path, autograd).  ``sdpa`` is PyTorch's
    default choice of backend; every provider that computes attention is first checked against a float32
    reference; "python floor" computes nothing: the forward allocates O and the LSE, and with a gradient it is
    :class:`_PythonFloor`, a Python autograd node that allocates the outputs and the gradients and launches no
    kernel: the cost of being a Python op at all.

    The providers take turns: each of ``repeats`` rounds times every provider for ``calls`` calls, so a drift
    of the host's speed during the run (seen: the same call 310 us in one minute and 460 the next) reaches
    every provider alike.  ``us_per_call`` is the median over the rounds; ``ratio`` is the median of the
    per-round ratios to SDPA."""
    _require_gpu()
    from triton.testing import do_bench
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in dtypes:
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        tol = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 1e-3}[dtype]
        for mode in ("fwd", "fwd+bwd"):
            timed = []   # (row, call, microseconds per call in each round)
            for name in providers:
                if name == "sdpa":
                    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                elif name == "python floor" and mode == "fwd":   # no autograd node: the two allocations
                    f = lambda q, k, v: (torch.empty_like(q), torch.empty(q.shape[:3], device=q.device))[0]  # noqa: E731
                elif name == "python floor":
                    f = lambda q, k, v: _PythonFloor.apply(q, k, v)[0]  # noqa: E731
                else:
                    f = lambda q, k, v: flash_attention(q, k, v, causal)  # noqa: E731
                row = OverheadRow(name, mode, str(dtype).replace("torch.", ""), causal, B, H, N, D)
                rows.append(row)
                try:
                    if name != "python floor":
                        err = (f(q, k, v).float() - ref).abs().max().item()
                        if not err <= tol:
                            row.status = f"WRONG (max error {err:.3g})"
                            continue
                    if mode == "fwd":
                        call = lambda f=f: f(q, k, v)  # noqa: E731
                    else:
                        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                        call = lambda f=f, qg=qg, kg=kg, vg=vg: torch.autograd.grad(  # noqa: E731
                            f(qg, kg, vg), (qg, kg, vg), do)
                    for _ in range(max(20, calls // 10)):    # warm-up: compile, fill caches
                        call()
                    timed.append((row, call, []))
                except Exception as e:
                    row.status = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            for _ in range(repeats):
                for row, call, per in timed:
                    per.append(_wall_per_call(call, calls))
            base = next((per for row, _, per in timed if row.provider == "sdpa"), None)
            for row, call, per in timed:
                row.us_per_call = statistics.median(per)
                if base is not None:
                    row.ratio = statistics.median(t / b for t, b in zip(per, base))
                row.gpu_us = do_bench(call, return_mode="median") * 1e3
    return rows


def format_overhead(rows) -> str:
    head = (f"{'provider':<14}{'mode':<9}{'dtype':<10}{'causal':<7}{'shape (B,H,N,D)':<17}"
            f"{'us/call':>9}{'x SDPA':>8}{'GPU us':>8}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.provider:<14}{r.mode:<9}{r.dtype:<10}{str(r.causal):<7}{f'{r.B},{r.H},{r.N},{r.D}':<17}"
                     f"{r.us_per_call:>9.1f}{r.ratio:>8.2f}{r.gpu_us:>8.1f}  {r.status}")
    return "\n".join(lines)
