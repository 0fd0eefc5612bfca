"""Forward / backward v6 against forward v4 / backward v5 on the variants v6 implements, by band width and document
length: where the plan should run which (an sm_90 GPU; docs/BENCHMARKS.md has what it measured).

    python scripts/v6_variant_probe.py [out.json] [--only docs]

Each row runs flashlab.flash_attention with the versions forced (the plan's choice set aside), checks the output and
the gradients against the v4 / v5 run of the same inputs, then times forward and backward
(triton.testing.do_bench, median), and the forward's host time and GPU time apart (the GPU's: calls replayed from a
CUDA graph); TFLOP/s count the visible query-key pairs only (4 D FLOPs a pair forward, 2.5
times that backward).  bf16, D = 128.  Also the plain causal forward at N = 2048 (v6 against v3), the bucket where
the plan starts running v6 for dense attention.
"""
from __future__ import annotations

import json
import sys
import time

import torch

sys.path.insert(0, ".")
import flashlab  # noqa: E402
from flashlab.kernels import plan as P  # noqa: E402
from flashlab import kernels  # noqa: E402
from flashlab.kernels import forward_v6 as fwd6  # noqa: E402
from flashlab.kernels import version_op  # noqa: E402

FORCE: dict = {}
_plan = P.plan


def _forced_plan(*a, **kw):
    kw.update(FORCE)
    return _plan(*a, **kw)


P.plan = _forced_plan     # variants._plan and plan_for look it up here
DT, D = torch.bfloat16, 128


def _bench(fn):
    from triton.testing import do_bench
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _host_ms(fn, n: int = 50) -> float:
    """The host's time a call (no sync inside: the GPU runs behind), the median of five runs of n calls."""
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e3)
        torch.cuda.synchronize()
    return sorted(runs)[2]


def _graph_ms(fn, calls: int = 10) -> float:
    """The GPU's time a forward call, the host taken out: ``calls`` calls (no autograd) captured in a CUDA graph,
    the graph replayed (median of 5 replays, CUDA events)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[2]


def _time(call, inputs):
    out = call(*inputs)
    do = torch.randn(out.shape, device=out.device, dtype=out.dtype, generator=torch.Generator(out.device).manual_seed(1))
    grads = torch.autograd.grad(out, inputs, do, retain_graph=True)
    t_f = _bench(lambda: call(*inputs))
    t_b = _bench(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True))
    return out.detach(), grads, t_f, t_b, _host_ms(lambda: call(*inputs)), _graph_ms(lambda: call(*inputs))


def run(rows, label, call, inputs, pairs, H, B, versions):
    ref = None
    for fv, bv, *persist in versions:
        FORCE.clear()
        FORCE.update(forward_version=fv, backward_version=bv)
        P.forget()
        fwd6.PERSIST_FOR = frozenset(persist[0] if persist else ())
        kernels._RUNNERS.clear()
        out, grads, t_f, t_b, host, gpu = _time(call, inputs)
        if ref is None:
            ref = (out, grads)
            err = 0.0
        else:
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip((out,) + grads, (ref[0],) + ref[1]))
        flops = 4.0 * D * pairs * H * B
        if persist and persist[0]:
            fv = fv + " persistent"
        r = dict(case=label, fwd=fv, bwd=bv, fwd_ms=t_f, bwd_ms=t_b, fwd_tflops=flops / t_f * 1e-9,
                 bwd_tflops=2.5 * flops / t_b * 1e-9, max_diff_vs_first=err, fwd_host_ms=host, fwd_gpu_ms=gpu,
                 fwd_gpu_tflops=flops / gpu * 1e-9)
        rows.append(r)
        print(f"  {label:38s} fwd {fv:>13s} {r['fwd_tflops']:6.1f} TF/s  bwd {bv} {r['bwd_tflops']:6.1f} TF/s  "
              f"diff {err:.1e}  a forward: host {host:.3f} ms, GPU {gpu:.3f} ms ({r['fwd_gpu_tflops']:5.1f} TF/s)", flush=True)
        assert err < 0.1, f"{label}: {fv}/{bv} disagrees with {versions[0]} ({err})"


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default="v6_variant_probe.json")
    ap.add_argument("--only", choices=("window", "docs", "plain"), default=None, help="one group of rows")
    ap.add_argument("--windows", default="256,1024,4096", help="the window rows' widths")
    a = ap.parse_args()
    out, only = a.out, a.only
    rows = []
    torch.manual_seed(0)
    B, H, N = 1, 16, 16384
    for W in (int(w) for w in a.windows.split(",")) if only in (None, "window") else ():
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=DT).requires_grad_() for _ in range(3))
        pairs = sum(min(i + 1, W) for i in range(N))
        run(rows, f"window {W} causal, N {N}", lambda a, b, c, W=W: flashlab.flash_attention(
            a, b, c, is_causal=True, window=(W - 1, 0)), (q, k, v), pairs, H, B,
            [("v4", "v5"), ("v6", "v6"), ("v6", "v6", {"band"}), ("v4", "v5"), ("v6", "v6"), ("v6", "v6", {"band"})])
    for L in (2048, 8192) if only in (None, "docs") else ():
        n_doc = N // L
        cu = torch.arange(0, N + 1, L, device="cuda", dtype=torch.int32)
        q, k, v = (torch.randn(N, H, D, device="cuda", dtype=DT).requires_grad_() for _ in range(3))
        run(rows, f"{n_doc} documents of {L}, causal", lambda a, b, c, L=L, cu=cu: flashlab.flash_attention_varlen(
            a, b, c, cu, cu, L, L, is_causal=True), (q, k, v), n_doc * L * (L + 1) // 2, H, 1,
            [("v4", "v5"), ("v6", "v6"), ("v6", "v6", {"varlen"}), ("v4", "v5"), ("v6", "v6"),
             ("v6", "v6", {"varlen"})])
    for n, b, causal in ((2048, 8, True), (4096, 4, True), (16384, 1, True), (2048, 8, False), (16384, 1, False)) \
            if only in (None, "plain") else ():
        q, k, v = (torch.randn(b, H, n, D, device="cuda", dtype=DT).requires_grad_() for _ in range(3))
        for fv, persist in (("v3", ()), ("v6", ()), ("v6", ("causal", "dense")), ("v6", ()), ("v6", ("causal", "dense"))):
            op = version_op(fv, "v6")
            FORCE.clear()
            P.forget()
            fwd6.PERSIST_FOR = frozenset(persist)
            kernels._RUNNERS.clear()
            o, grads, t_f, t_b, _, _ = _time(lambda a, c, d: op(a, c, d, causal)[0], (q, k, v))
            pairs = n * (n + 1) // 2 if causal else n * n
            r = dict(case=f"plain {'causal' if causal else 'dense'} N {n} B {b}",
                     fwd=fv + (" persistent" if persist else ""), bwd="v6", fwd_ms=t_f, bwd_ms=t_b,
                     fwd_tflops=4.0 * D * pairs * H * b / t_f * 1e-9)
            rows.append(r)
            print(f"  {r['case']:38s} fwd {r['fwd']:>13s} {r['fwd_tflops']:6.1f} TF/s", flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
