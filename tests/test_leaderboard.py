"""The class leaderboard (flashlab.grader.ranking) on the CPU: what the command does without a GPU,
the ranking, the CSV, the figure, and the timed window and its wire with the machinery moved onto the
CPU (the GPU run itself: scripts/gpu_leaderboard.py)."""
import csv
import io
import math
import contextlib
import socket
import threading
import time

import pytest
import torch
from matplotlib.figure import Figure

from flashlab.grader import batch, ranking as L, roster
from flashlab.grader import protocol as P


# ----------------------------------------------------------------------------
# the CPU path: a message, grades as usual, no leaderboard files
# ----------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_cpu_says_timing_needs_a_gpu_and_writes_no_leaderboard(tmp_path, capsys):
    from flashlab.__main__ import main
    (tmp_path / "class").mkdir()
    out = tmp_path / "grades"
    code = main(["grade", str(tmp_path / "class"), "--out", str(out), "--leaderboard", "--isolation", "weak",
                 "--quiet"])
    err = capsys.readouterr().err
    assert code == 0
    assert "timing needs a CUDA GPU" in err and "no leaderboard is written" in err
    assert "leaderboard: not written" in err                       # said again at the end
    assert (out / "grades.csv").exists()                           # grading itself ran
    assert not (out / "leaderboard.csv").exists() and not (out / "leaderboard.png").exists()
    # a learner's leaderboard() on a CPU: nothing timed (nor graded: that is grade()'s job), and it says so
    called = []
    board = L.leaderboard("flash_forward", lambda *a: called.append(a))
    assert "timing needs a CUDA GPU" in repr(board) and not called
    assert [e.status for e in board.entries] == ["not timed"] and board.entries[0].score(
        board.shape_labels["flash_forward"]) is None and board.entries[0].tflops == {}
    assert "not timed" in board.csv() and len(board.shape_labels["flash_forward"]) == 12


def test_leaderboard_refuses_resume(tmp_path):
    (tmp_path / "class").mkdir()
    with pytest.raises(ValueError, match="--resume"):
        batch.grade_all([str(tmp_path / "class")], str(tmp_path / "g"), isolation="weak", progress=False,
                        resume=True, leaderboard=True, log=lambda m: None)


def test_leaderboard_of_a_notebook_needs_a_timed_exercise():
    with pytest.raises(ValueError, match="flash_forward"):
        L.leaderboard("online_softmax", lambda *a: None)
    assert L.timed_exercises() == ["flash_forward", "flash_backward"]


# ----------------------------------------------------------------------------
# shapes, ranking, the table
# ----------------------------------------------------------------------------

def test_shapes_follow_the_protocol():
    s = L.shapes()
    assert len(s) == 12 and {x.N for x in s} == {1024, 4096, 16384} and {x.D for x in s} == {64, 128}
    one = L.Shape(4096, 128, True)
    assert (one.B, one.H) == (4, 16)
    assert one.flops("fwd") == 0.5 * 4 * 4 * 16 * 4096 ** 2 * 128 and one.flops("bwd") == 2.5 * one.flops("fwd")
    assert all(L.MIN_CALLS <= x.calls(m) <= L.MAX_CALLS for x in s for m in ("fwd", "bwd"))
    assert L.Shape(16384, 128, False).calls("bwd") == L.MIN_CALLS and L.Shape(1024, 64, True).calls("fwd") == L.MAX_CALLS
    assert L.Shape.from_dict(one.as_dict()) == one
    for bad in ({"N": "4096", "D": 64, "causal": True}, {"N": 4096, "D": 48, "causal": True},
                {"N": 4096, "D": 64, "causal": 1}, [1, 2]):
        with pytest.raises(ValueError):
            L.Shape.from_dict(bad)


LABELS = [L.Shape(1024, 64, False).label, L.Shape(1024, 64, True).label]


def _timing(values, status="ok", detail=""):
    shapes = [dict(L.Shape(1024, 64, c).as_dict(), status="ok", tflops=v) for c, v in zip((False, True), values)]
    if status != "ok":
        shapes[-1] = dict(shapes[-1], status=status, tflops=None)
    return {"status": status, "detail": detail, "shapes": shapes}


def _records():
    """A made-up graded class: results.jsonl lines with timings injected."""
    def rec(student, notebook, verdict, status="ok", detail=""):
        return {"student": student, "notebook": notebook, "sha256": "x", "status": status, "detail": detail,
                "grades": {"flash_forward": verdict}, "notes": [], "seconds": 1.0}
    passed = lambda t: {"status": "pass", "cases_passed": 9, "cases": 9, "timing": t}  # noqa: E731
    return [
        rec("ann", "ann/05.ipynb", passed(_timing([300.0, 250.0]))),
        rec("bo", "bo/05.ipynb", passed(_timing([100.0, 90.0]))),
        rec("cy", "cy/05.ipynb", passed(_timing([500.0, 480.0]))),
        # fast because wrong: its grade failed; a second notebook passed and was timed very fast
        rec("dee", "dee/05.ipynb", {"status": "fail", "cases_passed": 3, "cases": 9, "message": "hidden case 2: wrong"}),
        rec("dee", "dee/05b.ipynb", passed(_timing([9000.0, 9000.0]))),
        # right on the grader's cases, wrong at a timed shape
        rec("eve", "eve/05.ipynb", passed(_timing([2000.0, 2000.0], "wrong", "`o` is wrong at N=1024 D=64 causal"))),
        rec("fay", "fay/05.ipynb", {"status": "error", "cases_passed": 0, "cases": 9}, "timed out",
            "still running after 600 s"),
        rec("gus", "gus/05.ipynb", passed(_timing([400.0, 1.0], "timed out", "no answer in time"))),
        rec("hal", "hal/05.ipynb", {"status": "error", "cases_passed": 0, "cases": 9}, "crashed", "killed by SIGSEGV"),
        rec("ivy", "ivy/05.ipynb", passed(None)),                      # passed, never timed
    ]


def _board():
    rows = roster.student_rows(_records())
    refs = {"flash_forward": {"SDPA flash": _timing([320.0, 300.0]), "flashlab (op)": _timing([420.0, 400.0]),
                              "SDPA cuDNN": {"status": "error", "detail": "unavailable", "shapes": []}}}
    return L.build(L.entries_from_rows(rows, ["flash_forward"]), refs, {"flash_forward": LABELS})


def test_ranking_marks_every_student_and_never_ranks_a_wrong_kernel():
    board = _board()
    by = {e.name: e for e in board.entries}
    assert [e.name for e in board.entries if e.rank] == ["cy", "ann", "bo"]
    assert [by[n].rank for n in ("cy", "ann", "bo")] == [1, 2, 3]
    assert by["cy"].score(LABELS) == pytest.approx(math.sqrt(500 * 480))
    # nobody is dropped, and each says why it does not rank
    assert {e.name for e in board.entries if e.kind == "student"} == {"ann", "bo", "cy", "dee", "eve", "fay", "gus",
                                                                       "hal", "ivy"}
    assert by["dee"].status == "failed" and by["dee"].rank is None        # the worst verdict counts
    assert by["eve"].status == "wrong at a timed shape" and by["eve"].tflops == {}
    assert by["fay"].status == "timed out" and by["hal"].status == "crashed"
    assert by["gus"].status == "timed out" and by["gus"].tflops == {}    # no numbers of an unfinished kernel
    assert by["ivy"].status == "not timed"
    # references: lines, never ranked; an unavailable one is listed with its reason
    refs = [e for e in board.entries if e.kind == "reference"]
    assert [e.name for e in refs] == ["flashlab (op)", "SDPA flash", "SDPA cuDNN"]
    assert all(e.rank is None for e in refs) and refs[2].status == "timing failed"
    # order: ranked, references, then the rest by kind of failure
    order = [e.name for e in board.entries]
    assert order[:6] == ["cy", "ann", "bo", "flashlab (op)", "SDPA flash", "SDPA cuDNN"]
    assert order.index("eve") < order.index("gus") < order.index("hal") < order.index("dee") < order.index("ivy")
    text = repr(board)
    assert "wrong at a timed shape" in text and "  1  cy" in text


def test_a_student_timed_at_some_shapes_only_does_not_rank():
    e = L.entry_from_timing("flash_forward", "kim", {"status": "ok", "detail": "", "shapes": [
        dict(L.Shape(1024, 64, False).as_dict(), status="ok", tflops=900.0)]})
    ranked = L.rank([e], {"flash_forward": LABELS})
    assert ranked[0].status == "timing failed" and ranked[0].rank is None and "causal" in ranked[0].detail


def test_csv_schema():
    board = _board()
    rows = list(csv.reader(io.StringIO(board.csv())))
    assert rows[0] == L.CSV_HEAD + [f"tflops {l}" for l in LABELS] + ["detail"]
    assert len(rows) == 1 + len(board.entries)
    body = {r[2]: dict(zip(rows[0], r)) for r in rows[1:]}
    assert body["cy"]["rank"] == "1" and body["cy"]["tflops_geomean"] == f"{math.sqrt(500 * 480):.1f}"
    assert body["cy"][f"tflops {LABELS[0]}"] == "500.0"
    for name in ("dee", "eve", "gus", "fay", "ivy"):                   # marked, with no numbers
        assert body[name]["rank"] == "" and body[name]["tflops_geomean"] == ""
        assert all(body[name][f"tflops {l}"] == "" for l in LABELS)
    assert body["eve"]["status"] == "wrong at a timed shape" and "causal" in body["eve"]["detail"]
    assert body["SDPA flash"]["kind"] == "reference" and body["SDPA flash"]["tflops_geomean"] != ""


def test_csv_cells_are_never_formulas():
    e = L.Entry("flash_forward", "=cmd()", status="failed", detail="+x")
    row = list(csv.reader(io.StringIO(L.format_csv([e], {"flash_forward": LABELS}))))[1]
    assert row[2] == "'=cmd()" and row[-1] == "'+x"


def test_figure_draws_a_made_up_table():
    board = _board()
    fig = board.figure()
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    assert len(ax.patches) == 9                                        # a slot per student, none dropped
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights[-1] == pytest.approx(math.sqrt(500 * 480)) and heights.count(0) == 6
    texts = [t.get_text() for t in ax.texts]
    assert "wrong at a timed shape" in texts and "timed out" in texts and "crashed" in texts
    assert len(ax.get_lines()) == 2                                    # two references timed; cuDNN unavailable
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks[:3] == ["1. cy", "2. ann", "3. bo"]
    # two exercises: two panels
    extra = L.Entry("flash_backward", "cy", tflops={LABELS[0]: 200.0, LABELS[1]: 150.0})
    two = L.build(board.entries + [extra], {}, {"flash_forward": LABELS, "flash_backward": LABELS})
    assert len(two.figure().axes) == 2


# ----------------------------------------------------------------------------
# the timed window and its wire, on the CPU (tiny shapes, a torch reference)
# ----------------------------------------------------------------------------

class _CpuForward(L.ForwardTiming):
    """The forward's timing with a float32 PyTorch reference, so the machinery runs without a GPU."""

    def reference(self, s, causal):
        q, k, v = (s[n].float() for n in "qkv")
        sc = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            sc = sc.masked_fill(torch.ones(sc.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return {"o": (torch.softmax(sc, -1) @ v).to(s["q"].dtype), "lse": torch.logsumexp(sc, -1)}


class _Ex:
    name = "flash_forward"
    timing = _CpuForward()


def _right(q, k, v, o, lse, causal):
    ref = _Ex.timing.reference({"q": q, "k": k, "v": v}, causal)
    o.copy_(ref["o"])
    lse.copy_(ref["lse"])


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(L, "_DEVICE", "cpu")
    monkeypatch.setattr(L, "TOKENS", 64)
    monkeypatch.setattr(L, "HIDDEN", 32)
    return [L.Shape(32, 16, False), L.Shape(32, 16, True)]


def test_window_times_a_right_kernel(on_cpu):
    res = L.time_local(_Ex, lambda s: _Ex.timing.run(_right, s), on_cpu)
    assert res["status"] == "ok" and len(res["shapes"]) == 2
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["calls"] >= L.MIN_CALLS for r in res["shapes"])


@pytest.mark.parametrize("how", ["scaled", "lazy", "lse", "nan"])
def test_window_catches_wrong_outputs_of_the_timed_calls(on_cpu, how):
    seen = []

    def wrong(q, k, v, o, lse, causal):
        if how == "lazy" and seen:        # right once (the untimed call), then skips the work
            return
        seen.append(1)
        _right(q, k, v, o, lse, causal)
        if how == "scaled":
            o.mul_(1.1)
        elif how == "lse":
            lse.mul_(1.4426950408889634)     # base 2
        elif how == "nan":
            o[0, 0, -1, 0] = float("nan")

    res = L.time_local(_Ex, lambda s: _Ex.timing.run(wrong, s), on_cpu)
    assert res["status"] == "wrong" and res["shapes"][0]["status"] == "wrong" and res["shapes"][0]["ms"] is None
    assert len(res["shapes"]) == 1                                   # it stops at the first wrong shape
    e = L.entry_from_timing("flash_forward", "x", res)
    assert e.status == "wrong at a timed shape" and e.score([s.label for s in on_cpu]) is None


def test_judge_subtracts_the_graders_checksum_time_at_most_half():
    shape = L.Shape(1024, 64, False)
    exp = L.Expected(sums=[[1.0, 2.0]] * 4, norms=[[10.0, 10.0]] * 4, checksum_seconds=0.2)
    row = L.judge(L.FORWARD, shape, ("o", "lse"), exp, [[1.0, 2.0]] * 4, elapsed=1.0, calls=4)
    assert row["status"] == "ok" and row["ms"] == pytest.approx(200.0)
    assert row["tflops"] == pytest.approx(shape.flops("fwd") / 0.2 / 1e12)
    exp.checksum_seconds = 0.9
    assert L.judge(L.FORWARD, shape, ("o", "lse"), exp, [[1.0, 2.0]] * 4, 1.0, 4)["ms"] == pytest.approx(125.0)
    assert L.judge(L.FORWARD, shape, ("o", "lse"), exp, [[1.0, 2.0]] * 3, 1.0, 4)["status"] == "error"
    assert L.judge(L.FORWARD, shape, ("o", "lse"), exp, "lies", 1.0, 4)["status"] == "error"


def _serve(candidate, shapes, sandbox=None):
    """The grader's time_remote against a sandbox's serve_cases over a socket pair (threads)."""
    a, b = socket.socketpair()
    t = threading.Thread(target=sandbox or (lambda: P.serve_cases(_Ex, candidate, sock=a)), daemon=True)
    t.start()
    try:
        head, _ = P.recv(b, time.monotonic() + 10)
        assert head == {"op": "grade", "exercise": "flash_forward"}
        res = L.time_remote(b, _Ex, shapes, time.monotonic() + 60)
        try:
            P.send(b, {"op": "done"}, timeout=5)
        except OSError:
            pass
    finally:
        t.join(10)
        b.close()
    return res


def test_wire_times_a_right_kernel_with_the_graders_clock(on_cpu):
    res = _serve(_right, on_cpu)
    assert res["status"] == "ok" and [r["status"] for r in res["shapes"]] == ["ok", "ok"]
    assert all(r["ms"] > 0 for r in res["shapes"])


def test_the_graders_checksum_time_is_measured_in_the_windows_turn(on_cpu, monkeypatch):
    """The time subtracted from the clock is measured while the window has the GPU alone: measured beside other
    notebooks' cases (--jobs 7 on an H200) it came out long and a kernel read up to 2x too fast."""
    state, seen = {"alone": False}, []

    class Turns:
        @contextlib.contextmanager
        def case(self):
            yield

        @contextlib.contextmanager
        def timed(self):
            state["alone"] = True
            try:
                yield
            finally:
                state["alone"] = False

    real = L.Expected.measure

    def measure(self, *a, **k):
        seen.append((state["alone"], self.refs is not None))
        return real(self, *a, **k)
    monkeypatch.setattr(L.Expected, "measure", measure)
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: P.serve_cases(_Ex, _right, sock=a), daemon=True)
    t.start()
    try:
        P.recv(b, time.monotonic() + 10)
        res = L.time_remote(b, _Ex, on_cpu, time.monotonic() + 60, turns=Turns())
        P.send(b, {"op": "done"}, timeout=5)
    finally:
        t.join(10)
        b.close()
    assert res["status"] == "ok" and seen == [(True, True)] * len(on_cpu)
    exp = L.expected(_Ex.timing, on_cpu[0], 7, 2, ("o", "lse"))     # without keep: measured at once, freed
    assert exp.refs is None and exp.checksum_seconds > 0


def test_wire_marks_a_kernel_that_raises_or_stops(on_cpu):
    def raises(*args):
        raise RuntimeError("boom")
    res = _serve(raises, on_cpu)
    assert res["status"] == "error" and "boom" in res["detail"]
    assert L.entry_from_timing("flash_forward", "x", res).status == "timing failed"

    def dies_in_the_window(q, k, v, o, lse, causal):     # the process ends while the clock runs
        if getattr(dies_in_the_window, "warm", False):
            raise SystemExit
        dies_in_the_window.warm = True
        _right(q, k, v, o, lse, causal)

    a_side = {}

    def sandbox():
        a, = a_side["sock"]
        try:
            P.serve_cases(_Ex, dies_in_the_window, sock=a)
        except SystemExit:
            a.close()

    a, b = socket.socketpair()
    a_side["sock"] = (a,)
    t = threading.Thread(target=sandbox, daemon=True)
    t.start()
    P.recv(b, time.monotonic() + 10)
    res = L.time_remote(b, _Ex, on_cpu, time.monotonic() + 60)
    t.join(10)
    b.close()
    assert res["status"] == "crashed"
    assert L.entry_from_timing("flash_forward", "x", res).status == "crashed"


def test_wire_refuses_a_bad_time_request(on_cpu):
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: P.serve_cases(_Ex, _right, sock=a), daemon=True)
    t.start()
    P.recv(b, time.monotonic() + 10)
    P.send(b, {"op": "time", "shape": {"N": 32, "D": 16, "causal": False}, "seed": 1, "calls": 10 ** 6})
    reply, _ = P.recv(b, time.monotonic() + 10)
    assert reply["op"] == "timing" and reply["status"] == "error"
    P.send(b, {"op": "done"})
    t.join(10)
    b.close()


def _fake_exercise():
    """A cheap exercise (y = 2x) that carries the CPU forward timing: batch grading's real path."""
    import numpy as np
    from flashlab.grader.core import Case, Exercise
    return Exercise("fake_kernel", "f(x) -> 2 x", lambda rng: [Case({"N": 4}, {"x": np.arange(4.0)}, True)],
                    lambda f, case: {"y": np.asarray(f(case.inputs["x"]), dtype=np.float64)},
                    lambda case: {"y": case.inputs["x"] * 2}, lambda case, name, ref: 1e-9,
                    lambda case, name, idx: str(idx), timing=_CpuForward())


@pytest.mark.parametrize("right", [True, False])
def test_batch_times_a_kernel_only_after_the_grader_passed_it(on_cpu, right):
    ex = _fake_exercise()
    frames = []

    def candidate(*args):
        if len(args) == 1:                                   # the graded cases
            return args[0] * (2 if right else 3)
        frames.append("timed")
        _right(*args)

    g = batch.Grader(batch.Config(isolation="weak", leaderboard=on_cpu))
    try:
        g.exercises = {ex.name: ex}
        a, b = socket.socketpair()
        t = threading.Thread(target=lambda: P.serve_cases(ex, candidate, sock=a), daemon=True)
        t.start()
        header, _ = P.recv(b, time.monotonic() + 10)
        run = batch._Run(time.monotonic() + 60)
        run.clean_of = {"fake_kernel"}                   # the clean run: where a pass is timed (not the notebook's)
        g._grade_exercise(b, header, run)
        t.join(10)
        b.close()
    finally:
        g.close()
    verdict = run.grades["fake_kernel"]
    if right:
        assert verdict["status"] == "pass" and verdict["timing"]["status"] == "ok"
        assert [r["status"] for r in verdict["timing"]["shapes"]] == ["ok", "ok"] and frames
    else:                                                    # a kernel that failed its grade is never timed
        assert verdict["status"] == "fail" and "timing" not in verdict and not frames
    assert not t.is_alive()                                  # the sandbox was told "done"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_leaderboard_stops_when_the_graded_code_cannot_use_the_gpu():
    """The self-test notebook reports whether it sees a GPU; with the leaderboard on, a sandbox that
    cannot use it (here: no GPU at all) stops the run rather than grading kernels in the interpreter."""
    from flashlab.grader import isolation
    plain = batch.Grader(batch.Config(timeout=120, isolation="weak"))
    try:
        plain.selftest()          # an earlier run of the same setup, without the leaderboard: its facts are cached
    finally:
        plain.close()
    g = batch.Grader(batch.Config(timeout=120, isolation="weak", leaderboard=L.shapes((1024,), (64,))))
    try:
        with pytest.raises(isolation.IsolationError, match="cannot use it"):
            g.selftest()
    finally:
        g.close()


def test_a_timed_window_has_the_gpu_alone():
    """With --jobs > 1: a window waits for the cases being run, and cases asked for meanwhile wait for it."""
    turns, log = batch.GpuTurns(), []
    running, release = threading.Event(), threading.Event()

    def case(name, hold=False):
        with turns.case():
            log.append(f"{name} in")
            if hold:
                running.set()
                release.wait(5)
            log.append(f"{name} out")

    def window():
        with turns.timed():
            log.append("window in")
            time.sleep(0.05)
            log.append("window out")

    def until(cond, what):      # the turns' own state, not sleeps: a loaded machine schedules threads late
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.005)

    threads = [threading.Thread(target=case, args=("a", True))]
    threads[0].start()
    running.wait(5)
    threads.append(threading.Thread(target=window))
    threads[1].start()
    until(lambda: turns._window, "the window never asked for its turn")
    threads.append(threading.Thread(target=case, args=("b",)))
    threads[2].start()
    time.sleep(0.1)
    assert log == ["a in"]                                    # the window waits for a; b waits for the window
    release.set()
    for t in threads:
        t.join(5)
    assert log == ["a in", "a out", "window in", "window out", "b in", "b out"]


def test_memory_can_be_unlimited_for_cuda():
    import resource
    from flashlab.grader import cli, isolation
    assert cli._size("unlimited") == resource.RLIM_INFINITY and cli._size("4G") == 4 << 30
    lim = isolation.Limits(memory=cli._size("unlimited"))
    cmd = isolation.weak_command(["python"], lim)
    assert not any(a.startswith("--as=-") for a in cmd)                 # prlimit is told "unlimited", not -1
