"""The instructor's demo: naive attention vs PyTorch's SDPA vs flashlab, as the sequence grows.

    python -m flashlab demo                      # GPU: until naive attention runs out of memory
    python -m flashlab demo --out demo.png       # where the figure goes (default flashlab_demo.png)

In a notebook:

    from flashlab import demo
    demo.show()                     # a progress bar, the table, then the figure
    points = demo.run(); demo.figure(points)      # the same in two steps

What it does, for N = N0, 2 N0, 4 N0, ...:
  * one shape (B, H, N, D), fp16 on a GPU (fp32 on the CPU), causal;
  * each provider is first checked against a float32 naive reference on the first size, and a wrong
    one is reported, never timed;
  * forward time, backward time (medians of ``triton.testing.do_bench`` on a GPU), and the peak
    memory of a forward + backward above the inputs (``torch.cuda.max_memory_allocated``);
  * a provider that runs out of GPU memory is marked "out of memory" at that N and not tried at
    larger ones (the error is caught, the memory freed); the sweep goes on while another provider
    still runs, to the last size or until one call takes more than ``slow_s`` seconds.

On the CPU, kernels run in Triton's interpreter, so this is a smoke demonstration at tiny sizes:
its times measure the interpreter (NumPy), not a GPU kernel, and memory is not measured.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from . import device
from .reference import attention_naive_torch

PROVIDERS = ("naive", "sdpa", "flashlab")
LABELS = {"naive": "naive (PyTorch ops, S and P stored)", "sdpa": "PyTorch SDPA",
          "flashlab": "flashlab (Triton)"}
COLORS = {"naive": "tab:red", "sdpa": "tab:blue", "flashlab": "tab:green"}
OOM = "out of memory"


@dataclass
class Point:
    provider: str
    N: int
    B: int
    H: int
    D: int
    dtype: str
    causal: bool
    fwd_ms: float = math.nan
    bwd_ms: float = math.nan
    peak_mib: float = math.nan      # forward + backward, above inputs, output and gradients (GPU only)
    status: str = "ok"              # ok | out of memory | skipped (needs Triton) | WRONG (...) | error: ...
    device: str = ""


@dataclass
class Settings:
    sizes: list
    B: int
    H: int
    D: int
    dtype: torch.dtype
    causal: bool = True
    backward: bool = True
    slow_s: float = 2.0             # stop growing N once a call takes longer than this


def default_settings() -> Settings:
    """Sizes for this device: up to N = 128k on a GPU (naive attention runs out of memory well
    before on any current GPU); N = 32..128 in the interpreter."""
    if device.DEVICE.type == "cuda":
        return Settings(sizes=[1024 << i for i in range(8)], B=1, H=16, D=64, dtype=torch.float16)
    return Settings(sizes=[32, 64, 128], B=1, H=2, D=32, dtype=torch.float32, slow_s=60.0)


def _provider(name):
    if name == "naive":
        return lambda q, k, v, causal: attention_naive_torch(q, k, v, causal, return_lse=False)[0]
    if name == "sdpa":
        return lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name == "flashlab":
        from . import flash_attention
        return lambda q, k, v, causal: flash_attention(q, k, v, causal=causal)
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")


def _sync():
    if device.DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, grad_to_none=None) -> float:
    """Median milliseconds: do_bench on a GPU; on the CPU a few wall-clock runs (the interpreter)."""
    if device.DEVICE.type == "cuda" and device.TRITON:
        from triton.testing import do_bench
        return do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    def once():
        t0 = time.perf_counter()
        fn()
        _sync()
        return (time.perf_counter() - t0) * 1e3

    first = once()                                      # warm-up (first-call costs), and a guide
    return statistics.median([once() for _ in range(5 if first < 200 else 1)])


def _is_oom(e: Exception) -> bool:
    """PyTorch's allocator raises OutOfMemoryError; cuBLAS failing to get its workspace says ALLOC_FAILED."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in str(e) or "ALLOC_FAILED" in str(e)))


def _free():
    gc.collect()
    if device.DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def _measure(fn, q, k, v, do, causal, backward: bool, point: Point) -> None:
    """Fill in ``point``'s times and peak memory (CUDA memory errors propagate to the caller)."""
    gpu = device.DEVICE.type == "cuda"
    qg, kg, vg = (t.detach().requires_grad_(backward) for t in (q, k, v))
    if gpu:  # peak memory of one forward + backward, above what exists before and after it
        out = fn(qg, kg, vg, causal)
        if backward:
            out.backward(do)
        del out
        _sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(qg, kg, vg, causal)
        if backward:
            out.backward(do)
        _sync()
        point.peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        del out
    with torch.no_grad():
        point.fwd_ms = _time_ms(lambda: fn(q, k, v, causal))
    if backward:
        out = fn(qg, kg, vg, causal)
        point.bwd_ms = _time_ms(lambda: out.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
        del out


class _Steps:
    """The few tqdm methods :func:`run` uses, printing one line per step (when tqdm is missing)."""

    def __init__(self, total, desc="", disable=False, leave=True):
        self.n, self.total, self.disable = 0, total, disable

    def set_description(self, desc):
        if not self.disable:
            print(f"[{self.n + 1}/{self.total}] {desc}", flush=True)

    def update(self, k=1):
        self.n += k

    def close(self):
        pass


def run(settings: Settings | None = None, providers=PROVIDERS, progress: bool = True) -> list:
    """Run the sweep; returns a list of :class:`Point` (one per provider and size tried)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # a bare GPU machine: a line per step instead of a bar
        tqdm = _Steps

    s = settings or default_settings()
    dev = device.DEVICE
    dtname = str(s.dtype).replace("torch.", "")
    fns = {}
    points = []
    stopped = {}                           # provider -> N at which it stopped (out of memory, wrong, error)
    for name in providers:
        if name == "flashlab" and not device.TRITON:
            points.append(Point(name, s.sizes[0], s.B, s.H, s.D, dtname, s.causal,
                                status="skipped (needs Triton)", device=str(dev)))
            stopped[name] = s.sizes[0]
        else:
            fns[name] = _provider(name)
    bar = tqdm(total=len(s.sizes) * len(providers), desc="demo", disable=not progress, leave=True)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)   # tiny CPU sizes: time the work, not the waking of idle threads
    try:
        for i, N in enumerate(s.sizes):
            if all(name in stopped for name in providers):
                break
            gen = torch.Generator(device=dev).manual_seed(N)
            q, k, v, do = (torch.randn(s.B, s.H, N, s.D, device=dev, dtype=s.dtype, generator=gen)
                           for _ in range(4))
            ref = None
            slowest = 0.0
            for name in providers:
                bar.set_description(f"N={N} {name}")
                if name in stopped:        # it ran out of memory (or failed) at a smaller N
                    bar.update(1)
                    continue
                p = Point(name, N, s.B, s.H, s.D, dtname, s.causal, device=str(dev))
                points.append(p)
                try:
                    if i == 0:  # correctness first, on one head, against a float32 reference
                        if ref is None:
                            ref = attention_naive_torch(*(t[:1, :1].float() for t in (q, k, v)), s.causal,
                                                        return_lse=False)[0]
                        with torch.no_grad():
                            err = (fns[name](q, k, v, s.causal)[:1, :1].float() - ref).abs().max().item()
                        tol = {torch.float16: 2e-2, torch.bfloat16: 6e-2}.get(s.dtype, 1e-3)
                        if not err <= tol:
                            p.status, stopped[name] = f"WRONG (max error {err:.1e})", N
                            continue
                    _measure(fns[name], q, k, v, do, s.causal, s.backward, p)
                    slowest = max(slowest, p.fwd_ms, p.bwd_ms if s.backward else 0.0)
                except Exception as e:  # noqa: BLE001  (out of memory, or a backend that cannot do this: go on)
                    if _is_oom(e):
                        p.status, stopped[name] = OOM, N
                        p.fwd_ms = p.bwd_ms = p.peak_mib = math.nan
                    else:
                        p.status, stopped[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:100]}", N
                finally:
                    _free()
                    bar.update(1)
            del q, k, v, do, ref
            _free()
            if slowest > s.slow_s * 1e3:
                break
    finally:
        bar.close()
        torch.set_num_threads(threads)
    return points


def format_table(points) -> str:
    head = f"{'N':>7}  {'provider':<9}{'fwd ms':>10}{'bwd ms':>10}{'peak MiB':>11}  status"
    lines = [head, "-" * len(head)]
    for p in points:
        lines.append(f"{p.N:>7}  {p.provider:<9}{p.fwd_ms:>10.3f}{p.bwd_ms:>10.3f}{p.peak_mib:>11.1f}  {p.status}")
    return "\n".join(lines)


def _n_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def figure(points, title: str | None = None):
    """Forward and backward time against N and, on a GPU, peak memory (forward + backward); an x
    marks where a provider ran out of memory.  On the CPU only the time panel, labelled as such."""
    from matplotlib.figure import Figure

    from . import viz  # the course's plot helpers; importing it lets a notebook display the Figure

    gpu = any(p.device.startswith("cuda") for p in points)
    fig = Figure(figsize=(11, 4.2) if gpu else (7, 4.2))
    axes = fig.subplots(1, 2) if gpu else [fig.add_subplot()]
    ax_t = axes[0]
    providers = [n for n in PROVIDERS if any(p.provider == n for p in points)]
    for name in providers:
        ok = [p for p in points if p.provider == name and p.status == "ok"]
        oom = [p for p in points if p.provider == name and p.status == OOM]
        c = COLORS.get(name)
        if ok:
            ns = [p.N for p in ok]
            ax_t.plot(ns, [p.fwd_ms for p in ok], "o-", color=c, label=f"{LABELS[name]}, forward")
            if any(math.isfinite(p.bwd_ms) for p in ok):
                ax_t.plot(ns, [p.bwd_ms for p in ok], "s--", color=c, alpha=0.7, label=f"{LABELS[name]}, backward")
            if gpu:
                axes[1].plot(ns, [p.peak_mib for p in ok], "o-", color=c, label=LABELS[name])
        for p in oom:
            for ax in axes:
                ax.axvline(p.N, color=c, ls=":", alpha=0.7)
            if gpu:
                y = max((q.peak_mib for q in ok), default=1.0)
                axes[1].plot([p.N], [y], "x", color=c, ms=12, mew=3, label=f"{name}: out of memory at N={_n_label(p.N)}")
    sizes = sorted({p.N for p in points})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [_n_label(n) for n in sizes])
    s0 = points[0] if points else None
    shape = f"B={s0.B}, H={s0.H}, D={s0.D}, {s0.dtype}{', causal' if s0.causal else ''}" if s0 else ""
    if gpu:
        where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "GPU"
        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory / 2**20
            axes[1].axhline(total, color="gray", ls="--", lw=1, label=f"GPU memory ({total / 1024:.0f} GiB)")
        viz._finish_loglog(fig, axes[1], "sequence length N", "peak memory, forward + backward (MiB)",
                           "Peak memory")
        viz._finish_loglog(fig, ax_t, "sequence length N", "time (ms, median)", "Time")
    else:
        where = "CPU"
        viz._finish_loglog(fig, ax_t, "sequence length N", "time (ms, median)",
                           "Triton's interpreter: these times measure NumPy, not a GPU kernel;\n"
                           "memory is measured on a GPU only", legend_size=7)
    fig.suptitle(title or f"Attention as N grows ({shape}), {where}", fontsize=11)
    fig.tight_layout()
    return fig


def show(settings: Settings | None = None, providers=PROVIDERS):
    """Run the demo and return its figure: the last line of a notebook cell shows it."""
    points = run(settings, providers)
    print(format_table(points))
    return figure(points)


def as_dicts(points):
    return [asdict(p) for p in points]


def main(args) -> int:
    """``python -m flashlab demo``: run, print the table, save the figure."""
    s = default_settings()
    if args.sizes:
        s.sizes = sorted(args.sizes)
    if args.max_n:
        s.sizes = [n for n in s.sizes if n <= args.max_n]
    for field in ("B", "H", "D"):
        if getattr(args, field) is not None:
            setattr(s, field, getattr(args, field))
    if args.dtype:
        s.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    s.causal = not args.no_causal
    s.backward = not args.no_backward
    if device.DEVICE.type != "cuda":
        print("No GPU: kernels run in Triton's interpreter, so this is a small smoke demonstration; "
              "its times measure the interpreter, not a GPU, and memory is not measured.")
    points = run(s, providers=args.providers, progress=not args.quiet)
    print(format_table(points))
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(as_dicts(points), f, indent=1)
    try:
        figure(points).savefig(args.out, dpi=120, bbox_inches="tight")
        print(f"figure: {args.out}")
    except ImportError as e:
        print(f"no figure ({e}); the table above has the numbers")
    return 0


def add_command(sub) -> None:
    p = sub.add_parser("demo", help="naive vs SDPA vs flashlab as N grows: time, peak memory, a figure")
    p.add_argument("--sizes", nargs="+", type=int, help="sequence lengths (default: chosen for the device)")
    p.add_argument("--max-n", type=int, help="stop at this sequence length")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--B", type=int, help="batch (default 1)")
    p.add_argument("--H", type=int, help="heads (default 16 on a GPU, 2 on the CPU)")
    p.add_argument("--D", type=int, help="head dim (default 64 on a GPU, 32 on the CPU)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="default fp16 on a GPU, fp32 on the CPU")
    p.add_argument("--no-causal", action="store_true", help="full attention (default: causal)")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--out", default="flashlab_demo.png", help="the figure (PNG)")
    p.add_argument("--json", help="also write the points to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)
