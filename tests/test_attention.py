"""The public op and its Triton kernels against float64 autograd of naive attention.

Runs on the CPU through Triton's interpreter and, when a GPU is present, on CUDA
(compiled) with the same cases.  The accuracy rule is flashlab.accuracy's.
"""
import pytest
import torch
import torch.nn.functional as F

from flashlab import device, flash_attention
from flashlab.accuracy import check_attention

DEV = device.DEVICE


def _fa(q, k, v, causal, scale):
    return flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)


def _rand(shape, dtype, mag=1.0):
    return (mag * torch.randn(shape, device=DEV, dtype=torch.float32)).to(dtype)


def _assert_checks(checks, label):
    bad = [str(c) for c in checks if not c.ok]
    assert not bad, f"{label}:\n" + "\n".join(str(c) for c in checks)


CASES = [
    # B, H, Nq, Nk, D
    (1, 1, 1, 1, 16),
    (2, 3, 17, 17, 16),
    (1, 2, 100, 129, 32),
    (2, 1, 129, 100, 64),
    (1, 1, 64, 64, 128),
    (1, 2, 33, 5, 32),
    (1, 1, 5, 70, 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,Nq,Nk,D", CASES)
def test_forward_lse_backward_accuracy(rng, B, H, Nq, Nk, D, causal, dtype):
    q, k, v = _rand((B, H, Nq, D), dtype), _rand((B, H, Nk, D), dtype), _rand((B, H, Nk, D), dtype)
    _assert_checks(check_attention(_fa, q, k, v, causal), f"{dtype} causal={causal} {q.shape} {k.shape}")


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_gives_right_answers(rng, causal):
    """In the interpreter bf16 is upcast (its bf16 tl.dot is wrong); on a GPU it is native."""
    q, k, v = (_rand((1, 2, 77, 64), torch.bfloat16) for _ in range(3))
    checks = check_attention(_fa, q, k, v, causal)
    _assert_checks(checks, f"bf16 causal={causal}")
    o = flash_attention(q, k, v, causal)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_large_magnitude_logits(rng, dtype, causal):
    """Scores in the thousands: e^S overflows unless the running max is subtracted."""
    q = _rand((1, 2, 90, 32), dtype, mag=12.0)
    k = _rand((1, 2, 90, 32), dtype, mag=12.0)
    v = _rand((1, 2, 90, 32), dtype)
    o, lse = flash_attention(q, k, v, causal, return_lse=True)
    assert lse.abs().max() > 200, "test data too tame to exercise the max subtraction"
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    _assert_checks(check_attention(_fa, q, k, v, causal), f"large logits {dtype}")


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs(rng, causal):
    """A (B, N, H, D) tensor viewed as (B, H, N, D) works without a copy (strides are passed)."""
    B, N, H, D = 2, 45, 3, 32
    q, k, v = (_rand((B, N, H, D), torch.float32).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    _assert_checks(check_attention(_fa, q, k, v, causal), "transposed views")
    # sliced last dimension and a fused qkv buffer
    qkv = _rand((B, H, N, 3 * D), torch.float16)
    q, k, v = qkv[..., :D], qkv[..., D:2 * D], qkv[..., 2 * D:]
    _assert_checks(check_attention(_fa, q, k, v, causal), "slices of a fused qkv")


@pytest.mark.parametrize("D", [8, 24, 80])
def test_other_head_dims_are_padded(rng, D):
    q, k, v = (_rand((1, 2, 37, D), torch.float32) for _ in range(3))
    _assert_checks(check_attention(_fa, q, k, v, True), f"D={D}")


def test_custom_scale_and_sdpa_drop_in(rng):
    q, k, v = (_rand((2, 2, 50, 32), torch.float32) for _ in range(3))
    _assert_checks(check_attention(_fa, q, k, v, True, scale=0.3), "scale=0.3")
    for causal in (False, True):
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, scale=0.3)
        torch.testing.assert_close(flash_attention(q, k, v, causal, 0.3).double(), ref, atol=2e-5, rtol=0)


def test_lse_contract(rng):
    q, k, v = (_rand((2, 3, 20, 16), torch.float16) for _ in range(3))
    o, lse = flash_attention(q, k, v, return_lse=True)
    assert lse.shape == (2, 3, 20) and lse.dtype == torch.float32
    s = (q.double() @ k.double().transpose(-1, -2)) / 4.0
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-3, rtol=0)


def test_backward_is_deterministic(rng):
    q, k, v = (_rand((1, 2, 70, 32), torch.float16).requires_grad_() for _ in range(3))
    do = torch.randn_like(q)
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        flash_attention(q, k, v, True).backward(do)
        grads.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_gradients_reach_every_input(rng):
    """Gradient flows to every input, finite, and zero where the output cannot depend on it."""
    q, k, v = (_rand((1, 1, 9, 16), torch.float32).requires_grad_() for _ in range(3))
    flash_attention(q, k, v, True).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and torch.isfinite(t.grad).all()
    assert q.grad[:, :, 0].abs().max() < 1e-6  # row 0 sees one key: its output does not depend on q_0


BAD = [
    (lambda q: (q[0], q, q), ValueError, "4 dimensions"),
    (lambda q: (q, q.double(), q), TypeError, "dtype"),
    (lambda q: (q.int(), q.int(), q.int()), TypeError, "dtype"),
    (lambda q: (q, q[:, :1], q), ValueError, "batch and heads"),
    (lambda q: (q, q, q[:, :, :3]), ValueError, "same sequence length"),
    (lambda q: (q, q[..., :8], q[..., :8]), ValueError, "head dim"),
    (lambda q: (q, q, q.half()), TypeError, "one dtype"),
    (lambda q: (q.numpy(), q, q), TypeError, "torch.Tensor"),
    (lambda q: (q.new_zeros(1, 1, 4, 300),) * 3, ValueError, "head dim"),
    (lambda q: (q, q[:, :, :0], q), ValueError, "same sequence length"),   # an empty key with a full value
]


@pytest.mark.parametrize("make,exc,words", BAD)
def test_bad_inputs_raise_clear_errors(make, exc, words):
    q = torch.randn(1, 2, 8, 16)
    if DEV.type == "cuda":
        q = q.to(DEV)
    try:
        args = make(q)
    except TypeError:  # .numpy() of a CUDA tensor
        args = make(q.cpu())
    with pytest.raises(exc, match=words):
        flash_attention(*args)


def test_bad_scale():
    q = torch.randn(1, 1, 4, 16, device=DEV)
    with pytest.raises(ValueError, match="scale"):
        flash_attention(q, q, q, scale=-1.0)
    flash_attention(q, q, q, scale=0.5)                  # this kind of call is now checked and cached:
    for bad in (-1.0, float("nan"), float("inf"), "2"):  # a bad scale is still refused
        with pytest.raises(ValueError, match="scale"):
            flash_attention(q, q, q, scale=bad)


def test_checks_are_cached_per_kind_of_input_only(rng):
    """A good call of one kind does not let a different kind through unchecked."""
    q = torch.randn(1, 2, 8, 16, device=DEV)
    flash_attention(q, q, q)
    for make, exc, words in BAD:
        try:
            args = make(q)
        except TypeError:
            args = make(q.cpu())
        with pytest.raises(exc, match=words):
            flash_attention(*args)


def test_bad_inputs_under_autocast_raise_clear_errors():
    """Under autocast the inputs are cast first (a mix of fp16 and fp32 becomes one dtype, as for SDPA);
    everything else is still refused with the same message."""
    q = torch.randn(1, 2, 8, 16, device=DEV)
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        for make, exc, words in BAD:
            try:
                args = make(q)
            except TypeError:
                args = make(q.cpu())
            if words == "one dtype":
                assert flash_attention(*args).dtype == torch.bfloat16
                continue
            with pytest.raises(exc, match=words):
                flash_attention(*args)


def _autocast_case(rng, compiled):
    q, k, v = (_rand((1, 2, 40, 32), torch.float32).requires_grad_() for _ in range(3))
    f = lambda q, k, v: flash_attention(q, k, v, causal=True)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        o = f(q, k, v)
    assert o.dtype == torch.bfloat16, o.dtype
    # the computation is a bf16 one: the reference sees the inputs rounded to bf16
    qb, kb, vb = (t.detach().to(torch.bfloat16).double() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    assert (o.double() - ref).abs().max() < 2e-2
    do = torch.randn_like(o, dtype=torch.float32)
    o.float().backward(do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(do.double())
    for t, want in ((q, qd), (k, kd), (v, vd)):
        assert t.grad.dtype == torch.float32 and (t.grad.double() - want.grad).abs().max() < 6e-2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_runs_in_the_autocast_dtype(rng, compiled):
    """As SDPA: under torch.autocast(device, bfloat16) fp32 inputs run in bf16 and bf16 comes back (in the
    interpreter bf16 is upcast inside, and still returned as bf16); gradients reach the fp32 inputs as fp32."""
    _autocast_case(rng, compiled)


@pytest.mark.gpu
def test_gpu_autocast_matches_sdpa_dtype(rng):
    q, k, v = (torch.randn(1, 2, 256, 64, device=DEV) for _ in range(3))
    for dt in (torch.bfloat16, torch.float16):
        with torch.autocast("cuda", dtype=dt):
            o = flash_attention(q, k, v, causal=True)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert o.dtype == ref.dtype == dt
        assert (o.float() - ref.float()).abs().max() < 2e-2


@pytest.mark.gpu
def test_cpu_tensors_on_gpu_machine_raise():
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="cuda"):
        flash_attention(q, q, q)


def test_backward_makes_no_zero_gradient_for_the_lse():
    """The LSE is not differentiable: autograd must not allocate and fill a zero gradient for it on every
    backward (a kernel launch and an allocation, measured at ~70 us per call on the H200 machine's host)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 19, 16, generator=g).to(device.DEVICE) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.autograd.grad(flash_attention(q, k, v, is_causal=True), (q, k, v), do)     # compile, plan, cache
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dq, dk, dv = torch.autograd.grad(flash_attention(q, k, v, is_causal=True), (q, k, v), do)
    made = {e.key for e in prof.key_averages()}
    assert not made & {"aten::zeros", "aten::zero_", "aten::zeros_like"}, made
    ref = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True), (q, k, v), do.double())
    for got, want in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got.double(), want.double(), atol=2e-3, rtol=2e-3)
