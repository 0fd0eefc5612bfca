"""FA1's loop order and the reordered FA2 grid (flashlab.teaching.fa1_forward) against float64.

Interpreter-sized: ragged Nq != Nk, both causal modes, large logits, fp32 and fp16, tiles with
BLOCK_M != BLOCK_N, judged by the course's accuracy rule (flashlab.accuracy).  On a GPU the same
cases run compiled.
"""
import pytest
import torch

from flashlab import device
from flashlab.accuracy import check_attention
from flashlab.kernels import Config as C
from flashlab.teaching.fa1_forward import fa1_forward, ordered_forward

DEV = device.DEVICE


def _fn(launch, cfg, **kw):
    def fn(q, k, v, causal, scale):
        o = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
        launch(q, k, v, o, lse, causal, scale, config=cfg, **kw)
        return o, lse
    return fn


def _inputs(nq, nk, d, dtype, mag, seed):
    g = torch.Generator().manual_seed(seed)
    q = (mag * torch.randn(2, 2, nq, d, generator=g)).to(DEV, dtype)
    k = (mag * torch.randn(2, 2, nk, d, generator=g)).to(DEV, dtype)
    v = torch.randn(2, 2, nk, d, generator=g).to(DEV, dtype)
    return q, k, v


CASES = [  # (Nq, Nk, dtype, logit magnitude, tiles)
    (70, 45, torch.float32, 1.0, C(32, 16)),
    (45, 83, torch.float16, 1.0, C(16, 32)),
    (61, 61, torch.float16, 8.0, C(32, 32)),
    (50, 77, torch.float32, 8.0, C(16, 16)),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,dtype,mag,cfg", CASES)
def test_fa1_order_matches_float64(nq, nk, dtype, mag, cfg, causal):
    q, k, v = _inputs(nq, nk, 16, dtype, mag, seed=nq * 131 + nk)
    checks = check_attention(_fn(fa1_forward, cfg), q, k, v, causal, backward=False)
    assert all(c.ok for c in checks), [str(c) for c in checks]


@pytest.mark.parametrize("head_fastest", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_reordered_grid_matches_float64(head_fastest, causal):
    q, k, v = _inputs(53, 70, 16, torch.float16, 8.0, seed=7)
    checks = check_attention(_fn(ordered_forward, C(32, 16), head_fastest=head_fastest), q, k, v, causal,
                             backward=False)
    assert all(c.ok for c in checks), [str(c) for c in checks]


def test_fa1_state_is_what_algorithm_1_keeps():
    """A one-K/V-tile problem takes one step: the state never goes through the scratch, and still matches."""
    q, k, v = _inputs(40, 16, 16, torch.float32, 1.0, seed=3)
    checks = check_attention(_fn(fa1_forward, C(16, 16)), q, k, v, False, backward=False)
    assert all(c.ok for c in checks), [str(c) for c in checks]
