"""scripts/ring_scaling.py on 2 gloo processes (the interpreter) at tiny sizes: it runs end to end,
its correctness cases pass, its record matches the schema and notebook 09's figures draw from it; a
ring with a wrong merge FAILS its correctness section; the overlap arithmetic on made-up traces; the
per-step timeline of ring_attention."""
import importlib.util
import json
import math
import time
from pathlib import Path

import pytest
import torch

from flashlab import device

ROOT = Path(__file__).resolve().parents[1]

on_cpu_processes = pytest.mark.skipif(not device.INTERPRET, reason="the --cpu run uses gloo processes and the "
                                      "interpreter; on a GPU machine run the script itself on NCCL")


def _script():
    spec = importlib.util.spec_from_file_location("ring_scaling_script", ROOT / "scripts" / "ring_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rs():
    return _script()


@pytest.fixture(scope="module")
def cpu_run(rs, tmp_path_factory):
    out = tmp_path_factory.mktemp("ring") / "ring_scaling.json"
    t0 = time.perf_counter()
    rec = rs.main(["--cpu", "--spawn", "2", "--out", str(out)])
    return rec, out, time.perf_counter() - t0


@on_cpu_processes
def test_cpu_run_end_to_end(rs, cpu_run):
    rec, out, seconds = cpu_run
    # a budget, not a speed claim: about 33 s alone on 2 cores, 61 s beside another test worker (a CI run)
    assert seconds < 120, f"the --cpu run took {seconds:.0f} s (sections: {rec['seconds']})"
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(rec))
    assert rs.validate(on_disk) == [], rs.validate(on_disk)
    assert on_disk["world"] == 2 and on_disk["cpu"] is True and on_disk["machine"]["backend"] == "gloo"
    assert on_disk["machine"]["env"]["NCCL_NVLS_ENABLE"] == "0" and on_disk["machine"]["autotune"] is False

    c = on_disk["correctness"]
    assert c["all_ok"] and len(c["cases"]) == 8
    assert {(x["layout"], x["causal"], x["dtype"]) for x in c["cases"]} == {
        (lay, cz, dt) for lay in ("zigzag", "contiguous") for cz in (False, True) for dt in ("bf16", "fp16")}
    for case in c["cases"]:
        assert [ch["name"] for ch in case["checks"]] == ["o", "lse", "dq", "dk", "dv"]
        assert all(ch["ok"] and ch["err"] <= ch["bound"] for ch in case["checks"]), case
        assert case["max_diff_vs_op"] < 0.1

    o = on_disk["overlap"]
    for r in (0, 1):
        mine = [s for s in o["steps"] if s["rank"] == r]
        assert [(s["phase"], s["step"]) for s in mine] == [("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1)]
        for s in mine:
            assert s["start_ms"] <= s["compute_end_ms"] <= s["end_ms"]
            assert s["compute_ms"] > 0 and s["exposed_ms"] >= 0
    assert 0.0 <= o["exposed_fraction"] <= 1.0
    assert "not_run" in o["kernels"]                       # no GPU kernels on gloo: said, not invented
    assert o["p2p"]["bytes"] == 2 * 1 * 2 * 16 * 16 * 2 and o["p2p"]["gbps"] > 0

    s = on_disk["scaling"]
    assert s["worlds"] == [1, 2]
    rows = {(r["kind"], r["size"], r["world"], r["provider"]): r for r in s["rows"]}
    for kind, size in (("weak", 16), ("strong", 32)):
        for w in (1, 2):
            for prov in ("ring zigzag", "ring contiguous"):
                r = rows[(kind, size, w, prov)]
                assert r["seconds"] > 0 and r["not_run"] is None
                want_n = size * w if kind == "weak" else size
                assert r["N"] == want_n
                flops = 3.5 * 4 * 1 * 2 * want_n ** 2 * 16 * 0.5
                assert math.isclose(r["tflops"], flops / r["seconds"] / 1e12, rel_tol=1e-9)
                base = rows[(kind, size, 1, prov)]["tflops"]
                assert math.isclose(r["ratio"], r["tflops"] / (w * base), rel_tol=1e-9)
            cp = rows[(kind, size, w, "torch context_parallel")]
            assert cp["seconds"] is None and cp["not_run"]     # it does not run on CPUs: the reason is kept
    t = s["target"]
    assert t["provider"] == "ring zigzag" and t["world"] == 2 and t["ratio"] == rows[("weak", 16, 2, "ring zigzag")]["ratio"]
    assert "correctness: PASS" in rs.table(on_disk)


@on_cpu_processes
def test_figures_render_from_the_record(cpu_run):
    from matplotlib.figure import Figure
    from flashlab.distributed import figures as F
    rec = json.loads(cpu_run[1].read_text())
    figs = [F.fig_ring_timeline(rec), F.fig_ring_scaling(rec)]
    # a GPU record carries a kernel trace: the second panel
    rec["overlap"]["kernels"] = {"source": "torch.profiler", "ranks": {
        "0": [dict(kind="compute", name="fwd", start_us=0.0, dur_us=50.0),
              dict(kind="transfer", name="ncclDevKernel_SendRecv", start_us=5.0, dur_us=20.0)]}}
    rec["overlap"]["overlap_fraction"] = 1.0
    figs.append(F.fig_ring_timeline(rec))
    assert all(isinstance(f, Figure) and f.axes for f in figs)
    assert len(figs[2].axes) == len(figs[0].axes) + 1
    for f in figs:
        f.savefig(__import__("io").BytesIO(), format="png", dpi=40)
    with pytest.raises(ValueError, match="not run"):
        F.fig_ring_scaling(dict(rec, scaling={"not_run": "not in --sections"}))


@on_cpu_processes
def test_a_wrong_merge_fails_the_correctness_section(rs, monkeypatch, capfd):
    """A ring whose merge lets the newest part win (no log-sum-exp weights) must FAIL."""
    from flashlab.distributed import ring as RG

    def wrong_merge(o, lse, o_part, lse_part):
        return o_part.float().clone(), torch.logaddexp(lse, lse_part)

    monkeypatch.setattr(RG, "merge_attention", wrong_merge)     # the forked ranks inherit it
    rec = rs.main(["--cpu", "--spawn", "2", "--sections", "correctness", "--dtypes", "bf16", "--layouts", "zigzag"])
    c = rec["correctness"]
    assert len(c["cases"]) == 2 and not c["all_ok"]
    assert not any(x["ok"] for x in c["cases"])
    assert all(not next(ch for ch in x["checks"] if ch["name"] == "o")["ok"] for x in c["cases"])
    printed = capfd.readouterr().out
    assert printed.count("[correctness] FAIL") == 2 and "correctness: FAIL" in printed
    assert rec["overlap"] == {"not_run": "not in --sections correctness"}
    assert rs.validate(rec) == []


def test_validate_names_what_is_wrong(rs):
    good = {"schema": rs.SCHEMA, "date": "d", "command": "c", "world": 2, "cpu": True,
            "machine": {"gpu": None, "gpus": 0, "torch": "t", "triton": "t", "python": "p", "backend": "gloo",
                        "nccl": None, "autotune": False, "env": {}},
            "seconds": {"total": 1.0}, "correctness": {"not_run": "x"}, "overlap": {"not_run": "x"},
            "scaling": {"shape": {"B": 1, "H": 2, "H_kv": 2, "D": 16, "dtype": "bf16", "causal": True},
                        "worlds": [1, 2], "reps": 1,
                        "rows": [{"kind": "weak", "size": 16, "N": 16, "world": 1, "provider": "ring zigzag",
                                  "seconds": 0.1, "tflops": 1.0, "ratio": 1.0, "not_run": None}],
                        "target": {"kind": "weak", "size": 16, "provider": "ring zigzag", "world": 2,
                                   "ratio_min": 0.85, "ratio": None, "met": None}}}
    assert rs.validate(good) == []
    bad = json.loads(json.dumps(good))
    del bad["scaling"]["rows"][0]["tflops"]
    bad["world"] = "2"
    bad["schema"] = "other/1"
    bad["correctness"] = {"cases": []}
    problems = "\n".join(rs.validate(bad))
    for words in ("record.scaling.rows[0].tflops: missing", "record.world: expected", "record.schema",
                  "record.correctness.shape: missing"):
        assert words in problems, problems
    bad = json.loads(json.dumps(good))
    bad["cpu"] = 1
    bad["scaling"]["rows"][0]["world"] = True          # a bool is not an int here
    problems = "\n".join(rs.validate(bad))
    assert "record.cpu" in problems and "record.scaling.rows[0].world" in problems


def test_overlap_fraction_and_kernel_intervals(rs):
    k = lambda kind, s, d: dict(kind=kind, name=kind, start_us=float(s), dur_us=float(d))  # noqa: E731
    assert rs.overlap_fraction([k("compute", 0, 100), k("transfer", 10, 50)]) == 1.0
    assert rs.overlap_fraction([k("compute", 0, 100), k("transfer", 80, 40)]) == pytest.approx(0.5)
    assert rs.overlap_fraction([k("compute", 0, 10), k("compute", 5, 10), k("transfer", 0, 30)]) == pytest.approx(0.5)
    assert rs.overlap_fraction([k("transfer", 0, 30), k("compute", 40, 10)]) == 0.0
    assert rs.overlap_fraction([k("compute", 0, 10)]) is None
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage)", "ts": 1005.0, "dur": 30.0},
        {"cat": "kernel", "name": "_fwd_kernel", "ts": 1000.0, "dur": 100.0},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 990.0, "dur": 5.0},
        {"cat": "kernel", "name": "no duration", "ts": 990.0}]}
    iv = rs.kernel_intervals(trace)
    assert [(i["kind"], i["start_us"], i["dur_us"]) for i in iv] == [("compute", 0.0, 100.0), ("transfer", 5.0, 30.0)]
    assert rs.overlap_fraction(iv) == 1.0
    assert rs.kernel_intervals({}) == []


def test_attention_flops(rs):
    assert rs.attention_flops(1, 1, 4, 2, causal=False, passes=1) == 4 * 16 * 2
    assert rs.attention_flops(2, 3, 8, 16) == 3.5 * 4 * 2 * 3 * 64 * 16 * 0.5


def test_timeline_marks_each_step_and_leaves_the_ring_alone(monkeypatch):
    """With a recording stand-in for the ring (no process group): three marks per step, in order,
    none when no timeline is installed, and the same outputs either way."""
    from flashlab.distributed import ring as RG
    from flashlab.distributed.timeline import Timeline, recording

    class Req:
        def wait(self):
            time.sleep(0.002)                      # a transfer that arrives after the compute

    class FakeRing:
        rank, world = 1, 3

        def pass_on(self, tensors):
            return [t.clone() for t in tensors], [Req()]

    q, k, v = (torch.randn(1, 1, 8, 16, dtype=torch.float16, device=device.DEVICE) for _ in range(3))
    o0, l0 = RG._ring_forward(q, k, v, True, 0.25, False, FakeRing(), "zigzag")
    tl = Timeline("cpu")                          # host clocks: the stand-in's waits are host sleeps
    with recording(tl):
        assert RG._TIMELINE is tl
        o1, l1 = RG._ring_forward(q, k, v, True, 0.25, False, FakeRing(), "zigzag")
        RG._ring_backward(q, k, v, o1, l1, torch.randn_like(q), True, 0.25, False, FakeRing(), "zigzag")
    assert RG._TIMELINE is None
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    assert [(m[0], m[1], m[2]) for m in tl.marks[:3]] == [("fwd", 0, "start"), ("fwd", 0, "compute_end"),
                                                          ("fwd", 0, "end")]
    steps = tl.steps()
    assert [(s["phase"], s["step"]) for s in steps] == [("fwd", i) for i in range(3)] + [("bwd", i) for i in range(3)]
    for s in steps:
        assert 0 <= s["start_ms"] <= s["compute_end_ms"] <= s["end_ms"]
    # steps 0 and 1 wait on a transfer (2 ms each, at least); the last forward step posts none
    assert all(steps[i]["exposed_ms"] >= 1.5 for i in (0, 1))
    assert steps[2]["exposed_ms"] < 1.5
    n = len(tl.marks)
    RG._ring_forward(q, k, v, True, 0.25, False, FakeRing(), "zigzag")
    assert len(tl.marks) == n                      # not installed: nothing recorded


def test_plan_estimates_the_budget_without_running(rs, capsys):
    a = rs.parse([])
    lines, full = rs.plan(a, 8)
    assert len(lines) == 4 and all("w in [1, 2, 4, 8]" in x for x in lines)
    # the strong 512k case dominates; its one-GPU runs alone:
    one = rs.attention_flops(1, 8, 524288, 128) / 150e12 * 4 * 2       # ring + context parallelism, 4 runs
    assert one < full < 600
    _, no_cp = rs.plan(rs.parse(["--no-cp"]), 8)
    _, short = rs.plan(rs.parse(["--total", "131072"]), 8)
    assert no_cp < full and short < full
    assert rs.main(["--plan", "2"]) is None
    assert "scaling on 2 GPUs" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL ranks need two GPUs")
def test_two_gpus_nccl_small(tmp_path):
    """The script itself on 2 GPUs (NCCL) at small sizes: correctness passes, the kernel trace shows
    NCCL transfers, every scaling row ran or says why not."""
    import subprocess
    import sys
    out = tmp_path / "ring.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "ring_scaling.py"), "--spawn", "2", "--out", str(out),
           "--check", "1", "4", "2", "1024", "128", "--overlap-n", "4096", "--tokens-per-gpu", "4096",
           "--total", "16384", "--reps", "1", "--timeout", "500"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rs = _script()
    rec = json.loads(out.read_text())
    assert rs.validate(rec) == []
    assert rec["machine"]["backend"] == "nccl" and rec["machine"]["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert rec["correctness"]["all_ok"], [c for c in rec["correctness"]["cases"] if not c["ok"]]
    o = rec["overlap"]
    assert "ranks" in o["kernels"], o["kernels"]
    assert any(i["kind"] == "transfer" for i in o["kernels"]["ranks"]["0"])
    assert o["p2p"]["gbps"] > 1
    for r in rec["scaling"]["rows"]:
        assert (r["seconds"] is not None) != (r["not_run"] is not None), r
        if r["provider"].startswith("ring"):
            assert r["seconds"] is not None, r
