"""GPU only: the FP8 forward beside the bf16 forward, cuDNN, and each of its tile configs; accuracy first.

    python scripts/bench_fp8.py [--seqlens 4096 16384] [--dims 64 128] [--json OUT.json]

For each shape (16k tokens: B = 16384 / N, H = 2048 / D; causal both ways), on bf16 inputs:

1. accuracy on one (batch, head) against float64 of the original inputs: the bf16 op's max error and the FP8
   forward's (quantisation included), and the FP8 kernel's against float64 of its own dequantised inputs;
2. TFLOP/s (``do_bench`` medians; forward FLOPs 4 B H N^2 D, half when causal): flashlab's bf16 forward (the
   op, no gradient), SDPA's cuDNN backend, the FP8 kernel on inputs already in e4m3 (the plan's tiles, then each
   hand-picked config forced, with descriptor loads and, marked "ptr", with pointer loads), and
   ``flash_attention(..., fp8=True)`` whole (its quantisation included: the Triton kernels of
   flashlab/kernels/quantize_fp8.py on compute capability >= 8.9);
3. quantising Q, K and V^T alone, as ``fp8=True`` does (milliseconds, ``do_bench`` medians; once per shape, the
   same for both causal modes): the plain-torch passes (``flashlab.fp8._quantize_torch``) and the Triton kernels,
   with the HBM bandwidth the kernels' 5 bytes per bf16 element imply, and whether both gave the same bytes;
   the JSON also has the kernels on one tensor stored as (B, H, N, D) and as V^T (B, H, D, N).

Prints a table last; the issue's target is FP8 >= 1.3x the bf16 forward at N = 16384, D = 128.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashlab  # noqa: E402
from flashlab import fp8 as fp8_mod, kernels  # noqa: E402
from flashlab.kernels import forward_fp8, forward_v4, quantize_fp8  # noqa: E402


def quantise_qkv(q, k, v, quantize):
    """Q, K and V^T quantised with ``quantize`` (the torch passes or the kernels), as fp8=True does."""
    return quantize(q), quantize(k), quantize(v, True)


def same_bytes(a, b) -> bool:
    """Whether two quantise_qkv results are equal: the e4m3 bytes and the scales' bits."""
    return all(torch.equal(x8.view(torch.uint8), y8.view(torch.uint8)) and torch.equal(xs, ys)
               for (x8, xs), (y8, ys) in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py times GPU kernels: run it on a CUDA machine")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    cc = torch.cuda.get_device_capability()
    rows = []
    for D in a.dims:
        for N in a.seqlens:
            quant = None
            for causal in (False, True):
                B, H = max(1, 16384 // N), 2048 // D
                fl = 4 * B * H * N * N * D / (2 if causal else 1)
                tf = lambda ms: fl / ms * 1e-9   # noqa: E731
                g = torch.Generator(device="cuda").manual_seed(N + D + causal)
                q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
                (q8, qs), (k8, ks), (vt8, vs) = (fp8_mod.quantize_fp8(q), fp8_mod.quantize_fp8(k),
                                                 fp8_mod.quantize_fp8(v, transpose=True))
                # accuracy on (0, 0)
                ref = F.scaled_dot_product_attention(*(t[:1, :1].double() for t in (q, k, v)), is_causal=causal)
                o16 = flashlab.flash_attention(q, k, v, causal)
                o8 = flashlab.flash_attention_fp8(q8, k8, vt8, qs, ks, vs, causal)
                deq = [fp8_mod.dequantize_fp8(q8[:1, :1], qs[:1, :1]), fp8_mod.dequantize_fp8(k8[:1, :1], ks[:1, :1]),
                       fp8_mod.dequantize_fp8(vt8[:1, :1], vs[:1, :1], transposed=True)]
                ref8 = F.scaled_dot_product_attention(*deq, is_causal=causal)
                row = dict(D=D, N=N, causal=causal, B=B, H=H,
                           err_bf16=(o16[:1, :1].double() - ref).abs().max().item(),
                           err_fp8=(o8[:1, :1].double() - ref).abs().max().item(),
                           err_fp8_kernel=(o8[:1, :1].double() - ref8).abs().max().item())
                row["bf16_op"] = tf(do_bench(lambda: flashlab.flash_attention(q, k, v, causal), return_mode="median"))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    row["cudnn"] = tf(do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                               return_mode="median"))
                row["fp8_plan"] = tf(do_bench(lambda: flashlab.flash_attention_fp8(q8, k8, vt8, qs, ks, vs, causal,
                                                                                     check_scales=False),
                                              return_mode="median"))
                row["fp8_op_with_quantize"] = tf(do_bench(lambda: flashlab.flash_attention(q, k, v, causal, fp8=True),
                                                          return_mode="median"))
                if quant is None:   # causal does not change the quantisation: timed for the first mode only
                    runs = {"torch": fp8_mod._quantize_torch, "triton": quantize_fp8.quantize}
                    quant = {f"quantize_{name}_ms": do_bench(lambda f=f: quantise_qkv(q, k, v, f), return_mode="median")
                             for name, f in runs.items()}
                    quant["quantize_triton_tbps"] = 3 * q.numel() * 5 / quant["quantize_triton_ms"] * 1e-9
                    for name, tr in (("k", False), ("vt", True)):   # one tensor, each store layout
                        quant[f"quantize_triton_{name}_ms"] = do_bench(lambda tr=tr: quantize_fp8.quantize(v, tr),
                                                                       return_mode="median")
                    quant["quantize_same"] = same_bytes(*(quantise_qkv(q, k, v, f) for f in runs.values()))
                row.update(quant)
                o = torch.empty_like(q)
                lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
                row["configs"] = {}
                for cfg, tma in [(c, t) for t in (True, False) for c in forward_fp8.forward_fp8_configs(D, cc)]:
                    name = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}{'' if tma else ' ptr'}"
                    forward_fp8.TMA = tma            # descriptor loads (Hopper's default) or v2's pointer loads
                    try:
                        run = lambda cfg=cfg: kernels.launch_forward(  # noqa: E731
                            q8, k8, vt8, o, lse, causal, D ** -0.5, config=cfg, q_scale=qs, k_scale=ks, v_scale=vs)
                        run()
                        err = (o[:1, :1].double() - ref8).abs().max().item()
                        row["configs"][name] = (tf(do_bench(run, return_mode="median"))
                                                if err <= 4 * row["err_fp8_kernel"] + 1e-3 else f"WRONG {err:.3g}")
                    except Exception as e:   # noqa: BLE001 - a config that does not compile is reported
                        row["configs"][name] = f"error: {type(e).__name__}"
                forward_fp8.TMA = None
                if forward_v4.DESCRIPTOR_ERRORS:      # the descriptor path did not compile: its rows ran pointers
                    row["descriptor_errors"] = list(forward_v4.DESCRIPTOR_ERRORS)
                    row["configs"] = {k if k.endswith(" ptr") else k + " (fell back to ptr)": v
                                      for k, v in row["configs"].items()}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(f"{'D':>4}{'N':>7} {'causal':<7}{'bf16 op':>8}{'cuDNN':>7}{'fp8':>7}{'x bf16':>7}{'fp8+q':>7}{'x bf16':>7}"
          f"{'q torch':>8}{'q triton':>9}{'TB/s':>6}{'same':>6}   err bf16 / fp8 / fp8 kernel   best config")
    for r in rows:
        best = max((v, k) for k, v in r["configs"].items() if isinstance(v, float)) if any(
            isinstance(v, float) for v in r["configs"].values()) else (float("nan"), "-")
        print(f"{r['D']:>4}{r['N']:>7} {str(r['causal']):<7}{r['bf16_op']:>8.0f}{r['cudnn']:>7.0f}{r['fp8_plan']:>7.0f}"
              f"{r['fp8_plan'] / r['bf16_op']:>7.2f}{r['fp8_op_with_quantize']:>7.0f}"
              f"{r['fp8_op_with_quantize'] / r['bf16_op']:>7.2f}{r['quantize_torch_ms']:>8.3f}"
              f"{r['quantize_triton_ms']:>9.3f}{r['quantize_triton_tbps']:>6.2f}{str(r['quantize_same']):>6}   "
              f"{r['err_bf16']:.1e} / {r['err_fp8']:.1e} / {r['err_fp8_kernel']:.1e}   {best[1]} {best[0]:.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
