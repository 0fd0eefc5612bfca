"""The tiny GPT: its text, its data, and that training through flashlab's (or a learner's) backward
follows SDPA's training step for step from the same seed."""
import math

import pytest
import torch

from flashlab import gpt
from flashlab.kernels import launch_backward


@pytest.fixture(scope="module")
def data():
    return gpt.CharData(gpt.load_text(), block_size=16)


def test_shipped_text_is_small_plain_and_readable():
    text = gpt.load_text()
    assert 100_000 < len(text) < 400_000
    assert text.isascii() and 60 < len(set(text)) < 128
    assert ":bit bucket:" in text and text.count("\n:") > 300  # the Jargon File's entries, A to C


def test_batches_are_windows_shifted_by_one(data):
    x, y = data.batch(4, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert data.decode(data.encode("foo bar")) == "foo bar"


def test_unknown_attention_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention"):
        gpt.attention_fn("flash3")


def test_sdpa_training_learns(data):
    cfg = gpt.GPTConfig(data.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=32)
    r = gpt.train("sdpa", cfg, data, steps=80, batch_size=16, seed=1)
    first, last = sum(r["loss"][:5]) / 5, sum(r["loss"][-10:]) / 10
    assert math.isfinite(last) and last < first - 0.8, (first, last)
    assert abs(r["loss"][0] - math.log(data.vocab_size)) < 0.3     # starts at chance level


def test_same_seed_same_curve_naive_vs_sdpa(data):
    cfg = gpt.GPTConfig(data.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=32)
    a = gpt.train("sdpa", cfg, data, steps=15, batch_size=8, seed=3)["loss"]
    b = gpt.train("naive", cfg, data, steps=15, batch_size=8, seed=3)["loss"]
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_flashlab_and_a_learners_backward_train_like_sdpa(data):
    cfg = gpt.GPTConfig(data.vocab_size, block_size=16, n_layer=1, n_head=1, n_embd=16)

    def learner_bwd(q, k, v, o, lse, do, dq, dk, dv, causal):
        launch_backward(q, k, v, o, lse, do, dq, dk, dv, causal, 1 / math.sqrt(q.shape[-1]))

    ref = gpt.train("sdpa", cfg, data, steps=3, batch_size=2, seed=4)["loss"]
    for attn in ("flashlab", gpt.attention_from_kernels(learner_bwd)):
        got = gpt.train(attn, cfg, data, steps=3, batch_size=2, seed=4)["loss"]
        assert max(abs(x - y) for x, y in zip(got, ref)) < 1e-4, (got, ref)


def test_learner_attention_gradients_match_autograd():
    def learner_bwd(q, k, v, o, lse, do, dq, dk, dv, causal):
        launch_backward(q, k, v, o, lse, do, dq, dk, dv, causal, 1 / math.sqrt(q.shape[-1]))

    attn = gpt.attention_from_kernels(learner_bwd)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, 20, 16, generator=g)
    attn(q, k, v).backward(do)
    got = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True).backward(do.double())
    for a, b in zip(got, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_notebook_07_figures_render_from_a_record_shaped_like_the_script_writes():
    from matplotlib.figure import Figure

    from flashlab import viz_backward as VB
    rows = [{"provider": p, "mode": "bwd", "dtype": "float16", "causal": c, "B": 16384 // n, "H": 32, "N": n, "D": d,
             "ms": 1.0, "tflops": t, "max_err": 1e-3, "status": "ok"}
            for p, t in (("flashlab", 300.0), ("sdpa-cudnn", 450.0)) for c in (False, True)
            for n in (1024, 4096) for d in (64, 128)]
    rows.append(dict(rows[0], provider="sdpa-efficient", status="unavailable: RuntimeError"))
    atomic = {"determinism": [{"D": 64, "causal": True, "N": 4096, "runs": 5, "canonical_differ": 0.0,
                               "atomic_differ": 0.4, "canonical_max_abs_diff": 0.0, "atomic_max_abs_diff": 1e-3}],
              "timing": [{"D": 64, "causal": True, "N": 4096, "canonical_ms": 1.0, "atomic_ms": 0.9}]}
    figs = [VB.fig_bwd_tflops(rows), VB.fig_atomic_dq(atomic),
            VB.fig_bwd_sweep(VB.load_record("h200_backward_sweep.json")),
            VB.fig_backward_tiles(100, 200, 32, 32, causal=True, program=9),
            VB.fig_backward_tiles(64, 64, 16, 16, causal=False),
            VB.fig_loss_curves({"sdpa": [4.0, 3.5, 3.0], "flashlab": [4.0, 3.5, 3.1]}, smooth=2)]
    assert all(isinstance(f, Figure) for f in figs)
    assert VB.load_record("no_such_record.json") is None
