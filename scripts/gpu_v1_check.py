"""Time forward v1 and v2 with v1's hand-picked tiles (no autotuning), causal and not, fp16.

    python scripts/gpu_v1_check.py

A short check of the pointer change recorded in docs/BENCHMARKS.md (2026-11-30): each output is
first compared with float32 SDPA on one head, then timed (do_bench median).
"""
import math

import torch
from triton.testing import do_bench

import flashlab  # noqa: F401
from flashlab import kernels
from flashlab.bench import flops
from flashlab.kernels import Config as C

N = 4096
for D, cfg in ((64, C(128, 64, 4, 3)), (128, C(128, 64, 8, 3))):
    B, H = 16384 // N, 2048 // D
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
    for causal in (False, True):
        ref = torch.nn.functional.scaled_dot_product_attention(q[:1, :1].float(), k[:1, :1].float(),
                                                               v[:1, :1].float(), is_causal=causal)
        for ver in ("v1", "v2"):
            f = lambda: kernels.launch_forward(q, k, v, o, lse, causal, 1 / math.sqrt(D), version=ver, config=cfg)  # noqa: E731
            f()
            err = (o[:1, :1].float() - ref).abs().max().item()
            ms = do_bench(f, return_mode="median") if err < 2e-2 else math.nan
            print(f"fwd {ver} D={D} causal={causal!s:<5} N={N} tiles {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} "
                  f"s{cfg.num_stages}: err {err:.1e}, {flops(B, H, N, N, D, causal) / ms / 1e9:6.1f} TFLOP/s", flush=True)
