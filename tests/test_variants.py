"""Attention variants (forward v4, backward v5): every variant and combinations against float64.

GQA/MQA, sliding windows, soft-capping, ALiBi, bool and additive masks (broadcast), dropout, packed
sequences; forward and backward, ragged Nq != Nk, fp16/fp32/bf16, by the accuracy rule
(flashlab/accuracy.py: at most twice PyTorch's own same-dtype error plus a floor).  Dropout is
checked against the reference run with the kernel's own mask (the debug kernel that writes it),
and by finite differences.  Tile skipping is checked by poisoning the tiles outside the band with
NaN: a visited tile would spread it.  Sizes are small (N <= 96): the interpreter is slow.
"""
import math

import numpy as np
import pytest
import torch

import flashlab
from flashlab import device, variants
from flashlab.kernels import forward_v4
from flashlab.accuracy import judge
from flashlab.reference import attention_variants_torch, attention_varlen_torch, dropout_keep, dropout_rate

DEV = device.DEVICE
fa = flashlab.flash_attention


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(shape, device=DEV)).to(dtype)


def _ref(q, k, v, dtype, do, **kw):
    """(o, lse, dq, dk, dv) of the naive reference computed in ``dtype``."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    kw = dict(kw)
    if kw.get("attn_mask") is not None and kw["attn_mask"].dtype != torch.bool:
        kw["attn_mask"] = kw["attn_mask"].to(dtype)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(dtype)
    o, lse = attention_variants_torch(qq, kk, vv, **kw)
    o.backward(do.to(dtype))
    return o.detach(), lse.detach(), qq.grad, kk.grad, vv.grad


def _judge_all(ours, same, ref, dtype, label):
    """Accuracy rule on o, lse, dq, dk, dv; LSE = -inf (rows that see no key) must match exactly."""
    names = ("o", "lse", "dq", "dk", "dv")
    lse_o, lse_r = ours[1].double(), ref[1].double()
    assert torch.equal(torch.isneginf(lse_o), torch.isneginf(lse_r)), f"{label}: rows that see no key differ"
    fin = torch.isfinite(lse_r)
    lse_max = lse_r[fin].abs().max().item() if fin.any() else 0.0
    checks = []
    for i, n in enumerate(names):
        a, s, r = ours[i], same[i], ref[i]
        if n == "lse":
            a, s, r = (torch.where(fin, t.double(), torch.zeros_like(lse_r)) for t in (a, s, r))
            checks.append(judge(n, a, s, r, torch.float32))
        else:
            assert torch.isfinite(a).all(), f"{label}: {n} has NaN/inf"
            checks.append(judge(n, a, s, r, dtype, lse_max if n.startswith("d") and n != "do" else 0.0))
    assert all(c.ok for c in checks), f"{label}:\n" + "\n".join(str(c) for c in checks)


def _check(q, k, v, label="", **kw):
    dtype = q.dtype
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = fa(q, k, v, enable_gqa=True, return_lse=True, **kw)
    do = torch.randn_like(o)
    o.backward(do)
    ours = (o, lse, q.grad, k.grad, v.grad)
    ref = _ref(q, k, v, torch.float64, do, **kw)
    same_dtype = dtype if dtype != torch.bfloat16 else torch.float32   # CPU bf16 matmuls: fp32 stands in
    same = _ref(q, k, v, same_dtype, do, **kw)
    _judge_all(ours, same, ref, dtype, label or str(sorted(kw)))


def _slopes(H, B=None):
    base = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)], device=DEV)
    return base if B is None else base[None].repeat(B, 1) * torch.rand(B, 1, device=DEV).add(0.5)


CASES = [
    # (label, B, H, Hk, Nq, Nk, D, dtype, kwargs factory)
    ("gqa", 1, 4, 2, 45, 70, 32, torch.float32, lambda B, H, Nq, Nk: {}),
    ("mqa causal fp16", 1, 4, 1, 70, 45, 32, torch.float16, lambda B, H, Nq, Nk: dict(is_causal=True)),
    ("window", 1, 2, 2, 96, 80, 32, torch.float32, lambda B, H, Nq, Nk: dict(window=(20, 5))),
    ("window+causal D=24 fp16", 1, 2, 1, 90, 96, 24, torch.float16,
     lambda B, H, Nq, Nk: dict(window=(10, 3), is_causal=True)),
    ("window left unbounded", 1, 1, 1, 77, 77, 16, torch.float32, lambda B, H, Nq, Nk: dict(window=(-1, 7))),
    ("softcap causal, large logits", 1, 2, 2, 70, 70, 32, torch.float32,
     lambda B, H, Nq, Nk: dict(softcap=5.0, is_causal=True)),
    ("alibi (H,) causal fp16", 1, 4, 2, 64, 50, 16, torch.float16,
     lambda B, H, Nq, Nk: dict(alibi_slopes=_slopes(H), is_causal=True)),
    ("alibi (B, H) window", 2, 2, 2, 40, 60, 16, torch.float32,
     lambda B, H, Nq, Nk: dict(alibi_slopes=_slopes(H, B), window=(8, 8))),
    ("bool padding mask (B,1,1,Nk)", 2, 2, 2, 33, 70, 32, torch.float16,
     lambda B, H, Nq, Nk: dict(attn_mask=torch.arange(Nk, device=DEV)[None, None, None, :]
                               < torch.tensor([50, 17], device=DEV)[:, None, None, None])),
    ("bool mask (Nq, Nk) random, rows hidden", 1, 2, 2, 50, 41, 16, torch.float32,
     lambda B, H, Nq, Nk: dict(attn_mask=(torch.rand(Nq, Nk, device=DEV) > 0.4)
                               & (torch.arange(Nq, device=DEV)[:, None] % 7 != 3))),
    ("additive mask (1,H,Nq,Nk) with -inf", 1, 2, 2, 40, 50, 32, torch.float32,
     lambda B, H, Nq, Nk: dict(attn_mask=torch.randn(1, H, Nq, Nk, device=DEV).masked_fill(
         torch.rand(1, H, Nq, Nk, device=DEV) < 0.2, float("-inf")))),
    ("additive mask (B,1,Nq,1) fp16", 2, 2, 1, 37, 29, 16, torch.float16,
     lambda B, H, Nq, Nk: dict(attn_mask=torch.randn(B, 1, Nq, 1, device=DEV).half())),
    ("everything bf16", 1, 4, 2, 70, 60, 32, torch.bfloat16,
     lambda B, H, Nq, Nk: dict(is_causal=True, window=(25, 0), softcap=8.0, alibi_slopes=_slopes(H),
                               attn_mask=torch.rand(B, 1, Nq, Nk, device=DEV) > 0.1)),
    ("window beyond the keys: rows that see nothing", 1, 2, 2, 60, 20, 16, torch.float32,
     lambda B, H, Nq, Nk: dict(window=(0, 4))),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_variant_matches_float64(rng, case):
    label, B, H, Hk, Nq, Nk, D, dtype, make = case
    s = 3.0 if "large" in label else 1.0
    q, k, v = _rand(B, H, Nq, D, dtype=dtype, scale=s), _rand(B, Hk, Nk, D, dtype=dtype, scale=s), \
        _rand(B, Hk, Nk, D, dtype=dtype)
    _check(q, k, v, label, **make(B, H, Nq, Nk))


def test_strided_inputs_and_scale(rng):
    """(B, N, H, D) views, an explicit scale, GQA with a window."""
    q = _rand(1, 50, 4, 16).transpose(1, 2)
    k, v = _rand(1, 44, 2, 16).transpose(1, 2), _rand(1, 44, 2, 16).transpose(1, 2)
    _check(q, k, v, "strided", window=(12, 12), scale=0.4)


def test_tiles_outside_the_band_are_never_visited(rng):
    """NaN in every K/V tile no query tile's band reaches from rows 64-95 (32 x 32 tiles in the interpreter):
    a visited tile would make O NaN (0 * NaN).  Backward: NaN in Q/dO rows 0-31 must not reach dK, dV of keys 64-95."""
    if not device.INTERPRET:
        pytest.skip("tile sizes are the interpreter's (32 x 32)")
    N, D = 96, 16
    q, k, v = (_rand(1, 1, N, D) for _ in range(3))
    kp, vp = k.clone(), v.clone()
    kp[:, :, :32] = float("nan")
    vp[:, :, :32] = float("nan")
    o = fa(q, kp, vp, is_causal=True, window=(10, 0))
    ref = attention_variants_torch(q.double(), k.double(), v.double(), is_causal=True, window=(10, 0))[0]
    assert torch.isfinite(o[:, :, 64:]).all()
    torch.testing.assert_close(o[:, :, 64:].double(), ref[:, :, 64:], atol=1e-5, rtol=0)

    qp = q.clone()
    qp[:, :, :32] = float("nan")
    qp, k2, v2 = qp.requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()
    do = torch.randn(1, 1, N, D, device=DEV)
    do[:, :, :32] = float("nan")
    fa(qp, k2, v2, window=(10, 0)).backward(do)
    assert torch.isfinite(k2.grad[:, :, 64:]).all() and torch.isfinite(v2.grad[:, :, 64:]).all()
    assert torch.isfinite(qp.grad[:, :, 64:]).all()


def test_row_without_keys_gives_zero_and_zero_gradients(rng):
    q, k, v = (_rand(1, 2, 40, 16).requires_grad_() for _ in range(3))
    mask = torch.ones(40, 40, dtype=torch.bool, device=DEV)
    mask[5] = False
    o, lse = fa(q, k, v, attn_mask=mask, return_lse=True)
    o.sum().backward()
    assert (o[:, :, 5] == 0).all() and torch.isneginf(lse[:, :, 5]).all()
    assert (q.grad[:, :, 5] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_mask_is_a_broadcast_view_not_a_copy():
    pad = torch.ones(2, 1, 1, 300, dtype=torch.bool)
    m = variants._expand_mask(pad, 2, 8, 200, 300)
    assert m.shape == (2, 8, 200, 300) and m.stride() == (300, 0, 0, 1) and m.data_ptr() == pad.data_ptr()


# ----------------------------------------------------------------------------------------- dropout

def test_dropout_matches_reference_with_the_kernels_mask(rng):
    B, H, Hk, Nq, Nk, D, p, seed = 2, 2, 1, 40, 50, 16, 0.3, 1234
    q, k, v = _rand(B, H, Nq, D), _rand(B, Hk, Nk, D), _rand(B, Hk, Nk, D)
    keep = variants.dropout_mask(B, H, Nq, Nk, p, seed, device=DEV)
    kw = dict(is_causal=True, window=(30, 0))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = fa(qq, kk, vv, dropout_p=p, seed=seed, enable_gqa=True, return_lse=True, **kw)
    do = torch.randn_like(o)
    o.backward(do)
    rate = dropout_rate(p)                                    # p in 1/256ths: 77/256 here
    ref = _ref(q, k, v, torch.float64, do, dropout_mask=keep, dropout_p=rate, **kw)
    same = _ref(q, k, v, torch.float32, do, dropout_mask=keep, dropout_p=rate, **kw)
    _judge_all((o, lse, qq.grad, kk.grad, vv.grad), same, ref, torch.float32, "dropout")


def test_dropout_seed_and_generator():
    q, k, v = (_rand(1, 2, 33, 16) for _ in range(3))
    a = fa(q, k, v, dropout_p=0.2, seed=7)
    assert torch.equal(a, fa(q, k, v, dropout_p=0.2, seed=7))                 # same seed, same output
    assert (a - fa(q, k, v, dropout_p=0.2, seed=8)).abs().max() > 1e-3        # another seed, another mask
    torch.manual_seed(3)
    b = fa(q, k, v, dropout_p=0.2)
    torch.manual_seed(3)
    assert torch.equal(b, fa(q, k, v, dropout_p=0.2))                         # torch.manual_seed governs seed=None
    assert not torch.equal(b, fa(q, k, v, dropout_p=0.2))


def test_dropout_mask_keying_and_rate():
    """Keyed on (seed, batch, head, row, column): a sub-block does not depend on the sizes; rate 1 - p."""
    p = 0.25
    big = variants.dropout_mask(2, 3, 90, 96, p, 99, device=DEV)
    small = variants.dropout_mask(2, 3, 30, 20, p, 99, device=DEV)
    assert torch.equal(big[:, :, :30, :20], small)
    assert not torch.equal(big[0, 0], big[0, 1]) and not torch.equal(big[0, 0], big[1, 0])
    n = big.numel()
    assert abs(big.float().mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)


def test_dropout_mask_is_the_numpy_reference_bit_for_bit():
    """The kernels' bits are flashlab.reference.dropout_keep's (Philox in NumPy, one byte a score), for a seed of
    32 and one of 64 bits; p is applied in 1/256ths."""
    for p, seed in ((0.1, 7), (0.5, 2**40 + 3)):
        m = variants.dropout_mask(2, 2, 33, 50, p, seed, device=DEV).cpu().numpy()
        for b in range(2):
            for h in range(2):
                assert (m[b, h] == dropout_keep(seed, b * 2 + h, np.arange(33), np.arange(50), p)).all()
    assert dropout_rate(0.1) == 26 / 256 and dropout_rate(0.001) == 1 / 256 and dropout_rate(0.0) == 0.0
    assert dropout_rate(0.9999) == 255 / 256


def test_dropout_scaling_keeps_the_mean():
    """With V = 1 every undropped row of O is 1; dropped and rescaled by 1/(1-p) its mean stays 1."""
    p, N = 0.5, 96
    q, k = _rand(2, 2, N, 16), _rand(2, 2, N, 16)
    v = torch.ones(2, 2, N, 16, device=DEV)
    o = fa(q, k, v, dropout_p=p, seed=5)[..., 0]
    probs = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4.0, -1)
    sd = math.sqrt((probs ** 2).sum(-1).mul(p / (1 - p)).sum().item()) / o.numel()   # std of the mean of O
    assert abs(o.double().mean().item() - 1.0) < 5 * sd + 1e-6


def test_dropout_backward_by_finite_differences(rng):
    """d/dt f(x + t u) at t = 0 from the kernel's gradient against central differences, fp32, one seed."""
    q, k, v = (_rand(1, 2, 20, 16) for _ in range(3))
    w = torch.randn(1, 2, 20, 16, device=DEV)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    (fa(qq, kk, vv, dropout_p=0.3, seed=11, is_causal=True) * w).sum().backward()
    u = [torch.randn_like(t) for t in (q, k, v)]
    eps = 1e-2

    def f(t):
        xs = [x.double() + t * du.double() for x, du in zip((q, k, v), u)]
        return (fa(*(x.float() for x in xs), dropout_p=0.3, seed=11, is_causal=True).double() * w).sum().item()

    fd = (f(eps) - f(-eps)) / (2 * eps)
    an = sum((g.double() * du.double()).sum().item() for g, du in zip((qq.grad, kk.grad, vv.grad), u))
    assert abs(fd - an) <= 2e-3 * max(1.0, abs(an)), (fd, an)


# ----------------------------------------------------------------------------------------- varlen

def _packed(lens_q, lens_k, H, Hk, D, dtype=torch.float32):
    cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = _rand(int(cq[-1]), H, D, dtype=dtype)
    k, v = _rand(int(ck[-1]), Hk, D, dtype=dtype), _rand(int(ck[-1]), Hk, D, dtype=dtype)
    return q, k, v, cq, ck


VARLEN = [
    ("causal gqa", dict(is_causal=True)),
    ("window softcap alibi (S, H)", dict(window=(4, 2), softcap=3.0, alibi_slopes="SH")),
    ("dropout causal", dict(is_causal=True, dropout_p=0.2, seed=3)),
]


@pytest.mark.parametrize("label,kw", VARLEN, ids=[c[0] for c in VARLEN])
def test_varlen_matches_float64(rng, label, kw):
    lens_q, lens_k = [5, 33, 0, 1, 40], [7, 20, 0, 3, 40]
    H, Hk, D = 2, 1, 16
    q, k, v, cq, ck = _packed(lens_q, lens_k, H, Hk, D)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "SH":
        kw["alibi_slopes"] = _slopes(H, len(lens_q))
    ref_kw = {n: x for n, x in kw.items() if n not in ("dropout_p", "seed")}
    if "dropout_p" in kw:
        m = variants.dropout_mask(len(lens_q), H, 40, 40, kw["dropout_p"], kw["seed"], device=DEV)
        ref_kw["dropout_mask"] = [m[b:b + 1, :, :lq, :lk] for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]
        ref_kw["dropout_p"] = dropout_rate(kw["dropout_p"])
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flashlab.flash_attention_varlen(qq, kk, vv, cq, ck, 40, 40, enable_gqa=True, return_lse=True, **kw)
    assert o.shape == q.shape and lse.shape == (H, q.shape[0])
    do = torch.randn_like(o)
    o.backward(do)
    res = []
    for dt in (torch.float64, torch.float32):
        a, b, c = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        kwd = dict(ref_kw)
        if kwd.get("alibi_slopes") is not None:
            kwd["alibi_slopes"] = kwd["alibi_slopes"].to(dt)
        ro, rl = attention_varlen_torch(a, b, c, cq, ck, **kwd)
        ro.backward(do.to(dt))
        res.append((ro.detach(), rl.detach(), a.grad, b.grad, c.grad))
    _judge_all((o, lse, qq.grad, kk.grad, vv.grad), res[1], res[0], torch.float32, label)


DESCRIPTOR_CASES = [c for c in CASES if c[0] in ("mqa causal fp16", "window+causal D=24 fp16", "everything bf16")]


@pytest.mark.descriptors
@pytest.mark.parametrize("case", DESCRIPTOR_CASES, ids=[c[0] for c in DESCRIPTOR_CASES])
def test_descriptor_path_matches_float64(rng, case, monkeypatch):
    """The Hopper path (the streamed K/V, Q/dO tiles through tensor descriptors, zero past the end), run in the
    interpreter: GQA/MQA, ragged lengths, a window, soft-cap, ALiBi and a mask."""
    monkeypatch.setattr(forward_v4, "DESCRIPTORS_IN_INTERPRETER", True)
    test_variant_matches_float64(rng, case)
    assert not forward_v4.DESCRIPTOR_ERRORS


@pytest.mark.descriptors
def test_descriptor_path_varlen_with_dropout(rng, monkeypatch):
    """The descriptor path over packed sequences (an empty one included), causal, with dropout."""
    monkeypatch.setattr(forward_v4, "DESCRIPTORS_IN_INTERPRETER", True)
    test_varlen_matches_float64(rng, *VARLEN[2])


def test_descriptor_compile_failure_falls_back_to_pointers_once(monkeypatch):
    """On a GPU whose Triton cannot compile the descriptor path: one warning, the pointer loads run, then always."""
    from flashlab.kernels import tiles
    calls = []

    def fake_run(step, kern, args, consts, grid_of, runners, key):
        calls.append(consts["TMA"])
        if consts["TMA"]:
            raise RuntimeError("PassManager::run failed")
    monkeypatch.setattr(tiles, "run", fake_run)
    monkeypatch.setattr(device, "INTERPRET", False)
    monkeypatch.setattr(forward_v4, "DESCRIPTOR_ERRORS", [])
    step = type("S", (), {"grid_for": None})()
    kern = type("K", (), {"fn": forward_v4.flash_fwd_kernel_v4.fn})()
    with pytest.warns(RuntimeWarning, match="pointer loads run instead"):
        forward_v4.run_step(step, kern, (), {"TMA": True}, None, "fwd")
    assert calls == [True, False] and "PassManager" in forward_v4.DESCRIPTOR_ERRORS[0]
    plan = type("P", (), {"facts": type("F", (), {"interpret": False, "hopper": True, "device_descriptors": True})()})()
    assert not forward_v4.use_descriptors(plan, torch.zeros(4, 16))          # from then on: pointers
    monkeypatch.setattr(device, "INTERPRET", True)
    with pytest.raises(RuntimeError):                                          # the interpreter: raised
        forward_v4.run_step(step, kern, (), {"TMA": True}, None, "fwd")


def test_varlen_matches_padded_dense(rng):
    """The same documents padded to (B, H, N, D) with a key-padding mask give the same O (fp16)."""
    lens = [30, 11]
    H, D = 2, 16
    q, k, v, cq, ck = _packed(lens, lens, H, H, D, torch.float16)
    o = flashlab.flash_attention_varlen(q, k, v, cq, ck, 30, 30, causal=True)
    pad = lambda t: torch.stack([torch.nn.functional.pad(t[int(cq[b]):int(cq[b + 1])], (0, 0, 0, 0, 0, 30 - n))
                                 for b, n in enumerate(lens)]).transpose(1, 2)
    mask = (torch.arange(30, device=DEV)[None, :] < torch.tensor(lens, device=DEV)[:, None])[:, None, None, :]
    od = fa(pad(q), pad(k), pad(v), attn_mask=mask, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(o[:30], od[0, :30], atol=2e-3, rtol=0)
    torch.testing.assert_close(o[30:], od[1, :11], atol=2e-3, rtol=0)


# ----------------------------------------------------------------------------------------- op, compile, API

def test_compiled_fullgraph_with_variants(rng):
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v, m):
        return fa(q, k, v, attn_mask=m, dropout_p=0.2, is_causal=True, enable_gqa=True, window=(20, 0),
                  softcap=10.0, seed=42, return_lse=True)

    q, k, v = _rand(1, 4, 37, 16), _rand(1, 2, 29, 16), _rand(1, 2, 29, 16)
    m = torch.rand(1, 1, 37, 29, device=DEV) > 0.2
    outs = []
    for fn in (f, lambda *a: fa(*a[:3], attn_mask=a[3], dropout_p=0.2, is_causal=True, enable_gqa=True,
                                 window=(20, 0), softcap=10.0, seed=42, return_lse=True)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = fn(qq, kk, vv, m)
        o.sum().backward()
        outs.append((o, lse, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

    g = torch.compile(lambda q, k, v: fa(q, k, v, dropout_p=0.1), fullgraph=True, backend="aot_eager")
    assert torch.isfinite(g(q[:, :2], k, v)).all()                        # seed=None: drawn inside the operator


def test_opcheck_variant_operator(rng):
    q, k, v = _rand(1, 2, 19, 16), _rand(1, 1, 23, 16), _rand(1, 1, 23, 16)
    m = torch.rand(19, 23, device=DEV) > 0.3
    sl = _slopes(2)
    torch.library.opcheck(torch.ops.flashlab.variant_forward.default,
                          (q, k, v, m, sl, None, None, 19, 23, 5, 0, 4.0, 0.0, 0, 0.25, False),
                          test_utils=("test_schema", "test_faketensor"))


def test_sdpa_call_sites_and_the_old_positional_order(rng):
    q, k, v = (_rand(1, 2, 21, 16) for _ in range(3))
    ref = fa(q, k, v, is_causal=True)
    torch.testing.assert_close(fa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True), ref)   # nanoGPT's line
    torch.testing.assert_close(fa(q, k, v, causal=True), ref)
    torch.testing.assert_close(fa(q, k, v, True), ref)                     # flash_attention(q, k, v, causal)
    o, lse = fa(q, k, v, True, 0.3, True)                                  # (q, k, v, causal, scale, return_lse)
    torch.testing.assert_close(o, fa(q, k, v, is_causal=True, scale=0.3))
    assert lse.shape == (1, 2, 21)
    torch.testing.assert_close(fa(q, k, v, None, 0.0, False, 0.3), fa(q, k, v, scale=0.3))   # SDPA's order


def test_gqa_backward_is_deterministic(rng):
    q, k, v = _rand(1, 3, 33, 16), _rand(1, 1, 33, 16), _rand(1, 1, 33, 16)
    grads = []
    for _ in range(2):
        kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
        fa(q, kk, vv, enable_gqa=True, is_causal=True).sum().backward()
        grads.append((kk.grad, vv.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def _q(*s):
    return torch.randn(*s, device=DEV)


BAD = [
    (lambda: fa(_q(1, 4, 8, 16), _q(1, 3, 8, 16), _q(1, 3, 8, 16), enable_gqa=True), ValueError, "multiple"),
    (lambda: fa(_q(1, 4, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16)), ValueError, "enable_gqa=True"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), window=5), ValueError, "pair"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), window=(3, -2)), ValueError, "-1 for unbounded"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), window=(3.0, 0)), TypeError, "two ints"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), dropout_p=1.0), ValueError, r"\[0, 1\)"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), dropout_p=-0.1), ValueError, "dropout_p"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), softcap=-1.0), ValueError, "softcap"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), alibi_slopes=_q(3)), ValueError, r"\(2,\)"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), alibi_slopes=[0.5, 0.2]), TypeError, "tensor"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), attn_mask=_q(3, 8)), ValueError, "broadcast"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), attn_mask=torch.ones(8, 8, dtype=torch.int32,
                                                                                      device=DEV)),
     TypeError, "torch.bool"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), attn_mask=_q(8, 8).requires_grad_()),
     ValueError, "requires grad"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), dropout_p=0.1, seed=-3), ValueError, "seed"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), is_causal=True, causal=False), ValueError,
     "alias"),
    # the plain path (no variant) checks scale and seed as the variants' path does
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), scale=True), ValueError, "scale"),
    (lambda: fa(_q(1, 2, 8, 16), _q(1, 2, 8, 16), _q(1, 2, 8, 16), is_causal=True, seed=-5), ValueError, "seed"),
]


def _cu(*xs, dtype=torch.int32):
    return torch.tensor(xs, dtype=dtype, device=DEV)


VBAD = [
    (dict(cq=_cu(0, 5, 3, 10), ck=_cu(0, 5, 3, 10)), ValueError, "not decrease"),
    (dict(cq=_cu(0, 5, 9)), ValueError, "end at the packed length"),
    (dict(cq=_cu(0, 5, 10, dtype=torch.int64)), TypeError, "int32"),
    (dict(cq=_cu(1, 5, 10)), ValueError, "start at 0"),
    (dict(max_q=4), ValueError, "longest"),
    (dict(cq=_cu(0, 10)), ValueError, "same number of sequences"),
]


@pytest.mark.parametrize("call,exc,words", BAD)
def test_bad_inputs_raise_clear_errors(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("over,exc,words", VBAD)
def test_varlen_bad_inputs(over, exc, words):
    q = _rand(10, 2, 16)
    a = dict(cq=_cu(0, 5, 10), ck=_cu(0, 5, 10), max_q=5, max_k=5)
    a.update(over)
    with pytest.raises(exc, match=words):
        flashlab.flash_attention_varlen(q, q, q, a["cq"], a["ck"], a["max_q"], a["max_k"])


def test_varlen_reads_cu_seqlens_once_per_version(monkeypatch):
    """cu_seqlens' values are read (a host sync) on a tensor's first call only; written in place, or replaced by
    another tensor, they are read again, so a bad value still raises."""
    q = _rand(10, 2, 16)
    cq = _cu(0, 5, 10)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    call = lambda c: flashlab.flash_attention_varlen(q, q, q, c, c, 5, 5)   # noqa: E731
    o = call(cq)
    n = len(reads)
    assert n >= 1 and torch.equal(call(cq), o) and len(reads) == n            # the second call reads nothing
    cq[1] = 11                                                                # decreasing now: read, and refused
    with pytest.raises(ValueError, match="not decrease"):
        call(cq)
    with pytest.raises(ValueError, match="end at the packed length"):
        call(_cu(0, 5, 9))
    with torch.inference_mode():                      # no version counter there: read on every call
        ci = _cu(0, 5, 10)
        call(ci)
        ci[1] = 11
        with pytest.raises(ValueError, match="not decrease"):
            call(ci)
    n = len(reads)
    call(cq.new_tensor([0, 5, 10]))                   # the same tensor as cu_q and cu_k, with other maxima
    flashlab.flash_attention_varlen(q, q, q, cq2 := _cu(0, 4, 10), cq2, 6, 7)
    m = len(reads)
    flashlab.flash_attention_varlen(q, q, q, cq2, cq2, 6, 7)
    assert len(reads) == m > n                        # both (total, max) pairs remembered: no read the second time


def test_visited_tiles_are_exactly_those_the_band_meets(rng):
    """variants.band_tile_ranges (forward v4's band_tiles in Python) against brute force: a tile is
    visited iff one of its pairs is visible, and unmasked only if all its pairs are (and it is full)."""
    import random
    r = random.Random(0)
    for _ in range(200):
        nq, nk = r.randint(1, 200), r.randint(1, 200)
        bm, bn = r.choice([16, 32, 64]), r.choice([16, 32, 64])
        left, right = r.choice([-1, 0, 3, 17, 64]), r.choice([-1, 0, 5, 40])
        for r0 in range(0, nq, bm):
            lo, flo, fhi, hi = variants.band_tile_ranges(r0, bm, bn, nk, left, right)
            for c0 in range(0, nk, bn):
                vis = [(i, j) for i in range(r0, r0 + bm) for j in range(c0, min(c0 + bn, nk))
                       if (left < 0 or j >= i - left) and (right < 0 or j <= i + right)]
                seen = lo <= c0 < hi
                assert seen == bool(vis), (nq, nk, bm, bn, left, right, r0, c0)
                if flo <= c0 < fhi:
                    assert len(vis) == bm * bn, (nq, nk, bm, bn, left, right, r0, c0)


# ----------------------------------------------------------------------------------------- nanoGPT's call site
# (notebook 08's exercises are attacked in tests/test_variants_exercises.py)

class _NanoGPTAttention(torch.nn.Module):
    """nanoGPT's CausalSelfAttention, its SDPA line unchanged but for the function's name."""

    def __init__(self, n_embd=32, n_head=2, dropout=0.1):
        super().__init__()
        self.c_attn, self.c_proj = torch.nn.Linear(n_embd, 3 * n_embd), torch.nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x):
        flash_attention = fa
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = flash_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def test_nanogpt_sdpa_line_runs_unchanged_eager_and_compiled(rng):
    """Training (dropout 0.1) and eval (dropout_p=0, an int), eager and torch.compile(fullgraph=True): eval
    equals SDPA's; training under the same torch.manual_seed is the same call compiled or not."""
    torch.manual_seed(0)
    m = _NanoGPTAttention().to(DEV)
    x = torch.randn(2, 21, 32, device=DEV)
    torch._dynamo.reset()
    mc = torch.compile(m, fullgraph=True, backend="aot_eager")
    m.eval()
    with torch.no_grad():
        q, k, v = (t.view(2, 21, 2, 16).transpose(1, 2) for t in m.c_attn(x).split(32, dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        want = m.c_proj(y.transpose(1, 2).reshape(2, 21, 32))
    for f in (m, mc):
        torch.testing.assert_close(f(x), want, atol=1e-5, rtol=0)
    m.train()
    outs = []
    for f in (m, mc):
        torch.manual_seed(7)
        xx = x.clone().requires_grad_()
        y = f(xx)
        y.sum().backward()
        assert torch.isfinite(xx.grad).all()
        outs.append((y.detach(), xx.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-6, rtol=0)
    assert not torch.allclose(outs[0][0], want, atol=1e-3)          # dropout did drop something


def test_autocast_as_sdpa(rng):
    """Under torch.autocast the variants run in the autocast dtype and return it, eager and compiled."""
    dev = DEV.type
    dt = torch.bfloat16 if (dev == "cpu" or device.bf16_supported()) else torch.float16
    q, k, v = _rand(1, 4, 33, 16), _rand(1, 2, 40, 16), _rand(1, 2, 40, 16)
    kw = dict(enable_gqa=True, window=(9, 2), softcap=6.0)
    want = fa(q.to(dt), k.to(dt), v.to(dt), **kw)
    f = torch.compile(lambda q, k, v: fa(q, k, v, **kw), fullgraph=True, backend="aot_eager")
    for fn in (lambda q, k, v: fa(q, k, v, **kw), f):
        qq = q.clone().requires_grad_()
        with torch.autocast(dev, dtype=dt):
            o = fn(qq, k, v)
        assert o.dtype == dt
        torch.testing.assert_close(o, want, atol=0, rtol=0)
        o.float().sum().backward()
        assert qq.grad.dtype == torch.float32 and torch.isfinite(qq.grad).all()


def test_bench_command_runs_the_variants_benchmark(monkeypatch, capsys):
    """``python -m flashlab bench --variants`` is the variants' benchmark (flashlab/bench_variants.py): the names, the
    JSON file and --no-check reach it; a wrong name or a machine without a CUDA GPU is told so (exit status 2)."""
    from flashlab import __main__ as cli
    from flashlab import bench_variants
    real = bench_variants.main
    seen = []
    monkeypatch.setattr(bench_variants, "main", lambda argv=None: seen.append(argv) or 0)
    assert cli.main(["bench", "--variants", "window,docs", "--json", "out.json", "--no-check"]) == 0
    assert cli.main(["bench", "--variants"]) == 0
    assert seen == [["--only", "window,docs", "--json", "out.json", "--no-check"], []]
    assert real(["--only", "window,nope"]) == 2
    assert "unknown variant nope" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert real(["--only", "window"]) == 2
        assert "CUDA GPU" in capsys.readouterr().err


def test_a_kind_of_call_is_planned_once_and_forget_drops_it(monkeypatch):
    """The variants' forward keeps each exact kind of call's plan and runners (flashlab.variants._FWD_CALLS): a second
    call of the same kind does not plan again, another kind (other strides, another window) does, and plan.forget()
    (how tests and scripts force versions) drops what was kept; the outputs stay right."""
    from flashlab import variants
    from flashlab.kernels import plan as P
    P.forget()
    made = []
    real = variants._plan
    monkeypatch.setattr(variants, "_plan", lambda *a, **kw: made.append(1) or real(*a, **kw))
    q, k, v = (torch.randn(1, 2, 40, 16, device=DEV) for _ in range(3))
    o1 = fa(q, k, v, is_causal=True, window=(7, 0))
    o2 = fa(q, k, v, is_causal=True, window=(7, 0))
    assert len(made) == 1 and torch.equal(o1, o2)
    fa(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, is_causal=True, window=(7, 0))   # other strides
    fa(q, k, v, is_causal=True, window=(8, 0))                                               # another band
    assert len(made) == 3
    P.forget()
    o3 = fa(q, k, v, is_causal=True, window=(7, 0))
    assert len(made) == 4 and torch.equal(o1, o3)
    ref = attention_variants_torch(*(t.double() for t in (q, k, v)), is_causal=True, window=(7, 0))[0]
    assert (o1.double() - ref).abs().max() < 1e-4


# ----------------------------------------------------------------------------------------- edges a user meets


def test_additive_mask_of_finfo_min_is_masked_not_a_row_without_keys(rng):
    """HF's additive mask value, torch.finfo(float32).min: scores plus it times log2(e) overflowed to -inf, so a row
    masked by it alone read as seeing no key (O = 0).  SDPA (and float64) give that row V's plain average; the
    rows around it are masked as -inf would mask them."""
    q, k, v = (_rand(1, 2, 24, 16) for _ in range(3))
    m = torch.zeros(24, 24, device=DEV)
    m[3] = torch.finfo(torch.float32).min                           # the whole row
    m[7, 5:] = torch.finfo(torch.float32).min                       # part of a row
    o = fa(q, k, v, attn_mask=m)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m.double())
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(o[:, :, 3].double(), v.double().mean(dim=2), atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [(5, 2**31 - 1), (-1, 2**31 - 1), (2**31 - 1, 0), (2**31 - 1, 2**40)])
def test_window_bounds_near_int32_max_mean_unbounded(rng, window):
    """A bound past every key (INT32_MAX is a common "unbounded") is the same window as -1: near 2**31 it wrapped
    the kernels' int32 tile arithmetic (forward and backward silently wrong)."""
    q, k, v = (_rand(1, 1, 40, 16) for _ in range(3))
    _check(q, k, v, f"window {window}", window=window)
    same = tuple(-1 if x > 100 else x for x in window)
    torch.testing.assert_close(fa(q, k, v, window=window), fa(q, k, v, window=same), atol=0, rtol=0)


def test_varlen_takes_strided_cu_seqlens(rng):
    """cu_seqlens as a strided view (cu[::2]): the kernels read entry b at offset b, so it is made contiguous."""
    q, k, v = (_rand(37, 2, 16).requires_grad_() for _ in range(3))
    strided = torch.tensor([0, 99, 5, 99, 30, 99, 37], dtype=torch.int32, device=DEV)[::2]
    dense = strided.contiguous()
    o1 = flashlab.flash_attention_varlen(q, k, v, strided, strided, 25, 25, is_causal=True)
    g1 = torch.autograd.grad(o1.sum(), (q, k, v))
    o2 = flashlab.flash_attention_varlen(q, k, v, dense, dense, 25, 25, is_causal=True)
    g2 = torch.autograd.grad(o2.sum(), (q, k, v))
    for a, b in zip((o1, *g1), (o2, *g2)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(window=(3, 3))])
def test_second_derivative_is_refused_not_wrong(kw):
    """create_graph=True (a gradient penalty): the kernels' gradients carry no graph, so a second derivative would be
    a silently wrong number; it is an error, as with SDPA's flash kernels.  First-order gradients stay as they were."""
    q, k, v = (_rand(1, 2, 16, 16).requires_grad_() for _ in range(3))
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(fa(q, k, v, **kw).pow(2).sum(), q, create_graph=True)
    g, = torch.autograd.grad(fa(q, k, v, **kw).pow(2).sum(), q)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(window=(3, 3))])
def test_torch_func_transforms_are_refused_clearly(kw):
    """torch.func.grad / vmap wrap the tensors, which the kernels cannot take: a NotImplementedError that says what
    to use instead, not a storage error from deep inside."""
    q, k, v = (_rand(1, 2, 16, 16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.grad(lambda x: fa(x, k, v, **kw).sum())(q)
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.vmap(lambda x: fa(x, k, v, **kw))(q[None].expand(3, -1, -1, -1, -1))


EMPTY = [   # (q shape, k/v shape, keywords): a dimension of 0, as SDPA takes it
    ((2, 3, 5, 16), (2, 3, 0, 16), {}),
    ((2, 3, 5, 16), (2, 3, 0, 16), dict(is_causal=True)),
    ((2, 3, 0, 16), (2, 3, 7, 16), {}),
    ((0, 3, 5, 16), (0, 3, 7, 16), dict(is_causal=True)),
    ((2, 0, 5, 16), (2, 0, 7, 16), {}),
    ((2, 4, 5, 16), (2, 2, 0, 16), dict(enable_gqa=True, window=(2, 0))),
    ((2, 4, 0, 16), (2, 2, 7, 16), dict(enable_gqa=True, softcap=30.0, dropout_p=0.2, seed=1)),
    ((2, 3, 5, 16), (2, 3, 0, 16), dict(attn_mask="bool")),
    ((2, 3, 0, 16), (2, 3, 7, 16), dict(attn_mask="float", alibi_slopes="slopes")),
]


@pytest.mark.parametrize("qs,ks,kw", EMPTY)
def test_empty_inputs_give_sdpa_zeros(qs, ks, kw):
    """A batch, heads, queries or keys of length 0: O and the gradients are SDPA's (zeros of the inputs' shapes),
    the LSE -inf, and nothing reaches a kernel; a key/value of 0 heads beside query heads is refused."""
    kw = dict(kw)
    q = torch.randn(qs, device=DEV).requires_grad_()
    k, v = (torch.randn(ks, device=DEV).requires_grad_() for _ in range(2))
    B, H, Nq, _ = qs
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.ones(B, 1, Nq, ks[2], dtype=torch.bool, device=DEV)
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.zeros(1, H, Nq, ks[2], device=DEV)
    if kw.get("alibi_slopes") == "slopes":
        kw["alibi_slopes"] = torch.rand(H, device=DEV)
    o, lse = fa(q, k, v, return_lse=True, **kw)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), is_causal=kw.get("is_causal", False),
        enable_gqa=kw.get("enable_gqa", False))
    assert o.shape == ref.shape and lse.shape == qs[:3] and lse.dtype == torch.float32
    assert torch.equal(o.cpu(), ref) and bool(torch.isneginf(lse).all())
    (o * 1.5).sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any(), f"d{name}"


def test_empty_varlen_and_heads():
    """Packed calls with no rows or no keys (cu_seqlens still checked), and 0 key heads beside query heads."""
    q = torch.randn(6, 2, 16, device=DEV).requires_grad_()
    k = torch.randn(0, 2, 16, device=DEV).requires_grad_()
    cq = torch.tensor([0, 4, 6], dtype=torch.int32, device=DEV)
    c0 = torch.zeros(3, dtype=torch.int32, device=DEV)
    o, lse = flashlab.flash_attention_varlen(q, k, k, cq, c0, 4, 1, is_causal=True, return_lse=True)
    assert o.shape == q.shape and not o.any() and lse.shape == (2, 6) and bool(torch.isneginf(lse).all())
    o.sum().backward()
    assert q.grad.shape == q.shape and not q.grad.any() and k.grad.shape == k.shape
    with pytest.raises(ValueError, match="end at the packed length"):
        flashlab.flash_attention_varlen(q, k, k, cq, cq, 4, 4)
    e = torch.randn(0, 2, 16, device=DEV)
    o = flashlab.flash_attention_varlen(e, q.detach(), q.detach(), c0, cq, 1, 4)
    assert o.shape == e.shape
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        fa(torch.randn(1, 4, 3, 16, device=DEV), *(torch.randn(1, 0, 3, 16, device=DEV),) * 2, enable_gqa=True)
    with torch.autocast(DEV.type, dtype=torch.bfloat16):                # O in autocast's dtype, as SDPA's
        assert fa(torch.randn(1, 2, 3, 16, device=DEV), *(torch.randn(1, 2, 0, 16, device=DEV),) * 2).dtype \
            == torch.bfloat16
