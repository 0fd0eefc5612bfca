"""GPU only: what Triton's automatic warp specialisation gives a FlashAttention forward on this GPU.

    python scripts/warp_spec_probe.py [--n 16384] [--d 128] [--json OUT.json]

Issue: Hopper's fastest attention kernels (cuDNN, FlashAttention-3) split a program's warps into a producer
(TMA loads) and consumers (the two GEMMs and the softmax), which Triton's ``tl.dot`` pipeline does not.
Triton >= 3.4 offers one switch for it, ``tl.range(..., warp_specialize=True)`` on the key loop.  This script
writes the smallest dense (non-causal) forward with host-made tensor descriptors, the loop's only difference
being that switch, checks each configuration against SDPA in float32, and times both settings over a few
tiles beside flashlab's op and SDPA's cuDNN backend (``do_bench`` medians, fp16 and bf16, 16k tokens:
B = 16384 / N, H = 2048 / D).  A configuration that does not compile is reported with its error, not dropped.

The kernel is a probe, not a version of the course: it has no causal mask, no ragged edge (N must be a
multiple of the tiles) and no LSE.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, ".")


@triton.jit
def _probe_fwd(q_desc, k_desc, v_desc, o_desc, N, scale_log2, H: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    row0 = bh * N + pid_m * BLOCK_M                     # descriptors see (B * H * N, D)
    q = q_desc.load([row0, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in tl.range(0, N, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        k = k_desc.load([bh * N + start, 0])
        s = tl.dot(q, k.T) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([bh * N + start, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    o_desc.store([row0, 0], (acc / l_i[:, None]).to(o_desc.dtype))


def probe(q, k, v, block_m, block_n, warps, stages, ws):
    from triton.tools.tensor_descriptor import TensorDescriptor
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    descs = [TensorDescriptor.from_tensor(t.view(B * H * N, D), [bm, D])
             for t, bm in ((q, block_m), (k, block_n), (v, block_n), (o, block_m))]
    grid = (N // block_m, B * H)

    def run():
        _probe_fwd[grid](*descs, N, D ** -0.5 * 1.4426950408889634, H=H, D=D, BLOCK_M=block_m, BLOCK_N=block_n,
                         WS=ws, STAGES=stages, num_warps=warps)
    return o, run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--d", type=int, nargs="+", default=[128])
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("warp_spec_probe.py times GPU kernels: run it on a CUDA machine")
    from triton.testing import do_bench
    import flashlab
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def alloc(size, align, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")
    triton.set_allocator(alloc)
    configs = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2)]
    rows = []
    for dname in a.dtypes:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
        for D in a.d:
            for N in a.n:
                B, H = max(1, 16384 // N), 2048 // D
                flops = 4 * B * H * N * N * D
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt, generator=g) for _ in range(3))
                ref = F.scaled_dot_product_attention(q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float())
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = flops / do_bench(lambda: F.scaled_dot_product_attention(q, k, v),
                                             return_mode="median") * 1e-9
                ours = flops / do_bench(lambda: flashlab.flash_attention(q, k, v), return_mode="median") * 1e-9
                for bm, bn, w, st in configs:
                    tf = {}
                    for ws in (False, True):
                        key = f"{dname} D{D} N{N} {bm}x{bn} w{w} s{st} ws={ws}"
                        try:
                            o, run = probe(q, k, v, bm, bn, w, st, ws)
                            run()
                            err = (o[:1, :2].float() - ref).abs().max().item()
                            if not err < 2e-2:
                                tf[ws] = f"WRONG {err:.3g}"
                                continue
                            tf[ws] = flops / do_bench(run, return_mode="median") * 1e-9
                        except Exception as e:   # noqa: BLE001 - report, keep going
                            tf[ws] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''}"
                        print(key, tf[ws], flush=True)
                    rows.append(dict(dtype=dname, D=D, N=N, tiles=f"{bm}x{bn}", warps=w, stages=st,
                                     plain=tf[False], warp_specialized=tf[True], flashlab_op=ours, cudnn=cudnn))
    print()
    print(f"{'dtype':<6}{'D':>4}{'N':>7}  {'tiles':<8}{'w':>2}{'s':>2}  {'plain':>8}{'ws':>8}  {'op':>6}{'cuDNN':>7}")
    for r in rows:
        fmt = lambda x: f"{x:8.0f}" if isinstance(x, float) else f"{x[:8]:>8}"  # noqa: E731
        print(f"{r['dtype']:<6}{r['D']:>4}{r['N']:>7}  {r['tiles']:<8}{r['warps']:>2}{r['stages']:>2}  "
              f"{fmt(r['plain'])}{fmt(r['warp_specialized'])}  {r['flashlab_op']:6.0f}{r['cudnn']:7.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
