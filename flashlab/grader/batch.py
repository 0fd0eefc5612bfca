"""Grade a class: run each submitted exercise notebook in its own process, collect a table.

    python -m flashlab grade submissions/ --out grades/

Each notebook is copied to a scratch folder (the submission is never modified)
and executed top to bottom by nbclient in a child process with a time limit.
Every ``grade(...)`` call inside it appends one JSON line to the file named by
``$FLASHLAB_GRADE_LOG``; the table is built from those lines.  A notebook that
hangs, kills its kernel or is not a notebook at all gets a row saying so, and
the others are still graded.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

LOG_ENV = "FLASHLAB_GRADE_LOG"


def log_result(result) -> None:
    """Called by grade(): record the result when running under batch grading."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    status = ("not implemented" if result.not_implemented else "pass" if result.passed else
              "error" if any(c.status in ("error", "crash", "timeout") for c in result.cases) else "fail")
    line = {"exercise": result.name, "status": status,
            "cases_passed": sum(c.passed for c in result.cases), "cases": len(result.cases)}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


@dataclass
class Row:
    student: str
    path: str
    status: str = "ok"                 # ok, timed out, kernel died, not a notebook, error
    detail: str = ""
    grades: dict = field(default_factory=dict)
    seconds: float = 0.0


def find_notebooks(paths) -> list:
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(x for x in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in x.parts)
        else:
            found.append(p)
    return found


def _student_name(path: Path, roots) -> str:
    for root in map(Path, roots):
        if root.is_dir():
            try:
                return str(path.relative_to(root).with_suffix(""))
            except ValueError:
                continue
    return path.stem


def grade_one(path: Path, timeout: float) -> Row:
    row = Row(path.stem, str(path))
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flashlab-grade-") as tmp:
        copy = Path(tmp) / path.name
        try:
            shutil.copyfile(path, copy)
        except OSError as e:
            row.status, row.detail = "unreadable", str(e)
            return row
        log = Path(tmp) / "grades.jsonl"
        env = dict(os.environ, **{LOG_ENV: str(log)})
        cmd = [sys.executable, "-m", "flashlab.grader.batch", str(copy), str(timeout)]
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout + 30)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            code = None
        if code is None:
            row.status, row.detail = "timed out", f"still running after {timeout:.0f} s"
        elif code == 3:
            row.status, row.detail = "not a notebook", _last_line(out)
        elif code == 4:
            row.status, row.detail = "timed out", _last_line(out)
        elif code == 5:
            row.status, row.detail = "kernel died", _last_line(out)
        elif code != 0:
            row.status, row.detail = "error", _last_line(out)
        if log.exists():
            for line in log.read_text().splitlines():
                try:
                    g = json.loads(line)
                except json.JSONDecodeError:
                    continue
                row.grades[g["exercise"]] = g  # the last grade() call of an exercise counts
    row.seconds = time.monotonic() - start
    return row


def _last_line(text: str) -> str:
    lines = [l for l in (text or "").strip().splitlines() if l.strip()]
    return lines[-1][:200] if lines else ""


def _execute(path: str, timeout: float) -> int:
    """Child process: run one notebook; exit 0 ok, 3 not a notebook, 4 timeout, 5 kernel died."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:
        print(f"cannot read the notebook: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
        return 3
    client = NotebookClient(nb, timeout=timeout, allow_errors=True, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(path)}})
    try:
        client.execute()
    except CellTimeoutError:
        print(f"a cell ran longer than {timeout:.0f} s")
        return 4
    except DeadKernelError as e:
        print(f"the kernel died: {str(e).splitlines()[0][:150]}")
        return 5
    return 0


def grade_all(paths, out_dir="grades", timeout: float = 600.0, progress: bool = True):
    from tqdm.auto import tqdm
    notebooks = find_notebooks(paths)
    rows = []
    for nb in tqdm(notebooks, desc="grading", unit="notebook", disable=not progress):
        row = grade_one(nb, timeout)
        row.student = _student_name(nb, paths)
        rows.append(row)
    write_table(rows, out_dir)
    return rows


def exercise_columns(rows) -> list:
    cols = []
    for r in rows:
        for name in r.grades:
            if name not in cols:
                cols.append(name)
    return cols


def write_table(rows, out_dir) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cols = exercise_columns(rows)
    with open(out / "grades.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", "notebook", "run"] + cols + ["passed", "detail"])
        for r in rows:
            w.writerow([r.student, r.path, r.status] + [r.grades.get(c, {}).get("status", "-") for c in cols]
                       + [sum(g["status"] == "pass" for g in r.grades.values()), r.detail])
    (out / "summary.txt").write_text(format_summary(rows))


def format_summary(rows) -> str:
    cols = exercise_columns(rows)
    short = {"pass": "pass", "fail": "FAIL", "not implemented": "todo", "error": "ERR", "-": "-"}
    w = max([len("student")] + [len(r.student) for r in rows])
    widths = [max(len(c), 5) for c in cols]
    lines = ["  ".join([f"{'student':<{w}}", f"{'run':<14}"] + [f"{c:<{cw}}" for c, cw in zip(cols, widths)])]
    for r in rows:
        cells = [f"{short.get(r.grades.get(c, {}).get('status', '-'), '?'):<{cw}}" for c, cw in zip(cols, widths)]
        lines.append("  ".join([f"{r.student:<{w}}", f"{r.status:<14}"] + cells))
    problems = [r for r in rows if r.status != "ok"]
    if problems:
        lines.append("")
        lines += [f"{r.student}: {r.status} ({r.detail})" for r in problems]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(_execute(sys.argv[1], float(sys.argv[2])))
