"""Where the host time of a tiny forward + backward goes, on a GPU: flashlab beside SDPA, under torch.profiler.

    python scripts/host_profile.py [--calls 300] [--dtype fp16] [--out host_profile.txt]

At B 1, H 1, N 128, D 64 the GPU work is a few microseconds, so a call's wall clock is the host's: Python,
autograd, allocation, and each kernel launch (the CUDA driver's, and Triton's launcher or runner around it).
``python -m flashlab bench --overhead`` measures the totals; this prints, for each provider, the per-call wall
clock and the profiler's operators and CUDA runtime calls by their CPU time per call (self time, and total
time for flashlab's own functions), so the difference between the two can be attributed.  GPU only.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import flashlab  # noqa: E402
from flashlab.kernels import tiles  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", default="1,1,128,64", help="B,H,N,D (default: the tiny call)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--cprofile", type=int, default=0, metavar="K",
                    help="also print Python's own profile of flashlab's calls: the K functions with most own time")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_profile.py profiles GPU launches: run it on a CUDA machine")
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    shape = tuple(int(x) for x in a.shape.split(","))
    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=dt) for _ in range(4))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    providers = {
        "sdpa": lambda: torch.autograd.grad(F.scaled_dot_product_attention(qg, kg, vg, is_causal=a.causal), (qg, kg, vg), do),
        "flashlab": lambda: torch.autograd.grad(flashlab.flash_attention(qg, kg, vg, a.causal), (qg, kg, vg), do),
    }
    lines = []
    for name, fn in providers.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        before = dict(tiles.STATS)
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / a.calls * 1e6
        launches = {key: (tiles.STATS[key] - before[key]) / a.calls for key in tiles.STATS}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA],
                                    with_stack=False) as prof:
            for _ in range(a.calls):
                fn()
            torch.cuda.synchronize()
        lines.append(f"== {name} {a.dtype} fwd+bwd, B,H,N,D {a.shape}{' causal' if a.causal else ''}: {us:.1f} us per call (wall, unprofiled)"
                     + (f"; flashlab launches per call: {launches}" if name == "flashlab" else ""))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60)
        lines.append(table)
        try:
            kernels = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0
                       and e.self_cpu_time_total == 0]
            lines.append("GPU kernels per call: " + ", ".join(
                f"{e.key[:50]} {e.device_time_total / a.calls:.1f} us" for e in kernels))
        except Exception as e:   # the profiler's fields differ between torch versions
            lines.append(f"(GPU kernel list unavailable: {e})")
    if a.cprofile:
        import cProfile
        import io
        import pstats
        fn = providers["flashlab"]
        fwd = lambda: flashlab.flash_attention(qg, kg, vg, a.causal)    # noqa: E731
        for label, f in (("forward with grad (graph built, no backward)", fwd), ("forward + backward", fn)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                f()
            torch.cuda.synchronize()
            lines.append(f"== flashlab {label}: {(time.perf_counter() - t0) / a.calls * 1e6:.1f} us per call (wall)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.cprofile)
        lines.append(f"== cProfile, flashlab fwd+bwd, {a.calls} calls (times are totals):")
        lines.append(buf.getvalue())
    text = "\n".join(lines)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
