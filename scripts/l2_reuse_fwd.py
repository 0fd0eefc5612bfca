"""Does the FA2 forward's re-reading of K and V go to HBM, or is it served by the L2 cache?

Notebook 01 draws two places for a fused forward on the roofline: the ideal one (Q, K, V read once:
intensity N/e) and one where every query tile re-reads all of K and V from HBM (intensity about
2·B_r/e, left of the H200's ridge). This script decides between them by timing, on a GPU:

  1. it measures the HBM bandwidth (a large device-to-device copy) and checks flashlab's forward
     against SDPA on the same inputs;
  2. it times flashlab's forward (median of do_bench) at 16k tokens, fp16, non-causal;
  3. in that time HBM can move at most bandwidth × time bytes. If the no-cache model needs more,
     part of the K/V re-reads must have come from L2; the table prints the smallest share that must.
     0% means the timing alone cannot tell (the kernel is slow enough to have read everything from
     HBM); then only a DRAM byte counter settles it, e.g. Nsight Compute's dram__bytes_read.sum:
         ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum python scripts/l2_reuse_fwd.py

    python scripts/l2_reuse_fwd.py        # needs a CUDA GPU; prints a short table last

scripts/record_part2b.py goes further with the same byte model (flashlab.viz_speed): it times the
forward in two grid orders, so that the K/V re-reads can or cannot find their tiles in L2.
"""
from __future__ import annotations


import torch

import flashlab  # noqa: F401  (first: decides GPU vs interpreter)
from flashlab import device, viz_speed
from flashlab.kernels import forward_config


def main():
    if device.DEVICE.type != "cuda":
        raise SystemExit("needs a CUDA GPU")
    from triton.testing import do_bench

    # 1. bandwidth: copy 4 GiB (read 2 + write 2)
    src = torch.empty(2**30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    bw = 2 * src.numel() * src.element_size() / (ms * 1e-3)
    del src, dst
    rows = []
    for d in (64, 128):
        n = 16384
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        o = flashlab.flash_attention(q, k, v)
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :1], k[:, :1], v[:, :1])
        err = (o[:, :1].float() - ref.float()).abs().max().item()
        if not err < 2e-2:
            raise SystemExit(f"D={d}: flashlab's forward differs from SDPA by {err:.3g}: not timing it")
        ms = do_bench(lambda: flashlab.flash_attention(q, k, v), return_mode="median")
        t = ms * 1e-3
        e = 2
        block_m = forward_config(d, torch.float16).block_m
        ideal = viz_speed.fa2_bytes(b, h, n, d, block_m, e, reread=False)   # Q, K, V once, O, LSE
        nocache = viz_speed.fa2_bytes(b, h, n, d, block_m, e)                # Q, O, LSE once; K, V per Q tile
        hbm_max = bw * t
        share = viz_speed.l2_share_min(nocache, ideal, t, bw)
        tflops = 4.0 * b * h * n * n * d / t / 1e12
        rows.append((d, block_m, ms, tflops, ideal / 2**30, nocache / 2**30, hbm_max / 2**30, share))
        del q, k, v, o
    print(f"\nHBM bandwidth (copy): {bw / 1e12:.2f} TB/s; fp16, non-causal, N=16384, 16k tokens, median of do_bench")
    print(f"{'D':>4} {'B_r':>4} {'ms':>7} {'TFLOP/s':>8} {'ideal GiB':>10} {'no-L2 GiB':>10} "
          f"{'HBM max GiB':>12} {'K/V re-reads from L2 (at least)':>32}")
    for d, bm, ms, tf, ideal, nocache, hbm, share in rows:
        print(f"{d:>4} {bm:>4} {ms:>7.3f} {tf:>8.0f} {ideal:>10.2f} {nocache:>10.2f} {hbm:>12.2f} {100 * share:>31.0f}%")
    print("(0%: timing alone cannot tell; count DRAM bytes with a profiler, see the docstring)")


if __name__ == "__main__":
    main()
