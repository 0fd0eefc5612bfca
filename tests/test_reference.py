"""Every reference algorithm against naive attention (float64)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashlab import reference as R

SHAPES = [(1, 1, 16), (17, 17, 16), (100, 129, 32), (129, 100, 64), (64, 64, 64), (5, 200, 8)]


def _qkv(rng, nq, nk, d, mag=1.0):
    return (mag * rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, d)))


def test_naive_matches_torch_and_sdpa(rng):
    q, k, v = _qkv(rng, 33, 47, 16)
    for causal in (False, True):
        o, lse = R.attention_naive(q, k, v, causal)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        o_t, lse_t = R.attention_naive_torch(tq, tk, tv, causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(tq[None], tk[None], tv[None], is_causal=causal)[0]
        np.testing.assert_allclose(o, o_t.numpy(), atol=1e-12)
        np.testing.assert_allclose(o, sdpa.numpy(), atol=1e-12)
        s = (q @ k.T) / 4.0
        if causal:
            s = np.where(R.causal_mask(33, 47), s, -np.inf)
        np.testing.assert_allclose(lse, torch.logsumexp(torch.from_numpy(s), -1).numpy(), atol=1e-12)
        np.testing.assert_allclose(lse, lse_t.numpy(), atol=1e-12)


def test_causal_mask_is_top_left():
    m = R.causal_mask(3, 5)
    assert m.tolist() == [[True, False, False, False, False],
                          [True, True, False, False, False],
                          [True, True, True, False, False]]


@pytest.mark.parametrize("algo", [R.attention_fa1, R.attention_fa2])
@pytest.mark.parametrize("nq,nk,d", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 8), (8, 32), (64, 64)])
def test_tiled_matches_naive(rng, algo, nq, nk, d, causal, blocks):
    q, k, v = _qkv(rng, nq, nk, d)
    o_ref, lse_ref = R.attention_naive(q, k, v, causal)
    o, lse = algo(q, k, v, causal, *blocks)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("algo", [R.attention_fa1, R.attention_fa2])
def test_tiled_large_logits(rng, algo):
    """Scores in the thousands: e^s overflows float64 (past 709) unless the max is subtracted."""
    q, k, v = _qkv(rng, 50, 70, 16, mag=600.0)
    o_ref, lse_ref = R.attention_naive(q, k, v, True)
    assert np.abs(lse_ref).max() > 709, "test data too tame to overflow float64"
    o, lse = algo(q, k, v, True, 16, 16)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, o_ref, atol=1e-10)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(r=st.integers(1, 6), n=st.integers(1, 80), b=st.integers(1, 90), seed=st.integers(0, 2**31 - 1),
       mag=st.sampled_from([1.0, 50.0, 1000.0]))
def test_online_softmax_any_block_split(r, n, b, seed, mag):
    x = mag * np.random.default_rng(seed).standard_normal((r, n))
    ref = np.exp(x - x.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    np.testing.assert_allclose(R.online_softmax(x, b), ref, atol=1e-12)


def test_online_softmax_update_state(rng):
    x = rng.standard_normal((4, 37)) * 20
    m, l = np.full(4, -np.inf), np.zeros(4)
    for j in range(0, 37, 10):
        m, l = R.online_softmax_update(m, l, x[:, j:j + 10])
    np.testing.assert_allclose(m, x.max(1))
    np.testing.assert_allclose(l, np.exp(x - x.max(1, keepdims=True)).sum(1))


def _state(s, v):
    m = s.max(1)
    p = np.exp(s - m[:, None])
    return m, p.sum(1), p @ v


def test_merge_states_is_attention_and_associative(rng):
    q, k, v = _qkv(rng, 6, 30, 8)
    s = q @ k.T
    parts = [(s[:, a:b], v[a:b]) for a, b in ((0, 7), (7, 19), (19, 30))]
    st_ = [_state(*p) for p in parts]
    left = R.merge_states(*R.merge_states(*st_[0], *st_[1]), *st_[2])
    right = R.merge_states(*st_[0], *R.merge_states(*st_[1], *st_[2]))
    swapped = R.merge_states(*st_[2], *R.merge_states(*st_[1], *st_[0]))
    o_ref, lse_ref = R.attention_naive(q, k, v, scale=1.0)
    for m, l, acc in (left, right, swapped):
        np.testing.assert_allclose(acc / l[:, None], o_ref, atol=1e-12)
        np.testing.assert_allclose(m + np.log(l), lse_ref, atol=1e-12)
    # an empty part (m = -inf, l = 0) is the identity
    empty = (np.full(6, -np.inf), np.zeros(6), np.zeros((6, 8)))
    m, l, acc = R.merge_states(*empty, *left)
    np.testing.assert_allclose(acc / l[:, None], o_ref, atol=1e-12)


@pytest.mark.parametrize("nq,nk,d", [(17, 17, 16), (100, 129, 32), (129, 100, 8), (1, 5, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_references_match_autograd(rng, nq, nk, d, causal):
    q, k, v = _qkv(rng, nq, nk, d)
    do = rng.standard_normal((nq, d))
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    o_t, _ = R.attention_naive_torch(tq, tk, tv, causal)
    o_t.backward(torch.from_numpy(do))
    grads = (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())
    o, lse = R.attention_fa2(q, k, v, causal, 32, 16)
    for got in (R.attention_backward_naive(q, k, v, do, causal),
                R.attention_backward(q, k, v, o, lse, do, causal, 16, 32),
                R.attention_backward(q, k, v, o, lse, do, causal, 32, 16)):
        for g, r in zip(got, grads):
            np.testing.assert_allclose(g, r, atol=1e-11)


def test_online_softmax_update_survives_a_fully_masked_block():
    """A block whose scores are all -inf (a window or padding mask) leaves (m, l) = (-inf, 0), not NaN,
    and the blocks after it still give the exact softmax."""
    m, l = np.full(2, -np.inf), np.zeros(2)
    m, l = R.online_softmax_update(m, l, np.full((2, 4), -np.inf))
    assert np.isneginf(m).all() and (l == 0).all()
    x = np.random.default_rng(5).standard_normal((2, 9))
    for j in range(0, 9, 4):
        m, l = R.online_softmax_update(m, l, x[:, j:j + 4])
    np.testing.assert_allclose(l, np.exp(x - x.max(1, keepdims=True)).sum(1), rtol=1e-14)
    np.testing.assert_array_equal(m, x.max(1))
