"""The FP8 forward (flashlab/kernels/forward_fp8.py, flashlab/fp8.py) against float64, with its error bound derived.

The bound.  Let Q, K, V be the *dequantised* inputs (q8 * q_scale, ...), A = softmax(scale Q K^T) in float64 and
l_i = sum_j exp(s_ij - max_j s_ij) >= 1.  The kernel's scores are Q8 K8^T accumulated in float32 (products of
two e4m3 numbers are exact in float32), so the one rounding that matters is P's cast to e4m3 for P V:
a weight p in [0, 1] rounds to nearest, with error at most 2^-4 p where p >= 2^-6 (3 mantissa bits) and at
most min(p, 2^-10) below 2^-6 (subnormals are the multiples of 2^-9; 0 is one of them).  The row sum l uses
the unrounded weights, so O_kernel - O_ref = sum_j (p~_j - p_j) V_j / l, and, per element,

    |O_kernel - O_ref|_id  <=  sum_j (2^-4 A_ij + min(A_ij, 2^-10 / l_i)) |V_jd|  +  out  +  slack

(a weight rounded against a running max m' <= m is off by the same bound after its rescale 2^(m' - m) <= 1).
``out``: O's own rounding, 2^-8 |O| in bf16 (half its 2^-7 spacing), 2^-11 |O| in fp16, 0 in float32.  ``slack``: float32
arithmetic, 1e-4 max|V| (an exponent of |x| <= 10^3 carries 10^3 * 2^-24 = 6e-5 of relative error).

The op (``flash_attention(..., fp8=True)``) also quantises Q, K and V.  Its error against float64 of the
*original* inputs is then at most that quantisation's effect, measured exactly in float64 (attention of the
dequantised inputs minus attention of the originals), plus the kernel's bound above.  The quantisation's
effect is the large term: each logit moves by about sigma = sqrt(2) * 0.03 = 0.04 for unit-normal q, k (two
relative errors of rms at most 2^-3 / sqrt(12) = 0.036, 0.027 measured, per product, summed over D products and
scaled by 1 / sqrt(D)), so O moves by about sigma times the spread of V; for unit-normal inputs the tests hold
it to 0.25 (about 6 sigma).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import flashlab  # noqa: F401  (first: GPU or interpreter)
from flashlab import device, flash_attention, flash_attention_fp8, quantize_fp8
from flashlab.fp8 import FP8_DTYPE, _quantize_torch, _triton_quantises, dequantize_fp8
from flashlab.kernels import quantize_fp8 as quantize_kernels
from flashlab.kernels.forward_fp8 import round_to_e4m3
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEV = device.DEVICE


def _attention64(q, k, v, causal, scale):
    """(O, A, l) in float64; k, v (B, H_kv, Nk, D) repeated over the query heads' groups."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    a = torch.softmax(s, -1)
    lsum = torch.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True)
    return a @ v, a, lsum, v, torch.logsumexp(s, -1)


def _bound(a, lsum, v_rep, o_ref, out_dtype):
    """The per-element bound of the module docstring."""
    p_part = (2.0**-4 * a + torch.minimum(a, 2.0**-10 / lsum)) @ v_rep.abs()
    out = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype] * o_ref.abs()
    return p_part + out + 1e-4 * v_rep.abs().max()


def _inputs(B, H, Hk, Nq, Nk, D, mag=1.0):
    q = mag * torch.randn(B, H, Nq, D, device=DEV)
    k = mag * torch.randn(B, Hk, Nk, D, device=DEV)
    v = torch.randn(B, Hk, Nk, D, device=DEV)
    return q, k, v


def _kernel_check(q8, k8, vt8, qs, ks, vs, causal, out_dtype=torch.float32, scale=None, *, true_scales=None,
                  true_vt=None):
    """(max err / bound, lse error): the kernel against float64 of the dequantised inputs.
    ``true_scales``, ``true_vt``: what the reference uses (default: what the kernel got)."""
    rq, rk, rv = true_scales or (qs, ks, vs)
    D = q8.shape[-1]
    sm = 1 / math.sqrt(D) if scale is None else scale
    o, lse = flash_attention_fp8(q8, k8, vt8, qs, ks, vs, causal, scale, out_dtype=out_dtype, return_lse=True)
    Q, K, V = dequantize_fp8(q8, rq), dequantize_fp8(k8, rk), dequantize_fp8(vt8 if true_vt is None else true_vt, rv,
                                                                             transposed=True)
    o_ref, a, lsum, v_rep, lse_ref = _attention64(Q, K, V, causal, sm)
    assert o.dtype == out_dtype and o.shape == q8.shape and lse.dtype == torch.float32
    ratio = ((o.double() - o_ref).abs() / _bound(a, lsum, v_rep, o_ref, out_dtype)).max().item()
    return ratio, (lse.double() - lse_ref).abs().max().item()


CASES = [  # (B, H, H_kv, Nq, Nk, D, |q|, |k| scale): ragged (not multiples of 32), Nq != Nk both ways
    (1, 2, 2, 77, 45, 32, 1.0),
    (2, 1, 1, 33, 100, 64, 1.0),
    (1, 2, 2, 50, 70, 48, 1.0),      # D = 48: padded to 64 in e4m3
    (1, 1, 1, 65, 65, 32, 8.0),      # large-magnitude logits: |S| in the hundreds
    (1, 4, 2, 40, 39, 32, 1.0),      # GQA: two query heads per K/V head
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,Hk,Nq,Nk,D,mag", CASES)
def test_kernel_within_the_derived_bound(rng, B, H, Hk, Nq, Nk, D, mag, causal):
    q, k, v = _inputs(B, H, Hk, Nq, Nk, D, mag)
    q8, qs = quantize_fp8(q)
    k8, ks = quantize_fp8(k)
    vt8, vs = quantize_fp8(v, transpose=True)
    ratio, lse_err = _kernel_check(q8, k8, vt8, qs, ks, vs, causal, torch.bfloat16 if mag == 1.0 else torch.float32)
    assert ratio <= 1.0, f"error {ratio:.2f}x the bound"
    assert lse_err < 1e-4 * max(1.0, mag**2 * D)    # the LSE sees no rounded P: float32 arithmetic only


@pytest.mark.descriptors
@pytest.mark.parametrize("causal", [False, True])
def test_descriptor_loads_within_the_derived_bound(rng, causal, monkeypatch):
    """The Hopper path (K and V^T tiles through tensor descriptors, zeros past Nk), run in the interpreter too:
    ragged Nq, Nk a multiple of 16 (V^T's rows must be 16-byte aligned), a last tile past Nk, GQA."""
    from flashlab.kernels import forward_fp8, forward_v4
    used = []
    run_step = forward_v4.run_step

    def spy(step, kern, args, consts, runners, key):
        used.append(consts["TMA"])
        return run_step(step, kern, args, consts, runners, key)

    monkeypatch.setattr(forward_v4, "DESCRIPTORS_IN_INTERPRETER", True)
    monkeypatch.setattr(forward_v4, "run_step", spy)
    monkeypatch.setattr(forward_fp8, "TMA", None)
    for B, H, Hk, Nq, Nk, D in [(1, 2, 2, 77, 48, 32), (1, 4, 2, 40, 80, 64)]:
        q, k, v = _inputs(B, H, Hk, Nq, Nk, D)
        q8, qs = quantize_fp8(q)
        k8, ks = quantize_fp8(k)
        vt8, vs = quantize_fp8(v, transpose=True)
        ratio, lse_err = _kernel_check(q8, k8, vt8, qs, ks, vs, causal, torch.bfloat16)
        assert ratio <= 1.0, f"error {ratio:.2f}x the bound (Nq {Nq}, Nk {Nk}, D {D})"
        assert lse_err < 1e-4 * D
    assert used and all(used), "the descriptor path did not run"
    assert not forward_v4.DESCRIPTOR_ERRORS


def test_one_key_tile_matches_an_exact_emulation(rng):
    """With one key tile the running max is the final one, so the kernel is, rounding for rounding: scores in
    float32, P = 2^(x - m) cast to e4m3 (torch's cast: round to nearest even), P8 V8 / l * v_scale."""
    q, k, v = _inputs(1, 2, 2, 40, 32, 32, 2.0)
    q8, qs = quantize_fp8(q)
    k8, ks = quantize_fp8(k)
    vt8, vs = quantize_fp8(v, transpose=True)
    o = flash_attention_fp8(q8, k8, vt8, qs, ks, vs, out_dtype=torch.float32)
    qk_scale = (qs * ks * (1 / math.sqrt(32) * math.log2(math.e)))[..., None, None]
    x = (q8.float() @ k8.float().transpose(-1, -2)) * qk_scale
    p = torch.exp2(x - x.amax(-1, keepdim=True))
    v64, l64 = vt8.double().transpose(-1, -2) * vs.double()[..., None, None], p.double().sum(-1, keepdim=True)
    emul = (p.to(FP8_DTYPE).double() @ v64) / l64
    assert (o.double() - emul).abs().max().item() < 1e-5 * emul.abs().max().item()
    unrounded = (p.double() @ v64) / l64
    assert (o.double() - unrounded).abs().max().item() > 1e-3    # P really is rounded to e4m3


@triton.jit
def _round(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, round_to_e4m3(tl.load(X + offs, mask=offs < n)), mask=offs < n)


def test_round_to_e4m3_is_round_to_nearest_even(rng):
    """The interpreter's own cast mishandles mantissa carries; the kernel's rounding is torch's, bit for bit."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()       # every e4m3 number in [0, 448]
    grid = grid[grid <= 1]
    mids = (grid[1:] + grid[:-1]) / 2                                              # the ties
    x = torch.cat([grid, mids, torch.rand(4000) ** 4, torch.tensor([0.4895, 0.999, 2.0**-10, 2.0**-11, 3e-4])])
    x = x.to(DEV)
    y = torch.empty_like(x)
    _round[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y, x.to(FP8_DTYPE).float())


def test_a_wrong_scale_is_caught(rng):
    """The check can fail: the kernel given k_scale * 1.5, or v_scale * 1.1, is out of the bound."""
    q, k, v = _inputs(1, 2, 2, 64, 64, 32)
    q8, qs = quantize_fp8(q)
    k8, ks = quantize_fp8(k)
    vt8, vs = quantize_fp8(v, transpose=True)
    assert _kernel_check(q8, k8, vt8, qs, ks * 1.5, vs, False, true_scales=(qs, ks, vs))[0] > 1.0
    assert _kernel_check(q8, k8, vt8, qs, ks, vs * 1.1, True, true_scales=(qs, ks, vs))[0] > 1.0
    v8, vs = quantize_fp8(v[:, :, :32])          # V not transposed: with Nk == D the shapes cannot tell
    vt8 = v8.transpose(2, 3).contiguous()
    assert _kernel_check(q8, k8[:, :, :32], v8, qs, ks, vs, False, true_vt=vt8)[0] > 1.0
    assert _kernel_check(q8, k8[:, :, :32], vt8, qs, ks, vs, False)[0] <= 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_op_against_float64_of_the_original_inputs(rng, dtype, causal):
    q, k, v = (t.to(dtype) for t in _inputs(1, 2, 2, 70, 90, 64))
    o, lse = flash_attention(q, k, v, is_causal=causal, fp8=True, return_lse=True)
    assert o.dtype == dtype and o.shape == q.shape
    sm = 1 / math.sqrt(64)
    o64, *_ = _attention64(q.double(), k.double(), v.double(), causal, sm)
    q8, qs = quantize_fp8(q)
    k8, ks = quantize_fp8(k)
    vt8, vs = quantize_fp8(v, transpose=True)
    od, a, lsum, v_rep, _ = _attention64(dequantize_fp8(q8, qs), dequantize_fp8(k8, ks),
                                         dequantize_fp8(vt8, vs, transposed=True), causal, sm)
    err = (o.double() - o64).abs()
    allowed = (od - o64).abs() + _bound(a, lsum, v_rep, od, dtype)      # quantisation (measured) + the kernel's
    assert (err <= allowed).all(), (err - allowed).max().item()
    assert err.max().item() <= 0.25                                      # unit-normal inputs: 5 sigma
    same = flash_attention(q, k, v, causal=causal, fp8=True)            # the causal= alias; deterministic
    assert torch.equal(same, o)


def test_quantize_round_trip_and_zeros(rng):
    x = torch.randn(2, 3, 50, 40, device=DEV) * torch.tensor([1e-3, 1.0, 1e3], device=DEV)[None, :, None, None]
    x[1, 2] = 0.0                                                       # an all-zero head: scale 1, zeros back
    t8, s = quantize_fp8(x)
    assert t8.dtype == FP8_DTYPE and t8.shape == x.shape and s.shape == (2, 3) and s.dtype == torch.float32
    assert s[1, 2].item() == 1.0 and (t8[1, 2].float() == 0).all()
    back = dequantize_fp8(t8, s)
    amax = x.abs().amax(dim=(2, 3), keepdim=True).double()
    assert ((back - x.double()).abs() <= 2.0**-4 * x.double().abs() + 2.0**-10 * amax / 448).all()
    assert (t8.float().abs().amax(dim=(2, 3))[s != 1.0] == 448).all()    # each head's largest lands on 448
    tt8, ts = quantize_fp8(x, transpose=True)
    assert tt8.shape == (2, 3, 40, 50) and tt8.is_contiguous() and torch.equal(ts, s)
    assert torch.equal(tt8.transpose(2, 3).view(torch.uint8), t8.view(torch.uint8))


def _same_quantisation(x, transpose):
    """The Triton kernels' (t8, scale) against the plain-torch reference's: equal bytes, equal scale bits."""
    t8, s = quantize_kernels.quantize(x, transpose)
    r8, rs = _quantize_torch(x, transpose)
    assert t8.shape == r8.shape and t8.is_contiguous() and s.shape == rs.shape and s.dtype == torch.float32
    return torch.equal(t8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(s, rs)


def _heads(B, N, D, dtype):
    """(B, 4, N, D): heads of magnitude 1e-3, 1 and 1e4 (clamping and the scale matter), and an all-zero head."""
    x = torch.randn(B, 4, N, D, device=DEV) * torch.tensor([1e-3, 1.0, 1e4, 0.0], device=DEV)[None, :, None, None]
    return x.to(dtype)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_kernels_equal_torch_bit_for_bit(rng, dtype, transpose):
    """Ragged N (one tile, a partial tile, several tiles), D not a power of two, and non-contiguous inputs."""
    assert _triton_quantises(_heads(1, 8, 16, dtype))               # quantize_fp8 takes this path here too
    for N, D in [(1, 16), (37, 64), (300, 80), (600, 16)]:
        x = _heads(2, N, D, dtype)
        assert _same_quantisation(x, transpose), (N, D)
        assert _same_quantisation(_heads(2, D, N, dtype).transpose(2, 3), transpose), (N, D, "unit stride along N")
        assert _same_quantisation(x[:, 1:, ::2], transpose), (N, D, "a strided slice")
    t8, s = quantize_fp8(x, transpose=transpose)
    assert s[:, 3].eq(1.0).all() and t8[:, 3].float().eq(0).all()   # the all-zero head: scale 1, zeros


def test_quantize_kernels_check_can_fail(rng):
    """What the bitwise comparison catches: a scale off in its last bit, a missing transpose, a small scale error."""
    x = torch.randn(4, 16, 64, 32, device=DEV)
    t8, s = quantize_kernels.quantize(x)
    amax = x.abs().amax(dim=(2, 3))
    assert not torch.equal(s, amax / 448)           # the division rounds differently from * (1 / 448) in some heads
    assert torch.equal(s, amax * (1 / 448))
    vt8, _ = quantize_kernels.quantize(x, transpose=True)
    assert not torch.equal(vt8.view(torch.uint8), t8.view(torch.uint8).reshape(vt8.shape))
    nudged = (x / (s * (1 + 2.0**-10))[:, :, None, None]).clamp(-448, 448).to(FP8_DTYPE)
    assert not torch.equal(nudged.view(torch.uint8), t8.view(torch.uint8))


def test_quantize_kernels_round_ties_as_torch(rng):
    """Inputs on and one or two float32 steps beside every tie between two e4m3 numbers (both signs): rounding
    to nearest even, and x / scale, not x * (1 / scale), which rounds some of these the other way."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()      # every e4m3 number in [0, 448]
    ties = (grid[1:] + grid[:-1]) / 2
    head = torch.cat([ties, -ties]) * (1000 * (1 / 448))                         # x / scale lands near a tie
    bits = head.view(torch.int32)[:, None] + torch.arange(-2, 3, dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32).flatten(), torch.tensor([1000.0])])   # amax 1000: the scale above
    x = F.pad(x, (0, -x.numel() % 16)).reshape(1, 1, -1, 16).to(DEV)
    assert _same_quantisation(x, False) and _same_quantisation(x, True)
    r8, s = _quantize_torch(x)
    by_reciprocal = (x * (1 / s)[:, :, None, None]).clamp(-448, 448).to(FP8_DTYPE)
    assert not torch.equal(by_reciprocal.view(torch.uint8), r8.view(torch.uint8))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # inf / inf in the interpreter
def test_quantize_kernels_on_nan_and_inf_as_torch(rng):
    """A head with a NaN gets scale 1 (NaN elements stay NaN, the others are clamped to +-448); a head with an
    inf gets scale inf (finite elements 0, infinities NaN).  The bytes match torch's but for a NaN's sign bit."""
    x = torch.randn(1, 3, 50, 32, device=DEV) * 1000
    x[0, 0, 3, 4] = float("nan")
    x[0, 1, 7, 1], x[0, 1, 9, 9] = float("inf"), -float("inf")
    for transpose in (False, True):
        t8, s = quantize_kernels.quantize(x, transpose)
        r8, rs = _quantize_torch(x, transpose)
        assert torch.equal(s, rs) and s[0, 0] == 1.0 and s[0, 1] == float("inf") and torch.isfinite(s[0, 2])
        b, rb = t8.view(torch.uint8), r8.view(torch.uint8)
        nan, rnan = (b & 0x7F) == 0x7F, (rb & 0x7F) == 0x7F                  # e4m3's NaN: S.1111.111
        assert torch.equal(nan, rnan) and torch.equal(b[~nan], rb[~rnan]) and nan.sum() == 3


def test_op_quantises_with_the_kernels(rng):
    """fp8=True from non-contiguous bf16 inputs is the FP8 forward on torch's quantisation, exactly, and within
    the unit-normal cap of float64."""
    q, k, v = (t.bfloat16().transpose(2, 3) for t in (torch.randn(1, 2, 64, 70, device=DEV) for _ in range(3)))
    o = flash_attention(q, k, v, is_causal=True, fp8=True)
    (q8, qs), (k8, ks), (vt8, vs) = _quantize_torch(q), _quantize_torch(k), _quantize_torch(v, True)
    assert torch.equal(o, flash_attention_fp8(q8, k8, vt8, qs, ks, vs, True, out_dtype=torch.bfloat16))
    o64, *_ = _attention64(q.double(), k.double(), v.double(), True, 1 / math.sqrt(64))
    assert (o.double() - o64).abs().max().item() <= 0.25


def test_per_tensor_scales_broadcast(rng):
    q, k, v = _inputs(2, 2, 2, 40, 40, 32)
    q8, k8, vt8 = (t.clamp(-448, 448).to(FP8_DTYPE) for t in (q * 100, k * 100, v.transpose(2, 3) * 100))
    o = flash_attention_fp8(q8, k8, vt8, 0.01, torch.tensor(0.01, device=DEV), torch.full((1, 1), 0.01, device=DEV),
                            out_dtype=torch.float32)
    full = torch.full((2, 2), 0.01, device=DEV)
    assert torch.equal(o, flash_attention_fp8(q8, k8, vt8, full, full, full, out_dtype=torch.float32))


BAD = [
    (lambda q, k, v: flash_attention(q.requires_grad_(), k, v, fp8=True), ValueError, "forward-only"),
    (lambda q, k, v: flash_attention(q, k, v, fp8=True, dropout_p=0.1), ValueError, "dropout_p"),
    (lambda q, k, v: flash_attention(q, k, v, fp8=True, attn_mask=torch.ones(40, 40, dtype=torch.bool)),
     ValueError, "attn_mask"),
    (lambda q, k, v: flash_attention(q, k, v, fp8=True, window=(8, 0)), ValueError, "window"),
    (lambda q, k, v: flash_attention(q, k, v, fp8="yes"), TypeError, "fp8 must be a bool"),
    (lambda q, k, v: flash_attention_fp8(q, k, v, 1.0, 1.0, 1.0), TypeError, "quantize_fp8"),
    (lambda q, k, v: flash_attention_fp8(*(quantize_fp8(t)[0] for t in (q, k, v)), 1.0, 1.0, 1.0),
     ValueError, "transpose=True"),
    (lambda q, k, v: flash_attention_fp8(quantize_fp8(q)[0], quantize_fp8(k)[0], quantize_fp8(v, transpose=True)[0],
                                         torch.ones(3), 1.0, 1.0), ValueError, "q_scale must have shape"),
    (lambda q, k, v: flash_attention_fp8(quantize_fp8(q)[0], quantize_fp8(k)[0], quantize_fp8(v, transpose=True)[0],
                                         torch.ones(1, 2, dtype=torch.float64), 1.0, 1.0), TypeError, "float32"),
    (lambda q, k, v: flash_attention_fp8(quantize_fp8(q)[0], quantize_fp8(k)[0], quantize_fp8(v, transpose=True)[0],
                                         1.0, 1.0, 1.0, out_dtype=torch.int8), TypeError, "out_dtype"),
    # a scale that is not positive and finite would give a wrong O (negative) or NaN (zero, inf, NaN), silently
    (lambda q, k, v: flash_attention_fp8(quantize_fp8(q)[0], quantize_fp8(k)[0], quantize_fp8(v, transpose=True)[0],
                                         -0.01, 1.0, 1.0), ValueError, "q_scale must be positive and finite"),
    (lambda q, k, v: flash_attention_fp8(quantize_fp8(q)[0], quantize_fp8(k)[0], quantize_fp8(v, transpose=True)[0],
                                         1.0, torch.tensor([[1.0, 0.0]], device=DEV), 1.0), ValueError,
     "k_scale must be positive and finite"),
    (lambda q, k, v: flash_attention_fp8(quantize_fp8(q)[0], quantize_fp8(k)[0], quantize_fp8(v, transpose=True)[0],
                                         1.0, 1.0, float("nan")), ValueError, "v_scale must be positive and finite"),
    # grouped K/V heads need enable_gqa=True, as in the fp16/bf16 path and SDPA
    (lambda q, k, v: flash_attention(q, k[:, :1], v[:, :1], fp8=True), ValueError, "enable_gqa=True"),
]


@pytest.mark.parametrize("make,exc,words", BAD)
def test_bad_inputs_raise_clear_errors(rng, make, exc, words):
    q, k, v = (torch.randn(1, 2, 40, 32, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(exc, match=words):
        make(q, k, v)


def test_check_scales_false_skips_only_the_scale_check(rng, monkeypatch):
    """check_scales=False (for scales quantize_fp8 made) reads nothing back from the device; the default does."""
    q, k, v = (torch.randn(1, 2, 40, 32, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    (q8, qs), (k8, ks), (vt8, vs) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v, transpose=True)
    want = flash_attention_fp8(q8, k8, vt8, qs, ks, vs, True)
    reads = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real(t))
    got = flash_attention_fp8(q8, k8, vt8, qs, ks, vs, True, check_scales=False)
    assert not reads and torch.equal(got, want)
    flash_attention_fp8(q8, k8, vt8, qs, ks, vs, True)
    assert len(reads) == 3                                          # one check per scale by default
    monkeypatch.undo()
    with pytest.raises(ValueError, match="q_scale must be positive"):
        flash_attention_fp8(q8, k8, vt8, -qs, ks, vs, True)


def test_gqa_through_the_op_and_no_gradient_from_quantize(rng):
    q, k, v = _inputs(1, 4, 2, 50, 60, 32)
    o = flash_attention(q, k, v, fp8=True, enable_gqa=True)
    o64, *_ = _attention64(q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
                           False, 1 / math.sqrt(32))
    assert (o.double() - o64).abs().max().item() < 0.25          # the op's cap for unit-normal inputs (docstring)
    t8, scale = quantize_fp8(torch.randn(1, 2, 8, 16, device=DEV, requires_grad=True))
    assert not t8.requires_grad and not scale.requires_grad


def test_no_grad_is_fine_and_old_gpus_are_refused(rng):
    from flashlab.kernels import plan as P
    q, k, v = (torch.randn(1, 1, 33, 32, device=DEV, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        assert flash_attention(q, k, v, fp8=True).dtype == torch.float32
    for facts in (P.T4, P.A100):
        with pytest.raises(ValueError, match="compute capability >= 8.9"):
            P.plan(1, 1, 4096, 4096, 64, FP8_DTYPE, facts=facts)


def test_plan_picks_the_fp8_forward():
    from flashlab.kernels import plan as P
    for facts in (P.L4, P.H200):
        p = P.plan(1, 16, 16384, 16384, 128, FP8_DTYPE, True, facts=facts)
        assert p.fwd_version == "fp8" and p.bwd_version == "none" and p.backward == ()
        st = p.forward[0]
        assert st.config.block_n >= 32 and not st.autotune and "FP8" in p.reasons["fwd"]
    assert "fp8" not in P.FORWARD_VERSIONS                                # scripts compare the fp16/bf16 ones
    assert P.plan(1, 4, 256, 256, 64, FP8_DTYPE, variant=P.Variant(kv_groups=2), facts=P.H200).fwd_version == "fp8"
    assert P.plan(1, 4, 4096, 4096, 64, torch.float16, variant=P.Variant(kv_groups=2), facts=P.H200).fwd_version == "v4"
    with pytest.raises(ValueError, match="plain or causal"):
        P.plan(1, 1, 256, 256, 64, FP8_DTYPE, variant=P.Variant(window=(8, 0)), facts=P.H200)
    with pytest.raises(ValueError, match="cannot run"):
        P.plan(1, 1, 256, 256, 64, torch.float16, forward_version="fp8", facts=P.H200)


def test_cli_prints_the_fp8_plan(capsys):
    from flashlab.__main__ import main
    assert main(["plan", "--shape", "1,16,16384,128", "--fp8", "--causal", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "forward  fp8" in out and "float8_e4m3fn" in out and "128x128" in out and "inference only" in out
    assert main(["plan", "--shape", "1,16,16384,128", "--fp8", "--device", "a100"]) == 2
    assert "compute capability >= 8.9" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_fp8_forward(rng, causal, D):
    """On a GPU of compute capability >= 8.9: the plan picks the FP8 forward, and the compiled kernel keeps the
    bound at realistic sizes (hand-picked tiles: 128 x 128 on an H200)."""
    if device.capability() < (8, 9):
        with pytest.raises(ValueError, match="compute capability >= 8.9"):
            flash_attention(*_inputs(1, 2, 2, 256, 256, D), fp8=True)
        return
    from flashlab.kernels import plan as P
    assert P.plan(1, 16, 16384, 16384, D, FP8_DTYPE, causal).fwd_version == "fp8"
    q, k, v = _inputs(2, 4, 4, 1537, 1000, D)
    q8, qs = quantize_fp8(q)
    k8, ks = quantize_fp8(k)
    vt8, vs = quantize_fp8(v, transpose=True)
    ratio, lse_err = _kernel_check(q8, k8, vt8, qs, ks, vs, causal, torch.bfloat16)
    assert ratio <= 1.0 and lse_err < 1e-3
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o = flash_attention(q, k, v, is_causal=causal, fp8=True)
    o64, *_ = _attention64(q.double(), k.double(), v.double(), causal, 1 / math.sqrt(D))
    deq = (dequantize_fp8(*quantize_fp8(t)) for t in (q, k, v))
    od, a, lsum, v_rep, _ = _attention64(*deq, causal, 1 / math.sqrt(D))
    assert ((o.double() - o64).abs() <= (od - o64).abs() + _bound(a, lsum, v_rep, od, torch.bfloat16)).all()


@pytest.mark.gpu
def test_gpu_quantize_kernels_equal_torch(rng):
    """On a GPU of compute capability >= 8.9 quantize_fp8 runs the compiled kernels (the hardware's e4m3
    conversion): the same bytes and scales as torch's passes on the same GPU, at ragged and at realistic sizes."""
    if device.capability() < (8, 9):
        assert not _triton_quantises(torch.randn(1, 1, 8, 16, device="cuda"))
        return
    assert _triton_quantises(torch.randn(1, 1, 8, 16, device="cuda"))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for transpose in (False, True):
            for N, D in [(1, 16), (37, 64), (300, 80), (4097, 128), (1000, 256)]:
                x = _heads(2, N, D, dtype)
                assert _same_quantisation(x, transpose), (dtype, transpose, N, D)
                assert _same_quantisation(_heads(2, D, N, dtype).transpose(2, 3), transpose), (dtype, N, D, "N-major")
    x = torch.randn(2, 16, 16384, 128, device="cuda", dtype=torch.bfloat16)
    assert _same_quantisation(x, False) and _same_quantisation(x, True)
    x = torch.randn(1, 3, 50, 32, device="cuda") * 1000
    x[0, 0, 3, 4], x[0, 1, 7, 1] = float("nan"), float("inf")
    t8, s = quantize_kernels.quantize(x)
    r8, rs = _quantize_torch(x)
    b, rb = t8.view(torch.uint8), r8.view(torch.uint8)
    nan = (b & 0x7F) == 0x7F
    assert torch.equal(s, rs) and torch.equal(nan, (rb & 0x7F) == 0x7F) and torch.equal(b[~nan], rb[~nan])
