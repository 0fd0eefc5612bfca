"""Time, on one GPU, what one ring attention step runs: the step kernels and the merge.

    python scripts/ring_bench.py                       # table on stdout
    python scripts/ring_bench.py --out flashlab/data/h200_ring.json

For n rows per rank (B, H, H_kv, D as set below), it times:

* forward of a full block (n queries x n keys: a non-causal step, and a contiguous step below the diagonal);
* forward of the diagonal block (causal=True on n x n: every rank's step 0);
* forward of a zigzag step (n x n/2 or n/2 x n, full: every causal zigzag step after the first);
* the LSE merge of one step's partial result into the running (O, LSE): the ring's fused kernel
  (`flashlab.kernels.merge.merge_into`) and the readable element-wise one (`merge_attention`);
* backward of the full block and of the zigzag step (`attention._backward`, with the global O, LSE).

Each is gated on correctness first (the forward against attention in float32 on the same block; the
merge against the whole-block result), SDPA (`F.scaled_dot_product_attention`, its default backend) is
timed on the same forward blocks beside it, and everything is timed with `triton.testing.do_bench(return_mode="median")` after
a warm-up.  From the times it prints the bytes a step sends (K/V, and dK/dV in the backward) and the
bandwidth that would hide the transfer under that step's compute, next to NVLink (~450 GB/s per
direction) and InfiniBand (~50 GB/s); and a one-process ring (`simulate_ring`, all ranks in turn)
against the single-process op, for the record.  GPU only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashlab  # noqa: E402  (first: GPU or interpreter)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from flashlab.attention import _backward, _forward  # noqa: E402
from flashlab.distributed import merge_attention, simulate_ring  # noqa: E402
from flashlab.kernels.merge import merge_into  # noqa: E402
from flashlab.distributed import cost as C  # noqa: E402

NVLINK, IB = C.H200_NODE.nvlink, C.H200_NODE.ib


def sdpa_ref(q, k, v, causal, scale):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -math.inf)
    return torch.softmax(s, -1) @ v.float(), torch.logsumexp(s, -1)


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3   # seconds


def run(n, B, H, H_kv, D, dtype):
    dev = torch.device("cuda")
    scale = 1.0 / math.sqrt(D)
    g = H // H_kv
    q = torch.randn(B, H, n, D, device=dev, dtype=dtype)
    k = torch.randn(B, H_kv, n, D, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    h = n // 2
    rows = {}
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for name, args in (("fwd full", (q, ke, ve, False)), ("fwd diagonal", (q, ke, ve, True)),
                       ("fwd zigzag half", (q, ke[:, :, :h], ve[:, :, :h], False))):
        o, lse = _forward(*args, scale, False)
        ro, rl = sdpa_ref(*(t[:, :2] for t in args[:3]), args[3], scale)    # two heads: S fits in memory
        err = (o[:, :2].float() - ro).abs().max().item()
        if not err <= tol:
            raise SystemExit(f"{name} n={n}: wrong, max error {err:.2e} > {tol}")
        t = bench(lambda: _forward(*args, scale, False))
        fl = 4.0 * B * H * args[0].shape[2] * args[1].shape[2] * D * (0.5 if args[3] else 1.0)
        rows[name] = dict(seconds=t, tflops=fl / t / 1e12)
        # the peer: SDPA on the same block (its public call returns no LSE, which a ring step needs)
        so = F.scaled_dot_product_attention(*args[:3], is_causal=args[3], scale=scale)
        if not (so[:, :2].float() - ro).abs().max().item() <= tol:
            raise SystemExit(f"SDPA {name} n={n}: wrong")
        ts = bench(lambda: F.scaled_dot_product_attention(*args[:3], is_causal=args[3], scale=scale))
        rows[name]["sdpa_seconds"] = ts
    # the merge of one step: (O, LSE) of the first half of the keys with the second half's
    o1, l1 = _forward(q, ke[:, :, :h], ve[:, :, :h], False, scale, False)
    o2, l2 = _forward(q, ke[:, :, h:], ve[:, :, h:], False, scale, False)
    of, lf = _forward(q, ke, ve, False, scale, False)
    acc = o1.float()
    mo, ml = merge_attention(acc, l1, o2, l2)
    err = (mo - of.float()).abs().max().item()
    if not err <= tol:
        raise SystemExit(f"merge n={n}: wrong, max error {err:.2e}")
    moved = acc.numel() * 4 * 2 + o2.numel() * o2.element_size() + 3 * l1.numel() * 4
    t = bench(lambda: merge_attention(acc, l1, o2, l2))
    rows["merge torch"] = dict(seconds=t, gbps=moved / t / 1e9)
    # the ring's own merge: one fused kernel, in place (checked, then timed on a copy of the state)
    fo, fl_ = acc.clone(), l1.clone()
    merge_into(fo, fl_, o2, l2)
    err = (fo - of.float()).abs().max().item()
    if not err <= tol:
        raise SystemExit(f"fused merge n={n}: wrong, max error {err:.2e}")
    t = bench(lambda: merge_into(fo, fl_, o2, l2))
    rows["merge"] = dict(seconds=t, gbps=moved / t / 1e9)
    for name, (qq, kk, vv) in (("bwd full", (q, ke, ve)), ("bwd zigzag half", (q, ke[:, :, :h], ve[:, :, :h]))):
        o, lse = _forward(qq, kk, vv, False, scale, False)
        t = bench(lambda: _backward(qq, kk, vv, o, lse, do, False, scale, False))
        fl = 2.5 * 4.0 * B * H * qq.shape[2] * kk.shape[2] * D
        rows[name] = dict(seconds=t, tflops=fl / t / 1e12)
    e = q.element_size()
    kv_bytes = 2 * B * H_kv * n * D * e
    dkv_bytes = 2 * B * H_kv * n * D * 4          # the float32 accumulators travel in the backward
    rows["bytes"] = dict(kv=kv_bytes, kv_and_dkv=kv_bytes + dkv_bytes)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--H_kv", type=int, default=8)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ring_bench.py times GPU kernels: run it on a CUDA machine")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    torch.manual_seed(0)

    # a one-process ring against the op, for the record (correctness, not speed)
    qs = torch.randn(1, 8, 4096, 128, device="cuda", dtype=dtype)
    ks, vs = (torch.randn(1, 2, 4096, 128, device="cuda", dtype=dtype) for _ in range(2))
    check = {}
    for layout in ("zigzag", "contiguous"):
        o, lse = simulate_ring(qs, ks, vs, 4, True, layout=layout)
        ro = F.scaled_dot_product_attention(qs, ks.repeat_interleave(4, 1), vs.repeat_interleave(4, 1), is_causal=True)
        check[layout] = (o.float() - ro.float()).abs().max().item()

    results = {}
    hdr = (f"{'n':>6} {'fwd full':>10} {'fwd diag':>10} {'fwd zz':>10} {'merge':>9} {'(torch)':>9} {'bwd full':>10} "
           f"{'bwd zz':>10} | {'hide fwd zz GB/s':>16} {'hide bwd zz GB/s':>16} | {'SDPA full':>10} "
           f"{'SDPA diag':>10} {'SDPA zz':>10}")
    lines = [hdr]
    for n in a.ns:
        r = run(n, a.B, a.H, a.H_kv, a.D, dtype)
        results[n] = r
        us = {k: r[k]["seconds"] * 1e6 for k in r if "seconds" in r[k]}
        need_f = r["bytes"]["kv"] / r["fwd zigzag half"]["seconds"] / 1e9
        need_b = r["bytes"]["kv_and_dkv"] / r["bwd zigzag half"]["seconds"] / 1e9
        lines.append(f"{n:>6} {us['fwd full']:>8.1f}us {us['fwd diagonal']:>8.1f}us {us['fwd zigzag half']:>8.1f}us "
                     f"{us['merge']:>7.1f}us {us['merge torch']:>7.1f}us {us['bwd full']:>8.1f}us {us['bwd zigzag half']:>8.1f}us | "
                     f"{need_f:>16.0f} {need_b:>16.0f} | "
                     + " ".join(f"{r[k]['sdpa_seconds'] * 1e6:>8.1f}us" for k in ("fwd full", "fwd diagonal",
                                                                               "fwd zigzag half")))
        r["hide_gbps"] = dict(fwd_zigzag=need_f, bwd_zigzag=need_b)
    rec = dict(machine=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                            python=platform.python_version()),
               date=datetime.date.today().isoformat(), command=" ".join(sys.argv),
               shape=dict(B=a.B, H=a.H, H_kv=a.H_kv, D=a.D, dtype=a.dtype),
               simulate_ring_max_err_vs_sdpa=check, steps={str(k): v for k, v in results.items()},
               links_gbps=dict(nvlink=NVLINK / 1e9, infiniband=IB / 1e9))
    if a.out:
        a.out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"B={a.B} H={a.H} H_kv={a.H_kv} D={a.D} {a.dtype}")
    print(f"one-process ring (4 ranks, causal) vs SDPA, max |error|: {check}")
    print(f"'hide' = K/V bytes (backward: + float32 dK/dV) of one step / that step's time: the link bandwidth "
          f"that hides the transfer (NVLink ~{NVLINK / 1e9:.0f}, InfiniBand ~{IB / 1e9:.0f} GB/s)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
