"""Attention variants on a GPU: flashlab (the plan's versions: forward / backward v6 for GQA, soft-cap, dropout, packed
documents and a window, on an sm_90 GPU at D = 128; forward v4 / backward v5 otherwise) beside
FlexAttention and SDPA.

    python -m flashlab bench --variants [gqa,window,...] [--json out.json] [--no-check]
    python scripts/bench_variants.py [--quick] [--json out.json] [--only gqa,window,...] [--no-check]

Three stages, in order:
  (a) correctness: every variant (K/V heads grouped 4:1 in each) in bf16, GQA and dropout in fp16 too,
      forward and backward, against float64 at a modest size
      (accuracy rule of flashlab/accuracy.py: at most twice PyTorch's own same-dtype error plus a floor),
      the dropout mask against its NumPy copy (flashlab.reference.dropout_keep) bit for bit; any mismatch
      stops the run (exit status 1) before anything is timed;
  (b) the timings below, each provider gated on correctness first;
  (c) the issue's targets (ratio, target, met?), printed last and written into the JSON with the rows.

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
import os
import sys
import time

import torch
import torch.nn.functional as F

import flashlab
from flashlab.kernels import plan as _plan
from flashlab.reference import attention_variants_torch, attention_varlen_torch

DT = torch.bfloat16
D = 128


# ----------------------------------------------------------------------------------------- (a) correctness

def _judge_grads(label, ours, dtype, ref_fn, inputs, do):
    """ours: (o, dq, dk, dv); ref_fn(*inputs) -> o, run in float64 and in ``dtype`` (PyTorch's own error)."""
    from flashlab.accuracy import judge
    outs = {}
    for dt in (torch.float64, dtype):
        xs = [t.detach().to(dt).requires_grad_() for t in inputs]
        o = ref_fn(*xs, dt)
        g = torch.autograd.grad(o, xs, do.to(dt))
        outs[dt] = (o.detach(),) + tuple(g)
    checks = [judge(n, a, s, r, dtype) for n, a, s, r in zip(("o", "dq", "dk", "dv"), ours, outs[dtype],
                                                               outs[torch.float64])]
    ok = all(c.ok for c in checks) and all(torch.isfinite(a).all().item() for a in ours)
    print(f"  check {label:44s} {'ok' if ok else 'MISMATCH'}  "
          + "; ".join(f"{c.name} {c.err:.1e} (bound {c.bound:.1e})" for c in checks), flush=True)
    return ok


def check_variants() -> list:
    """Stage (a).  Returns the labels that failed.  Lengths are multiples of 16 (as the timed ones, so most
    compiled kernels are shared) but not of the tiles: ragged last tiles everywhere."""
    from flashlab import variants
    from flashlab.reference import dropout_keep, dropout_rate
    fails = []
    dev = "cuda" if torch.cuda.is_available() else "cpu"         # cpu: a dry run of this stage in the interpreter
    gen = torch.Generator(device=dev).manual_seed(0)
    B, H, Hk, Nq, Nk, d = (2, 8, 2, 1008, 1104, D) if dev == "cuda" else (2, 4, 2, 70, 90, 32)

    def rnd(*shape, dt):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen)

    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)], device=dev)
    pad = (torch.arange(Nk, device=dev)[None, :] < torch.tensor([Nk, 700], device=dev)[:, None])[:, None, None]
    add = rnd(1, 1, Nq, Nk, dt=torch.float32).clamp(-3, 3)
    cases = [("gqa 8/2 causal", dict(is_causal=True)),
             ("gqa window (255, 0) causal", dict(is_causal=True, window=(255, 0))),
             ("window (100, 50)", dict(window=(100, 50))),
             ("softcap 30 causal", dict(is_causal=True, softcap=30.0)),
             ("alibi causal", dict(is_causal=True, alibi_slopes=slopes)),
             ("bool padding mask (B,1,1,Nk)", dict(attn_mask=pad)),
             ("additive mask (1,1,Nq,Nk)", dict(attn_mask=add))]
    for dtype in (torch.bfloat16, torch.float16):      # bf16: every case; fp16: the first case and dropout
        dn = str(dtype)[6:]
        q, k, v = rnd(B, H, Nq, d, dt=dtype), rnd(B, Hk, Nk, d, dt=dtype), rnd(B, Hk, Nk, d, dt=dtype)
        do = rnd(B, H, Nq, d, dt=dtype)
        for label, kw in (cases if dtype == torch.bfloat16 else cases[:1]):
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            o = flashlab.flash_attention(*xs, enable_gqa=True, **kw)
            ours = (o.detach(),) + torch.autograd.grad(o, xs, do)

            def ref(a, b, c, dt, kw=kw):
                kk = dict(kw)
                if kk.get("attn_mask") is not None and kk["attn_mask"].dtype != torch.bool:
                    kk["attn_mask"] = kk["attn_mask"].to(dt)
                if kk.get("alibi_slopes") is not None:
                    kk["alibi_slopes"] = kk["alibi_slopes"].to(dt)
                return attention_variants_torch(a, b, c, **kk)[0]
            if not _judge_grads(f"{label} {dn}", ours, dtype, ref, (q, k, v), do):
                fails.append(f"{label} {dn}")
        # dropout: the kernels' mask, written by the debug kernel, is the NumPy copy's; the op matches the
        # reference run with that mask and the rate really applied (p in 1/256ths)
        p, seed = 0.1, 2**40 + 17
        keep = variants.dropout_mask(B, H, Nq, Nk, p, seed, device=dev)
        same = all((keep[b, h].cpu().numpy() == dropout_keep(seed, b * H + h, range(Nq), range(Nk), p)).all()
                   for b, h in ((0, 0), (1, H - 1)))
        print(f"  check dropout mask = reference.dropout_keep (NumPy) {'ok' if same else 'MISMATCH'}", flush=True)
        if not same:
            fails.append(f"dropout mask {dn}")
        kw = dict(is_causal=True, window=(300, 0))
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        o = flashlab.flash_attention(*xs, enable_gqa=True, dropout_p=p, seed=seed, **kw)
        ours = (o.detach(),) + torch.autograd.grad(o, xs, do)
        ref = lambda a, b, c, dt: attention_variants_torch(a, b, c, dropout_mask=keep, dropout_p=dropout_rate(p),
                                                           **kw)[0]
        if not _judge_grads(f"dropout 0.1 gqa window causal {dn}", ours, dtype, ref, (q, k, v), do):
            fails.append(f"dropout {dn}")
        if dtype != torch.bfloat16:
            continue
        # packed documents (one empty), GQA, causal, soft-cap
        lens = [304, 0, 517, 1, 1104] if dev == "cuda" else [30, 0, 17, 1, 40]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        T = int(cu[-1])
        pq, pk, pv, pdo = rnd(T, H, d, dt=dtype), rnd(T, Hk, d, dt=dtype), rnd(T, Hk, d, dt=dtype), \
            rnd(T, H, d, dt=dtype)
        kw = dict(is_causal=True, softcap=20.0)
        xs = [t.clone().requires_grad_() for t in (pq, pk, pv)]
        o = flashlab.flash_attention_varlen(*xs, cu, cu, max(lens), max(lens), enable_gqa=True, **kw)
        ours = (o.detach(),) + torch.autograd.grad(o, xs, pdo)

        def vref(a, b, c, dt):
            r = H // Hk
            return attention_varlen_torch(a, b.repeat_interleave(r, 1), c.repeat_interleave(r, 1), cu, cu, **kw)[0]
        if not _judge_grads(f"varlen 5 docs (one empty) gqa softcap {dn}", ours, dtype, vref, (pq, pk, pv), pdo):
            fails.append(f"varlen {dn}")
    if dev == "cuda":   # large enough (B H Nk >= plan.ONE_PASS_MIN_ROWS) that an sm_90 GPU runs backward v6 too
        B6, H6, Hk6, N6 = 2, 16, 4, 2100
        q, k, v = rnd(B6, H6, N6, d, dt=DT), rnd(B6, Hk6, N6 - 40, d, dt=DT), rnd(B6, Hk6, N6 - 40, d, dt=DT)
        do = rnd(B6, H6, N6, d, dt=DT)
        for label, kw in (("gqa 16/4 causal", dict(is_causal=True)), ("window (300, 0) causal", dict(is_causal=True,
                          window=(300, 0))), ("gqa window (200, 77)", dict(window=(200, 77))),
                          ("softcap 30 causal", dict(is_causal=True, softcap=30.0))):
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            o = flashlab.flash_attention(*xs, enable_gqa=True, **kw)
            ours = (o.detach(),) + torch.autograd.grad(o, xs, do)
            ref = lambda a, b, c, dt, kw=kw: attention_variants_torch(a, b, c, **kw)[0]
            if not _judge_grads(f"{label} N {N6} bf16", ours, DT, ref, (q, k, v), do):
                fails.append(f"{label} N {N6}")
    return fails


# ----------------------------------------------------------------------------------------- (b) timings

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
    try:   # one packed sequence: (N, H, D)
        from torch.nn.attention.varlen import varlen_attn
        cu = torch.tensor([0, N], dtype=torch.int32, device="cuda")
        t = lambda x: x[0].transpose(0, 1)
        _guarded(rows, "window", "torch varlen_attn", pairs, B, H,
                 lambda q, k, v: varlen_attn(t(q), t(k), t(v), cu, cu, N, N, window_size=(W - 1, 0))
                 .transpose(0, 1)[None], (q, k, v), ref)
    except ImportError:
        pass


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
                 lambda q, k, v: varlen_attn(q, k, v, cu, cu, L, L, window_size=(-1, 0)), (q, k, v), ref)
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


# ----------------------------------------------------------------------------------------- (c) targets

# (label, variant, flashlab's provider, peer provider, mode, target ratio): flashlab's TFLOP/s over the peer's
TARGETS = [("GQA fwd >= 0.9x cuDNN", "gqa", "flashlab", "sdpa-cudnn", "fwd", 0.9),
           ("GQA bwd >= 0.85x cuDNN", "gqa", "flashlab", "sdpa-cudnn", "bwd", 0.85),
           ("GQA fwd >= 1.3x FlexAttention", "gqa", "flashlab", "flex", "fwd", 1.3),
           ("GQA bwd >= 1.3x FlexAttention", "gqa", "flashlab", "flex", "bwd", 1.3),
           ("window 1024 fwd >= 1.5x FlexAttention", "window", "flashlab", "flex", "fwd", 1.5),
           ("window 1024 bwd >= 1.5x FlexAttention", "window", "flashlab", "flex", "bwd", 1.5),
           ("packed documents fwd >= 1.3x FlexAttention", "docs", "flashlab varlen", "flex", "fwd", 1.3),
           ("packed documents bwd >= 1.3x FlexAttention", "docs", "flashlab varlen", "flex", "bwd", 1.3),
           ("soft-cap fwd >= 1.5x FlexAttention", "softcap", "flashlab", "flex", "fwd", 1.5),
           ("soft-cap bwd >= 1.5x FlexAttention", "softcap", "flashlab", "flex", "bwd", 1.5),
           ("bool padding mask fwd >= 1.0x SDPA efficient", "padding", "flashlab", "sdpa-efficient", "fwd", 1.0),
           ("bool padding mask bwd >= 1.0x SDPA efficient", "padding", "flashlab", "sdpa-efficient", "bwd", 1.0)]


def targets(rows) -> list:
    """The issue's targets against this run's rows: dicts (target, ours, peer, ratio, wanted, met)."""
    by = {(r["variant"], r.get("provider")): r for r in rows}
    out = []
    for label, var, ours, peer, mode, want in TARGETS:
        a, b = by.get((var, ours), {}), by.get((var, peer), {})
        x, y = a.get(f"{mode}_tflops", math.nan), b.get(f"{mode}_tflops", math.nan)
        ratio = x / y if y == y and y else math.nan
        out.append(dict(target=label, ours=x, peer=y, ratio=ratio, wanted=want, met=bool(ratio >= want)))
    # the same call without dropout: flash_attention with p = 0, which runs the plan's plain kernels (v6 on an
    # H200); the v4 / v5 row without dropout is kept beside it (the record before 2026-12-03 divided by that one)
    drop, plain = by.get(("dropout", "flashlab p=0.1"), {}), by.get(("dropout", "flashlab p=0.0"), {})
    t_d = drop.get("fwd_ms", math.nan) + drop.get("bwd_ms", math.nan)
    t_p = plain.get("fwd_ms", math.nan) + plain.get("bwd_ms", math.nan)
    ratio = t_p / t_d if t_d == t_d else math.nan
    out.append(dict(target="dropout p=0.1 fwd+bwd >= 0.75x the call without", ours=t_d, peer=t_p, ratio=ratio,
                    wanted=0.75, met=bool(ratio >= 0.75)))
    return out


def print_targets(tg) -> None:
    print("\ntargets (ratio: flashlab's TFLOP/s over the peer's; dropout: time without over time with)")
    print(f"  {'target':48s} {'ratio':>7s} {'wanted':>7s}  met?")
    for t in tg:
        r = "n/a" if t["ratio"] != t["ratio"] else f"{t['ratio']:.2f}"
        print(f"  {t['target']:48s} {r:>7s} {t['wanted']:>7.2f}  {'yes' if t['met'] else 'NO'}")


ALL = {"gqa": bench_gqa, "window": bench_window, "docs": bench_docs, "softcap": bench_softcap,
       "padding": bench_padding, "dropout": bench_dropout}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashlab bench --variants",
                                 description="the attention variants beside FlexAttention and SDPA (a CUDA GPU)")
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=",".join(ALL), help=f"a comma-separated list of {', '.join(ALL)}")
    ap.add_argument("--no-check", action="store_true", help="skip stage (a), the correctness checks")
    a = ap.parse_args(argv)
    unknown = [n for n in a.only.split(",") if n not in ALL]
    if unknown:
        print(f"unknown variant {', '.join(unknown)}: choose from {', '.join(ALL)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("the variants' benchmark times kernels on a CUDA GPU; this machine has none (notebook 08 shows the "
              "recorded H200 numbers)", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
          f"{__import__('triton').__version__}  FLASHLAB_AUTOTUNE={os.environ.get('FLASHLAB_AUTOTUNE', '1')}",
          flush=True)
    if not a.no_check:
        t0 = time.time()
        print("(a) correctness against float64", flush=True)
        fails = check_variants()
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
        from flashlab.kernels import forward_v4
        for err in forward_v4.DESCRIPTOR_ERRORS:   # then (a) checked the pointer loads
            print(f"  DESCRIPTOR PATH FAILED TO COMPILE (pointer loads run instead): {err}", flush=True)
        if fails:
            print(f"\nMISMATCH: {', '.join(fails)}: stopping before any timing", flush=True)
            return 1
    print("(b) timings", flush=True)
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
    print("\nwhat ran (the launch plans of the variant calls; descriptors: Hopper and aligned strides)")
    for p in list(_plan._PLANS.values()):
        if p.variant.features() or p.fwd_version == "v4":
            steps = "; ".join(f"{s.kernel} {s.config}" for s in p.forward + p.backward[1:])
            desc = "yes" if p.facts.hopper and p.layout.tma else "no"
            print(f"  B={p.B} H={p.H} N={p.Nq} {', '.join(p.variant.describe(p.causal)) or 'no feature'}: {steps}; "
                  f"descriptor loads {desc}")
    from flashlab.kernels import forward_v4
    for err in forward_v4.DESCRIPTOR_ERRORS:
        print(f"  DESCRIPTOR PATH FAILED TO COMPILE (pointer loads ran instead): {err}")
    tg = targets(rows)
    print_targets(tg)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, targets=tg), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
