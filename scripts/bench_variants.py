"""Attention variants on a GPU: flashlab (forward v4 / backward v5) beside FlexAttention and SDPA.

    python scripts/bench_variants.py [--quick] [--json out.json] [--only gqa,window,...]

The issue's shapes (bf16, D = 128):
    gqa      GQA 32 query / 8 K/V heads, causal, B 2, N 8192
    window   sliding window 1024 (window=(1023, 0)), causal, B 1, H 16, N 16384
    docs     8 packed documents of 2048, causal within each, B 1, H 16, N 16384 (flashlab: varlen)
    softcap  soft-cap 30, causal, B 2, H 16, N 8192
    dropout  p = 0.1 against the same call without dropout, causal, B 2, H 16, N 4096 (fwd + bwd)
    padding  bool key-padding mask (B, 1, 1, Nk), B 4, H 16, N 4096, 3/4 of the keys kept on average

Protocol (DESIGN.md): every provider is gated on correctness first (against flashlab's float64
reference at a small size of the same variant, then against flashlab at the timed size), then timed
with ``triton.testing.do_bench(..., return_mode="median")`` after a warm-up.  TFLOP/s count only the
query-key pairs the variant leaves visible (4 D FLOPs per pair forward, 2.5 times that backward).
FlexAttention is ``torch.compile(flex_attention)`` with its block mask (built once, outside the timing).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import flashlab  # noqa: E402
from flashlab.reference import attention_variants_torch, attention_varlen_torch  # noqa: E402

DT = torch.bfloat16
D = 128


def _bench(fn):
    from triton.testing import do_bench
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _time_fwd_bwd(fwd, inputs):
    """(fwd ms, bwd ms): forward alone; backward of one retained graph."""
    t_f = _bench(lambda: fwd(*inputs))
    out = fwd(*inputs)
    do = torch.randn_like(out)
    t_b = _bench(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True))
    return t_f, t_b


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def _inputs(B, H, Hk, N, dtype=DT):
    q = torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hk, N, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hk, N, D, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _gate_small(name, kw, Hq=4, Hk=4, N=512, varlen_docs=None):
    """flashlab against the float64 reference at a small size of the same variant (fwd and grads)."""
    torch.manual_seed(0)
    if varlen_docs:
        lens = [N // varlen_docs] * varlen_docs
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(N, Hq, D, device="cuda", dtype=DT, requires_grad=True) for _ in range(3))
        o = flashlab.flash_attention_varlen(q, k, v, cu, cu, lens[0], lens[0], **kw)
        ref = lambda a, b, c: attention_varlen_torch(a, b, c, cu, cu, **kw)[0]
    else:
        q, k, v = _inputs(1, Hq, Hk, N)
        o = flashlab.flash_attention(q, k, v, enable_gqa=Hq != Hk, **kw)
        ref = lambda a, b, c: attention_variants_torch(a, b, c, **kw)[0]
    do = torch.randn_like(o)
    g = torch.autograd.grad(o, (q, k, v), do)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ro = ref(*r)
    rg = torch.autograd.grad(ro, r, do.double())
    errs = [_err(o, ro)] + [_err(a, b) / max(1.0, b.abs().max().item()) for a, b in zip(g, rg)]
    ok = errs[0] < 2e-2 and all(e < 5e-2 for e in errs[1:])
    print(f"  gate {name:8s} small N={N}: err o {errs[0]:.1e}, dq/dk/dv {errs[1]:.1e} {errs[2]:.1e} {errs[3]:.1e}"
          f" {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def _row(rows, variant, provider, pairs, B, H, tf, tb, err, note=""):
    f = 4.0 * D * pairs * B * H
    r = dict(variant=variant, provider=provider, fwd_ms=tf, bwd_ms=tb,
             fwd_tflops=f / tf * 1e-9 if tf == tf else math.nan,
             bwd_tflops=2.5 * f / tb * 1e-9 if tb == tb else math.nan, max_err_vs_flashlab=err, note=note)
    rows.append(r)
    print(f"  {variant:8s} {provider:26s} fwd {tf:8.3f} ms {r['fwd_tflops']:6.1f} TF/s | bwd {tb:8.3f} ms "
          f"{r['bwd_tflops']:6.1f} TF/s | err {err:.1e} {note}", flush=True)


def _causal_pairs(n):
    return n * (n + 1) / 2


def _guarded(rows, variant, provider, pairs, B, H, fwd, inputs, ref_out):
    try:
        out = fwd(*inputs)
        err = _err(out, ref_out)
        if not err < 5e-2:
            _row(rows, variant, provider, pairs, B, H, math.nan, math.nan, err, "WRONG: not timed")
            return
        tf, tb = _time_fwd_bwd(fwd, inputs)
        _row(rows, variant, provider, pairs, B, H, tf, tb, err)
    except Exception as e:  # a provider that cannot run this variant
        rows.append(dict(variant=variant, provider=provider, error=f"{type(e).__name__}: {str(e)[:200]}"))
        print(f"  {variant:8s} {provider:26s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


def bench_gqa(rows, quick):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, H, Hk, N = (1, 32, 8, 2048) if quick else (2, 32, 8, 8192)
    if not _gate_small("gqa", dict(is_causal=True), Hq=8, Hk=2):
        return
    q, k, v = _inputs(B, H, Hk, N)
    pairs = _causal_pairs(N)
    fl = lambda q, k, v: flashlab.flash_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = fl(q, k, v)
    _guarded(rows, "gqa", "flashlab", pairs, B, H, fl, (q, k, v), ref)

    def sdpa(backend, rep=False):
        def f(q, k, v):
            if rep:
                k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not rep)
        return f
    _guarded(rows, "gqa", "sdpa-cudnn", pairs, B, H, sdpa(SDPBackend.CUDNN_ATTENTION), (q, k, v), ref)
    _guarded(rows, "gqa", "sdpa-flash", pairs, B, H, sdpa(SDPBackend.FLASH_ATTENTION), (q, k, v), ref)
    _guarded(rows, "gqa", "sdpa-flash, K/V repeated", pairs, B, H, sdpa(SDPBackend.FLASH_ATTENTION, True), (q, k, v),
             ref)
    flex, cbm = _flex()
    bm = cbm(lambda b, h, qi, ki: ki <= qi, None, None, N, N, device="cuda")
    _guarded(rows, "gqa", "flex", pairs, B, H, lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True),
             (q, k, v), ref)


def bench_window(rows, quick):
    B, H, N, W = (1, 16, 4096, 1024) if quick else (1, 16, 16384, 1024)
    if not _gate_small("window", dict(is_causal=True, window=(127, 0))):
        return
    q, k, v = _inputs(B, H, H, N)
    pairs = sum(min(i + 1, W) for i in range(N))
    fl = lambda q, k, v: flashlab.flash_attention(q, k, v, is_causal=True, window=(W - 1, 0))
    ref = fl(q, k, v)
    _guarded(rows, "window", "flashlab", pairs, B, H, fl, (q, k, v), ref)
    flex, cbm = _flex()
    bm = cbm(lambda b, h, qi, ki: (ki <= qi) & (qi - ki < W), None, None, N, N, device="cuda")
    _guarded(rows, "window", "flex", pairs, B, H, lambda q, k, v: flex(q, k, v, block_mask=bm), (q, k, v), ref)


def bench_docs(rows, quick):
    B, H, N, ndoc = (1, 16, 4096, 8) if quick else (1, 16, 16384, 8)
    if not _gate_small("docs", dict(is_causal=True), N=512, varlen_docs=4):
        return
    L = N // ndoc
    cu = torch.arange(0, N + 1, L, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(N, H, D, device="cuda", dtype=DT, requires_grad=True) for _ in range(3))
    pairs = ndoc * _causal_pairs(L)
    fl = lambda q, k, v: flashlab.flash_attention_varlen(q, k, v, cu, cu, L, L, is_causal=True)
    ref = fl(q, k, v)
    _guarded(rows, "docs", "flashlab varlen", pairs, 1, H, fl, (q, k, v), ref)
    flex, cbm = _flex()
    doc = torch.arange(N, device="cuda") // L
    bm = cbm(lambda b, h, qi, ki: (ki <= qi) & (doc[qi] == doc[ki]), None, None, N, N, device="cuda")
    t = lambda x: x.transpose(0, 1)[None]
    _guarded(rows, "docs", "flex", pairs, 1, H,
             lambda q, k, v: flex(t(q), t(k), t(v), block_mask=bm)[0].transpose(0, 1), (q, k, v), ref)
    try:
        from torch.nn.attention.varlen import varlen_attn
        _guarded(rows, "docs", "torch varlen_attn", pairs, 1, H,
                 lambda q, k, v: varlen_attn(q, k, v, cu, cu, L, L, is_causal=True), (q, k, v), ref)
    except ImportError:
        pass


def bench_softcap(rows, quick):
    B, H, N, c = (1, 16, 4096, 30.0) if quick else (2, 16, 8192, 30.0)
    if not _gate_small("softcap", dict(is_causal=True, softcap=c)):
        return
    q, k, v = _inputs(B, H, H, N)
    pairs = _causal_pairs(N)
    fl = lambda q, k, v: flashlab.flash_attention(q, k, v, is_causal=True, softcap=c)
    ref = fl(q, k, v)
    _guarded(rows, "softcap", "flashlab", pairs, B, H, fl, (q, k, v), ref)
    flex, cbm = _flex()
    bm = cbm(lambda b, h, qi, ki: ki <= qi, None, None, N, N, device="cuda")

    def sm(score, b, h, qi, ki):
        return c * torch.tanh(score / c)
    _guarded(rows, "softcap", "flex", pairs, B, H, lambda q, k, v: flex(q, k, v, score_mod=sm, block_mask=bm),
             (q, k, v), ref)


def bench_dropout(rows, quick):
    B, H, N = (1, 16, 2048) if quick else (2, 16, 4096)
    q, k, v = _inputs(B, H, H, N)
    pairs = _causal_pairs(N)
    for p in (0.0, 0.1):
        fl = lambda q, k, v, p=p: flashlab.flash_attention(q, k, v, dropout_p=p, is_causal=True, seed=1)
        tf, tb = _time_fwd_bwd(fl, (q, k, v))
        _row(rows, "dropout", f"flashlab p={p}", pairs, B, H, tf, tb, 0.0,
             "(p = 0 runs the op's plain kernels)" if p == 0 else "")
    fl = lambda q, k, v: flashlab.variants.attention(q, k, v, is_causal=True)     # v4 / v5, every flag off
    tf, tb = _time_fwd_bwd(fl, (q, k, v))
    _row(rows, "dropout", "flashlab v4/v5, no dropout", pairs, B, H, tf, tb, 0.0)


def bench_padding(rows, quick):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, H, N = (2, 16, 2048) if quick else (4, 16, 4096)
    if not _gate_small("padding", dict(attn_mask=torch.arange(512, device="cuda") < 300)):
        return
    torch.manual_seed(1)
    lens = torch.randint(N // 2, N + 1, (B,), device="cuda")
    mask = (torch.arange(N, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
    q, k, v = _inputs(B, H, H, N)
    pairs = lens.double().mean().item() * N
    fl = lambda q, k, v: flashlab.flash_attention(q, k, v, attn_mask=mask)
    ref = fl(q, k, v)
    _guarded(rows, "padding", "flashlab", pairs, B, H, fl, (q, k, v), ref)

    def eff(q, k, v):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    _guarded(rows, "padding", "sdpa-efficient", pairs, B, H, eff, (q, k, v), ref)


ALL = {"gqa": bench_gqa, "window": bench_window, "docs": bench_docs, "softcap": bench_softcap,
       "padding": bench_padding, "dropout": bench_dropout}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=",".join(ALL))
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
          f"{__import__('triton').__version__}", flush=True)
    rows = []
    for name in a.only.split(","):
        t0 = time.time()
        try:
            ALL[name](rows, a.quick)
        except Exception as e:
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append(dict(variant=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(f"  ({name}: {time.time() - t0:.0f} s)", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
