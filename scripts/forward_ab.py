"""The v6 forwards' calls timed through the public op, to compare two trees of the project on one GPU.

    PYTHONPATH=TREE python scripts/forward_ab.py LABEL OUT.jsonl

Run it once a tree and a round from each tree's root (its own flashlab is imported), alternating the trees; each run
appends one JSON line a call (label, call, ms, TFLOP/s of the visible pairs) to OUT.jsonl.  Forward only (under
``torch.no_grad()``), bf16, D = 128, ``triton.testing.do_bench``'s median after a warm-up call; set
``FLASHLAB_AUTOTUNE=0`` for the hand-picked tiles.  The calls: causal and non-causal B 2 x H 16 x 8192, soft-cap 30,
GQA 32 / 8, 8 packed documents of 2048 and a window of 1024 at N 16384 (docs/BENCHMARKS.md, 2026-12-06)."""
import json
import sys

import torch

sys.path.insert(0, ".")
import flashlab  # noqa: E402  (before triton: flashlab.device chooses the interpreter)
from flashlab.bench_variants import _causal_pairs as causal_pairs  # noqa: E402
from triton.testing import do_bench  # noqa: E402

D = 128
DT = torch.bfloat16


def calls(dev="cuda"):
    """[(name, call, visible pairs)] on fresh random inputs."""
    torch.manual_seed(0)
    x = lambda *shape: torch.randn(*shape, D, device=dev, dtype=DT)
    q, k, v = x(2, 16, 8192), x(2, 16, 8192), x(2, 16, 8192)
    qg, kg, vg = x(2, 32, 8192), x(2, 8, 8192), x(2, 8, 8192)
    L, docs = 2048, 8
    qp, kp, vp = x(L * docs, 16), x(L * docs, 16), x(L * docs, 16)
    cu = torch.arange(0, L * docs + 1, L, device=dev, dtype=torch.int32)
    qw, kw, vw = x(1, 16, 16384), x(1, 16, 16384), x(1, 16, 16384)
    W = 1024
    fa = flashlab.flash_attention
    return [
        ("causal B2 H16 N8192", lambda: fa(q, k, v, is_causal=True), 2 * 16 * causal_pairs(8192)),
        ("plain B2 H16 N8192", lambda: fa(q, k, v), 2 * 16 * 8192 * 8192),
        ("softcap30 B2 H16 N8192", lambda: fa(q, k, v, is_causal=True, softcap=30.0), 2 * 16 * causal_pairs(8192)),
        ("gqa32/8 B2 N8192", lambda: fa(qg, kg, vg, is_causal=True, enable_gqa=True), 2 * 32 * causal_pairs(8192)),
        ("docs 8x2048 H16", lambda: flashlab.flash_attention_varlen(qp, kp, vp, cu, cu, L, L, is_causal=True),
         16 * docs * causal_pairs(L)),
        ("window1024 H16 N16384", lambda: fa(qw, kw, vw, is_causal=True, window=(W - 1, 0)),
         16 * sum(min(i + 1, W) for i in range(16384))),
    ]


def main(label: str, out: str) -> None:
    with open(out, "a") as f, torch.no_grad():
        for name, fn, pairs in calls():
            fn()
            torch.cuda.synchronize()
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            row = dict(label=label, case=name, ms=ms, tflops=pairs * 4 * D / ms / 1e9)
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
