"""The variants in forward and backward v6 (GQA, sliding windows, soft-cap as constexpr branches, Hopper only):
where the plan runs them, that each variant's kernel compiles for sm_90 with this Triton (no GPU needed), and on
an sm_90 GPU their accuracy against float64 through flashlab.flash_attention, ragged and Nq != Nk, rows that see
no key, large logits.  (test_variants.py checks every variant in forward v4 / backward v5, in the interpreter.)"""
import json

import pytest
import torch

import flashlab
from flashlab import device
from flashlab.kernels import backward_v6, forward_v6
from flashlab.kernels import plan as P

from test_forward_v6 import compile_in_child
from test_variants import _check

needs_gluon = pytest.mark.skipif(not forward_v6.AVAILABLE, reason="this Triton has no Gluon warp specialisation")
H200 = P.SIMULATED["h200"]
bf16, fp16 = torch.bfloat16, torch.float16


def test_v6_declares_what_it_implements():
    assert forward_v6.SUPPORTS == {"gqa", "window", "softcap", "varlen", "dropout"}
    assert backward_v6.SUPPORTS == {"gqa", "window", "softcap", "dropout", "varlen"}


@needs_gluon
def test_packed_sequences_can_be_forced_through_both_v6_kernels():
    var = P.Variant(varlen=True, kv_groups=2)
    forced = P.plan(8, 16, 2048, 2048, 128, bf16, True, variant=var, facts=H200, forward_version="v6",
                    backward_version="v6")
    assert (forced.fwd_version, forced.bwd_version) == ("v6", "v6")


@needs_gluon
@pytest.mark.parametrize("var", [P.Variant(kv_groups=4), P.Variant(softcap=True), P.Variant(kv_groups=8, softcap=True),
                                 P.Variant(dropout=True), P.Variant(kv_groups=4, softcap=True, dropout=True),
                                 P.Variant(varlen=True), P.Variant(varlen=True, kv_groups=4, dropout=True)], ids=str)
def test_plan_runs_v6_for_gqa_softcap_dropout_and_packed_sequences(var):
    p = P.plan(2, 32, 8192, 8192, 128, bf16, True, variant=var, facts=H200)
    assert (p.fwd_version, p.bwd_version) == ("v6", "v6"), p
    assert p.backward[1].bh == 2 * 32 // var.kv_groups        # one program per K/V head's tile: dK, dV summed there


@needs_gluon
@pytest.mark.parametrize("var", [P.Variant(window=(1023, 0)), P.Variant(kv_groups=8, window=(255, 64), softcap=True),
                                 P.Variant(varlen=True, window=(-1, 64))], ids=str)
def test_plan_runs_windows_in_forward_v6_on_a_persistent_grid_and_backward_v6(var):
    """Forward v6 on a persistent grid for windows, and backward v6, which measured 1.25-1.30x backward v5 at a window
    of 1024 once it copied LSE and Delta into shared memory (docs/BENCHMARKS.md, 2026-12-05, fifth entry); a caller
    who wants v5's deterministic backward asks for it."""
    p = P.plan(2, 32, 8192, 8192, 128, bf16, True, variant=var, facts=H200)
    assert (p.fwd_version, p.bwd_version) == ("v6", "v6"), p
    assert "persistent grid" in p.reasons["fwd"], p.reasons
    call = forward_v6.variant_scalars(p, 0.1)
    assert forward_v6.persistent(p, call)
    assert p.forward[0].persistent == H200.sms and p.forward[0].grid == (H200.sms,)    # what `flashlab plan` shows
    assert P.plan(2, 32, 8192, 8192, 128, bf16, True, variant=var, facts=H200, deterministic=True).bwd_version == "v5"


@needs_gluon
@pytest.mark.parametrize("var,persistent", [(P.Variant(kv_groups=4), False), (P.Variant(varlen=True), False),
                                            (P.Variant(dropout=True), False), (P.Variant(window=(64, 64)), True)],
                         ids=str)
def test_only_windows_run_on_a_persistent_grid(var, persistent):
    """A persistent grid measured slower for causal attention and packed documents (a static share of the tiles
    loses the hardware's longest-first hand-out) and only as fast non-causal (docs/BENCHMARKS.md, 2026-12-04)."""
    for causal in (False, True):
        p = P.plan(2, 32, 8192, 8192, 128, bf16, causal, variant=var, facts=H200)
        assert p.fwd_version == "v6"
        assert forward_v6.persistent(p, forward_v6.variant_scalars(p, 0.1)) == persistent, (var, causal)
        assert bool(p.forward[0].persistent) == persistent      # the plan says what the launch will do


@needs_gluon
@pytest.mark.parametrize("why,kw,want", [
    ("ALiBi is not v6's", dict(variant=P.Variant(kv_groups=4, alibi=True)), ("v4", "v5")),
    ("a window with dropout, deterministic: forward v6, backward v5",
     dict(variant=P.Variant(window=(64, 0), dropout=True), deterministic=True), ("v6", "v5")),
    ("deterministic dropout: forward v6, backward v5 (the same bits)",
     dict(variant=P.Variant(dropout=True), deterministic=True), ("v6", "v5")),
    ("D = 64", dict(D=64), ("v4", "v5")),
    ("the 1024 bucket", dict(N=1000), ("v4", "v5")),
    ("not Hopper", dict(facts=P.SIMULATED["a100"]), ("v4", "v5")),
    ("fp32", dict(dtype=torch.float32), ("v4", "v5")),
    ("deterministic: backward v5 sums without atomics", dict(deterministic=True), ("v6", "v5")),
    ("a small backward", dict(B=1, H=4, N=2048), ("v6", "v5")),
])
def test_plan_keeps_v4_v5_where_v6_does_not_run(why, kw, want):
    args = dict(B=2, H=16, N=4096, D=128, dtype=bf16, facts=H200, variant=P.Variant(kv_groups=4), deterministic=False)
    args.update(kw)
    p = P.plan(args["B"], args["H"], args["N"], args["N"], args["D"], args["dtype"], True, variant=args["variant"],
               facts=args["facts"], deterministic=args["deterministic"])
    assert (p.fwd_version, p.bwd_version) == want, (why, p)
    if want[1] == "v5" and args["variant"].features() <= forward_v6.SUPPORTS and args["facts"] is H200 \
            and args["D"] == 128 and args["dtype"] == bf16 and args["N"] > 1024:
        assert "backward v6 does too, but" in p.reasons["bwd"], p.reasons["bwd"]   # the plan says why not


COMPILE = """
import json, sys
from flashlab.kernels import backward_v6, forward_v6
out = []
for mod, kw in ((forward_v6, dict(band=True, varlen=True)), (forward_v6, dict(softcap=True, causal=True)),
                (backward_v6, dict(band=True, softcap=True, kv_group=2)), (backward_v6, dict(kv_group=4, causal=True)),
                (backward_v6, dict(kv_group=4)), (forward_v6, dict(dropout=True, causal=True)),
                (backward_v6, dict(dropout=True, kv_group=2, causal=True, varlen=True)),
                (forward_v6, dict(band=True, varlen=True, dropout=True, persist=True))):
    k = mod.compile_sm90(**kw)
    ptx = k.asm["ptx"]
    out.append(dict(shared=k.metadata.shared, wgmma=ptx.count("wgmma.mma_async"), tma="cp.async.bulk.tensor" in ptx,
                    local="ld.local" in ptx or "st.local" in ptx, tanh_exp2=ptx.count("ex2.approx"),
                    mulhi=ptx.count("mul.hi.u32")))
print(json.dumps(out))
"""


@needs_gluon
def test_v6_variant_kernels_compile_for_sm90():
    """Each variant's constexpr branch compiles with this Triton and fits an H200's shared memory.  The backward's
    loops: the window's three (the band's two edges masked, the inside not), causal two, plain one; a GQA program
    walks its group's query heads in one more loop around them, so its PTX holds each loop once.  Dropout compiles
    forward and backward (its Philox in integer multiplies: mul.hi), the backward's with packed sequences too; the
    forward on a persistent grid too."""
    fb, fsc, bb, bgc, bg, fd, bd, fp = compile_in_child(COMPILE, False)
    for k in (fb, fsc, bb, bgc, bg, fd, bd, fp):
        assert k["shared"] <= H200.shared_memory and k["tma"] and not k["local"] and k["wgmma"] > 0
    assert fsc["tanh_exp2"] > fb["tanh_exp2"]                   # soft-cap's tanh adds exponentials
    # Philox's rounds (2 mul.hi a round): present, and each call made once per thread (four copies per lane of a quad
    # would put the forward past 1,000; measured 266 and 132 more than without dropout)
    assert fb["mulhi"] + 40 <= fd["mulhi"] <= fb["mulhi"] + 400 and bg["mulhi"] + 40 <= bd["mulhi"] <= bg["mulhi"] + 250
    assert (bb["wgmma"], bgc["wgmma"], bg["wgmma"], bd["wgmma"]) == (2 * 32 * 3, 2 * 32 * 2, 2 * 32, 2 * 32 * 2)


# ------------------------------------------------------------------------------------------------- on the GPU

sm90 = pytest.mark.skipif(not (device.DEVICE.type == "cuda" and P.device_facts().sm90 and forward_v6.AVAILABLE),
                          reason="needs an sm_90 GPU (H100, H200) and Gluon")

CASES = [
    # (label, B, H, Hk, Nq, Nk, dtype, kwargs)
    ("gqa 8/2", 1, 8, 2, 1100, 1300, bf16, {}),
    ("gqa 8/2 causal, Nq > Nk", 1, 8, 2, 1900, 1200, fp16, dict(is_causal=True)),
    ("mqa causal, large logits", 2, 4, 1, 1500, 1500, bf16, dict(is_causal=True)),
    ("window (300, 0) causal", 1, 2, 2, 2100, 2100, bf16, dict(is_causal=True, window=(300, 0))),
    ("window (200, 77), Nq < Nk", 1, 2, 2, 1500, 2300, fp16, dict(window=(200, 77))),
    ("window (-1, 130)", 1, 2, 1, 1300, 1250, bf16, dict(window=(-1, 130))),
    ("window (100, 4): rows past Nk + 100 see nothing", 1, 2, 2, 2300, 1100, bf16, dict(window=(100, 4))),
    ("softcap 30 causal, large logits", 1, 4, 4, 2000, 2000, bf16, dict(is_causal=True, softcap=30.0)),
    ("softcap 5, Nq > Nk", 1, 2, 2, 1700, 1040, fp16, dict(softcap=5.0)),
    ("softcap 8 + window (255, 0) + gqa 4/2", 1, 4, 2, 1800, 1800, bf16,
     dict(is_causal=True, window=(255, 0), softcap=8.0)),
    ("window (300, 2**31 - 1): a bound past every key", 1, 2, 2, 1500, 1700, bf16, dict(window=(300, 2**31 - 1))),
    ("window (2**31 - 1, 0) causal", 1, 2, 2, 1500, 1500, fp16, dict(is_causal=True, window=(2**31 - 1, 0))),
]


def _inputs(label, B, H, Hk, Nq, Nk, dtype):
    """q (B, H, Nq, 128), k, v (B, Hk, Nk, 128); q and k three times larger for a case labelled "large" logits."""
    s = 3.0 if "large" in label else 1.0
    q = (s * torch.randn(B, H, Nq, 128, device="cuda")).to(dtype)
    k = (s * torch.randn(B, Hk, Nk, 128, device="cuda")).to(dtype)
    return q, k, torch.randn(B, Hk, Nk, 128, device="cuda").to(dtype)


def _force(monkeypatch, **versions):
    """Every plan made from here on runs these versions (windows and packed sequences: the plan's own choice is
    v4 / v5, and these tests are v6's)."""
    plan = P.plan
    monkeypatch.setattr(P, "plan", lambda *a, **kw: plan(*a, **dict(kw, **versions)))
    P.forget()


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gpu_v6_variants_match_float64(case, monkeypatch):
    """Forward and backward v6, forced (the plan runs v6 for GQA and soft-cap only, and not on small problems)."""
    label, B, H, Hk, Nq, Nk, dtype, kw = case
    _force(monkeypatch, forward_version="v6", backward_version="v6")
    try:
        _check(*_inputs(label, B, H, Hk, Nq, Nk, dtype), label, **kw)
        ran = [(p.fwd_version, p.bwd_version) for p in P._PLANS.values() if p.variant.features()]
        assert ran and all(r == ("v6", "v6") for r in ran), ran
    finally:
        P.forget()


MANY = [
    # (label, B, H, Hk, Nq, Nk, dtype, kwargs): more Q tiles x B * H than an H200 has multiprocessors (132), so a
    # persistent program runs several work items, its ring of K / V stages and Q's barrier carried across them
    ("window (300, 0) causal, 288 items", 2, 8, 2, 2300, 2300, bf16, dict(is_causal=True, window=(300, 0))),
    ("window (100, 4), rows that see no key, 304 items", 2, 8, 8, 2400, 1100, fp16, dict(window=(100, 4))),
    ("window (255, 0) + soft-cap 8 + gqa, large logits", 3, 8, 4, 1500, 1500, bf16,
     dict(is_causal=True, window=(255, 0), softcap=8.0)),
    ("gqa causal (persistent only when forced)", 2, 8, 2, 2300, 2300, bf16, dict(is_causal=True)),
    ("gqa, Nq != Nk (persistent only when forced)", 2, 8, 4, 2100, 1900, fp16, {}),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("every_kind", [False, True], ids=["as planned", "every kind persistent"])
@pytest.mark.parametrize("case", MANY, ids=[c[0] for c in MANY])
def test_gpu_v6_persistent_grid_matches_float64(case, every_kind, monkeypatch):
    """Forward v6 on a persistent grid (windows, as the plan runs them; every_kind: causal and non-causal calls too,
    which the plan keeps on a program a tile) with many work items a program, against float64."""
    label, B, H, Hk, Nq, Nk, dtype, kw = case
    if every_kind:
        monkeypatch.setattr(forward_v6, "PERSIST_FOR", frozenset({"band", "varlen", "causal", "dense"}))
    _force(monkeypatch, forward_version="v6")
    try:
        _check(*_inputs(label, B, H, Hk, Nq, Nk, dtype), label, **kw)
        plans = [p for p in P._PLANS.values() if p.variant.features()]
        assert plans and all(p.fwd_version == "v6" for p in plans)
        assert all(forward_v6.persistent(p, forward_v6.variant_scalars(p, 0.1)) == (every_kind or "window" in kw)
                   for p in plans)
    finally:
        P.forget()


VARLEN = [
    # (label, lengths of q, lengths of k, H, Hk, dtype, kwargs)
    ("6 documents, window (150, 20): a persistent grid of 408 items", [2100, 700, 2100, 1, 2100, 1500], None, 4, 2,
     bf16, dict(window=(150, 20), is_causal=True)),
    ("5 documents, one empty, causal", [700, 0, 1300, 1, 2049], None, 4, 2, bf16, dict(is_causal=True)),
    ("4 documents, keys != queries, window (150, 20)", [300, 1200, 77, 2100], [500, 1000, 0, 2100], 2, 2, fp16,
     dict(window=(150, 20))),
    ("3 documents, soft-cap 20, non-causal", [1500, 1024, 129], None, 2, 1, bf16, dict(softcap=20.0)),
    ("3 documents, dropout 0.2, causal, gqa 4/2", [900, 1, 1337], [900, 130, 1337], 4, 2, bf16,
     dict(is_causal=True, dropout_p=0.2, seed=2**40 + 9)),
    ("2 documents of 2048 (whole tiles), causal", [2048, 2048], None, 2, 2, bf16,
     dict(is_causal=True)),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("versions", [("v6", "v5"), ("v6", "v6")], ids="/".join)
@pytest.mark.parametrize("case", VARLEN, ids=[c[0] for c in VARLEN])
def test_gpu_v6_packed_sequences_match_float64(case, versions, monkeypatch):
    """Forward v6, forced, on packed (total, H, D) tensors (each sequence's rows from cu_seqlens, a program past a
    short one's end storing nothing), with backward v5 or v6 (v6: a Q tile past the sequence's end and a K tile past
    its keys read the next sequence's rows, which the mask must hide); against the float64 reference sequence by
    sequence (dropout: given the kernels' mask, sequence b's that of batch b)."""
    from flashlab import variants
    from flashlab.accuracy import judge
    from flashlab.reference import attention_varlen_torch, dropout_rate
    label, lq, lk, H, Hk, dtype, kw = case
    lk = lk or lq
    _force(monkeypatch, forward_version=versions[0], backward_version=versions[1])
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lq), H, 128, device="cuda").to(dtype)
    k, v = (torch.randn(sum(lk), Hk, 128, device="cuda").to(dtype) for _ in range(2))
    ref_kw = {n: x for n, x in kw.items() if n not in ("dropout_p", "seed")}
    if "dropout_p" in kw:
        keep = variants.dropout_mask(len(lq), H, max(lq), max(lk), kw["dropout_p"], kw["seed"], device="cuda")
        ref_kw.update(dropout_p=dropout_rate(kw["dropout_p"]),
                      dropout_mask=[keep[b:b + 1, :, :a, :c] for b, (a, c) in enumerate(zip(lq, lk))])
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o = flashlab.flash_attention_varlen(*xs, cu_q, cu_k, max(lq), max(lk), enable_gqa=True, **kw)
    do = torch.randn_like(o)
    ours = (o.detach(),) + torch.autograd.grad(o, xs, do)
    outs = {}
    for dt in (torch.float64, torch.float32):
        ys = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        r = H // Hk
        ref = attention_varlen_torch(ys[0], ys[1].repeat_interleave(r, 1), ys[2].repeat_interleave(r, 1), cu_q,
                                     cu_k, **ref_kw)[0]
        outs[dt] = (ref.detach(),) + torch.autograd.grad(ref, ys, do.to(dt))
    checks = [judge(n, a, s, r, dtype) for n, a, s, r in zip(("o", "dq", "dk", "dv"), ours, outs[torch.float32],
                                                               outs[torch.float64])]
    assert all(c.ok for c in checks) and all(torch.isfinite(t).all() for t in ours), \
        f"{label}:\n" + "\n".join(map(str, checks))
    ran = [(p.fwd_version, p.bwd_version) for p in P._PLANS.values() if p.variant.varlen]
    assert ran and all(r == versions for r in ran), ran


@pytest.mark.gpu
@sm90
def test_gpu_v6_gqa_on_strided_views_and_an_unchanged_sdpa_line():
    """(B, N, H, D) storage (nanoGPT's transpose) with 8 query and 2 K/V heads, the SDPA call as written."""
    P.forget()
    x = torch.randn(2, 2100, 12, 128, device="cuda", dtype=bf16)
    q = x[:, :, :8].transpose(1, 2)
    k, v = x[:, :, 8:10].transpose(1, 2), x[:, :, 10:].transpose(1, 2)
    _check(q, k, v, "strided gqa causal", is_causal=True)
    got = flashlab.flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    assert any(p.fwd_version == "v6" for p in P._PLANS.values() if p.variant.features())


def test_v6_refuses_variant_arguments_it_does_not_implement():
    """A mask or ALiBi reaching v6 (only a forced version could send them) is an error, not ignored."""
    p = P.plan(1, 2, 4096, 4096, 128, bf16, True, facts=H200)
    assert forward_v6.variant_scalars(p, 0.1, softcap=None, dropout_p=0.0, seed=0, mask=None).causal
    for bad in (dict(mask=torch.ones(2, 3, dtype=torch.bool)), dict(slopes=torch.ones(2))):
        with pytest.raises(ValueError, match="implements"):
            forward_v6.variant_scalars(p, 0.1, **bad)
    call = forward_v6.variant_scalars(P.plan(1, 2, 4096, 4096, 128, bf16, True, facts=H200,
                                             variant=P.Variant(window=(100, -1))), 0.1, softcap=30.0)
    assert (call.band, call.causal, call.left, call.right) == (True, False, 100, 0)   # causal folds into the band
    assert call.softcap and abs(call.qk_scale - 30.0 * forward_v6.LOG2E) < 1e-9 and abs(call.cap_in - 0.1 / 30) < 1e-12
    drop = forward_v6.variant_scalars(p, 0.1, dropout_p=0.1, seed=(3 << 32) + 5)
    assert drop.dropout and drop.p_drop == 26 / 256 and (drop.seed_lo, drop.seed_hi) == (5, 3)   # the rate in 256ths


def test_v6_seed_halves_are_signed_32_bit_ints():
    """Triton types an int argument by its value: halves past 2**31 would make the kernel i64 on some calls and i32 on
    others (a second compilation; through a kept runner, an error).  Every seed's halves fit an i32, and are its bits."""
    p = P.plan(1, 2, 4096, 4096, 128, bf16, True, facts=H200)
    g = torch.Generator().manual_seed(0)
    seeds = [0, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62 - 1, 2**63 - 1] + \
        torch.randint(0, 2**62, (200,), generator=g).tolist()
    for seed in seeds:
        c = forward_v6.variant_scalars(p, 0.1, dropout_p=0.1, seed=seed)
        assert -2**31 <= c.seed_lo < 2**31 and -2**31 <= c.seed_hi < 2**31, (seed, c)
        assert (c.seed_lo & 0xFFFFFFFF) | ((c.seed_hi & 0xFFFFFFFF) << 32) == seed, seed


# ------------------------------------------------------------------------------------------------- dropout

DROPOUT = [
    # (label, B, H, Hk, Nq, Nk, dtype, kwargs)
    ("p 0.1 causal gqa 4/2, ragged", 2, 4, 2, 1100, 1300, bf16, dict(is_causal=True, dropout_p=0.1, seed=3)),
    ("p 0.3 non-causal, Nq > Nk, a seed past 2**32", 1, 2, 2, 1500, 1040, fp16,
     dict(dropout_p=0.3, seed=(5 << 32) + 11)),
    ("p 0.2 + window (200, 0) + softcap 20, large logits", 1, 2, 1, 1400, 1400, bf16,
     dict(is_causal=True, window=(200, 0), softcap=20.0, dropout_p=0.2, seed=123456789)),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("versions", [("v6", "v6"), ("v6", "v5"), ("v4", "v6")], ids="/".join)
@pytest.mark.parametrize("case", DROPOUT, ids=[c[0] for c in DROPOUT])
def test_gpu_v6_dropout_matches_float64(case, versions, monkeypatch):
    """Forward and backward v6 with dropout against the float64 reference given the kernels' mask (variants.dropout_mask,
    forward v4's): and paired with v4 / v5, whose masks must be the same bits."""
    from flashlab import variants
    from flashlab.reference import dropout_rate
    label, B, H, Hk, Nq, Nk, dtype, kw = case
    _force(monkeypatch, forward_version=versions[0], backward_version=versions[1])
    try:
        s = 3.0 if "large" in label else 1.0
        q = (s * torch.randn(B, H, Nq, 128, device="cuda")).to(dtype)
        k = (s * torch.randn(B, Hk, Nk, 128, device="cuda")).to(dtype)
        v = torch.randn(B, Hk, Nk, 128, device="cuda").to(dtype)
        keep = variants.dropout_mask(B, H, Nq, Nk, kw["dropout_p"], kw["seed"], device="cuda")
        ref_kw = {n: x for n, x in kw.items() if n not in ("dropout_p", "seed")}
        ref_kw.update(dropout_mask=keep, dropout_p=dropout_rate(kw["dropout_p"]))
        from test_variants import _judge_all, _ref
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o, lse = flashlab.flash_attention(qq, kk, vv, enable_gqa=True, return_lse=True, **kw)
        do = torch.randn_like(o)
        o.backward(do)
        ref = _ref(q, k, v, torch.float64, do, **ref_kw)
        same = _ref(q, k, v, torch.float32, do, **ref_kw)
        _judge_all((o, lse, qq.grad, kk.grad, vv.grad), same, ref, dtype, label)
        ran = [(p.fwd_version, p.bwd_version) for p in P._PLANS.values() if p.variant.features()]
        assert ran and all(r == versions for r in ran), ran
    finally:
        P.forget()


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("p,seed", [(0.25, 2**40 + 77), (0.6, 2**63 - 1)])
def test_gpu_v6_dropout_mask_bit_for_bit(p, seed, monkeypatch):
    """Q = 0 makes P uniform (1 / Nk), so with V one-hot on 128 keys O reads the forward's keep bits of those keys
    exactly, and with dO one-hot on 128 rows dV reads the backward's: both must be reference.dropout_keep's, on the
    third key tile and the second Q tile, for every (batch, head).  p = 0.6: the threshold byte's top bit set (the
    byte compare's other case); 2**63 - 1: a seed whose low half is past 2**31."""
    import numpy as np
    from flashlab.reference import dropout_keep
    _force(monkeypatch, forward_version="v6", backward_version="v6")
    try:
        B, H, Nq, Nk = 2, 2, 300, 384
        q = torch.zeros(B, H, Nq, 128, device="cuda", dtype=bf16, requires_grad=True)
        k = torch.randn(B, H, Nk, 128, device="cuda", dtype=bf16, requires_grad=True)
        eye = torch.eye(128, device="cuda", dtype=bf16)
        v = torch.zeros(B, H, Nk, 128, device="cuda", dtype=bf16)
        v[:, :, 256:] = eye                                           # keys 256 ... 383
        v.requires_grad_()
        o = flashlab.flash_attention(q, k, v, dropout_p=p, seed=seed)
        do = torch.zeros_like(o)
        do[:, :, 128:256] = eye                                       # rows 128 ... 255
        o.backward(do)
        for b in range(B):
            for h in range(H):
                want_f = dropout_keep(seed, b * H + h, np.arange(Nq), np.arange(256, 384), p)
                got_f = (o[b, h].float() > 0).cpu().numpy()
                assert (got_f == want_f).all(), f"forward bits, (b, h) = {b, h}: {(got_f != want_f).sum()} differ"
                want_b = dropout_keep(seed, b * H + h, np.arange(128, 256), np.arange(Nk), p).T   # dV[j, c]: row 128 + c
                got_b = (v.grad[b, h].float() > 0).cpu().numpy()
                assert (got_b == want_b).all(), f"backward bits, (b, h) = {b, h}: {(got_b != want_b).sum()} differ"
    finally:
        P.forget()


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("packed", [False, True], ids=["dense gqa", "packed"])
def test_gpu_v6_later_calls_through_the_compiled_kernels_runner(packed, monkeypatch, request):
    """After a specialisation's first launch, v6 launches through the compiled kernel's runner (no argument binding:
    tiles.launch_cached); a second call on new data of the same shapes must take that path, forward and backward,
    and still match float64.  (Forced: at these sizes the plan's backward is v5.)"""
    from flashlab.kernels import tiles
    from flashlab.kernels import _RUNNERS
    from flashlab.reference import attention_varlen_torch
    _force(monkeypatch, forward_version="v6", backward_version="v6")
    request.addfinalizer(P.forget)
    lens, H, Hk = [700, 1400, 1948], 4, 2
    cu = torch.tensor([0, 700, 2100, 4048], dtype=torch.int32, device="cuda")

    def data():
        if packed:
            return (torch.randn(sum(lens), H, 128, device="cuda", dtype=bf16),
                    *(torch.randn(sum(lens), Hk, 128, device="cuda", dtype=bf16) for _ in range(2)))
        return (torch.randn(2, H, 2100, 128, device="cuda", dtype=bf16),
                *(torch.randn(2, Hk, 2100, 128, device="cuda", dtype=bf16) for _ in range(2)))

    def call(q, k, v):
        if packed:
            return flashlab.flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=True,
                                                   enable_gqa=True)
        return flashlab.flash_attention(q, k, v, is_causal=True, enable_gqa=True)

    xs = [t.requires_grad_() for t in data()]
    call(*xs).backward(torch.randn(xs[0].shape, device="cuda", dtype=bf16))     # the first: compiled, runners kept
    fast = tiles.STATS["fast"]
    q, k, v = data()
    if not packed:
        _check(q, k, v, "second call, dense gqa", is_causal=True)
    else:
        from flashlab.accuracy import judge
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        o = call(*xs)
        do = torch.randn_like(o)
        ours = (o.detach(),) + torch.autograd.grad(o, xs, do)
        refs = {}
        for dt in (torch.float64, torch.float32):
            ys = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
            ref = attention_varlen_torch(ys[0], ys[1].repeat_interleave(2, 1), ys[2].repeat_interleave(2, 1), cu, cu,
                                         is_causal=True)[0]
            refs[dt] = (ref.detach(),) + torch.autograd.grad(ref, ys, do.to(dt))
        checks = [judge(n, a, s, r, bf16) for n, a, s, r in zip(("o", "dq", "dk", "dv"), ours, refs[torch.float32],
                                                                  refs[torch.float64])]
        assert all(c.ok for c in checks), "\n".join(map(str, checks))
    assert tiles.STATS["fast"] >= fast + 3, tiles.STATS      # forward v6, the Delta step and backward v6
    kept = {name for r in _RUNNERS.values() for name in r}
    assert {"fwd v6", "bwd v6"} <= kept, kept
    ran = [(p.fwd_version, p.bwd_version) for p in P._PLANS.values() if p.variant.features()]
    assert ran and all(r == ("v6", "v6") for r in ran), ran


@pytest.mark.gpu
@sm90
def test_gpu_v6_dropout_seeds_of_every_size_through_kept_runners(monkeypatch, request):
    """seed=None draws a seed below 2**62 on every call, so the seed's low half is past 2**31 on about half of them.
    Calls of the same shapes must all run, forward and backward, with the bits of their own seed (each output against
    the v4 / v5 run of the same seed).  The runners' key tells seeds below 2**31 from the others; among the others the
    first, 2**32 + 5, has a low half below 2**31, and the next, 2**31 + 5, one past it: with halves typed by value
    the second would reach a kept i32 kernel with an int it cannot take."""
    from flashlab.kernels import tiles
    request.addfinalizer(P.forget)
    SEEDS = (5, 2**32 + 5, 2**31 + 5, 2**63 - 1, 2**40 + 2**31, None)
    q, k, v = (torch.randn(1, 4, 2100, 128, device="cuda", dtype=bf16) for _ in range(3))
    do = torch.randn_like(q)
    outs = {}
    for versions in (("v6", "v6"), ("v4", "v5")):
        _force(monkeypatch, forward_version=versions[0], backward_version=versions[1])
        fast0 = tiles.STATS["fast"]
        for seed in SEEDS:
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            if seed is None:    # a drawn seed, the same for both versions
                torch.manual_seed(11)
            o = flashlab.flash_attention(*xs, is_causal=True, dropout_p=0.2, seed=seed)
            outs[versions, seed] = (o.detach(),) + torch.autograd.grad(o, xs, do)
        if versions[0] == "v6":   # four calls through kept runners: forward v6, Delta, backward v6 each
            assert tiles.STATS["fast"] - fast0 >= 12, tiles.STATS
    for seed in SEEDS:
        a, b = outs[("v6", "v6"), seed], outs[("v4", "v5"), seed]
        err = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
        assert err < 5e-2, (seed, err)
    assert (outs[("v6", "v6"), 5][0] != outs[("v6", "v6"), 2**31 + 5][0]).any()
