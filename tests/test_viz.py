"""Figures are functions returning a Figure: they render headless and draw what they claim."""
import numpy as np
import pytest
from matplotlib.figure import Figure

from flashlab import bench, viz


def _render(fig):
    assert isinstance(fig, Figure) and fig.axes
    assert len(viz._png(fig)) > 1000


def test_all_figures_render():
    rng = np.random.default_rng(0)
    _render(viz.fig_memory_vs_n([256, 512, 1024], measured={"naive": [1e6, 4e6, 1.6e7]}))
    _render(viz.fig_roofline({"naive": (1e9, 1e8), "fused": (1e9, 1e6, 3e14)}))
    fig = viz.fig_roofline({"v1": (1e9, 1e5, 4.5e14), "v2": (1e9, 1e5, 4.6e14), "bound only": (1e9, 1e7)})
    inset = fig.axes[0].child_axes[0]          # several measured points: their values as bars, readable
    assert [t.get_text() for t in inset.get_yticklabels()] == ["v1", "v2"]
    assert [round(p.get_width()) for p in inset.patches] == [450, 460]
    _render(fig)
    _render(viz.fig_op_breakdown({"QK^T": 1.0, "softmax": 0.5}, 0.3))
    _render(viz.fig_online_softmax(rng.standard_normal(20), 4, step=2))
    _render(viz.fig_tiles(100, 130, 32, 32, step=3, order="fa1", causal=True))
    _render(viz.fig_hbm_traffic([256, 1024]))
    _render(viz.fig_bars({"a": 1.0, "b": 2.0}, "ms"))
    _render(viz.fig_error_vs([1, 2], {"x": [1e-16, np.nan]}, "tiles"))


def test_online_softmax_trace_ends_at_the_true_state():
    x = np.random.default_rng(1).standard_normal(23) * 5
    m, l, seen = viz.online_softmax_trace(x, 4)[-1]
    assert seen >= 23 and m == x.max()
    np.testing.assert_allclose(l, np.exp(x - x.max()).sum())


@pytest.mark.parametrize("causal", [False, True])
def test_tile_schedule_orders_and_skipping(causal):
    fa2 = viz.tile_schedule(130, 130, 32, 32, "fa2", causal)
    fa1 = viz.tile_schedule(130, 130, 32, 32, "fa1", causal)
    assert sorted(fa1) == sorted(fa2)
    assert fa2 == sorted(fa2) and fa1 == sorted(fa1, key=lambda t: (t[1], t[0]))   # Q-outer vs K/V-outer
    n = 5                                            # ceil(130 / 32) tiles per side
    # a tile is visited iff it holds a key a query of the tile may see (its first key <= the tile's last query)
    expected = {(i, j) for i in range(n) for j in range(n) if not causal or j * 32 <= min((i + 1) * 32, 130) - 1}
    assert set(fa2) == expected and len(fa2) == len(expected)
    assert len(fa2) == (n * (n + 1) // 2 if causal else n * n)


def test_traffic_and_flop_models():
    t = viz.hbm_traffic(np.array([4096.0]), 64, 128, 128)
    assert t["naive"][0] > t["FA1"][0] > t["FA2"][0] > viz.flash_bytes(4096, 64)
    assert bench.flops(1, 1, 10, 10, 4, False) == 1600 and bench.flops(1, 1, 10, 10, 4, True, "bwd") == 2000
