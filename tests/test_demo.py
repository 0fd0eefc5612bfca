"""python -m flashlab demo on the CPU: tiny sizes through the interpreter (a smoke demonstration),
and the GPU path's bookkeeping (out of memory, wrong providers) with providers that fake it."""
import json
import math

import pytest
import torch
from matplotlib.figure import Figure

from flashlab import demo, device
from flashlab.__main__ import main

TINY = dict(sizes=[16, 40], B=1, H=1, D=16, dtype=torch.float32)


RUNS = demo.PROVIDERS if device.TRITON else ("naive", "sdpa")   # without Triton flashlab is skipped


def test_demo_runs_all_providers_forward_and_backward():
    points = demo.run(demo.Settings(**TINY), progress=False)
    if not device.TRITON:
        skipped = [p for p in points if p.provider == "flashlab"]
        assert [p.status for p in skipped] == ["skipped (needs Triton)"]
        points = [p for p in points if p.provider != "flashlab"]
    assert [(p.provider, p.N) for p in points] == [(n, N) for N in TINY["sizes"] for n in RUNS]
    for p in points:
        assert p.status == "ok", p
        assert p.fwd_ms > 0 and p.bwd_ms > 0, p
        if device.DEVICE.type == "cpu":
            assert math.isnan(p.peak_mib)       # memory is a GPU measurement
        else:
            assert p.peak_mib > 0
    fig = demo.figure(points)
    assert isinstance(fig, Figure) and len(fig.axes) == (2 if device.DEVICE.type == "cuda" else 1)


def test_command_writes_table_figure_and_json(tmp_path, capsys):
    png, js = tmp_path / "demo.png", tmp_path / "demo.json"
    assert main(["demo", "--sizes", "24", "--B", "1", "--H", "1", "--D", "16", "--quiet",
                 "--out", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "flashlab" in out and "sdpa" in out and "naive" in out and str(png) in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(js.read_text())
    assert {r["provider"] for r in rows} == set(demo.PROVIDERS)
    assert all(r["status"] == "ok" for r in rows if r["provider"] in RUNS), rows


def test_out_of_memory_is_caught_and_the_sweep_goes_on(monkeypatch):
    """A provider that runs out of memory at N >= 32 is marked there and not tried again; the others go on."""
    real = demo._provider

    def provider(name):
        fn = real(name)
        if name != "naive":
            return fn

        def naive(q, k, v, causal):
            if q.shape[2] >= 32:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
            return fn(q, k, v, causal)
        return naive

    monkeypatch.setattr(demo, "_provider", provider)
    s = demo.Settings(sizes=[16, 32, 64], B=1, H=1, D=16, dtype=torch.float32)
    points = demo.run(s, providers=("naive", "sdpa"), progress=False)
    naive = [(p.N, p.status) for p in points if p.provider == "naive"]
    assert naive == [(16, "ok"), (32, demo.OOM)]
    assert [(p.N, p.status) for p in points if p.provider == "sdpa"] == [(16, "ok"), (32, "ok"), (64, "ok")]
    demo.figure(points)  # the out-of-memory mark draws


def test_a_wrong_provider_is_reported_never_timed(monkeypatch):
    real = demo._provider
    monkeypatch.setattr(demo, "_provider", lambda name: (lambda q, k, v, causal: real(name)(q, k, v, causal) + 0.1)
                        if name == "sdpa" else real(name))
    points = demo.run(demo.Settings(sizes=[16, 32], B=1, H=1, D=16, dtype=torch.float32),
                      providers=("naive", "sdpa"), progress=False)
    sdpa = [p for p in points if p.provider == "sdpa"]
    assert len(sdpa) == 1 and sdpa[0].status.startswith("WRONG") and math.isnan(sdpa[0].fwd_ms)
