"""Time the backward kernels under a few tile configurations (GPU only); prints a table.

    python scripts/sweep_backward.py

Each candidate is checked against the default configuration's gradients before it is timed.
"""
import math

import torch
from triton.testing import do_bench

import flashlab  # noqa: F401
from flashlab.bench import flops
from flashlab.kernels import Config, launch_backward, launch_forward

C = Config
CANDIDATES = {
    "default": None,
    "32x128 / 128x32, 4w, 3st": (C(32, 128, 4, 3), C(128, 32, 4, 3)),
    "32x128 / 128x32, 4w, 5st": (C(32, 128, 4, 5), C(128, 32, 4, 5)),
    "64x128 / 128x64, 8w, 3st": (C(64, 128, 8, 3), C(128, 64, 8, 3)),
    "64x64 / 64x64, 4w, 3st": (C(64, 64, 4, 3), C(64, 64, 4, 3)),
    "32x64 / 64x32, 4w, 3st": (C(32, 64, 4, 3), C(64, 32, 4, 3)),
}
print(f"{'D':>4} {'causal':>6}  {'config':<28}{'ms':>8}{'TFLOP/s':>9}  check")
for D in (64, 128):
    for causal in (False, True):
        N, H, B = 16384, 2048 // D, 1
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(4))
        o, lse = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
        s = 1 / math.sqrt(D)
        launch_forward(q, k, v, o, lse, causal, s)
        ref = None
        for name, cfg in CANDIDATES.items():
            g = [torch.empty_like(t) for t in (q, k, v)]
            try:
                launch_backward(q, k, v, o, lse, do, *g, causal, s, config=cfg)
                if ref is None:
                    ref = [t.clone() for t in g]
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(g, ref))
                ms = do_bench(lambda: launch_backward(q, k, v, o, lse, do, *g, causal, s, config=cfg),
                              return_mode="median")
                print(f"{D:>4} {str(causal):>6}  {name:<28}{ms:>8.3f}{flops(B, H, N, N, D, causal, 'bwd') / ms / 1e9:>9.0f}"
                      f"  max diff {err:.1e}", flush=True)
            except Exception as e:
                print(f"{D:>4} {str(causal):>6}  {name:<28} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
