"""The ring attention cost model on paper (no GPU): the overlap condition and ring vs all-to-all.

    python scripts/ring_cost_model.py                          # tables
    python scripts/ring_cost_model.py --figures out/           # and notebook 09's two figures as PNG
    python scripts/ring_cost_model.py --flops 550e12 --ib 100e9 --H 64 --H_kv 8

The model and its assumptions are in flashlab/distributed/cost.py; the numbers are datasheet
bandwidths and one kernel rate (set them with the flags), not measurements.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashlab.distributed import cost as C  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flops", type=float, default=C.H200_NODE.flops, help="attention FLOP/s of one GPU")
    ap.add_argument("--nvlink", type=float, default=C.H200_NODE.nvlink, help="bytes/s per direction in a node")
    ap.add_argument("--ib", type=float, default=C.H200_NODE.ib, help="bytes/s per direction per GPU between nodes")
    ap.add_argument("--gpus-per-node", type=int, default=C.H200_NODE.gpus_per_node)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--H_kv", type=int, default=8)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[131072, 1048576])
    ap.add_argument("--figures", type=Path, default=None, help="folder for overlap.png and cost_model.png")
    a = ap.parse_args()
    m = C.Machine(a.flops, a.nvlink, a.ib, a.gpus_per_node)

    print(f"n* (rows per rank from which a ring step's transfer hides), F = {m.flops / 1e12:.0f} TFLOP/s, bf16")
    print(f"{'link':<11} {'GB/s':>6} {'H/H_kv':>7} {'non-causal':>11} {'causal zz':>10} {'bwd causal':>11}")
    for name, bw in (("NVLink", m.nvlink), ("InfiniBand", m.ib)):
        for H, Hkv in ((a.H, a.H), (a.H, a.H_kv)):
            r = [C.overlap_rows(bw, m.flops, H, Hkv, 2, c) for c in (False, True)]
            b = C.overlap_rows(bw, m.flops, H, Hkv, 2, True, backward=True)
            print(f"{name:<11} {bw / 1e9:>6.0f} {f'{H}/{Hkv}':>7} {r[0]:>11,.0f} {r[1]:>10,.0f} {b:>11,.0f}")
    for N in a.seqlens:
        s = C.scaling(N, None, m, H=a.H, H_kv=a.H_kv, D=a.D)
        print(f"\nN = {N:,} tokens, H = {a.H}, H_kv = {a.H_kv}, D = {a.D}, causal, forward of one layer (ms)")
        print(f"{'W':>5} {'ideal':>10} {'ring':>10} {'Ulysses':>10}  {'ring / ideal':>12}")
        for W, i, r, u in zip(s["W"], s["ideal"], s["ring"], s["ulysses"]):
            print(f"{W:>5} {i * 1e3:>10.2f} {r * 1e3:>10.2f} {(f'{u * 1e3:.2f}' if u else '-'):>10}  {r / i:>12.2f}")
    if a.figures:
        from flashlab.distributed import figures as F
        a.figures.mkdir(parents=True, exist_ok=True)
        F.fig_overlap(a.H, a.H_kv, a.D, m=m).savefig(a.figures / "overlap.png", dpi=120, bbox_inches="tight")
        F.fig_cost_model(tuple(a.seqlens), a.H, a.H_kv, a.D, m=m).savefig(a.figures / "cost_model.png", dpi=120,
                                                                         bbox_inches="tight")
        print(f"\nwrote {a.figures / 'overlap.png'} and {a.figures / 'cost_model.png'}")


if __name__ == "__main__":
    main()
