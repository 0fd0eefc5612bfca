"""Backward v6's kernel alone (torch.profiler, 20 calls) at the variants' backward shapes, after a float32 check of
each kind of call; for comparing checkouts of the kernels, one process each (H100 / H200, bf16, D 128):

    PYTHONPATH=CHECKOUT python scripts/bwd_kernel_times.py TAG OUT.json [--whole]

Every backward is forced into v6 (the plan runs them all there now; a window's ran in v5 before).  The calls: dense
causal B 8 x 2048, dense non-causal B 4 x 4096, 8 packed documents of 2048 (causal), a window of 1024 (B 1 x 16384,
causal), GQA 32 / 8 causal B 2 x 8192; H 16 but GQA's.  The checks (gradients against float32 attention, relative to
the largest entry, < 2e-2): windows (300, 0) causal, (200, 77) Nq < Nk, (-1, 130) MQA, (100, 4) with rows that see no
key, (1023, 0) causal; GQA causal; non-causal Nq < Nk.  --whole: also the whole backward call (do_bench, median);
--all-kernels: every kernel of each call (the JSON always holds them), to see where the time outside the kernel goes.
"""
import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import flashlab
from flashlab.kernels import plan as P

DEV, DT = "cuda", torch.bfloat16
GEN = torch.Generator(device=DEV).manual_seed(0)


def _r(*shape):
    return torch.randn(*shape, device=DEV, dtype=DT, generator=GEN)


def _reference(q, k, v, causal, window):
    """float32 attention, K / V heads repeated for GQA; window bounds (left, right), None for none."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    i = torch.arange(q.shape[2], device=DEV)[:, None]
    j = torch.arange(k.shape[2], device=DEV)[None]
    ok = torch.ones_like(s[0, 0], dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window:
        ok &= (j >= i - window[0]) & (j <= i + window[1])
    return torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0) @ v


CHECKS = [(1, 2, 2, 2100, 2100, True, (300, 0)), (1, 2, 2, 1500, 2300, False, (200, 77)),
          (1, 2, 1, 1300, 1250, False, (-1, 130)), (1, 2, 2, 2300, 1100, False, (100, 4)),
          (2, 4, 2, 1900, 1900, True, None), (2, 2, 2, 1000, 1300, False, None), (1, 4, 4, 4096, 4096, True, (1023, 0))]


def check(tag):
    for B, H, Hk, Nq, Nk, causal, window in CHECKS:
        q, k, v = (_r(B, h, n, 128).requires_grad_() for h, n in ((H, Nq), (Hk, Nk), (Hk, Nk)))
        kw = dict(is_causal=causal, enable_gqa=H != Hk, **({"window": window} if window else {}))
        o = flashlab.flash_attention(q, k, v, **kw)
        do = torch.randn_like(o)
        got = torch.autograd.grad(o, (q, k, v), do)
        xf = [t.detach().float().requires_grad_() for t in (q, k, v)]
        w = None if window is None else tuple(10 ** 9 if x < 0 else x for x in window)
        want = torch.autograd.grad(_reference(*xf, causal, w), xf, do.float())
        errs = [((a.float() - b).abs().max() / (b.abs().max() + 1e-6)).item() for a, b in zip(got, want)]
        print(f"{tag} check B{B} H{H}/{Hk} {Nq}x{Nk} causal={causal} window={window}: dq dk dv "
              + " ".join(f"{e:.1e}" for e in errs), flush=True)
        assert max(errs) < 2e-2, "the backward disagrees with float32 attention: fix before timing"


def calls():
    def dense(B, N, causal):
        xs = [_r(B, 16, N, 128).requires_grad_() for _ in range(3)]
        return xs, lambda: flashlab.flash_attention(*xs, is_causal=causal)

    def docs():
        cu = torch.arange(0, 16384 + 1, 2048, device=DEV, dtype=torch.int32)
        xs = [_r(16384, 16, 128).requires_grad_() for _ in range(3)]
        return xs, lambda: flashlab.flash_attention_varlen(*xs, cu, cu, 2048, 2048, is_causal=True)

    def window():
        xs = [_r(1, 16, 16384, 128).requires_grad_() for _ in range(3)]
        return xs, lambda: flashlab.flash_attention(*xs, is_causal=True, window=(1023, 0))

    def gqa():
        xs = [_r(2, 32, 8192, 128).requires_grad_()] + [_r(2, 8, 8192, 128).requires_grad_() for _ in range(2)]
        return xs, lambda: flashlab.flash_attention(*xs, is_causal=True, enable_gqa=True)

    return {"dense causal 8x2048": lambda: dense(8, 2048, True), "dense 4x4096": lambda: dense(4, 4096, False),
            "docs 8x2048": docs, "window 1024": window, "gqa 32/8 causal": gqa}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tag")
    ap.add_argument("out")
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--all-kernels", action="store_true",
                    help="print every kernel of each call, not only the backward's")
    a = ap.parse_args()
    plan = P.plan
    P.plan = lambda *args, **kw: plan(*args, **dict(kw, backward_version="v6"))
    check(a.tag)
    res = {}
    for name, make in calls().items():
        P.forget()
        xs, f = make()
        o = f()
        do = torch.randn_like(o)
        for _ in range(3):
            torch.autograd.grad(o, xs, do, retain_graph=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                torch.autograd.grad(o, xs, do, retain_graph=True)
            torch.cuda.synchronize()
        every = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                every[e.name] = every.get(e.name, 0.0) + e.device_time_total / 20
        kern = sum(t for n, t in every.items() if n.startswith("flash_bwd_kernel"))
        res[name] = {"kernel_us": kern, "every_kernel_us": every}
        line = f"{a.tag} {name:22s} bwd kernel {kern:8.1f} us"
        if a.whole:
            res[name]["whole_us"] = 1000 * do_bench(lambda: torch.autograd.grad(o, xs, do, retain_graph=True),
                                                    warmup=25, rep=100, return_mode="median")
            line += f"   whole call {res[name]['whole_us']:8.1f} us"
        print(line, flush=True)
        if a.all_kernels:
            for n, t in sorted(every.items(), key=lambda x: -x[1]):
                print(f"{a.tag}     {t:8.1f} us  {n[:110]}", flush=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
