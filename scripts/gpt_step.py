"""GPU only: the tiny GPT's training step (notebook 07's model) with SDPA and with flashlab, round by round.

    python scripts/gpt_step.py [--rounds 3] [--steps 60] [--batch 32] [--json OUT.json]

The model of ``flashlab.gpt.gpu_config`` (6 layers, 6 heads of 64, T = 256), bf16 autocast, AdamW, batch 32:
notebook 07's run, at ``gpt.train``'s default learning rate (3e-3; ``--lr 1e-3`` is the notebook's on a GPU).  Each round trains a fresh model for ``--steps`` steps with each attention, SDPA first, then
flashlab (the same seed: the same weights and batches), and takes ``flashlab.gpt.train``'s median step time (a
step's wall clock from batch to optimiser step, synchronised, after its first 5 steps).  The host's speed drifts
on a shared machine, so each round runs both and each round's ratio is reported; the result is the median
of the rounds' ratios.  Also the largest difference of the two loss curves in each round (both attentions are
exact: the curves differ by rounding only).

Prints a table last.  docs/BENCHMARKS.md has what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashlab import gpt  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    data = gpt.CharData(gpt.load_text(), block_size=256)
    cfg = gpt.gpu_config(data.vocab_size)
    rows = []
    for r in range(args.rounds):
        runs = {a: gpt.train(a, cfg, data, steps=args.steps, batch_size=args.batch, lr=args.lr, dtype=torch.bfloat16)
                for a in ("sdpa", "flashlab")}
        diff = max(abs(a - b) for a, b in zip(runs["sdpa"]["loss"], runs["flashlab"]["loss"]))
        row = {"round": r, "sdpa_ms": runs["sdpa"]["step_ms"], "flashlab_ms": runs["flashlab"]["step_ms"],
               "ratio": runs["flashlab"]["step_ms"] / runs["sdpa"]["step_ms"], "max_loss_diff": diff,
               "sdpa_peak_mib": runs["sdpa"]["peak_mib"], "flashlab_peak_mib": runs["flashlab"]["peak_mib"]}
        rows.append(row)
        print(f"round {r}: SDPA {row['sdpa_ms']:.2f} ms, flashlab {row['flashlab_ms']:.2f} ms "
              f"({row['ratio']:.3f}x), largest loss difference {diff:.3f}", flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": cfg.__dict__,
           "batch": args.batch, "steps": args.steps, "lr": args.lr, "rounds": rows,
           "median_ratio": statistics.median(r["ratio"] for r in rows)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print("\n| round | SDPA ms | flashlab ms | x SDPA | loss diff |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['sdpa_ms']:.2f} | {r['flashlab_ms']:.2f} | {r['ratio']:.3f} | "
              f"{r['max_loss_diff']:.3f} |")
    print(f"median of the rounds' ratios: {out['median_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
