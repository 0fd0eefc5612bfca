"""Where does flashlab lose time on small problems?  Host overhead, short sequences, a tiny GPT.

    python scripts/small_problems.py [--quick]        # needs a CUDA GPU; prints short tables last

1. Host work per call: one small problem (B=1, H=16, N=1024, D=64, fp16, causal) timed three ways:
   the kernel alone (``launch_forward`` into preallocated tensors), the public op, and SDPA; the host
   time per call (Python time to enqueue, no synchronisation); then ``cProfile`` of the public op's
   forward and forward+backward, the functions with the most time of their own.
2. Short sequences at 16k tokens (B = 16384 // N, H = 2048 // D), fp16: TFLOP/s of each forward
   version (its default configs: hand-picked below N = 1024, autotuned from there), the op's
   backward (v1 and v2), and SDPA's flash and cuDNN backends.
3. The tiny GPT of notebook 07 (6 layers, 6 heads of 64, context 256, bf16 autocast): median step
   time with SDPA and with flashlab, and the GPU time per kernel of one flashlab step (torch.profiler).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flashlab  # noqa: E402  (first: decides GPU vs interpreter)
from flashlab import bench, device, gpt, kernels  # noqa: E402


def host_overhead():
    from triton.testing import do_bench
    B, H, N, D = 1, 16, 1024, 64
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(4))
    o, lse = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
    scale = 1 / math.sqrt(D)
    fns = {
        "kernel alone (launch_forward)": lambda: kernels.launch_forward(q, k, v, o, lse, True, scale),
        "flashlab.flash_attention": lambda: flashlab.flash_attention(q, k, v, causal=True),
        "SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    rows = []
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        ms = do_bench(fn, return_mode="median")
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host_us = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        rows.append((name, ms * 1e3, host_us))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd_bwd():
        flashlab.flash_attention(qg, kg, vg, causal=True).backward(do)
    fwd_bwd()
    for what, fn in (("forward", fns["flashlab.flash_attention"]), ("forward+backward", fwd_bwd)):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        print(f"\n--- cProfile, 300 calls of the op's {what} ---")
        print("\n".join(s.getvalue().splitlines()[:40]))
    return rows


def short_sequences(ns, ds):
    rows = []
    for D in ds:
        for causal in (False, True):
            for N in ns:
                provs = [(f"fwd {v}", lambda q, k, v_, c, ver=v: _fwd(q, k, v_, c, ver)) for v in kernels.FORWARD_VERSIONS]
                provs += ["flashlab", "sdpa-flash", "sdpa-cudnn"]
                rows += bench.run_case(provs, N, D, torch.float16, causal, "fwd")
                provs = [(f"bwd {v}", lambda q, k, v_, c, ver=v: _BwdVersion(ver)(q, k, v_, c)) for v in kernels.BACKWARD_VERSIONS]
                provs += ["sdpa-flash", "sdpa-cudnn"]
                rows += bench.run_case(provs, N, D, torch.float16, causal, "bwd")
                print(bench.format_table(rows[-10:]).split("\n", 2)[-1], flush=True)
    return rows


def _fwd(q, k, v, causal, version):
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)
    kernels.launch_forward(q, k, v, o, lse, causal, 1 / math.sqrt(q.shape[-1]), version=version)
    return o


class _BwdVersion:
    """The op with one backward version forced (forward: the default)."""

    def __init__(self, version):
        self.version = version

    def __call__(self, q, k, v, causal):
        version = self.version

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)
                kernels.launch_forward(q, k, v, o, lse, causal, 1 / math.sqrt(q.shape[-1]))
                ctx.save_for_backward(q, k, v, o, lse)
                return o

            @staticmethod
            def backward(ctx, do):
                q, k, v, o, lse = ctx.saved_tensors
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                kernels.launch_backward(q, k, v, o, lse, do.contiguous(), dq, dk, dv, causal,
                                        1 / math.sqrt(q.shape[-1]), version=version)
                return dq, dk, dv
        return Fn.apply(q, k, v)


def tiny_gpt(steps):
    data = gpt.CharData(gpt.load_text(), block_size=256, dev=device.DEVICE)
    cfg = gpt.gpu_config(data.vocab_size)
    out = {}
    for attn in ("sdpa", "flashlab"):
        r = gpt.train(attn, cfg, data, steps=steps, batch_size=32, dtype=torch.bfloat16)
        out[attn] = (r["step_ms"], r["peak_mib"], r["loss"][-1])
        model = r["model"]
    x, y = data.batch(32, torch.Generator().manual_seed(0))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
        torch.cuda.synchronize()
    print("\n--- one flashlab GPT step (3 steps profiled), by GPU time ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    args = ap.parse_args()
    if device.DEVICE.type != "cuda":
        raise SystemExit("needs a CUDA GPU")
    print(device.format_report(device.report()), flush=True)
    host = host_overhead()
    ns = [256, 512, 1024] if args.quick else [256, 512, 1024, 2048]
    seq = short_sequences(ns, [64] if args.quick else [64, 128])
    g = tiny_gpt(40)

    print("\n=== host work per call (B=1, H=16, N=1024, D=64, fp16, causal) ===")
    print("| what | do_bench median (us) | host time per call (us) |\n|---|---|---|")
    for name, us, host_us in host:
        print(f"| {name} | {us:.1f} | {host_us:.1f} |")
    print("\n=== short sequences, 16k tokens, fp16: TFLOP/s ===")
    keys = sorted({(r.mode, r.D, r.causal) for r in seq})
    for mode, D, causal in keys:
        sel = [r for r in seq if (r.mode, r.D, r.causal) == (mode, D, causal)]
        provs = list(dict.fromkeys(r.provider for r in sel))
        print(f"\n{mode} D={D} causal={causal}\n| N | " + " | ".join(provs) + " |")
        for N in ns:
            cells = []
            for p in provs:
                r = next((r for r in sel if r.provider == p and r.N == N), None)
                cells.append(f"{r.tflops:.0f}" if r is not None and r.status == "ok" else (r.status[:12] if r else "-"))
            print(f"| {N} | " + " | ".join(cells) + " |")
    print("\n=== tiny GPT (6x6 heads of 64, T=256, batch 32, bf16), 40 steps ===")
    for attn, (ms, mib, loss) in g.items():
        print(f"{attn}: {ms:.1f} ms/step, peak {mib:.0f} MiB, last loss {loss:.3f}")


if __name__ == "__main__":
    main()
