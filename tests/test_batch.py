"""Assignments and batch grading: a bad class folder is graded to the end."""
import csv
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from flashlab.grader.assign import assign, is_edited, strip_solution
from flashlab.grader.batch import grade_all

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


def _notebook(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


OWN = """import flashlab, numpy as np
from flashlab.grader import grade
def osu(m, l, x):
    m_new = np.maximum(m, x.max(1))
    return m_new, np.exp(m - m_new) * l + np.exp(x - m_new[:, None]).sum(1)
def os_(x, b):
    m, l = np.full(len(x), -np.inf), np.zeros(len(x))
    for j in range(0, x.shape[1], b):
        m, l = osu(m, l, x[:, j:j + b])
    return np.exp(x - m[:, None]) / l[:, None]
"""   # the learner's own code: the grader refuses flashlab's references as answers
GOOD = OWN + """grade("online_softmax", os_)
grade("online_softmax_update", osu)"""
WRONG = OWN + """grade("online_softmax", lambda x, b: np.exp(x) / np.exp(x).sum(1, keepdims=True))
grade("online_softmax_update", osu)"""


@pytest.mark.notebook
def test_batch_grading_survives_a_bad_class(tmp_path):
    sub = tmp_path / "class"
    sub.mkdir()
    _notebook(sub / "alice.ipynb", [GOOD])
    _notebook(sub / "bob.ipynb", [WRONG])
    _notebook(sub / "carol.ipynb", [OWN + "grade('online_softmax', os_)",
                                    "import time\ntime.sleep(600)"])
    _notebook(sub / "dave.ipynb", ["import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"])
    (sub / "erin.ipynb").write_text("{ this is not json")
    before = {p.name: p.read_bytes() for p in sub.iterdir()}
    rows = grade_all([sub], tmp_path / "grades", timeout=25, progress=False)
    assert {p.name: p.read_bytes() for p in sub.iterdir()} == before          # submissions untouched
    by = {r.student: r for r in rows}
    assert by["alice"].status == "ok" and by["alice"].grades["online_softmax"]["status"] == "pass"
    assert by["bob"].status == "ok" and by["bob"].grades["online_softmax"]["status"] == "fail"
    assert by["bob"].grades["online_softmax_update"]["status"] == "pass"
    assert by["carol"].status == "timed out" and by["carol"].grades["online_softmax"]["status"] == "pass"
    assert by["dave"].status == "kernel died"
    assert by["erin"].status == "not a notebook"
    table = list(csv.DictReader(open(tmp_path / "grades" / "grades.csv")))
    assert [r["student"] for r in table] == ["alice", "bob", "carol", "dave", "erin"]
    assert table[1]["online_softmax"] == "fail" and table[4]["run"] == "not a notebook"
    summary = (tmp_path / "grades" / "summary.txt").read_text()
    assert "FAIL" in summary and "timed out" in summary


def test_cli_assign_check_passes_on_the_repository():
    out = subprocess.run([sys.executable, "-m", "flashlab", "assign", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
