"""Part-2 figures render headless; the datasheet table says what it derives."""
import pytest

from flashlab import hardware, viz, viz_triton as V


def _render(fig):
    assert fig.axes and len(viz._png(fig)) > 1000


def test_part2_figures_render():
    _render(V.fig_program_blocks(23, 8))
    _render(V.fig_strided_view(3, 4, 2, transposed=True))
    _render(V.fig_fa2_grid(300, 64, 2, 3))
    _render(V.fig_memory_hierarchy({"H200 SXM": {"shared memory": (3e7, 3e13), "DRAM": (1.4e11, 4.8e12)}}))
    rows = [dict(provider=p, N=n, D=d, tflops=t) for p, t in (("naive", 50.0), ("flashlab", 300.0))
            for n in (512, 1024) for d in (64, 128)]
    _render(V.fig_tflops_vs_n(rows))
    _render(V.fig_peak_memory({"naive": [(1024, 1e8), (2048, None)], "flashlab": [(1024, 1e5), (2048, 2e5)]}))
    _render(V.fig_grouped_bars({"fp16": {"a": 1e-3, "b": 2e-3}}, "error", log=True, hline=(3e-3, "limit")))


def test_shared_memory_bandwidth_is_the_derived_figure():
    assert hardware.smem_bandwidth_gbps("A100 40GB") == pytest.approx(19_491.84)   # 128 B x 108 SMs x 1.41 GHz
    assert hardware.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert hardware.peak_bandwidth("NVIDIA A100-SXM4-80GB", 80e9) == 2.039e12
    assert hardware.peak_bandwidth("Some other GPU") is None
