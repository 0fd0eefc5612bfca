"""Ring attention on several GPUs (NCCL) or CPU processes (gloo): exact, overlapped, and how it scales.

    torchrun --nproc-per-node 8 scripts/ring_scaling.py --out flashlab/data/h200_ring_scaling.json
    python scripts/ring_scaling.py --spawn 8 --out flashlab/data/h200_ring_scaling.json   # the same, own processes
    python scripts/ring_scaling.py --cpu --spawn 2 --out /tmp/ring.json                   # gloo, tiny sizes (tests)

NVLink multicast stays off: the script sets NCCL_NVLS_ENABLE=0 (and TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1) before any process group exists.  Rank r uses cuda:r (torchrun: LOCAL_RANK).
flashlab's autotuner is off (FLASHLAB_AUTOTUNE=0: the hand-picked tiles at every size, the same
kernels in every ratio's numerator and denominator) unless ``--autotune``: tuning runs each candidate
config several times per new length bucket, which at 512k rows on one GPU costs minutes.

Sections (``--sections``, default all three), each on the W ranks of the run:

1. correctness: forward and backward of ``ring_attention`` on W ranks, both layouts (zigzag,
   contiguous), causal and not, bf16 and fp16 (``--dtypes``), GQA (H_kv < H); rank 0 gathers O, LSE,
   dQ, dK, dV and judges each by ``flashlab.accuracy``'s rule against float64 attention on the whole
   sequence on one device (PyTorch's naive attention in the same dtype is the peer), and records the
   largest difference from the single-device op ``flash_attention`` on the whole sequence.  Prints
   PASS/FAIL per case.  Expected on H200s: ~30 s (8 cases at N 4096, most of it compiling).
2. overlap: one fwd+bwd at ``--overlap-n`` rows per rank on all W ranks with the per-step timeline of
   ``flashlab.distributed.timeline`` (CUDA events: compute, and the exposed wait = the part of the
   transfer that compute did not hide) and, on GPUs, ``torch.profiler``'s kernel trace (the compute
   kernels and NCCL's SendRecv kernels on their own stream: the next K/V block in flight during
   compute; overlap_fraction = the share of transfer time under a compute kernel); and the bytes/s
   of the P2P step alone (a K/V block passed around the ring, no compute).  ~15 s.
3. scaling, fwd+bwd, causal, D 128, bf16 (``--scaling-dtype``): weak (``--tokens-per-gpu``, default
   16k and 64k) and strong (``--total``, default 128k and 512k) on w = 1, 2, 4, .., W GPUs (ranks
   0..w-1, a subgroup; the others wait), ring zigzag and ring contiguous (w = 1: one tile, the
   layouts are the same run), and PyTorch's context parallelism
   (``torch.distributed.tensor.experimental.context_parallel`` around SDPA, gated on its output
   first; 'not run: <reason>' where it does not run).  The throughput is attention FLOPs (causal:
   half of 4·B·H·N²·D, times 3.5 for fwd+bwd) per second of the slowest rank (median of ``--reps``);
   ratio = throughput(w) / (w · throughput(1)) of the same provider.  Target: ring zigzag, causal,
   64k tokens per GPU, ratio >= 0.85 at the largest w.

Time budget on 8 H200s with the defaults (B 1, H 8, H_kv 8, D 128; 1 warm-up + 3 timed reps; assumed
~150 TFLOP/s fwd+bwd per GPU, not measured): correctness ~30 s, overlap ~15 s, scaling ~5.5 min
(weak 16k ~3 s, weak 64k ~45 s, strong 128k ~17 s, strong 512k ~4.5 min of which the one-GPU 512k
baseline is ~1 min for the ring and as much for context parallelism): ~6.5 minutes in all, under
10.  Shorter: ``--no-cp`` (~-2 min), ``--total 131072`` (~-4 min), ``--reps 2``.  ``--plan W``
prints this estimate for any sizes and W without running anything.  Each section's wall seconds go
into the record.

The record (``--out``; notebook 09 and ``flashlab.distributed.figures`` read it), schema
"flashlab.ring_scaling/1" (``validate(record)`` checks it; ``null`` where a value was not measured):

    schema      "flashlab.ring_scaling/1"
    date, command (str); world (int: W); cpu (bool: gloo processes, tiny sizes)
    machine     {gpu (str|null), gpus (int), torch, triton, python (str), backend ("nccl"|"gloo"),
                 nccl (str|null), autotune (bool: flashlab's kernels autotuned), env {NCCL_NVLS_ENABLE,
                 TORCH_SYMM_MEM_DISABLE_MULTICAST, NVSHMEM_DISABLE_NVLS, FLASHLAB_AUTOTUNE: str|null}}
    seconds     {section name: wall seconds, ..., "total"}
    correctness {shape {B, H, H_kv, N, D}, world, all_ok (bool), cases: [{layout, causal (bool),
                 dtype, ok (bool), max_diff_vs_op (float), checks: [{name, err, torch_err, bound,
                 ok}]}]}                                   or {not_run: str}
    overlap     {shape {B, H, H_kv, n, D, dtype, causal}, world,
                 steps: [{rank, phase ("fwd"|"bwd"), step, start_ms, compute_end_ms, end_ms,
                          compute_ms, exposed_ms}],      (each rank's times from its first mark)
                 kernels: {source (str), ranks: {"r": [{kind ("compute"|"transfer"), name,
                          start_us, dur_us}]}} (ranks 0-3, 2000 kernels each) or {not_run: str},
                 overlap_fraction (float|null), exposed_fraction (float: sum exposed / sum step time),
                 p2p {bytes (int: sent by each rank in one step; it receives as many), seconds,
                      gbps (bytes / seconds: per direction, per GPU)},
                 in_ring_gbps (float|null: K/V bytes / mean NCCL kernel time in the forward)}
                                                           or {not_run: str}
    scaling     {shape {B, H, H_kv, D, dtype, causal}, worlds [int], reps (int),
                 rows: [{kind ("weak"|"strong"), size (tokens per GPU | total), N, world, provider
                         ("ring zigzag"|"ring contiguous"|"torch context_parallel"), seconds,
                         tflops, ratio (float|null), not_run (str|null)}],
                 target {kind, size, provider, world, ratio_min, ratio (float|null), met (bool|null)}}
                                                           or {not_run: str}
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

MULTICAST_OFF = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))


def _multicast_off():
    """NVLink multicast off, before any process group exists (NCCL reads these when it starts)."""
    for k, v in MULTICAST_OFF:
        os.environ[k] = v


if __name__ in ("__main__", "__mp_main__"):       # run as the script (or its spawned ranks), not imported
    _multicast_off()
    if "--cpu" in sys.argv[1:]:
        os.environ.setdefault("TRITON_INTERPRET", "1")     # before flashlab (and triton) is imported
    if "--autotune" not in sys.argv[1:]:
        os.environ["FLASHLAB_AUTOTUNE"] = "0"              # hand-picked tiles at every size (see --autotune)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashlab  # noqa: E402  (first: GPU or interpreter)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SCHEMA = "flashlab.ring_scaling/1"
PROVIDERS = ("ring zigzag", "ring contiguous", "torch context_parallel")
ENV_KEYS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "FLASHLAB_AUTOTUNE")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TARGET = 0.85
KEEP_TRACES = 4            # ranks whose kernel trace goes into the record (it is package data: kept small)


# ----------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------

def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="gloo CPU processes, the interpreter, tiny sizes")
    ap.add_argument("--spawn", type=int, default=None, help="start W processes here (not under torchrun)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    ap.add_argument("--sections", default="correctness,overlap,scaling")
    ap.add_argument("--dtypes", default="bf16,fp16", help="correctness dtypes")
    ap.add_argument("--layouts", default="zigzag,contiguous", help="correctness layouts")
    ap.add_argument("--check", type=int, nargs=5, metavar=("B", "H", "H_kv", "N", "D"), default=None,
                    help="correctness shape (default 1 4 2 4096 128; --cpu 1 2 1 32 16)")
    ap.add_argument("--overlap-n", type=int, default=None, help="rows per rank (default 16384; --cpu 16)")
    ap.add_argument("--p2p-reps", type=int, default=None)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=None, help="scaling/overlap heads (default 8; --cpu 2)")
    ap.add_argument("--H-kv", type=int, default=None, help="K/V heads (default = H)")
    ap.add_argument("--D", type=int, default=None, help="head dim (default 128; --cpu 16)")
    ap.add_argument("--scaling-dtype", default=None, choices=sorted(DTYPES), help="default bf16")
    ap.add_argument("--tokens-per-gpu", type=int, nargs="*", default=None, help="weak (default 16384 65536)")
    ap.add_argument("--total", type=int, nargs="*", default=None, help="strong (default 131072 524288)")
    ap.add_argument("--worlds", type=int, nargs="*", default=None, help="default 1, 2, 4, .., W")
    ap.add_argument("--reps", type=int, default=None, help="timed reps (default 3; --cpu 1)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 1; --cpu 0)")
    ap.add_argument("--no-cp", action="store_true", help="skip torch's context_parallel")
    ap.add_argument("--autotune", action="store_true",
                    help="let flashlab's kernels autotune (off by default: tuning each new length bucket runs "
                         "every candidate config several times, minutes at 512k on one GPU)")
    ap.add_argument("--timeout", type=float, default=None, help="--spawn: seconds before every rank is stopped")
    ap.add_argument("--plan", type=int, default=None, metavar="W",
                    help="print the scaling runs for W GPUs and their estimated seconds, run nothing")
    ap.add_argument("--assume-tflops", type=float, default=150.0,
                    help="--plan: fwd+bwd TFLOP/s per GPU assumed for the estimate (an assumption, not a measurement)")
    a = ap.parse_args(argv)
    cpu = a.cpu
    pick = lambda x, gpu, c: x if x is not None else (c if cpu else gpu)  # noqa: E731
    a.check = pick(a.check, [1, 4, 2, 4096, 128], [1, 2, 1, 32, 16])
    a.overlap_n = pick(a.overlap_n, 16384, 16)
    a.p2p_reps = pick(a.p2p_reps, 20, 2)
    a.H = pick(a.H, 8, 2)
    a.H_kv = a.H if a.H_kv is None else a.H_kv
    a.D = pick(a.D, 128, 16)
    a.scaling_dtype = pick(a.scaling_dtype, "bf16", "bf16")
    a.tokens_per_gpu = pick(a.tokens_per_gpu, [16384, 65536], [16])
    a.total = pick(a.total, [131072, 524288], [32])
    a.reps = pick(a.reps, 3, 1)
    a.warmup = pick(a.warmup, 1, 0)
    a.timeout = pick(a.timeout, 900.0, 300.0)
    a.sections = [s for s in a.sections.split(",") if s]
    bad = set(a.sections) - {"correctness", "overlap", "scaling"}
    if bad:
        ap.error(f"--sections: unknown {sorted(bad)}; use correctness, overlap, scaling")
    a.dtypes = a.dtypes.split(",")
    a.layouts = a.layouts.split(",")
    if not set(a.dtypes) <= set(DTYPES):
        ap.error(f"--dtypes: use bf16 and/or fp16, got {a.dtypes}")
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return a


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------

def _device(a):
    if not a.cpu and torch.cuda.is_available() and flashlab.device.GPU:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _randn(shape, seed, dev, dtype):
    """Normal numbers made on ``dev`` (a 512k-row tensor drawn on the host would take seconds); the
    same seed gives the same tensor on every rank (every GPU of one kind)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=dev).to(dtype)


def attention_flops(B, H, N, D, causal=True, passes=3.5):
    """Attention FLOPs of fwd (1) + bwd (2.5): 4·B·H·N²·D, half of it when causal."""
    return passes * 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)


def _reference(Q, K, V, dO, causal, dtype):
    """(o, lse, dq, dk, dv) of naive attention in ``dtype`` on the whole sequence (GQA by expansion)."""
    from flashlab.reference import attention_naive_torch
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (Q, K, V))
    g = q.shape[1] // k.shape[1]
    o, lse = attention_naive_torch(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), causal, None)
    o.backward(dO.to(dtype))
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def _max_over(x, group, dev):
    t = torch.tensor([float(x)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


# ----------------------------------------------------------------------------
# 1. correctness
# ----------------------------------------------------------------------------

def section_correctness(rank, world, a, dev):
    from flashlab.accuracy import judge
    from flashlab.distributed import all_gather_sequence, ring_attention, shard
    B, H, H_kv, N, D = a.check
    if N % (2 * world):
        raise ValueError(f"--check: N = {N} must be divisible by 2·W = {2 * world} (the zigzag's 2W chunks)")
    cases = []
    seed = 100
    for dname in a.dtypes:
        dtype = DTYPES[dname]
        for layout in a.layouts:
            for causal in (False, True):
                seed += 1
                Q, dO = (_randn((B, H, N, D), seed * 10 + i, dev, torch.float32) for i in (0, 1))
                K, V = (_randn((B, H_kv, N, D), seed * 10 + i, dev, torch.float32) for i in (2, 3))
                Qc, Kc, Vc, dOc = (t.to(dtype) for t in (Q, K, V, dO))
                q, k, v = (shard(t, rank, world, layout).requires_grad_() for t in (Qc, Kc, Vc))
                o, lse = ring_attention(q, k, v, is_causal=causal, layout=layout, return_lse=True)
                o.backward(shard(dOc, rank, world, layout))
                got = [all_gather_sequence(t, layout) for t in (o.detach(), lse[..., None], q.grad, k.grad, v.grad)]
                got[1] = got[1][..., 0]
                if rank == 0:
                    # the inputs as the ring saw them (rounded to dtype), in float64 and in dtype
                    ref = _reference(Qc, Kc, Vc, dOc, causal, torch.float64)
                    same = _reference(Qc, Kc, Vc, dOc, causal, dtype)
                    lse_max = ref[1].abs().max().item()
                    checks = []
                    for i, name in enumerate(("o", "lse", "dq", "dk", "dv")):
                        dt = torch.float32 if name == "lse" else dtype
                        c = judge(name, got[i], same[i], ref[i], dt, lse_max if i >= 2 else 0.0)
                        checks.append(dict(name=c.name, err=c.err, torch_err=c.torch_err, bound=c.bound, ok=c.ok))
                    # the single-device op on the whole sequence
                    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (Qc, Kc, Vc))
                    g = H // H_kv
                    oo = flashlab.flash_attention(qq, kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1), causal)
                    oo.backward(dOc)
                    diff = max(float((x.float() - y.float()).abs().max()) for x, y in
                               zip((got[0], got[2], got[3], got[4]), (oo.detach(), qq.grad, kk.grad, vv.grad)))
                    ok = all(c["ok"] for c in checks)
                    cases.append(dict(layout=layout, causal=causal, dtype=dname, ok=ok, max_diff_vs_op=diff,
                                      checks=checks))
                    worst = max(checks, key=lambda c: c["err"] / c["bound"] if c["bound"] else math.inf)
                    print(f"[correctness] {'PASS' if ok else 'FAIL'}  W={world} {layout:>10} "
                          f"{'causal' if causal else 'full':>6} {dname}: worst {worst['name']} err "
                          f"{worst['err']:.2e} <= bound {worst['bound']:.2e}? {worst['ok']}; "
                          f"max |ring - op| {diff:.2e}", flush=True)
                dist.barrier()
    if rank != 0:
        return None
    return dict(shape=dict(B=B, H=H, H_kv=H_kv, N=N, D=D), world=world, all_ok=all(c["ok"] for c in cases),
                cases=cases)


# ----------------------------------------------------------------------------
# 2. overlap
# ----------------------------------------------------------------------------

def _p2p_gbps(rank, world, shape, dtype, dev, reps):
    """Bytes/s of one ring step's transfer alone: each rank sends a K/V block to rank+1 and receives
    one from rank-1 (the ring's own ``pass_on``), timed over ``reps`` steps."""
    from flashlab.distributed.ring import _Ring, _wait
    ring = _Ring(None)
    kv = [torch.randn(shape, device=dev).to(dtype) for _ in range(2)]
    nbytes = sum(t.numel() * t.element_size() for t in kv)
    for _ in range(2):                                   # warm-up: NCCL connects on first use
        _, reqs = ring.pass_on(kv)
        _wait(reqs)
    _sync(dev)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        kv, reqs = ring.pass_on(kv)
        _wait(reqs)
    _sync(dev)
    sec = _max_over((time.perf_counter() - t0) / reps, None, dev)
    return dict(bytes=nbytes, seconds=sec, gbps=nbytes / sec / 1e9)


def kernel_intervals(trace: dict, limit: int = 2000) -> list:
    """GPU kernels of a chrome trace (``torch.profiler``'s export) as [{kind, name, start_us, dur_us}]
    from the first kernel on; NCCL's kernels are the transfer, every other kernel compute."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not ev:
        return []
    t0 = min(float(e["ts"]) for e in ev)
    out = [dict(kind="transfer" if "nccl" in e.get("name", "").lower() else "compute", name=e.get("name", "")[:40],
                start_us=float(e["ts"]) - t0, dur_us=float(e["dur"])) for e in ev]
    out.sort(key=lambda x: x["start_us"])
    return out[:limit]


def overlap_fraction(intervals: list):
    """Share of transfer time during which some compute kernel runs (None without transfers)."""
    comp = sorted((i["start_us"], i["start_us"] + i["dur_us"]) for i in intervals if i["kind"] == "compute")
    merged = []
    for s, e in comp:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    total = hidden = 0.0
    for i in intervals:
        if i["kind"] != "transfer":
            continue
        s, e = i["start_us"], i["start_us"] + i["dur_us"]
        total += e - s
        hidden += sum(max(0.0, min(e, me) - max(s, ms)) for ms, me in merged)
    return hidden / total if total > 0 else None


def section_overlap(rank, world, a, dev):
    from flashlab.distributed import ring_attention
    from flashlab.distributed.timeline import Timeline, recording
    dtype = DTYPES[a.scaling_dtype]
    n, B, H, H_kv, D = a.overlap_n, a.B, a.H, a.H_kv, a.D
    q = _randn((B, H, n, D), 7 + rank, dev, dtype).requires_grad_()
    k, v = (_randn((B, H_kv, n, D), 17 + 2 * rank + i, dev, dtype).requires_grad_() for i in (0, 1))
    do = _randn((B, H, n, D), 27 + rank, dev, dtype)

    def step():
        ring_attention(q, k, v, is_causal=True, layout="zigzag").backward(do)

    step()                                              # warm-up: kernels compiled, NCCL connected
    _sync(dev)
    dist.barrier()
    tl = Timeline(dev)
    with recording(tl):
        step()
    steps = [dict(r, rank=rank) for r in tl.steps()]
    kernels, frac, in_ring = None, None, None
    if dev.type == "cuda":
        try:
            import tempfile
            from torch.profiler import ProfilerActivity, profile
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                _sync(dev)
            with tempfile.TemporaryDirectory() as d:
                p = os.path.join(d, "trace.json")
                prof.export_chrome_trace(p)
                with open(p) as f:
                    iv = kernel_intervals(json.load(f))
            kernels = iv
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            kernels = f"not run: {type(e).__name__}: {e}"[:300]
    else:
        kernels = "not run: no GPU (gloo on CPUs: the transfer has no device kernels; see steps' exposed_ms)"
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(steps=steps, kernels=kernels))
    kv_bytes = 2 * B * H_kv * n * D * torch.tensor([], dtype=dtype).element_size()
    p2p = _p2p_gbps(rank, world, (B, H_kv, n, D), dtype, dev, a.p2p_reps) if world > 1 else None
    if rank != 0:
        return None
    all_steps = [s for g in gathered for s in g["steps"]]
    if isinstance(gathered[0]["kernels"], list):
        ranks = {str(r): g["kernels"] for r, g in enumerate(gathered) if isinstance(g["kernels"], list)}
        # the fraction over every rank; the record keeps the trace of the first KEEP_TRACES ranks
        kern = dict(source="torch.profiler (CUDA kernels; NCCL kernels = transfer)",
                    ranks={r: iv for r, iv in ranks.items() if int(r) < KEEP_TRACES})
        fr = [overlap_fraction(iv) for iv in ranks.values()]
        fr = [x for x in fr if x is not None]
        frac = sum(fr) / len(fr) if fr else None
        nccl = [i["dur_us"] for i in ranks["0"] if i["kind"] == "transfer"]
        # the forward's W-1 K/V transfers come first; the backward's carry K/V or float32 dK/dV
        fwd = nccl[:world - 1]
        in_ring = kv_bytes / (sum(fwd) / len(fwd) * 1e-6) / 1e9 if fwd else None
    else:
        kern = dict(not_run=str(gathered[0]["kernels"])[9:].strip() or "no kernels")
    busy = sum(s["end_ms"] - s["start_ms"] for s in all_steps)
    exposed = sum(s["exposed_ms"] for s in all_steps)
    if p2p is None:
        p2p = dict(bytes=kv_bytes, seconds=None, gbps=None)
    return dict(shape=dict(B=B, H=H, H_kv=H_kv, n=n, D=D, dtype=a.scaling_dtype, causal=True), world=world,
                steps=all_steps, kernels=kern, overlap_fraction=frac,
                exposed_fraction=exposed / busy if busy > 0 else 0.0, p2p=p2p, in_ring_gbps=in_ring)


# ----------------------------------------------------------------------------
# 3. scaling
# ----------------------------------------------------------------------------

def _time(fn, dev, group, warmup, reps):
    """Median over reps of the slowest member's seconds for fn() (members of ``group`` only)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(_max_over(time.perf_counter() - t0, group, dev))
    return statistics.median(times)


def _ring_runner(r, w, N, a, dev, dtype, layout, group):
    from flashlab.distributed import ring_attention
    n = N // w
    B, H, H_kv, D = a.B, a.H, a.H_kv, a.D
    q = _randn((B, H, n, D), 1000 + r, dev, dtype).requires_grad_()
    k, v = (_randn((B, H_kv, n, D), 2000 + 2 * r + i, dev, dtype).requires_grad_() for i in (0, 1))
    do = _randn((B, H, n, D), 3000 + r, dev, dtype)

    def fn():
        q.grad = k.grad = v.grad = None
        ring_attention(q, k, v, is_causal=True, layout=layout, group=group).backward(do)
    return fn


def _cp_runner(r, w, N, a, dev, dtype, group):
    """torch's context parallelism on ranks 0..w-1: SDPA inside ``context_parallel`` (its causal load
    balancing on, K/V rotated by its default method), gated first on its output at a small N against
    SDPA on the whole sequence.  Returns (fn, None) or (None, reason)."""
    import contextlib

    import torch.nn.functional as F
    if a.H_kv != a.H:
        return None, "GQA (H_kv < H): context_parallel's SDPA takes as many K/V heads as query heads here"
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # noqa: BLE001
        return None, f"import: {type(e).__name__}: {e}"
    mesh = DeviceMesh.from_group(group, dev.type) if group is not None else DeviceMesh(dev.type, list(range(w)))
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    B, H, D = a.B, a.H, a.D

    def make(Nn, seed):
        return [_randn((B, H, Nn, D), seed + i, dev, dtype) for i in range(4)]     # same on every rank

    # the gate: forward output at a small N against SDPA on the whole sequence
    Ng = (8 if dev.type == "cpu" else 256) * w
    Q, K, V, dO = make(Ng, 4000)
    with sdpa_kernel(backends):
        want = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    q, k, v = (t.clone() for t in (Q, K, V))
    with sdpa_kernel(backends), context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                                                 no_restore_buffers={q, k, v}):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (full,) = context_parallel_unshard(mesh, [out], [2])
    err = float((full.float() - want.float()).abs().max())
    if not err <= 2e-2:
        return None, f"its output differs from SDPA on the whole sequence by {err:.2e}"
    Q, K, V, dO = make(N, 5000)
    bufs = [Q, K, V, dO]
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(sdpa_kernel(backends))
        stack.enter_context(context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2],
                                             no_restore_buffers=set(bufs)))
    except BaseException:
        stack.close()
        raise
    q, k, v = (t.detach().requires_grad_() for t in bufs[:3])
    do = bufs[3]

    def fn():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    fn.close = stack.close
    return fn, None


def section_scaling(rank, world, a, dev):
    dtype = DTYPES[a.scaling_dtype]
    worlds = a.worlds or sorted({1, world} | {2 ** i for i in range(1, 8) if 2 ** i <= world})
    worlds = [w for w in worlds if 1 <= w <= world]
    groups = {w: (None if w == world else dist.new_group(list(range(w)))) for w in worlds}   # every rank, in order
    configs = [("weak", s) for s in a.tokens_per_gpu] + [("strong", s) for s in a.total]
    rows = []
    for kind, size in configs:
        base = {}
        for w in worlds:
            N = size * w if kind == "weak" else size
            member = rank < w
            group = groups[w]
            for prov in PROVIDERS:
                row = dict(kind=kind, size=size, N=N, world=w, provider=prov, seconds=None, tflops=None,
                           ratio=None, not_run=None)
                reason, sec = None, None
                if N % (2 * w):
                    reason = f"N = {N} is not divisible by 2·w = {2 * w}"
                elif prov == "torch context_parallel" and a.no_cp:
                    reason = "--no-cp"
                elif prov == "ring contiguous" and w == 1:
                    sec = next((r["seconds"] for r in rows[::-1] if r["provider"] == "ring zigzag"
                                and r["kind"] == kind and r["size"] == size and r["world"] == 1), None)
                    reason = None if sec is not None else "w = 1: the zigzag run did not run"
                elif member:
                    fn = None
                    try:
                        if prov.startswith("ring"):
                            fn = _ring_runner(rank, w, N, a, dev, dtype, prov.split()[1], group)
                        else:
                            fn, reason = _cp_runner(rank, w, N, a, dev, dtype, group)
                        if fn is not None:
                            sec = _time(fn, dev, group, a.warmup, a.reps)
                    except Exception as e:  # noqa: BLE001 - one provider's failure (e.g. out of memory) is
                        # reported, not fatal: every member meets the same shapes, so all of them get here
                        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                        print(f"[scaling] rank {rank}: {prov} N={N} w={w} raised {reason}", flush=True)
                    finally:
                        if fn is not None and hasattr(fn, "close"):
                            fn.close()
                        fn = None
                        if dev.type == "cuda":
                            torch.cuda.empty_cache()
                # rank 0 is a member of every subgroup: it speaks for it
                obj = [None]
                if rank == 0:
                    obj = [(sec, reason)]
                dist.broadcast_object_list(obj, src=0)
                sec, reason = obj[0]
                if reason is not None:
                    row["not_run"] = reason
                elif sec is not None:
                    fl = attention_flops(a.B, a.H, N, a.D, True)
                    row["seconds"], row["tflops"] = sec, fl / sec / 1e12
                    if w == 1:
                        base[prov] = row["tflops"]
                    if base.get(prov):
                        row["ratio"] = row["tflops"] / (w * base[prov])
                rows.append(row)
                if rank == 0:
                    ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.3f}"
                    val = (f"{row['seconds'] * 1e3:9.1f} ms {_num(row['tflops'])} TFLOP/s ratio {ratio}"
                           if row["seconds"] else f"not run: {row['not_run']}")
                    print(f"[scaling] {kind:>6} {size:>7} N={N:>8} w={w} {prov:<22} {val}", flush=True)
                    _checkpoint("scaling", _scaling_record(a, worlds, rows))     # a stopped run keeps its rows
                dist.barrier()
    if rank != 0:
        return None
    return _scaling_record(a, worlds, rows)


def _scaling_record(a, worlds, rows):
    wmax = max(worlds)
    size_t = 65536 if 65536 in a.tokens_per_gpu else (max(a.tokens_per_gpu) if a.tokens_per_gpu else None)
    hit = [r for r in rows if r["kind"] == "weak" and r["size"] == size_t and r["world"] == wmax
           and r["provider"] == "ring zigzag"]
    ratio = hit[0]["ratio"] if hit else None
    target = dict(kind="weak", size=size_t, provider="ring zigzag", world=wmax, ratio_min=TARGET, ratio=ratio,
                  met=None if ratio is None or wmax == 1 else bool(ratio >= TARGET))
    return dict(shape=dict(B=a.B, H=a.H, H_kv=a.H_kv, D=a.D, dtype=a.scaling_dtype, causal=True),
                worlds=worlds, reps=a.reps, rows=list(rows), target=target)


# ----------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------

def _machine(dev):
    import triton
    from flashlab.kernels import tiles
    nccl = None
    if dev.type == "cuda":
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(x) for x in v) if isinstance(v, (tuple, list)) else str(v)
        except Exception:  # noqa: BLE001
            nccl = None
    return dict(gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                gpus=torch.cuda.device_count() if dev.type == "cuda" else 0,
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                backend=str(dist.get_backend()), nccl=nccl,
                autotune=bool(tiles.AUTOTUNE and not flashlab.device.INTERPRET),
                env={k: os.environ.get(k) for k in ENV_KEYS})


SECTIONS = ("correctness", "overlap", "scaling")


def _write(rec, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    tmp.replace(path)


_CHECKPOINT = None          # rank 0, with --out: write the record with one section's partial result


def _checkpoint(name, res):
    if _CHECKPOINT is not None:
        _CHECKPOINT(name, res)


def worker(rank, world, a):
    """Every rank runs this; rank 0 returns the record (the others None).  With ``--out``, rank 0
    writes the record after every section (the sections still to come: not_run), so a run stopped
    part way keeps what it measured."""
    dev = _device(a)
    rec = dict(schema=SCHEMA, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=a.launcher + " scripts/ring_scaling.py " + " ".join(a.argv), world=world, cpu=bool(a.cpu),
               machine=_machine(dev), seconds={})
    for name in SECTIONS:
        rec[name] = dict(not_run="the run stopped before this section finished")
    global _CHECKPOINT

    def checkpoint(name, res):
        _write(dict(rec, **{name: res}), a.out)
    _CHECKPOINT = checkpoint if (rank == 0 and a.out) else None
    t_all = time.perf_counter()
    for name, fn in zip(SECTIONS, (section_correctness, section_overlap, section_scaling)):
        t0 = time.perf_counter()
        if name in a.sections:
            res = fn(rank, world, a, dev)
        else:
            res = dict(not_run=f"not in --sections {','.join(a.sections)}")
        dist.barrier()
        if rank == 0:
            rec[name] = res
            rec["seconds"][name] = time.perf_counter() - t0
            rec["seconds"]["total"] = time.perf_counter() - t_all
            if a.out:
                _write(rec, a.out)
    return rec if rank == 0 else None


def _num(x) -> str:
    """7 characters: 1 decimal from 1 up, 2 significant digits below (CPU runs are tiny)."""
    return f"{x:7.1f}" if abs(x) >= 1 else f"{x:7.2g}"


def table(rec) -> str:
    """The short table printed last."""
    out = [f"ring_scaling: W={rec['world']} {rec['machine']['backend']} {rec['machine']['gpu'] or 'CPU'}, "
           f"torch {rec['machine']['torch']}; seconds " + ", ".join(f"{k} {v:.0f}" for k, v in rec["seconds"].items())]
    c = rec["correctness"]
    if "cases" in c:
        n_ok = sum(x["ok"] for x in c["cases"])
        out.append(f"correctness: {'PASS' if c['all_ok'] else 'FAIL'} ({n_ok}/{len(c['cases'])} cases; "
                   f"shape {c['shape']})")
        out += [f"  FAIL {x['layout']} causal={x['causal']} {x['dtype']}" for x in c["cases"] if not x["ok"]]
    else:
        out.append(f"correctness: not run: {c['not_run']}")
    o = rec["overlap"]
    if "steps" in o:
        p = o["p2p"]
        out.append(f"overlap (n={o['shape']['n']} rows/rank): exposed wait {o['exposed_fraction']:.1%} of step time; "
                   f"transfer under compute {o['overlap_fraction']:.1%}" if o["overlap_fraction"] is not None else
                   f"overlap (n={o['shape']['n']} rows/rank): exposed wait {o['exposed_fraction']:.1%} of step time; "
                   f"kernel trace not run")
        if p.get("gbps"):
            out.append(f"  P2P step alone: {p['bytes'] / 1e6:.3g} MB in {p['seconds'] * 1e3:.3g} ms = {p['gbps']:.3g} GB/s"
                       + (f"; in the ring {o['in_ring_gbps']:.1f} GB/s" if o.get("in_ring_gbps") else ""))
    else:
        out.append(f"overlap: not run: {o['not_run']}")
    s = rec["scaling"]
    if "rows" in s:
        out.append(f"scaling fwd+bwd causal {s['shape']}: TFLOP/s (ratio to w x one GPU)")
        worlds = s["worlds"]
        out.append(f"  {'kind':>6} {'size':>7} {'provider':<22} " + " ".join(f"{'w=' + str(w):>15}" for w in worlds))
        keys = []
        for r in s["rows"]:
            if (r["kind"], r["size"], r["provider"]) not in keys:
                keys.append((r["kind"], r["size"], r["provider"]))
        for kind, size, prov in keys:
            cells = []
            for w in worlds:
                r = next((x for x in s["rows"] if (x["kind"], x["size"], x["provider"], x["world"]) == (kind, size, prov, w)), None)
                if r is None or r["tflops"] is None:
                    cells.append(f"{'not run':>15}")
                else:
                    cells.append(f"{_num(r['tflops'])} ({r['ratio']:.2f})" if r["ratio"] is not None
                                 else f"{_num(r['tflops']):>15}")
            out.append(f"  {kind:>6} {size:>7} {prov:<22} " + " ".join(cells))
        for r in {x["not_run"] for x in s["rows"] if x["provider"] == "torch context_parallel" and x["not_run"]}:
            out.append(f"  torch context_parallel not run: {r}")
        t = s["target"]
        got = "n/a" if t["ratio"] is None else f"{t['ratio']:.3f}"
        out.append(f"  target: {t['provider']} {t['kind']} {t['size']} tokens/GPU at w={t['world']}: ratio "
                   f"{got} >= {t['ratio_min']}? {t['met']}")
    else:
        out.append(f"scaling: not run: {s['not_run']}")
    return "\n".join(out)


def plan(a, world: int) -> tuple:
    """(lines, seconds): the scaling runs for ``world`` GPUs and an estimate of each one's seconds at
    ``--assume-tflops`` per GPU, (warm-up + reps) runs each; contiguous causal waits for its busiest
    rank ((2w-1)/w of the mean work); context parallelism is assumed as fast as the zigzag ring."""
    worlds = a.worlds or sorted({1, world} | {2 ** i for i in range(1, 8) if 2 ** i <= world})
    rate, runs = a.assume_tflops * 1e12, a.warmup + a.reps
    lines, total = [], 0.0
    for kind, sizes in (("weak", a.tokens_per_gpu), ("strong", a.total)):
        for size in sizes:
            sec = 0.0
            for w in worlds:
                N = size * w if kind == "weak" else size
                zz = attention_flops(a.B, a.H, N, a.D) / w / rate
                con = zz * (2 * w - 1) / w if w > 1 else 0.0
                cp = 0.0 if a.no_cp else zz
                sec += runs * (zz + con + cp)
            lines.append(f"  {kind:>6} {size:>8,}: w in {worlds}, ~{sec:6.1f} s")
            total += sec
    return lines, total


def main(argv=None):
    a = parse(argv)
    if a.plan:
        lines, total = plan(a, a.plan)
        print(f"scaling on {a.plan} GPUs, B {a.B} H {a.H} H_kv {a.H_kv} D {a.D} {a.scaling_dtype}, {a.warmup} warm-up + "
              f"{a.reps} reps, at an assumed {a.assume_tflops:.0f} TFLOP/s fwd+bwd per GPU:")
        print("\n".join(lines) + f"\n  scaling ~{total / 60:.1f} min (+ ~1 min correctness, overlap and compiling)")
        return None
    _multicast_off()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and a.spawn is None:       # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        a.launcher = f"torchrun --nproc-per-node {world}"
        backend = "gloo" if a.cpu else "nccl"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend)
        try:
            rec = worker(rank, world, a)
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return None
    else:
        from flashlab.distributed.local import run_local
        a.launcher = "python"
        if a.cpu:
            world, backend = a.spawn or 2, "gloo"
        else:
            if not torch.cuda.is_available():
                raise SystemExit("no CUDA GPU here: run with --cpu (gloo processes, tiny sizes), or on a GPU machine")
            world, backend = a.spawn or torch.cuda.device_count(), "nccl"
            if world > torch.cuda.device_count():
                raise SystemExit(f"--spawn {world}: this machine has {torch.cuda.device_count()} GPUs (one per rank)")
        rec = run_local(worker, world, (a,), backend=backend, timeout=a.timeout)[0]
    problems = validate(rec)
    if problems:
        print("record does not match the schema:\n  " + "\n  ".join(problems), file=sys.stderr)
    if a.out:
        _write(rec, a.out)
        print(f"wrote {a.out}")
    print(table(rec))
    return rec


# ----------------------------------------------------------------------------
# the schema
# ----------------------------------------------------------------------------

NUM = (int, float)
OPT_NUM = (int, float, type(None))
_CHECK = {"name": str, "err": NUM, "torch_err": NUM, "bound": NUM, "ok": bool}
_CASE = {"layout": str, "causal": bool, "dtype": str, "ok": bool, "max_diff_vs_op": NUM, "checks": [_CHECK]}
_STEP = {"rank": int, "phase": str, "step": int, "start_ms": NUM, "compute_end_ms": NUM, "end_ms": NUM,
         "compute_ms": NUM, "exposed_ms": NUM}
_KERNEL = {"kind": str, "name": str, "start_us": NUM, "dur_us": NUM}
_ROW = {"kind": str, "size": int, "N": int, "world": int, "provider": str, "seconds": OPT_NUM, "tflops": OPT_NUM,
        "ratio": OPT_NUM, "not_run": (str, type(None))}
SPEC = {
    "schema": str, "date": str, "command": str, "world": int, "cpu": bool,
    "machine": {"gpu": (str, type(None)), "gpus": int, "torch": str, "triton": str, "python": str, "backend": str,
                "nccl": (str, type(None)), "autotune": bool, "env": dict},
    "seconds": dict,
    "correctness": ("not_run", {"shape": {"B": int, "H": int, "H_kv": int, "N": int, "D": int}, "world": int,
                                "all_ok": bool, "cases": [_CASE]}),
    "overlap": ("not_run", {"shape": {"B": int, "H": int, "H_kv": int, "n": int, "D": int, "dtype": str,
                                      "causal": bool},
                            "world": int, "steps": [_STEP],
                            "kernels": ("not_run", {"source": str, "ranks": {"*": [_KERNEL]}}),
                            "overlap_fraction": OPT_NUM, "exposed_fraction": NUM,
                            "p2p": {"bytes": int, "seconds": OPT_NUM, "gbps": OPT_NUM}, "in_ring_gbps": OPT_NUM}),
    "scaling": ("not_run", {"shape": {"B": int, "H": int, "H_kv": int, "D": int, "dtype": str, "causal": bool},
                            "worlds": [int], "reps": int, "rows": [_ROW],
                            "target": {"kind": str, "size": (int, type(None)), "provider": str, "world": int,
                                       "ratio_min": NUM, "ratio": OPT_NUM, "met": (bool, type(None))}}),
}


def _validate(x, spec, where, out):
    if isinstance(spec, tuple) and spec and spec[0] == "not_run":
        if isinstance(x, dict) and set(x) == {"not_run"}:
            if not isinstance(x["not_run"], str):
                out.append(f"{where}.not_run: not a string")
            return
        return _validate(x, spec[1], where, out)
    if isinstance(spec, dict):
        if not isinstance(x, dict):
            out.append(f"{where}: expected an object, got {type(x).__name__}")
            return
        if "*" in spec:
            for k, v in x.items():
                _validate(v, spec["*"], f"{where}.{k}", out)
            return
        for k, s in spec.items():
            if k not in x:
                out.append(f"{where}.{k}: missing")
            else:
                _validate(x[k], s, f"{where}.{k}", out)
        return
    if isinstance(spec, list):
        if not isinstance(x, list):
            out.append(f"{where}: expected a list, got {type(x).__name__}")
            return
        for i, v in enumerate(x):
            _validate(v, spec[0], f"{where}[{i}]", out)
        return
    types = spec if isinstance(spec, tuple) else (spec,)
    if isinstance(x, bool) and bool not in types:
        out.append(f"{where}: expected {[t.__name__ for t in types]}, got bool")
    elif not isinstance(x, types):
        out.append(f"{where}: expected {[t.__name__ for t in types]}, got {type(x).__name__}")


def validate(rec) -> list:
    """Where ``rec`` departs from the schema (an empty list: it matches)."""
    out = []
    _validate(rec, SPEC, "record", out)
    if isinstance(rec, dict) and rec.get("schema") != SCHEMA:
        out.append(f"record.schema: expected {SCHEMA!r}, got {rec.get('schema')!r}")
    return out


if __name__ == "__main__":
    main()
