"""Notebook 06's FA1/L2 helpers on a synthetic record: byte models, verdicts computed from the numbers, figures."""
import pytest

from flashlab import viz, viz_speed as S


def _record(fa2_over_fa1=1.4, head_fastest_slowdown=1.5):
    fa1 = [dict(D=d, causal=c, N=n, fa2_tflops=300.0, fa1_tflops=300.0 / fa2_over_fa1)
           for d in (64, 128) for c in (False, True) for n in (1024, 4096, 16384)]
    l2 = []
    for d in (64, 128):
        for n in (4096, 16384):
            for order, ms in (("tile-fastest", 2.0), ("head-fastest", 2.0 * head_fastest_slowdown)):
                l2.append(dict(D=d, N=n, B=16384 // n, H=2048 // d, order=order, ms=ms, tflops=100 / ms,
                               l2_share_min=0.25))
    return {"fa1": fa1, "l2": l2}


def test_byte_models():
    # ideal FA2: Q, K, V, O once (fp16) and a float32 LSE
    assert S.fa2_bytes(1, 1, 1024, 64, 128, reread=False) == 4 * 1024 * 64 * 2 + 4 * 1024
    # no cache: K and V once per Q tile (8 tiles)
    assert S.fa2_bytes(1, 1, 1024, 64, 128) == 2 * 1024 * 64 * 2 + 4 * 1024 + 8 * 2 * 1024 * 64 * 2
    assert S.fa1_bytes(2, 3, 1024, 64, 128, 64) > 10 * S.fa2_bytes(2, 3, 1024, 64, 128, reread=False)
    assert S.l2_share_min(10.0, 2.0, 1.0, 4.0) == pytest.approx(0.75)   # 4 bytes could move, 10 needed
    assert S.l2_share_min(10.0, 2.0, 1.0, 20.0) == 0.0


def test_verdicts_follow_the_numbers():
    assert "4 inside" not in S.fa1_verdict(_record(1.4))
    assert "12 inside" in S.fa1_verdict(_record(1.4))
    assert "12 above" in S.fa1_verdict(_record(3.0))
    assert "12 below" in S.fa1_verdict(_record(1.1))
    assert S.fa2_over_fa1(_record(2.0))[(64, True)] == [(1024, 2.0), (4096, 2.0), (16384, 2.0)]
    v = S.l2_verdict(_record(1.4, 1.5))
    assert "or more: the normal order owes that much to K/V re-reads served by L2" in v
    assert ("proves some of them never reached HBM" in v) == any(
        r["l2_share_min"] > 0 for r in _record(1.4, 1.5)["l2"] if r["order"] == "tile-fastest" and r["B"] * r["H"] >= 64)
    assert "do not show" in S.l2_verdict(_record(1.4, 1.0))
    rec = _record(1.4, 1.0)               # only the many-heads rows (B*H >= 4 x SMs) decide
    rec["machine"] = {"sms": 8}
    for r in rec["l2"]:
        if r["B"] * r["H"] >= 32 and r["order"] == "head-fastest":
            r["ms"] *= 2
    v = S.l2_verdict(rec)
    assert "served by L2" in v and "B*H=16" not in v.splitlines()[0]
    assert S.order_slowdown(_record(head_fastest_slowdown=1.5))[(64, 4096, 128)] == pytest.approx(1.5)
    assert S.many_heads(64, 132) == (33, 32) and S.many_heads(128, 132) == (66, 16)


def test_figures_render():
    for fig in (S.fig_fa1_vs_fa2(_record()), S.fig_grid_order(_record())):
        assert fig.axes and len(viz._png(fig)) > 1000


def test_autotune_table_and_its_guard():
    from flashlab import device, kernels
    rows = [{"N": 1024, "kernel": "fwd v2", "head_dim": 128, "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
            {"N": 4096, "kernel": "fwd v3", "head_dim": 128, "block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
            {"N": 4096, "kernel": "dq v2", "head_dim": 128, "block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3}]
    lines = S.format_autotune(rows).splitlines()
    assert lines[0].split() == ["D", "N", "forward", "dQ"]
    assert lines[1].split() == ["128", "1024", "v2:", "128x64,", "8w/3s", "-"]
    assert lines[2].split() == ["128", "4096", "v3:", "128x128,", "8w/2s", "v2:", "64x32,", "4w/3s"]
    if device.DEVICE.type != "cuda":
        assert kernels.tuned_configs() == []     # the interpreter never autotunes
        with pytest.raises(RuntimeError, match="GPU only"):
            S.autotune_choices([1024], 64)


def test_autotune_table_keeps_only_the_versions_the_op_ran():
    """A process that timed every version has tuned configs for all of them: the table shows the op's."""
    import torch
    base = dict(dtype="float16", n_key=4096, head_dim=128, causal=False, precision="ieee",
                block_m=64, block_n=64, num_warps=4, num_stages=3)
    tuned = [dict(base, kernel=k) for k in ("fwd v2", "fwd v3", "dkdv v2", "dq v2", "bwd v3", "bwd v4")]
    tuned.append(dict(base, kernel="fwd v3", n_key=8192))
    tuned.append(dict(base, kernel="fwd v3", causal=True))
    kept = S.ran_by_the_op(tuned, {"fwd": "v3", "bwd": "v4"}, 4096, 128, False, torch.float16)
    assert [r["kernel"] for r in kept] == ["fwd v3", "bwd v4"]
    kept = S.ran_by_the_op(tuned, {"fwd": "v2", "bwd": "v2"}, 4096, 128, False, torch.float16)
    assert [r["kernel"] for r in kept] == ["fwd v2", "dkdv v2", "dq v2"]
