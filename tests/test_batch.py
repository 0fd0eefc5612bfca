"""Assignments, and the parts of batch grading that need no sandbox: the wire, inputs, outputs, rules."""
import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from flashlab.grader import batch
from flashlab.grader import protocol as P
from flashlab.grader import roster
from flashlab.grader.assign import assign, is_edited, strip_solution

ROOT = Path(__file__).resolve().parents[1]


def test_strip_solution_keeps_indentation_and_code_around():
    src = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n\ngrade('f', f)"
    assert strip_solution(src) == ("def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError\n"
                                   "\ngrade('f', f)")
    with pytest.raises(ValueError):
        strip_solution("### BEGIN SOLUTION\nx = 1")


def test_assign_check_and_never_overwrite_edits(tmp_path):
    sol, ex = tmp_path / "solutions", tmp_path / "exercises"
    shutil.copytree(ROOT / "solutions", sol)
    logs = []
    assert assign(sol, ex, log=logs.append) == 0
    assert assign(sol, ex, check=True, log=logs.append) == 0
    target = ex / "02_online_softmax.ipynb"
    nb = nbformat.read(target, as_version=4)
    assert not is_edited(nb)
    assert "raise NotImplementedError" in "".join(c.source for c in nb.cells)
    assert "BEGIN SOLUTION" not in "".join(c.source for c in nb.cells)
    assert "/exercises/02_online_softmax.ipynb" in nb.cells[0].source      # badge points at the exercise
    # a learner edits it: regenerating keeps their work, --force replaces it
    nb.cells[-1].source += "\n# my answer"
    nbformat.write(nb, target)
    assert is_edited(nbformat.read(target, as_version=4))
    assign(sol, ex, log=logs.append)
    assert "# my answer" in nbformat.read(target, as_version=4).cells[-1].source
    assert any("kept" in l for l in logs)
    assert assign(sol, ex, check=True, log=logs.append) == 1                # out of date
    assign(sol, ex, force=True, log=logs.append)
    assert "# my answer" not in nbformat.read(target, as_version=4).cells[-1].source
    # a solution changed: --check notices
    s = nbformat.read(sol / "01_naive_attention.ipynb", as_version=4)
    s.cells.append(nbformat.v4.new_markdown_cell("new text"))
    nbformat.write(s, sol / "01_naive_attention.ipynb")
    assert assign(sol, ex, check=True, log=logs.append) == 1


# ----------------------------------------------------------------------------
# batch grading, the parts that need no sandbox (tests/test_batch_attacks.py runs whole classes)
# ----------------------------------------------------------------------------

def test_protocol_carries_arrays_tensors_and_nothing_else(rng):
    t = torch.from_numpy(rng.standard_normal((3, 5))).to(torch.bfloat16)
    value = {"q": t, "x": rng.standard_normal((2, 3)), "_stray": ["a", "b"], "_unwritten": {"o": np.ones(4, bool)},
             "n": None, "k": [1, 2.5, "s"]}
    arrays = []
    a, b = socket.socketpair()
    tree = P.pack(value, arrays)
    P.send(a, {"op": "case", "inputs": tree}, arrays)
    header, got = P.recv(b, time.monotonic() + 5)
    back = P.unpack(header["inputs"], got, torch_ok=True)
    assert back["q"].dtype == torch.bfloat16 and torch.equal(back["q"], t)          # bf16 rebuilt exactly
    assert np.array_equal(back["x"], value["x"]) and back["x"].dtype == np.float64
    assert back["_stray"] == ["a", "b"] and back["_unwritten"]["o"].dtype == bool
    assert back["n"] is None and back["k"] == [1, 2.5, "s"]
    with pytest.raises(P.ProtocolError):
        P.unpack(header["inputs"], got)                      # the grader takes no tensors
    with pytest.raises(TypeError):
        P.pack({"f": object()}, [])                          # nothing but data travels
    with pytest.raises(TypeError):
        P.pack(np.array([object()]), [])


@pytest.mark.parametrize("frame, why", [
    (b"\xff\xff\xff\xff", "over the"),
    (pickle.dumps({"op": "verdict", "status": "pass"}), "over the"),
    (b"\x00\x00\x00\x05nope!", "not JSON"),
    (b"\x00\x00\x00\x02[]", "JSON object"),
    (json.dumps({"arrays": [{"dtype": "|O", "shape": [1]}]}), "numeric dtypes"),
    (json.dumps({"arrays": [{"dtype": "<f8", "shape": [10 ** 5, 10 ** 5]}]}), "size limit"),
    (json.dumps({"arrays": [{"dtype": "<f8", "shape": [-1]}]}), "shape"),
    (json.dumps({"arrays": [{"dtype": "<f8", "shape": [4]}]}), "stopped sending"),    # promised, never sent
])
def test_protocol_refuses_hostile_frames(frame, why):
    if isinstance(frame, str):
        frame = struct.pack(">I", len(frame)) + frame.encode()
    a, b = socket.socketpair()
    a.sendall(frame)
    with pytest.raises(P.ProtocolError, match=why):
        P.recv(b, time.monotonic() + 0.5)


def test_bad_array_references_are_refused():
    for tree in ({"__array__": 3}, {"__array__": "0"}, {"__array__": 0, "evil": 1}, {"__array__": True}):
        with pytest.raises(P.ProtocolError):
            P.unpack(tree, [np.zeros(2)])


def _serve(ex_name, candidate, grader, notebook_ex=None):
    """The grader's side of one grade() call, with the notebook's side in a thread (no sandbox);
    ``notebook_ex``: the exercise as the notebook has it (patched, for an attack)."""
    from flashlab.grader.exercises import EXERCISES
    a, b = socket.socketpair()
    child = threading.Thread(target=lambda: P.serve_cases(notebook_ex or EXERCISES[ex_name], candidate, sock=b),
                             daemon=True)
    child.start()
    run = batch._Run(time.monotonic() + 60)
    header, _ = P.recv(a, time.monotonic() + 10)
    grader._grade_exercise(a, header, run)
    child.join(10)
    a.close()
    return run.grades[ex_name]


def test_the_verdict_is_computed_by_the_grader():
    from flashlab import reference as R
    def own(x, b):                                         # the learner's own code (references are refused)
        m, l = np.full(len(x), -np.inf), np.zeros(len(x))
        for j in range(0, x.shape[1], b):
            m_new = np.maximum(m, x[:, j:j + b].max(1))
            l = np.exp(m - m_new) * l + np.exp(x[:, j:j + b] - m_new[:, None]).sum(1)
            m = m_new
        return np.exp(x - m[:, None]) / l[:, None]
    grader = batch.Grader(batch.Config(isolation="weak"))
    try:
        assert _serve("online_softmax", own, grader)["status"] == "pass"
        def wrong(x, b):                                   # no max subtraction: overflows on large logits
            with np.errstate(all="ignore"):
                return np.exp(x) / np.exp(x).sum(1, keepdims=True)
        v = _serve("online_softmax", wrong, grader)
        assert v["status"] == "fail" and v["cases_passed"] < v["cases"]
        # the candidate mutates its inputs to zero: the grader's reference uses its own copy
        def zeroing(m, l, x):
            m[...] = 0; l[...] = 0; x[...] = 0  # noqa: E702
            return R.online_softmax_update(m, l, x)
        assert _serve("online_softmax_update", zeroing, grader)["status"] == "fail"
        def stub(x, b):
            raise NotImplementedError
        assert _serve("online_softmax", stub, grader)["status"] == "not implemented"
    finally:
        grader.close()


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")


def test_discover_takes_regular_notebooks_only_and_names_students(tmp_path):
    cls = tmp_path / "class"
    _touch(cls / "alice" / "hw" / "a.ipynb")
    _touch(cls / "alice" / "b.IPYNB")
    _touch(cls / "bob.ipynb")
    _touch(cls / "alice" / ".ipynb_checkpoints" / "a-checkpoint.ipynb")
    _touch(cls / "notes.txt")
    os.symlink(cls / "bob.ipynb", cls / "carol.ipynb")
    os.symlink(cls / "alice", cls / "dave")
    os.mkfifo(cls / "pipe.ipynb")
    with open(os.fsencode(cls) + b"/\xff\xfe.ipynb", "w") as f:
        f.write("{}")
    subs, skipped = roster.discover([cls])
    assert sorted((s.student, s.notebook) for s in subs) == sorted([
        ("alice", "class/alice/b.IPYNB"), ("alice", "class/alice/hw/a.ipynb"), ("bob", "class/bob.ipynb"),
        ("\udcff\udcfe", "class/\udcff\udcfe.ipynb")])
    reasons = {s.path: s.reason for s in skipped}
    assert "symbolic link" in reasons["class/carol.ipynb"] and "symbolic link" in reasons["class/dave"]
    assert "not a regular file" in reasons["class/pipe.ipynb"] and "not a notebook" in reasons["class/notes.txt"]
    subs, skipped = roster.discover([cls], student_pattern=r"(?P<student>[a-z]+)/hw/")
    assert [(s.student, s.notebook) for s in subs] == [("alice", "class/alice/hw/a.ipynb")]
    with pytest.raises(OSError):
        roster.read_submission(str(cls / "carol.ipynb"))          # a link is never opened
    with pytest.raises(ValueError):
        roster.read_submission(str(cls / "pipe.ipynb"))           # nor a FIFO (and it does not block)


def test_names_and_cells_are_shown_safely():
    assert roster.show("caf\udce9\nx\u202e") == "caf\\xe9\\nx\\u202e"
    for bad in ("=1+1", "+1", "-1", "@SUM(A1)", "=HYPERLINK(\"x\")", "|cmd"):
        assert roster.csv_cell(bad).startswith("'")
    assert roster.csv_cell("\t=1")[0] not in "\t="                 # control characters are escaped first
    assert roster.csv_cell("alice") == "alice"


def test_outputs_replace_links_never_follow_them(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "summary.txt")
    d = roster.OutDir(out)
    d.replace("summary.txt", "new")
    assert victim.read_text() == "keep" and not (out / "summary.txt").is_symlink()
    os.symlink(victim, out / "results.jsonl")
    with pytest.raises(ValueError):
        d.open_append("results.jsonl", fresh=False)
    d.open_append("results.jsonl", fresh=True)                     # a fresh run replaces the link
    d.append_line('{"a": 1}')
    assert victim.read_text() == "keep" and (out / "results.jsonl").read_text() == '{"a": 1}\n'
    d.close()
    os.symlink(out, tmp_path / "link")
    with pytest.raises(ValueError):
        roster.OutDir(tmp_path / "link")


def test_without_root_the_sandbox_is_refused_not_faked(monkeypatch):
    from flashlab.grader import isolation
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(isolation.IsolationError, match="root"):
        isolation.choose("auto")
    assert isolation.choose("weak") == "weak"                    # only when asked for by name


def test_one_row_per_student_and_the_worst_verdict_counts():
    rec = lambda nb, st, g: {"student": "s", "notebook": nb, "sha256": "", "status": st, "detail": "",  # noqa: E731
                             "grades": {k: {"status": v} for k, v in g.items()}, "notes": []}
    rows = roster.student_rows([rec("a", "ok", {"x": "pass", "y": "pass"}), rec("b", "timed out", {"x": "fail"})])
    (row,) = rows
    assert row.grades["x"]["status"] == "fail" and row.grades["y"]["status"] == "pass"
    assert row.status == "timed out" and any("worst counts" in n for n in row.notes)
    text = roster.format_summary(rows)
    assert "Timed out:" in text and "Failed:" in text


def test_cli_assign_check_passes_on_the_repository():
    out = subprocess.run([sys.executable, "-m", "flashlab", "assign", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _own_online_softmax(x, b):
    m, l = np.full(len(x), -np.inf), np.zeros(len(x))
    for j in range(0, x.shape[1], b):
        m_new = np.maximum(m, x[:, j:j + b].max(1))
        l = np.exp(m - m_new) * l + np.exp(x[:, j:j + b] - m_new[:, None]).sum(1)
        m = m_new
    return np.exp(x - m[:, None]) / l[:, None]


def test_running_out_of_time_is_incomplete_never_a_pass():
    """A right answer that sleeps through the budget: grading stops early, and the verdict says how many
    cases ran ("incomplete: k of n"), never "pass" (a wrong answer could hide in the cases not run)."""
    import dataclasses
    from flashlab.grader.exercises import EXERCISES
    slow_ex = dataclasses.replace(EXERCISES["online_softmax"], budget=1.0)

    def sleepy(x, b):
        time.sleep(0.6)
        return _own_online_softmax(x, b)
    grader = batch.Grader(batch.Config(isolation="weak"))
    try:
        grader.exercises = {**grader.exercises, "online_softmax": slow_ex}
        v = _serve("online_softmax", sleepy, grader)
    finally:
        grader.close()
    assert v["status"] == "fail" and 0 < v["cases_passed"] < v["cases"], v
    assert f"incomplete: {v['cases_passed']} of {v['cases']} cases ran" in v["message"], v
    from flashlab.grader.core import grade as core_grade
    r = core_grade(slow_ex, sleepy)
    assert not r.passed and r.incomplete and "incomplete" in str(r)


def test_a_folder_swapped_for_a_link_after_the_listing_is_not_followed(tmp_path, monkeypatch):
    """eve's folder is listed, then replaced by a link to a folder holding a right answer: the notebook is
    opened folder by folder without following links, so the swap is refused, never graded."""
    cls, elsewhere = tmp_path / "class", tmp_path / "solutions"
    _nb_file(cls / "eve" / "work.ipynb", "x = 1")
    _nb_file(elsewhere / "work.ipynb", "x = 2")
    real_discover = batch.discover

    def discover_then_swap(*a, **k):
        found = real_discover(*a, **k)
        shutil.rmtree(cls / "eve")
        os.symlink(elsewhere, cls / "eve", target_is_directory=True)
        return found
    monkeypatch.setattr(batch, "discover", discover_then_swap)
    (row,) = batch.grade_all([cls], tmp_path / "out", timeout=60, progress=False, isolation="weak")
    assert row.status == "rejected" and "cannot read" in row.detail, row
    with pytest.raises(OSError):
        roster.read_submission(str(cls / "eve" / "work.ipynb"), str(cls), ("eve", "work.ipynb"))


def _nb_file(path, source):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nbformat.writes(nb))


def test_an_interrupt_while_a_notebook_is_parsed_is_no_verdict(tmp_path, monkeypatch):
    """SIGTERM while a notebook is being parsed: nothing is stored for it, the run ends non-zero
    (KeyboardInterrupt: the CLI's 130), and --resume grades it."""
    import signal
    cls, out = tmp_path / "class", tmp_path / "out"
    _nb_file(cls / "a.ipynb", "x = 1")
    real = nbformat.reads

    def parse_while_interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)        # arrives while nbformat parses the notebook
        time.sleep(0.5)
        return real(*a, **k)
    monkeypatch.setattr(nbformat, "reads", parse_while_interrupted)
    with pytest.raises(KeyboardInterrupt):
        batch.grade_all([cls], out, timeout=60, progress=False, isolation="weak")
    assert not [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()], "a verdict was stored"
    monkeypatch.setattr(nbformat, "reads", real)
    (row,) = batch.grade_all([cls], out, timeout=60, progress=False, isolation="weak", resume=True)
    assert row.status == "ok", row


def test_requirements_rest_on_the_reads_the_grader_served():
    """Under batch grading the inputs a requirement constrains (online_softmax's x, attention_tiled's k and v)
    are served element by element on request and the grader checks its own log: every right variant
    still passes, and a notebook that patches the exercise's run (so that nothing is recorded or
    reported) gets NaN where it does not ask, or a violation where it asks for everything at once."""
    import dataclasses
    from flashlab.grader.exercises import EXERCISES
    from flashlab import reference as R
    from test_grader_algorithm import RIGHT_TILED, os_array_split, os_copy, os_own, os_per_row, \
        os_split_blockwise_writeout
    grader = batch.Grader(batch.Config(isolation="weak"))
    try:
        for fn in (os_own, os_split_blockwise_writeout, os_per_row, os_copy, os_array_split):
            assert _serve("online_softmax", fn, grader)["status"] == "pass", fn.__name__
        for fn in RIGHT_TILED:
            v = _serve("attention_tiled", fn, grader)
            assert v["status"] == "pass", (fn.__name__, v)

        def two_pass(x, b):                                    # max, then sum, then write-out: three passes
            e = np.exp(x - x.max(1, keepdims=True))
            return e / e.sum(1, keepdims=True)

        def naive(q, k, v, causal, bq, bk):
            return R.attention_naive(q, np.asarray(k), np.asarray(v), causal)
        # the notebook's exercise patched: its run hands the candidate plain arrays and reports nothing
        for ex_name, cand, plain in (("online_softmax", two_pass, ("x",)), ("attention_tiled", naive, ("k", "v"))):
            ex = EXERCISES[ex_name]

            def forged_run(f, case, ex=ex, plain=plain):       # everything fetched at once, then plain NumPy
                for n in plain if isinstance(case.inputs[plain[0]], np.ndarray) and hasattr(
                        case.inputs[plain[0]], "_rec") else ():
                    rec = case.inputs[n]._rec
                    rec.use(np.arange(rec.size))
                i = {n: np.array(x.view(np.ndarray)) if n in plain else x for n, x in case.inputs.items()}
                out = f(i["x"], case.params["block_size"]) if ex_name == "online_softmax" else \
                    f(i["q"], i["k"], i["v"], case.params["causal"], case.params["block_q"], case.params["block_k"])
                return {"p": out} if ex_name == "online_softmax" else {"o": out[0], "lse": out[1]}

            def blind_run(f, case, ex=ex, plain=plain):         # nothing fetched: the data is not there
                i = {n: np.array(x.view(np.ndarray)) if n in plain else x for n, x in case.inputs.items()}
                out = f(i["x"], case.params["block_size"]) if ex_name == "online_softmax" else \
                    f(i["q"], i["k"], i["v"], case.params["causal"], case.params["block_q"], case.params["block_k"])
                return {"p": out} if ex_name == "online_softmax" else {"o": out[0], "lse": out[1]}
            for run in (forged_run, blind_run):
                v = _serve(ex_name, cand, grader, notebook_ex=dataclasses.replace(ex, run=run))
                assert v["status"] in ("fail", "error") and v["cases_passed"] < v["cases"], (ex_name, run.__name__, v)
                assert run is blind_run or "wrong algorithm" in v["message"], v
    finally:
        grader.close()
