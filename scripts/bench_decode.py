"""Decoding speed: flashlab.flash_decode against SDPA (its best backend) and FlexAttention, on one GPU.

    python scripts/bench_decode.py                   # the table (TB/s, us, ratios), gated on correctness
    python scripts/bench_decode.py --sweep           # also time num_splits and tile configs (tuning data)
    python scripts/bench_decode.py --json out.json   # and save every number

Shapes (issue 20): B 8, 32 query / 8 KV heads, D 128, bf16, Nq 1, every sequence full, keys 8k / 32k / 128k,
and B 1 with one 128k sequence.  Providers, each gated on correctness against a float32 reference
(two sequences of each shape) before it is timed:

  * flashlab contiguous:  flash_decode(q, k, v, cache_seqlens)
  * flashlab paged 16/64: flash_decode(q, k_pool, v_pool, cache_seqlens, block_table=...) with a shuffled
                          pool of blocks of 16 / 64 keys
  * SDPA: F.scaled_dot_product_attention(q, k, v, enable_gqa=True) under each backend that accepts it
          (flash, cuDNN, efficient; math is far slower); the fastest is the one compared against
  * Flex: torch.compile(flex_attention) with a block mask for the lengths (kv_idx < len[b]), enable_gqa

Bandwidth counts the K and V bytes that must be read, 2 * B * H_kv * N * D * 2 bytes (q and o are
negligible).  Times: triton.testing.do_bench medians after a warm-up (eager calls, the usual
protocol), plus a CUDA-graph replay for flashlab and SDPA (the kernels without host launch costs).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

import flashlab
from flashlab.decode import _decode

HBM = 4.8e12   # the H200's datasheet bandwidth, bytes/s
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def bench(fn, warmup=25, rep=100):
    import triton
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e-3   # seconds


def bench_graph(fn, reps=20):
    """Median time of one call replayed from a CUDA graph that holds `reps` calls."""
    import triton
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median") * 1e-3 / reps


def graph_check(q, k, v, table, N, gen, who):
    """Capture one call in a CUDA graph, give it new (ragged) lengths, replay: it must match an eager call."""
    lens = torch.full((q.shape[0],), N, dtype=torch.int32, device=q.device)
    f = lambda: flashlab.flash_decode(q, k, v, lens, block_table=table, return_lse=True)   # noqa: E731
    f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o_g, l_g = f()
    lens.copy_(torch.randint(1, N + 1, (q.shape[0],), generator=gen, dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    o_e, l_e = f()
    d = max((o_g.float() - o_e.float()).abs().max().item(), (l_g - l_e).abs().max().item())
    log(f"   CUDA graph of {who}: replay with new lengths {lens.tolist()} vs eager: max diff {d:.2e} "
        f"({'ok' if d <= 1e-2 else 'WRONG'})")


def reference(q, k, v, lens, rows):
    """float32 attention of sequences `rows`, (len(rows), H, 1, D)."""
    out = []
    B, H, Nq, D = q.shape
    G = H // k.shape[1]
    for b in rows:
        n = int(lens[b])
        kk = k[b, :, :n].float().repeat_interleave(G, 0)
        vv = v[b, :, :n].float().repeat_interleave(G, 0)
        s = (q[b].float() @ kk.transpose(-1, -2)) / math.sqrt(D)
        out.append(torch.softmax(s, -1) @ vv)
    return torch.stack(out)


def make_pool(k, v, bs, gen):
    B, H_kv, N, D = k.shape
    nb = N // bs
    perm = torch.randperm(B * nb, generator=gen).to(k.device)
    kp = torch.empty(B * nb, H_kv, bs, D, device=k.device, dtype=k.dtype)
    vp = torch.empty_like(kp)
    kp[perm] = k.view(B, H_kv, nb, bs, D).permute(0, 2, 1, 3, 4).reshape(B * nb, H_kv, bs, D)
    vp[perm] = v.view(B, H_kv, nb, bs, D).permute(0, 2, 1, 3, 4).reshape(B * nb, H_kv, bs, D)
    return kp, vp, perm.view(B, nb).to(torch.int32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--shapes", default="8:8192,8:32768,8:131072,1:131072")
    args = ap.parse_args()
    import triton
    props = torch.cuda.get_device_properties(0)
    log(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    H, H_kv, D, Nq, dt = 32, 8, 128, 1, torch.bfloat16
    records = []

    # a read-only ceiling: one reduction over 4 GiB (bytes read / time)
    x = torch.randn(2**31, device=dev, dtype=dt)
    t = bench(lambda: x.sum(dtype=torch.float32), 10, 50)
    ceiling = x.numel() * 2 / t / 1e12
    log(f"ceiling: torch sum over {x.numel() * 2 / 1e9:.1f} GB reads at {ceiling:.2f} TB/s")
    del x

    sdpa_backends = {"flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                     "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
                     "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION}   # math: far slower, left out
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    results = {}
    for B, N in shapes:
        name = f"B{B} N{N // 1024}k"
        q = torch.randn(B, H, Nq, D, device=dev, dtype=dt)
        k = torch.randn(B, H_kv, N, D, device=dev, dtype=dt)
        v = torch.randn(B, H_kv, N, D, device=dev, dtype=dt)
        lens = torch.full((B,), N, dtype=torch.int32, device=dev)
        nbytes = 2 * B * H_kv * N * D * 2
        rows = sorted({0, B - 1})
        ref = reference(q, k, v, lens, rows)
        res = results.setdefault(name, {"bytes": nbytes})

        ref_max = ref.abs().max().item()

        def gate(o, who):
            """Max error against float32 at most 3 % of max |O| (bf16 rounds O to 0.4 %; zeros would fail)."""
            err = (o[rows].float() - ref).abs().max().item()
            ok = err <= 0.03 * ref_max
            if not ok:
                log(f"{name} {who}: WRONG (max err {err:.3e}); not timed")
            return ok, err

        def record(who, t, tg=None, err=None, extra=None):
            r = dict(shape=name, provider=who, us=t * 1e6, TBps=nbytes / t / 1e12,
                     graph_us=None if tg is None else tg * 1e6,
                     graph_TBps=None if tg is None else nbytes / tg / 1e12, err=err, **(extra or {}))
            res[who] = r
            records.append(r)
            g = "" if tg is None else f"   graph {tg * 1e6:8.1f} us {nbytes / tg / 1e12:5.2f} TB/s"
            log(f"{name:<12} {who:<22} {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s{g}")

        layouts = {"flashlab contiguous": (k, v, None)}
        for bs in (16, 64):
            layouts[f"flashlab paged {bs}"] = make_pool(k, v, bs, gen)
        for who, (kc, vc, table) in layouts.items():
            f = lambda: flashlab.flash_decode(q, kc, vc, lens, block_table=table)   # noqa: E731
            ok, err = gate(f(), who)
            if ok:
                record(who, bench(f), bench_graph(f), err)
            if N == shapes[0][1] and B == shapes[0][0]:
                graph_check(q, kc, vc, table, N, gen, who)
            if args.sweep:
                for S in ([2, 4, 8, 16, 33] if B > 1 else [16, 33, 66, 132, 264]):
                    fs = lambda: flashlab.flash_decode(q, kc, vc, lens, block_table=table, num_splits=S)  # noqa: E731
                    if gate(fs(), who)[0]:
                        t = bench(fs, 10, 40)
                        records.append(dict(shape=name, provider=who, sweep="num_splits", num_splits=S, us=t * 1e6,
                                            TBps=nbytes / t / 1e12))
                        log(f"   sweep {who} num_splits={S:<4} {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s")
                for cfg in ([] if not (N == 32768 or B == 1) or "64" in who else [dict(BLOCK_N=64, num_warps=4, num_stages=4), dict(BLOCK_N=128, num_warps=4, num_stages=3),
                             dict(BLOCK_N=128, num_warps=8, num_stages=3), dict(BLOCK_N=32, num_warps=4, num_stages=4),
                             dict(BLOCK_N=64, num_warps=2, num_stages=3)]):
                    fc = lambda: _decode(q, kc, vc, lens, table, False, None, None, None, None, False, config=cfg)  # noqa: E731
                    try:
                        okc = gate(fc(), who)[0]
                    except Exception as e:   # out of resources, say
                        log(f"   config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    if okc:
                        t = bench(fc, 10, 40)
                        records.append(dict(shape=name, provider=who, sweep="config", config=cfg, us=t * 1e6,
                                            TBps=nbytes / t / 1e12))
                        log(f"   config {who} {cfg} {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s")
        del layouts

        best = None
        for bname, be in sdpa_backends.items():
            f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)   # noqa: E731
            try:
                with torch.nn.attention.sdpa_kernel([be]):
                    o = f()
                    ok, err = gate(o, f"SDPA {bname}")
                    if not ok:
                        continue
                    t = bench(f)
                    try:
                        tg = bench_graph(f)
                    except Exception:
                        tg = None
            except Exception as e:
                log(f"{name} SDPA {bname}: not available ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
                continue
            record(f"SDPA {bname}", t, tg, err)
            if best is None or t < res[best]["us"] * 1e-6:
                best = f"SDPA {bname}"
        res["SDPA best"] = best

        if not args.no_flex:
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                flex = torch.compile(flex_attention, dynamic=False)

                def mask_mod(b, h, q_idx, kv_idx):
                    return kv_idx < lens[b]
                bm = create_block_mask(mask_mod, B, None, Nq, N, device="cuda")
                f = lambda: flex(q, k, v, block_mask=bm, enable_gqa=True)   # noqa: E731
                tc = time.time()
                o = f()
                torch.cuda.synchronize()
                log(f"{name} Flex compiled in {time.time() - tc:.1f} s")
                ok, err = gate(o, "Flex")
                if ok:
                    record("Flex", bench(f), None, err)
            except Exception as e:
                log(f"{name} Flex failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        del q, k, v
        torch.cuda.empty_cache()
        if args.json:
            json.dump(dict(device=props.name, torch=torch.__version__, triton=triton.__version__,
                           read_ceiling_TBps=ceiling, command=" ".join(sys.argv), results=results,
                           records=records), open(args.json, "w"), indent=1)

    # ---------------------------------------------------------------- the table
    print()
    print(f"{props.name}; torch {torch.__version__}, triton {triton.__version__}; bf16, H 32 / H_kv 8, D 128, Nq 1; "
          f"TB/s = K+V bytes / median time; x SDPA, x Flex: their time / ours; read ceiling (torch sum) {ceiling:.2f} TB/s")
    hdr = f"{'shape':<12} {'provider':<22} {'us':>8} {'TB/s':>6} {'%4.8':>5} {'x SDPA':>7} {'x Flex':>7} {'graph us':>9} {'graph TB/s':>10}"
    print(hdr)
    print("-" * len(hdr))
    for name, res in results.items():
        sd = res.get(res.get("SDPA best") or "", None)
        fx = res.get("Flex")
        for who, r in res.items():
            if not isinstance(r, dict):
                continue
            xs = f"{sd['us'] / r['us']:7.2f}" if sd else "      -"
            xf = f"{fx['us'] / r['us']:7.2f}" if fx else "      -"
            gu = f"{r['graph_us']:9.1f}" if r.get("graph_us") else "        -"
            gt = f"{r['graph_TBps']:10.2f}" if r.get("graph_TBps") else "         -"
            print(f"{name:<12} {who:<22} {r['us']:8.1f} {r['TBps']:6.2f} {100 * r['TBps'] * 1e12 / HBM:4.0f}% "
                  f"{xs} {xf} {gu} {gt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
