"""The demo's short backward, taken apart: which backward version, and where its host time goes.  GPU only.

    python scripts/demo_backward.py [--seqlens 1024 2048 4096] [--cprofile 15]

The README's demo (``python -m flashlab demo``: B 1, H 16, D 64, fp16, causal) times ``out.backward(do)``
with ``triton.testing.do_bench``.  For each N this times that backward as the demo does, three ways:
SDPA (its default backend), flashlab with the plan's backward, and flashlab with each other plain backward
version forced (v2: three launches, no descriptors; v4: one pass, seven host descriptors); then the host
time of one backward call (Python until the launches are queued, no synchronisation: mean over 200
calls) and, with ``--cprofile K``, the K functions with the most own time in the plan's backward at the
second N.  A table last.
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import flashlab  # noqa: E402
from flashlab import attention  # noqa: E402

PLAN_FOR = attention.plan_for


def use_backward(version):
    """Make the op plan with this backward version (None: the plan's own choice); drop the calls made so far."""
    attention.plan_for = PLAN_FOR if version is None else functools.partial(PLAN_FOR, backward_version=version)
    attention._FWD.clear()
    attention._BWD.clear()


def host_us(out, do, calls=200):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        out.backward(do, retain_graph=True)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096])
    ap.add_argument("--cprofile", type=int, default=15)
    a = ap.parse_args()
    rows = []
    for n in a.seqlens:
        q, k, v = (torch.randn(1, 16, n, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        modes = [("sdpa", None), ("flashlab (plan)", None), ("flashlab, bwd v2", "v2"), ("flashlab, bwd v4", "v4")]
        for name, version in modes:
            if name == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                which = "-"
            else:
                use_backward(version)
                out = flashlab.flash_attention(q, k, v, is_causal=True)
                out.backward(do, retain_graph=True)   # compiles, autotunes; makes the backward call
                c = next(iter(next(iter(attention._FWD.values())).bwd.values()))
                which = c.plan.bwd_version
            ms = do_bench(lambda: out.backward(do, retain_graph=True), grad_to_none=[q, k, v], return_mode="median")
            fwd_ms = do_bench(lambda: (F.scaled_dot_product_attention(q, k, v, is_causal=True) if name == "sdpa"
                                       else flashlab.flash_attention(q, k, v, is_causal=True)), return_mode="median")
            hus = host_us(out, do)
            rows.append((n, name, which, fwd_ms, ms, hus))
            print(f"N {n:6d} {name:18s} bwd {which:3s} fwd {fwd_ms:.4f} ms  bwd {ms:.4f} ms  host {hus:7.1f} us", flush=True)
            if a.cprofile and name == "flashlab (plan)" and n == a.seqlens[min(1, len(a.seqlens) - 1)]:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(100):
                    out.backward(do, retain_graph=True)
                prof.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.cprofile)
                print(f"cProfile of 100 backward calls, N = {n}, the plan's backward ({which}):")
                print(buf.getvalue())
        use_backward(None)
    print(f"\n{'N':>6} {'provider':18s} {'bwd':4s} {'fwd ms':>8} {'bwd ms':>8} {'host us':>8} {'x SDPA bwd':>10}")
    base = {n: ms for n, name, _, _, ms, _ in rows if name == "sdpa"}
    for n, name, which, f, ms, hus in rows:
        print(f"{n:6d} {name:18s} {which:4s} {f:8.4f} {ms:8.4f} {hus:8.1f} {ms / base[n]:10.2f}")


if __name__ == "__main__":
    main()
