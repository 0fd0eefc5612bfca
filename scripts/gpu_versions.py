"""Check, then time, every kernel version on a GPU; prints a table last.

    python scripts/gpu_versions.py [--out DIR] [--seqlens 1024 4096 16384] [--dtypes fp16] [--versions v2 v3] [--passes fwd bwd]

1. Correctness: each version (forward vN with backward vN; backward v4 with forward v3) on fresh random data,
   ragged Nq != Nk, causal both ways, large logits, fp16 and bf16, judged by
   flashlab.accuracy's rule against float64 (autotuned path where it applies).
2. Timing: the protocol's shapes (B = 16384 / N, H = 2048 / D), each version checked on
   one head against a float32 reference before it is timed (autotuning runs in the
   warm-up), kernel launches timed with do_bench's median.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashlab  # noqa: E402,F401
from flashlab import kernels  # noqa: E402
from flashlab.accuracy import check_attention  # noqa: E402
from flashlab.bench import flops  # noqa: E402
from flashlab.reference import attention_naive_torch  # noqa: E402
from tests.test_kernels import _op  # noqa: E402

DT = {"fp16": torch.float16, "bf16": torch.bfloat16}


def correctness(log, versions):
    bad = 0
    for dt in (torch.float16, torch.bfloat16):
        for D in (64, 128):
            for causal in (False, True):
                for (Nq, Nk, mag) in ((1531, 1531, 1.0), (1000, 1777, 1.0), (1100, 1100, 6.0)):
                    q = (mag * torch.randn(2, 3, Nq, D, device="cuda")).to(dt)
                    k = (mag * torch.randn(2, 3, Nk, D, device="cuda")).to(dt)
                    v = torch.randn(2, 3, Nk, D, device="cuda").to(dt)
                    for bv in versions:
                        fv = bv if bv in kernels.FORWARD_VERSIONS else "v3"   # backward v4 pairs with forward v3
                        checks = check_attention(_op(fv, bv), q, k, v, causal)
                        ok = all(c.ok for c in checks)
                        bad += not ok
                        line = (f"{'ok ' if ok else 'BAD'} {fv}/{bv} {str(dt)[6:]} D={D} causal={causal} "
                                f"Nq={Nq} Nk={Nk} mag={mag}: " + "; ".join(str(c) for c in checks))
                        log.write(line + "\n")
                        if not ok:
                            print(line, flush=True)
    return bad


def time_versions(seqlens, dtypes, log, versions, passes=("fwd", "bwd")):
    rows = []
    for dname in dtypes:
        dt = DT[dname]
        for D in (64, 128):
            for causal in (False, True):
                for N in seqlens:
                    B, H = 16384 // N, 2048 // D
                    g = torch.Generator(device="cuda").manual_seed(N + D)
                    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dt, generator=g) for _ in range(4))
                    s = 1 / math.sqrt(D)
                    qr, kr, vr = (t[:1, :1].float().requires_grad_() for t in (q, k, v))
                    o_ref, _ = attention_naive_torch(qr, kr, vr, causal)
                    o_ref.backward(do[:1, :1].float())
                    refs = (o_ref.detach(), qr.grad, kr.grad, vr.grad)
                    o = torch.empty_like(q)
                    lse = torch.empty(B, H, N, device="cuda")
                    for fv in (v for v in versions if "fwd" in passes and v in kernels.FORWARD_VERSIONS):
                        f = lambda: kernels.launch_forward(q, k, v, o, lse, causal, s, version=fv)  # noqa: E731
                        t0 = time.time()
                        f()
                        tune_s = time.time() - t0
                        err = (o[:1, :1].float() - refs[0]).abs().max().item()
                        ms = do_bench(f, return_mode="median") if err < 2e-2 * (4 if dt == torch.bfloat16 else 1) else math.nan
                        rows.append(dict(pass_="fwd", version=fv, dtype=dname, D=D, causal=causal, N=N, ms=ms,
                                         tflops=flops(B, H, N, N, D, causal) / ms / 1e9, err=err, tune_s=tune_s))
                        log.write(json.dumps(rows[-1]) + "\n")
                    kernels.launch_forward(q, k, v, o, lse, causal, s, version="v1")
                    grads = [torch.empty_like(t) for t in (q, k, v)]
                    for bv in (v for v in versions if "bwd" in passes and v in kernels.BACKWARD_VERSIONS):
                        f = lambda: kernels.launch_backward(q, k, v, o, lse, do, *grads, causal, s, version=bv)  # noqa: E731
                        t0 = time.time()
                        f()
                        tune_s = time.time() - t0
                        err = max((g_[:1, :1].float() - r).abs().max().item() / max(1.0, r.abs().max().item())
                                  for g_, r in zip(grads, refs[1:]))
                        ms = do_bench(f, return_mode="median") if err < 5e-2 else math.nan
                        rows.append(dict(pass_="bwd", version=bv, dtype=dname, D=D, causal=causal, N=N, ms=ms,
                                         tflops=flops(B, H, N, N, D, causal, "bwd") / ms / 1e9, err=err,
                                         tune_s=tune_s))
                        log.write(json.dumps(rows[-1]) + "\n")
                    log.flush()
                    del q, k, v, do, o, lse, grads
                    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--dtypes", nargs="+", default=["fp16"])
    ap.add_argument("--versions", nargs="+", default=list(kernels.BACKWARD_VERSIONS))
    ap.add_argument("--passes", nargs="+", default=["fwd", "bwd"])
    ap.add_argument("--skip-check", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "versions_log.txt"), "w") as log:
        t0 = time.time()
        bad = 0 if a.skip_check else correctness(log, a.versions)
        print(f"correctness: {bad} failures ({time.time() - t0:.0f} s)", flush=True)
        rows = time_versions(a.seqlens, a.dtypes, log, a.versions, a.passes)
    for k_, v_ in kernels._TUNED.items():
        best = getattr(v_, "cache", {})
        for key, cfg in best.items():
            print("autotuned", k_[0], k_[1], key[:4], cfg, flush=True)
    print(f"{'pass':<5}{'dtype':<6}{'D':>4} {'causal':<7}{'N':>6}  " + "  ".join(f"{v:>11}" for v in a.versions))
    for p in a.passes:
        for dname in a.dtypes:
            for D in (64, 128):
                for causal in (False, True):
                    for N in a.seqlens:
                        sel = {r["version"]: r for r in rows if r["pass_"] == p and r["dtype"] == dname and r["D"] == D
                               and r["causal"] == causal and r["N"] == N}
                        cells = [f"{sel[v]['tflops']:>7.1f} TF" if v in sel else f"{'-':>11}" for v in a.versions]
                        print(f"{p:<5}{dname:<6}{D:>4} {str(causal):<7}{N:>6}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
