"""Record on a GPU what notebook 07 shows as "recorded" on a CPU; writes flashlab/data/h200_part3.json.

    PYTHONPATH=. python scripts/record_part3.py [--out flashlab/data/h200_part3.json] [--quick]

1. The tiny GPT at a realistic size (flashlab.gpt.gpu_config: 6 layers, 6 heads of 64, context 256),
   trained 300 steps in bf16 autocast from the same seed with SDPA, flashlab and naive attention:
   per-step losses, validation losses, median step time, peak memory.
2. Backward TFLOP/s against N (16k tokens per batch, fp16, D = 64 and 128, causal both ways):
   flashlab and SDPA's FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION backends, each checked
   for correctness before it is timed (flashlab.bench.run_case).
3. The atomic-dQ backward (flashlab.teaching.atomic_dq): gradients checked against the canonical
   backward, then run 5 times on the same inputs (bitwise repeatability of dQ), and timed.

Checks first, timings after, a short table last.  About 3-4 minutes on an H200.
"""
import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import flashlab  # noqa: F401,I001  (first: GPU or interpreter)
import torch
import triton
from triton.testing import do_bench

from flashlab import bench, device, gpt
from flashlab.kernels import launch_backward, launch_forward
from flashlab.teaching.atomic_dq import launch_backward_atomic

ROOT = Path(__file__).resolve().parents[1]


def machine():
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "PYTHONPATH=. python " + " ".join(["scripts/record_part3.py"] + sys.argv[1:])}


def record_gpt(steps):
    data = gpt.CharData(gpt.load_text(), block_size=256)
    cfg = gpt.gpu_config(data.vocab_size)
    runs = {}
    for attn in ("sdpa", "flashlab", "naive"):
        t0 = time.perf_counter()
        r = gpt.train(attn, cfg, data, steps=steps, batch_size=32, lr=1e-3, seed=0, dtype=torch.bfloat16,
                      eval_every=max(1, steps // 10), eval_batches=8)
        r.pop("model")
        r["wall_s"] = time.perf_counter() - t0
        runs[attn] = r
        print(f"gpt {attn:<9} final loss {r['loss'][-1]:.3f}  val {r['val'][-1][1]:.3f}  "
              f"step {r['step_ms']:.1f} ms  peak {r['peak_mib'] or 0:.0f} MiB  ({r['wall_s']:.0f} s)", flush=True)
    a, b = runs["sdpa"]["loss"], runs["flashlab"]["loss"]
    diff = [abs(x - y) for x, y in zip(a, b)]
    return {"config": runs["sdpa"]["config"], "params": runs["sdpa"]["params"],
            "batch_size": 32, "steps": steps, "dtype": "bfloat16 autocast", "seed": 0,
            "max_abs_loss_diff_sdpa_flashlab": max(diff),
            "mean_abs_loss_diff_last50": statistics.mean(diff[-50:]), "runs": runs}


def record_bwd_bench(seqlens):
    rows = []
    provs = ["flashlab", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"]
    for D in (64, 128):
        for causal in (False, True):
            for N in seqlens:
                rs = bench.run_case(provs, N, D, torch.float16, causal, "bwd")
                rows += bench.as_dicts(rs)
                print("bwd " + "  ".join(f"{r.provider} {r.tflops:.0f}" if r.status == "ok" else
                                         f"{r.provider} {r.status[:30]}" for r in rs)
                      + f"   (D={D}, causal={causal}, N={N})", flush=True)
    return rows


def record_atomic(shapes, runs=5):
    det, tim = [], []
    for D, causal, N in shapes:
        B, H = max(1, 16384 // N), 2048 // D
        gen = torch.Generator(device="cuda").manual_seed(N + D)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
        o, lse = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
        s = 1 / math.sqrt(D)
        launch_forward(q, k, v, o, lse, causal, s)

        def two_kernels(*a):   # the canonical backward: v2's two kernels (the op's default on Hopper is one pass)
            return launch_backward(*a, version="v2")

        def grads(fn):
            g = [torch.empty_like(t) for t in (q, k, v)]
            fn(q, k, v, o, lse, do, *g, causal, s)
            torch.cuda.synchronize()
            return g

        ref = grads(two_kernels)
        first = grads(launch_backward_atomic)
        err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1)).item()
                  for a, b in zip(first, ref))
        if not err < 2e-2:
            raise SystemExit(f"atomic-dQ backward disagrees with the canonical one: relative error {err:.2e}")
        canon_runs = [grads(two_kernels)[0] for _ in range(runs)]
        atomic_runs = [first[0]] + [grads(launch_backward_atomic)[0] for _ in range(runs - 1)]

        def differ(rs):   # largest share of elements whose bits differ from the first run
            return max((r.view(torch.int16) != rs[0].view(torch.int16)).float().mean().item() for r in rs[1:])

        def maxdiff(rs):
            return max((r.float() - rs[0].float()).abs().max().item() for r in rs[1:])

        det.append({"D": D, "causal": causal, "N": N, "runs": runs, "check_rel_err": err,
                    "canonical_differ": differ(canon_runs), "atomic_differ": differ(atomic_runs),
                    "canonical_max_abs_diff": maxdiff(canon_runs), "atomic_max_abs_diff": maxdiff(atomic_runs)})
        g = [torch.empty_like(t) for t in (q, k, v)]
        ms_c = do_bench(lambda: two_kernels(q, k, v, o, lse, do, *g, causal, s), return_mode="median")
        ms_a = do_bench(lambda: launch_backward_atomic(q, k, v, o, lse, do, *g, causal, s), return_mode="median")
        fl = bench.flops(B, H, N, N, D, causal, "bwd")
        tim.append({"D": D, "causal": causal, "N": N, "canonical_ms": ms_c, "atomic_ms": ms_a,
                    "canonical_tflops": fl / ms_c / 1e9, "atomic_tflops": fl / ms_a / 1e9})
        d = det[-1]
        print(f"atomic D={D} causal={causal} N={N}: dQ bits differ in {100 * d['atomic_differ']:.2f}% "
              f"(canonical {100 * d['canonical_differ']:.2f}%), max diff {d['atomic_max_abs_diff']:.2e}; "
              f"{ms_c:.3f} ms canonical vs {ms_a:.3f} ms atomic", flush=True)
        del q, k, v, do, o, lse, g, canon_runs, atomic_runs, ref, first
        torch.cuda.empty_cache()
    return {"determinism": det, "timing": tim}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "flashlab" / "data" / "h200_part3.json"))
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer steps and sizes")
    args = ap.parse_args()
    if device.DEVICE.type != "cuda":
        raise SystemExit("needs a CUDA GPU (this records GPU measurements)")
    t0 = time.perf_counter()
    rec = {"what": "notebook 07's recorded GPU measurements (scripts/record_part3.py)", "machine": machine()}
    rec["gpt"] = record_gpt(30 if args.quick else 300)
    rec["bwd_bench"] = record_bwd_bench([1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    shapes = [(64, False, 4096), (64, True, 4096), (128, False, 4096), (128, True, 4096),
              (64, False, 16384), (128, True, 16384)]
    rec["atomic"] = record_atomic(shapes[:2] if args.quick else shapes)
    rec["wall_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print(f"\nwrote {args.out} in {rec['wall_s']:.0f} s")
    print_table(rec)


def print_table(rec):
    print(f"{'GPT (bf16)':<12}{'final loss':>11}{'val':>8}{'step ms':>9}{'peak MiB':>10}")
    for name, r in rec["gpt"]["runs"].items():
        print(f"{name:<12}{r['loss'][-1]:>11.3f}{r['val'][-1][1]:>8.3f}{r['step_ms']:>9.1f}{r['peak_mib'] or 0:>10.0f}")
    print(f"max |loss(sdpa) - loss(flashlab)| over the run: {rec['gpt']['max_abs_loss_diff_sdpa_flashlab']:.3g}")
    big = max(r["N"] for r in rec["bwd_bench"])
    print(f"\nbackward TFLOP/s at N={big} (fp16)")
    for r in rec["bwd_bench"]:
        if r["N"] == big:
            print(f"  D={r['D']:<4}causal={str(r['causal']):<6}{r['provider']:<16}{r['tflops']:>6.0f}  {r['status']}")
    print("\natomic dQ: share of dQ elements whose bits differ between identical runs; time")
    for d, t in zip(rec["atomic"]["determinism"], rec["atomic"]["timing"]):
        print(f"  D={d['D']:<4}causal={str(d['causal']):<6}N={d['N']:<6} atomic {100 * d['atomic_differ']:6.2f}%  "
              f"canonical {100 * d['canonical_differ']:4.2f}%   {t['atomic_ms']:.3f} vs {t['canonical_ms']:.3f} ms")


if __name__ == "__main__":
    main()
