"""Where a backward call's GPU time goes: its kernels' times (torch.profiler) and the whole call (do_bench), for a
dense causal call, the same in (B, N, H, D) memory, 8 packed documents of the same shape, and a window of 1024 keys
(backward as planned, v6, and in backward v5).  bf16, D = 128, H = 16, 16k tokens; torch.autograd.grad, as the variants'
benchmark times it.

    python scripts/bwd_call_profile.py OUT.json [--head-groups 1,2,4,16]

--head-groups: also the packed and the dense call with tiles.HEAD_GROUP fixed (the causal grid's sections of heads).
"""
import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import flashlab
from flashlab.kernels import plan as _plan
from flashlab.kernels import tiles

DEV, DT, D, H = "cuda", torch.bfloat16, 128, 16
B, N = 8, 2048
GEN = torch.Generator(device=DEV).manual_seed(0)


def _r(*shape):
    return torch.randn(*shape, device=DEV, dtype=DT, generator=GEN)


def dense_bhsd():
    xs = [_r(B, H, N, D).requires_grad_() for _ in range(3)]
    return xs, lambda: flashlab.flash_attention(*xs, is_causal=True)


def dense_bshd():
    xs = [_r(B, N, H, D).transpose(1, 2).requires_grad_() for _ in range(3)]
    return xs, lambda: flashlab.flash_attention(*xs, is_causal=True)


def docs():
    cu = torch.arange(0, B * N + 1, N, device=DEV, dtype=torch.int32)
    xs = [_r(B * N, H, D).requires_grad_() for _ in range(3)]
    return xs, lambda: flashlab.flash_attention_varlen(*xs, cu, cu, N, N, is_causal=True)


def window():
    xs = [_r(1, H, B * N, D).requires_grad_() for _ in range(3)]
    return xs, lambda: flashlab.flash_attention(*xs, is_causal=True, window=(1023, 0))


def timed(label, make, reps=10):
    _plan.forget()
    xs, f = make()
    o = f()
    do = torch.randn_like(o)
    torch.autograd.grad(o, xs, do, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.autograd.grad(o, xs, do, retain_graph=True)
        torch.cuda.synchronize()
    ks = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            ks[e.name[:50]] = ks.get(e.name[:50], 0.0) + e.device_time_total / reps
    whole = 1000 * do_bench(lambda: torch.autograd.grad(o, xs, do, retain_graph=True), warmup=25, rep=100,
                            return_mode="median")
    kern = sum(v for k, v in ks.items() if k.startswith("flash_bwd") and "pre" not in k and "delta" not in k)
    other = sum(ks.values()) - kern
    print(f"{label:34s} whole {whole:7.1f} us   attention kernels {kern:7.1f}   other {other:6.1f}   "
          + "; ".join(f"{k[:28]} {v:.0f}" for k, v in sorted(ks.items(), key=lambda x: -x[1])[:5]), flush=True)
    return dict(label=label, whole_us=whole, kernel_us=kern, other_us=other, kernels=ks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--head-groups", default="")
    a = ap.parse_args()
    rows = [timed("dense causal B8 N2048 (B, H, N, D)", dense_bhsd),
            timed("dense causal, (B, N, H, D) memory", dense_bshd),
            timed("8 packed documents of 2048", docs)]
    for g in [int(x) for x in a.head_groups.split(",") if x]:
        tiles.HEAD_GROUP = g
        rows += [timed(f"documents, head group {g}", docs), timed(f"dense causal, head group {g}", dense_bhsd)]
        tiles.HEAD_GROUP = None
    rows.append(timed("window 1024 (as planned: backward v6)", window))
    planned = _plan.V6_PLANNED
    _plan.V6_PLANNED = planned - {"window"}
    try:
        rows.append(timed("window 1024 (backward v5)", window))
    finally:
        _plan.V6_PLANNED = planned
    json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
