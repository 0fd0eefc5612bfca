"""Host work per call of flashlab.flash_attention without the GPU: every kernel launch replaced by a no-op.

    python scripts/host_cost.py [--calls 20000]

Runs in Triton's interpreter (CPU) with ``InterpretedFunction.__getitem__`` returning a function that does
nothing, so what is timed is flashlab's own host code around the launches: validation, the version and tile
choice, allocation, argument lists, autograd.  Triton's launch itself (on a GPU: the compiled kernel's runner,
or JITFunction.run) is not in it; ``python -m flashlab bench --overhead`` measures the whole call on a GPU.
Prints CPU microseconds per call (``time.process_time``, the least of 7 repeats: on a shared machine wall
clock measures the neighbours) at B 1, H 1, N 128, D 64, fp16 and bf16, forward without
grad and forward + backward (torch.autograd.grad), causal and not; and a windowed forward through the variants' path.
"""
import argparse
import time

import torch

import flashlab
from triton.runtime.interpreter import InterpretedFunction

InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)


def per_call(fn, calls):
    for _ in range(200):
        fn()
    runs = []
    for _ in range(7):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        runs.append((time.process_time() - t0) / calls * 1e6)
    return min(runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    f = flashlab.flash_attention
    print(f"{'dtype':<10}{'causal':<8}{'fwd us':>8}{'fwd+bwd us':>12}")
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            q, k, v, do = (torch.randn(1, 1, 128, 64).to(dtype) for _ in range(4))
            fwd = per_call(lambda: f(q, k, v, causal), args.calls)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            both = per_call(lambda: torch.autograd.grad(f(qg, kg, vg, causal), (qg, kg, vg), do), args.calls // 4)
            print(f"{str(dtype).replace('torch.', ''):<10}{str(causal):<8}{fwd:>8.1f}{both:>12.1f}")
    # a variant call (flashlab.variants' host code, forward v4's launcher here): a causal window, fp32 (no cast)
    q, k, v = (torch.randn(1, 16, 1024, 128) for _ in range(3))
    with torch.no_grad():
        fwd = per_call(lambda: f(q, k, v, is_causal=True, window=(1023, 0)), args.calls // 4)
    print(f"variant: window (1023, 0) causal, fp32, B 1, H 16, N 1024, D 128: forward {fwd:.1f} us")


if __name__ == "__main__":
    main()
