"""The notebooks are the product: each runs top to bottom here (small sizes on a CPU),
solutions pass their grades, exercise stubs report 'not implemented', outputs are stripped.
Graded notebooks are run by the batch grader, so their verdicts are the trusted ones."""
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import browser_util
from flashlab.colab import badge, install_cell
from flashlab.grader.assign import assign
from flashlab import device
from flashlab.grader import isolation as iso
from flashlab.grader.batch import grade_all

ROOT = Path(__file__).resolve().parents[1]
LECTURES = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
ALL = LECTURES + SOLUTIONS + EXERCISES


def _run(path, tmp_path, timeout=600):
    """Execute a copy of the notebook here (the lectures: nothing is graded)."""
    nb = nbformat.read(path, as_version=4)
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        keep = os.environ.get("FLASHLAB_EXECUTED_DIR")   # to read a run's figures and numbers afterwards
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, Path(keep) / f"{path.parent.name}-{path.name}")


def _grades(path, tmp_path, timeout=600):
    """Grade the notebook as an instructor does (batch grading, in the sandbox where root): the
    verdicts are the grader's own, computed outside the notebook's process."""
    isolation = "auto" if os.geteuid() == 0 else "weak"      # weak: our own notebooks, trusted
    # On a GPU, as the README tells an instructor (--memory unlimited): CUDA reserves more address space than
    # the 4 GiB a process gets by default, and libtorch_cuda would not even load.
    limits = iso.Limits(memory=-1) if device.DEVICE.type == "cuda" else None
    rows = grade_all([path], tmp_path / "grades", timeout=timeout, progress=False, isolation=isolation,
                     limits=limits)
    assert len(rows) == 1, rows
    row = rows[0]
    assert row.status == "ok", f"{row.status}: {row.detail}"
    return [dict(g, exercise=name) for name, g in row.grades.items()]


def test_there_is_a_course():
    assert len(LECTURES) >= 4 and len(SOLUTIONS) >= 3 and len(EXERCISES) == len(SOLUTIONS)


@pytest.mark.notebook
@pytest.mark.parametrize("path", LECTURES, ids=lambda p: p.name)
def test_lecture_runs(path, tmp_path):
    if browser_util.missing() is None:   # executed once, in JupyterLab: tests/test_browser.py
        pytest.skip("executed in JupyterLab by tests/test_browser.py")
    _run(path, tmp_path)


@pytest.mark.notebook
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_passes(path, tmp_path):
    grades = _grades(path, tmp_path)
    assert grades, "the notebook graded nothing"
    assert all(g["status"] == "pass" for g in grades), grades


@pytest.mark.notebook
@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_exercise_runs_through_as_todo(path, tmp_path):
    grades = _grades(path, tmp_path)
    assert grades and all(g["status"] == "not implemented" for g in grades), grades


def test_exercises_are_generated_from_solutions():
    assert assign(ROOT / "solutions", ROOT / "exercises", check=True, log=lambda *_: None) == 0


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_outputs_stripped_and_colab_ready(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "outputs must be stripped in git"
    assert code[0].source == install_cell(), "first code cell must be flashlab.colab.install_cell()"
    rel = f"{path.parent.name}/{path.name}"
    assert badge(rel) in nb.cells[0].source, f"the first cell needs the Colab badge for {rel}"
    imports = [c.source for c in code if "import triton" in c.source or "import flashlab" in c.source]
    assert imports and "import flashlab" in imports[0].split("import triton")[0], "import flashlab before triton"
