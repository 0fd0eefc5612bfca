"""GPU-only checks: realistic sizes, native bf16, no N x N memory.  Skipped without CUDA."""
import pytest
import torch

from flashlab import attention, bench, flash_attention, kernels
from flashlab.accuracy import check_attention

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hand_picked_configs(request, monkeypatch):
    """The accuracy grid runs with the hand-picked configs: autotuning would compile and time every
    candidate for each (head dim, causal, dtype, length bucket), minutes of compilation for nothing
    this file checks.  The autotuned paths have their own GPU tests in test_kernels.py (the tuned
    launch, the tensor past 2^31 elements); a test marked ``autotune`` here keeps autotuning on."""
    if "autotune" not in request.keywords:
        monkeypatch.setattr(kernels.tiles, "AUTOTUNE", False)
        attention._FWD.clear()     # the calls made ready so far hold plans made with autotuning on
        attention._BWD.clear()
    yield
    attention._FWD.clear()
    attention._BWD.clear()


def _fa(q, k, v, causal, scale):
    return flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N,D", [(1000, 64), (1537, 128), (2048, 32), (333, 256)])
def test_gpu_sizes_accuracy(N, D, causal, dtype):
    q, k, v = (torch.randn(2, 4, N, D, device="cuda", dtype=dtype) for _ in range(3))
    checks = check_attention(_fa, q, k, v, causal)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.autotune
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_large_logits(dtype):
    q, k, v = (8 * torch.randn(1, 4, 777, 64, device="cuda", dtype=dtype) for _ in range(3))
    checks = check_attention(_fa, q, k, v, True)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def test_tf32_is_opt_in():
    q, k, v = (torch.randn(1, 2, 512, 64, device="cuda") for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    err_ieee = (flash_attention(q, k, v).double() - ref).abs().max().item()
    err_tf32 = (flash_attention(q, k, v, allow_tf32=True).double() - ref).abs().max().item()
    assert err_ieee < 1e-5 < err_tf32


def test_no_n_squared_memory():
    """Forward + backward at N = 16384 needs O(N) extra memory; S alone would be 8 GiB here."""
    N, D, H = 16384, 64, 16
    peak = bench.peak_memory(lambda q, k, v, c: flash_attention(q, k, v, c), N, D, torch.float16, 1, H)
    s_bytes = H * N * N * 2
    inputs = 3 * H * N * D * 2
    assert peak < 2 * inputs, f"peak {peak / 2**20:.1f} MiB over inputs; S would be {s_bytes / 2**30:.1f} GiB"


@pytest.mark.autotune
def test_overhead_benchmark_rows():
    """bench.overhead: every provider checked and timed beside SDPA, per call and on the GPU."""
    rows = bench.overhead(calls=50, repeats=2, dtypes=(torch.float16,))
    assert [(r.provider, r.mode) for r in rows] == [(p, m) for m in ("fwd", "fwd+bwd") for p in bench.OVERHEAD_PROVIDERS]
    assert all(r.status == "ok" and r.us_per_call > 0 and r.gpu_us > 0 for r in rows), bench.format_overhead(rows)
    assert rows[0].ratio == 1.0 and all(r.ratio > 0 for r in rows)
    assert "x SDPA" in bench.format_overhead(rows)
