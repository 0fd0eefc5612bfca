"""GPU only: forward v5 (host descriptors) against v2 (pointers) at N = 1024, where the plan chooses between them.

    python scripts/short_forward.py [--dtypes fp16 bf16] [--json OUT.json]

1. Correctness, forward only: v5 at ragged Nq != Nk (and Nq > Nk), causal both ways, large logits, D 64 and
   128, each dtype, by flashlab.accuracy's rule against float64, at one forced config (no autotuning).
2. Timing at the protocol's shape (B = 16384 / N, H = 2048 / D, N = 1024), ``do_bench`` medians: v2 and v5 at
   the same forced configs (the tiles Triton's tutorial 06 picked there, and the long-sequence 128 x 128), then
   the op (``flashlab.flash_attention``, which the plan now sends to v5, autotuned) beside SDPA's cuDNN backend.

Prints a table last (TFLOP/s).  docs/BENCHMARKS.md has what it measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashlab  # noqa: E402
from flashlab import kernels  # noqa: E402
from flashlab.accuracy import check_attention  # noqa: E402
from flashlab.bench import flops  # noqa: E402
from flashlab.kernels import Config as C  # noqa: E402

DT = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (D, causal) -> the configs timed for both versions: tutorial 06's pick at N = 1024 first
CONFIGS = {(64, False): [C(64, 64, 4, 2), C(128, 64, 4, 3)], (64, True): [C(64, 64, 4, 2), C(128, 64, 4, 3)],
           (128, False): [C(128, 64, 4, 2), C(128, 128, 8, 3)], (128, True): [C(64, 64, 4, 3), C(128, 64, 4, 2)]}


def forward_op(version, cfg):
    def fn(q, k, v, causal, scale):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)
        kernels.launch_forward(q, k, v, o, lse, causal, scale or 1 / math.sqrt(q.shape[-1]), version=version,
                               config=cfg)
        return o, lse
    return fn


def correctness(dtypes) -> list:
    bad = []
    for dname in dtypes:
        for D in (64, 128):
            for causal in (False, True):
                for Nq, Nk, mag in ((1000, 1037, 1.0), (777, 300, 6.0)):
                    q = (mag * torch.randn(2, 3, Nq, D, device="cuda")).to(DT[dname])
                    k = (mag * torch.randn(2, 3, Nk, D, device="cuda")).to(DT[dname])
                    v = torch.randn(2, 3, Nk, D, device="cuda").to(DT[dname])
                    checks = check_attention(forward_op("v5", CONFIGS[(D, causal)][0]), q, k, v, causal, backward=False)
                    if not all(c.ok for c in checks):
                        bad.append(f"v5 {dname} D={D} causal={causal} Nq={Nq} Nk={Nk}: " + "; ".join(map(str, checks)))
    return bad


def timings(dtypes) -> list:
    from triton.testing import do_bench
    rows, N = [], 1024
    for dname in dtypes:
        for (D, causal), cfgs in CONFIGS.items():
            B, H = 16384 // N, 2048 // D
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=DT[dname]) for _ in range(3))
            o, lse = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
            fl = flops(B, H, N, N, D, causal)
            row = dict(dtype=dname, D=D, causal=causal, N=N)
            for cfg in cfgs:
                for ver in ("v2", "v5"):
                    run = lambda: kernels.launch_forward(q, k, v, o, lse, causal, D ** -0.5, version=ver,  # noqa: E731
                                                         config=cfg)
                    run()
                    row[f"{ver} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"] = round(
                        fl / do_bench(run, return_mode="median") / 1e9, 1)
            with torch.no_grad():
                op = lambda: flashlab.flash_attention(q, k, v, is_causal=causal)  # noqa: E731
                op()
                row["op"] = round(fl / do_bench(op, return_mode="median") / 1e9, 1)
                row["op version"] = kernels.plan.plan_for(q, k, v, causal, extra=(o,)).fwd_version
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    row["cudnn"] = round(fl / do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal), return_mode="median") / 1e9, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["fp16"], choices=list(DT))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    bad = correctness(a.dtypes)
    print(f"correctness: {len(bad)} failures", *bad, sep="\n", flush=True)
    rows = timings(a.dtypes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bad": bad, "rows": rows}, f, indent=1)
    for r in rows:
        cells = "  ".join(f"{k} {v}" for k, v in r.items() if k not in ("dtype", "D", "causal", "N"))
        print(f"{r['dtype']} D={r['D']} causal={r['causal']!s:<5} N={r['N']}: {cells}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
