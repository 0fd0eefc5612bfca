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


def test_ws_schedule_keeps_the_kernels_rules():
    """Forward v6's schematic (notebook 06, section 8) obeys the kernel's barriers: a stage is refilled only after
    every consumer released the tile it held, a product starts only after its tile landed, the tensor cores run
    one product at a time; with two consumer partitions they are busier than with one lockstep program."""
    from matplotlib.figure import Figure
    for consumers, gemm in ((1, 2.0), (2, 1.0)):
        ev = V.ws_schedule(n_tiles=6, stages=2, consumers=consumers, gemm=gemm)
        landed = {int(lbl.split(",")[0][1:]): b for lane, a, b, lbl, k in ev if lane.startswith("TMA")}
        issued = {int(lbl.split()[0][1:]): a for lane, a, b, lbl, k in ev if lane == "producer warp"}
        gemms = sorted((a, b, lbl) for lane, a, b, lbl, k in ev if lane == "tensor cores")
        assert all(b1 <= a2 + 1e-9 for (_, b1, _), (a2, _, _) in zip(gemms, gemms[1:]))   # one at a time
        for a, b, lbl in gemms:
            if lbl.startswith("S"):
                assert a >= landed[int(lbl.split()[0][1:])] - 1e-9                     # K_j had landed
        pv_done = {}
        for a, b, lbl in gemms:
            if lbl.startswith("PV"):
                pv_done.setdefault(int(lbl.split()[0][2:]), []).append(b)
        for j, t in issued.items():
            if j >= 2:                                                                 # stage j % 2 was free
                assert t >= max(pv_done[j - 2]) - 1e-9 and len(pv_done[j - 2]) == consumers
        assert len([g for g in gemms if g[2].startswith("S")]) == 6 * consumers
    lock = V.tensor_core_busy(V.ws_schedule(consumers=1, gemm=2.0))
    split = V.tensor_core_busy(V.ws_schedule(consumers=2, gemm=1.0))
    assert 0 < lock < split <= 1
    assert isinstance(V.fig_ws_schedule(), Figure)
