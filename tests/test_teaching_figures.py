"""The ceiling helper and the figures notebooks 05-07 draw (headless: each returns a Figure)."""
import math

import pytest
import torch

import flashlab  # noqa: F401
from flashlab.teaching import ceiling


def test_recorded_ceiling_is_the_recording():
    from flashlab import bench
    rec = bench.load_record(ceiling.RECORD)
    c = ceiling.recorded(torch.float16)
    if rec is None:
        assert c is None
        return
    want = next(r for r in rec["matmul"] if r["provider"] == "torch.matmul" and r["dtype"] == "fp16")
    assert c.tflops == want["tflops"] and not c.live and c.dtype == "fp16"
    assert c.percent(c.tflops / 2) == "50 %"
    assert "recorded" in c.label and rec["machine"]["gpu"] in c.label
    assert ceiling.recorded(torch.float32) is None        # no fp32 matmul recorded: no ceiling of another dtype


def test_figures_draw():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from flashlab import viz_speed, viz_triton
    rows = [{"provider": p, "N": n, "D": d, "tflops": t, "status": "ok"}
            for p, t in (("naive", 60.0), ("v1 (taught)", 400.0), ("op 2026-11-30", 500.0))
            for n in (512, 4096) for d in (64, 128)]
    assert isinstance(viz_triton.fig_tflops_vs_n(rows, "t", ceiling=(700.0, "matmul")), Figure)
    mem = {"naive": [(1024, 2**26), (2048, None)], "flashlab": [(1024, 2**18), (2048, 2**19)], "SDPA": [(1024, 0), (2048, 0)]}
    fig = viz_triton.fig_peak_memory(mem, "m")
    ax = fig.axes[0]
    assert ax.get_yscale() == "symlog"
    assert any("out of memory at N = 2,048" in t.get_text() for t in ax.texts)
    one_n = {"fa1": [{"D": d, "N": 4096, "causal": c, "fa1_tflops": 80.0, "fa2_tflops": 350.0}
                     for d in (64, 128) for c in (False, True)]}
    assert isinstance(viz_speed.fig_fa1_vs_fa2(one_n), Figure)
    fig = viz_speed.fig_roofline_pair({"once": (1e15, 1e11), "re-read": (1e15, 8e12)},
                                      {"v1": 4e14, "v3": 5e14}, (698e12, "matmul 698"), 4.3e12, "t")
    assert len(fig.axes) == 2 and not any(a.child_axes for a in fig.axes)   # side by side, no inset
    assert math.isclose(fig.axes[1].get_xlim()[1], 698 * 1.25)
