"""Record on a GPU notebook 06's FA1-against-FA2 timings and the L2 (grid order) experiment.

    python3 scripts/record_part2b.py --out flashlab/data/h200_fa1_l2.json     # about 2-3 minutes on an H200

Checks first (every kernel timed here against SDPA on the same inputs; a wrong one stops the
script), then times, and prints a short table last.  No autotuning in the timings (only in the
last section): every kernel runs with the forward's first hand-picked tile config
(``flashlab.kernels.forward_config``), the same tiles for all (the FA1-order kernel with at least
8 warps: ``fa1_config``'s docstring says why).
Timings are medians of ``triton.testing.do_bench_cudagraph`` (CUDA graphs: the FA1-order kernel
launches once per K/V tile, and the launches' CPU cost is left out for every kernel alike).
Sections (each also a key of the JSON file):

  checks     max |O - SDPA| of FA1 order, flashlab v1, v2, and v1 in both grid orders (fp16, D = 64
             and 128, causal both, ragged N)
  bandwidth  HBM copy bandwidth (a 4 GiB device-to-device copy), bytes/s
  matmul     torch.matmul, fp16, 8192^3: TFLOP/s, the practical ceiling
  fa1        FA1 order vs flashlab's FA2 v1 at the same tiles: 16k tokens (B = 16384 / N,
             H = 2048 / D), fp16, D = 64 and 128, N = 1024, 4096, 16384, causal both
  l2         the same FA2 forward (v1's code) with the Q tile index fastest in the grid (v1's order)
             and with the (batch, head) index fastest, non-causal, D = 64 and 128: N = 4096 and
             16384 at 16k tokens, and N = 4096 with B*H >= 8 heads per SM (B = 33, H = 32 or
             B = 66, H = 16 on 132 SMs: interleaved, the programs running together then all belong
             to different heads; at 16k tokens, B*H = 16-128, they still share some); with the
             bytes the no-cache model needs and the least share of the K/V re-reads that must
             have come from L2 given the measured time and copy bandwidth
  autotune   the config autotuning picks for the op's forward and both backward kernels (fp16,
             non-causal, 16k tokens, D = 64 and 128, N = 1024 ... 16384); this section autotunes

Counting DRAM bytes instead of inferring them: with FLASHLAB_NCU=1 the script only runs each grid
order once (D = 64, N = 16384, non-causal, after one warm-up call) for a profiler to wrap:

    FLASHLAB_NCU=1 ncu --clock-control none --kernel-name flash_fwd_kernel --launch-skip 2 --launch-count 2 \\
        --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum \\
        python3 scripts/record_part2b.py

(the first two launches are the warm-ups; the third is the tile-fastest order, the fourth the
head-fastest one).  ``--cpu-smoke`` runs the checks and the bookkeeping with tiny sizes in the
interpreter, to catch Python errors without a GPU; its JSON is a throwaway.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a clone: no install needed
if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
import flashlab  # noqa: E402,F401,I001  (first: GPU or interpreter)
from flashlab import device, reference, viz_speed  # noqa: E402
from flashlab.kernels import forward_config, launch_forward  # noqa: E402
from flashlab.teaching.fa1_forward import fa1_config, fa1_forward, ordered_forward  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

NS_FA1 = [1024, 4096, 16384]
NS_AUTOTUNE = [1024, 2048, 4096, 8192, 16384]
NS_L2 = [4096, 16384]
DS = [64, 128]


def kernels_by_name(cfg):
    """name -> f(q, k, v, o, lse, causal), every one at the tile config ``cfg``."""
    return {
        "FA1 order": lambda q, k, v, o, lse, c: fa1_forward(q, k, v, o, lse, c, config=fa1_config(cfg)),
        "v1": lambda q, k, v, o, lse, c: launch_forward(q, k, v, o, lse, c, 1 / math.sqrt(q.shape[-1]),
                                                        version="v1", config=cfg),
        "v2": lambda q, k, v, o, lse, c: launch_forward(q, k, v, o, lse, c, 1 / math.sqrt(q.shape[-1]),
                                                        version="v2", config=cfg),
        "v1 tile-fastest": lambda q, k, v, o, lse, c: ordered_forward(q, k, v, o, lse, c, config=cfg),
        "v1 head-fastest": lambda q, k, v, o, lse, c: ordered_forward(q, k, v, o, lse, c, config=cfg,
                                                                      head_fastest=True),
    }


def reference_output(q, k, v, causal):
    if device.DEVICE.type == "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return reference.attention_naive_torch(q.double(), k.double(), v.double(), causal)[0]


def checks_section(smoke):
    out = []
    n, tol = (45, 2e-2) if smoke else (1531, 2e-2)
    bh = (1, 2) if smoke else (2, 4)
    gen = torch.Generator(device=device.DEVICE).manual_seed(0)
    for d in ([16] if smoke else DS):
        cfg = forward_config(d, torch.float16)
        for causal in (False, True):
            q, k, v = (torch.randn(*bh, n, d, device=device.DEVICE, generator=gen).to(torch.float16)
                       for _ in range(3))
            ref = reference_output(q, k, v, causal)
            for name, fn in kernels_by_name(cfg).items():
                o, lse = torch.full_like(q, float("nan")), torch.empty(q.shape[:3], device=q.device)
                fn(q, k, v, o, lse, causal)
                err = (o.double() - ref.double()).abs().max().item()
                out.append(dict(kernel=name, D=d, N=n, causal=causal, max_err=err, ok=bool(err <= tol)))
    bad = [c for c in out if not c["ok"]]
    for c in out:
        print(f"check {c['kernel']:<16} D={c['D']:<4} causal={c['causal']!s:<6} max|O - ref| = {c['max_err']:.2e}"
              f"  {'ok' if c['ok'] else 'WRONG'}")
    if bad:
        raise SystemExit(f"{len(bad)} kernel(s) disagree with the reference: not timing anything")
    return out


def bandwidth_section():
    src = torch.empty(2**30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    from triton.testing import do_bench
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**30 * 2 / (ms * 1e-3)


def matmul_section():
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.float16) for _ in range(2))
    ms = viz_speed.cuda_time(lambda: a @ b, "matmul")
    return [dict(provider="torch.matmul", dtype="fp16", M=n, N=n, K=n, ms=ms, tflops=2 * n**3 / (ms * 1e-3) / 1e12)]


def _smoke_timer(fn, label=""):
    fn()                      # --cpu-smoke: run it once in the interpreter, time nothing
    return math.nan


def fa1_section(smoke):
    if smoke:
        return [viz_speed.measure_fa1_vs_fa2(64, 16, c, timer=_smoke_timer, b_h=(1, 2)) for c in (False, True)]
    rows = []
    for d in DS:
        for n in NS_FA1:
            for causal in (False, True):
                rows.append(viz_speed.measure_fa1_vs_fa2(n, d, causal))
            torch.cuda.empty_cache()
    return rows


def l2_section(bw, smoke):
    if smoke:
        return viz_speed.measure_grid_orders(64, 16, bw, timer=_smoke_timer, b_h=(1, 2))
    rows = []
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    for d in DS:
        for n in NS_L2:
            rows += viz_speed.measure_grid_orders(n, d, bw)           # the protocol's 16k tokens
            torch.cuda.empty_cache()
        rows += viz_speed.measure_grid_orders(4096, d, bw, b_h=viz_speed.many_heads(d, n_sm))   # 8 heads per SM
        torch.cuda.empty_cache()
    return rows


def ncu_only():
    d, n = 64, 16384
    b, h = 16384 // n, 2048 // d
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
    cfg = forward_config(d, torch.float16)
    for hf in (False, True):          # warm-up (compile) both orders
        ordered_forward(q, k, v, o, lse, False, config=cfg, head_fastest=hf)
    for hf in (False, True):          # the two launches to profile
        ordered_forward(q, k, v, o, lse, False, config=cfg, head_fastest=hf)
    torch.cuda.synchronize()
    print(f"ran the two grid orders once each (D={d}, N={n}, B={b}, H={h}, tiles {cfg})")


def _shown(path):
    """The output path as written in the record: relative to the repository, never a machine's absolute path."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return p.name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file to write, e.g. flashlab/data/h200_fa1_l2.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes in the interpreter; no timings")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    if not smoke and device.DEVICE.type != "cuda":
        raise SystemExit("needs a CUDA GPU (or --cpu-smoke to test the script in the interpreter)")
    if os.environ.get("FLASHLAB_NCU") and not smoke:
        return ncu_only()
    if not args.out:
        ap.error("--out is required")
    t0 = time.time()
    record = {
        "what": "notebook 06's FA1-order and L2 (grid order) measurements, recorded by scripts/record_part2b.py",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python3 scripts/record_part2b.py --out " + _shown(args.out) + (" --cpu-smoke" if smoke else ""),
        "timing": ("median of triton.testing.do_bench_cudagraph (rep=60: 10 replays of a graph of about 60 ms "
                   "of calls); fp16; tiles: forward_config(D), FA1 with fa1_config"),
    }
    if smoke:
        record["machine"] = {"gpu": None, "python": platform.python_version(), "torch": torch.__version__,
                             "triton": triton.__version__, "note": "--cpu-smoke: interpreter, no timings"}
    else:
        props = torch.cuda.get_device_properties(0)
        record["machine"] = {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                             "compute_capability": f"{props.major}.{props.minor}",
                             "sms": props.multi_processor_count, "python": platform.python_version(),
                             "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    record["checks"] = checks_section(smoke)
    bw = 4.0e12 if smoke else bandwidth_section()
    record["bandwidth_bytes_per_s"] = bw
    record["matmul"] = [] if smoke else matmul_section()
    record["fa1"] = fa1_section(smoke)
    record["l2"] = l2_section(bw, smoke)
    # what autotuning picks per sequence length (the op's forward and backward, fp16, non-causal)
    record["autotune"] = [] if smoke else [r for d in (64, 128) for r in viz_speed.autotune_choices(NS_AUTOTUNE, d)]
    record["timing_fallbacks"] = viz_speed.FALLBACKS
    record["seconds"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))

    m = record["machine"]
    print(f"\n{m['gpu']}, torch {m['torch']}, triton {m['triton']}, {record['seconds']} s; "
          f"HBM copy {bw / 1e12:.2f} TB/s" + "".join(f"; matmul {r['dtype']} {r['M']}^3 {r['tflops']:.0f} TFLOP/s"
                                                     for r in record["matmul"]))
    print(f"\n{'D':>4} {'N':>6} {'causal':>6} {'FA1 TFLOP/s':>12} {'FA2 v1':>8} {'FA2/FA1':>8}")
    for r in record["fa1"]:
        print(f"{r['D']:>4} {r['N']:>6} {str(r['causal']):>6} {r['fa1_tflops']:>12.1f} {r['fa2_tflops']:>8.1f}"
              f" {r['fa2_tflops'] / r['fa1_tflops']:>8.2f}")
    print(f"\nno-L2: bytes if every K/V re-read came from HBM; needs: those bytes / time, against the copy's "
          f"{bw / 1e12:.2f} TB/s")
    print(f"{'D':>4} {'N':>6} {'B*H':>5} {'order':>13} {'ms':>8} {'TFLOP/s':>8} {'v1 ms':>8} "
          f"{'no-L2 GiB':>10} {'needs TB/s':>10} {'HBM max GiB':>12} {'re-reads from L2 (at least)':>28}")
    for r in record["l2"]:
        v1 = f"{r['v1_ms']:8.3f}" if "v1_ms" in r else " " * 8
        print(f"{r['D']:>4} {r['N']:>6} {r['B'] * r['H']:>5} {r['order']:>13} {r['ms']:>8.3f} {r['tflops']:>8.1f} {v1} "
              f"{r['nocache_bytes'] / 2**30:>10.2f} {r['nocache_bytes'] / (r['ms'] * 1e-3) / 1e12:>10.2f} "
              f"{r['hbm_max_bytes'] / 2**30:>12.2f} {100 * r['l2_share_min']:>27.0f}%")
    if record["autotune"]:
        print("\nautotuning's choice (fp16, non-causal, 16k tokens):\n" + viz_speed.format_autotune(record["autotune"]))
    print("\n" + viz_speed.fa1_verdict(record) + "\n" + viz_speed.l2_verdict(record))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
