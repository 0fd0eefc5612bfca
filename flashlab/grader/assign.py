"""Make the student notebooks: exercises/ is generated from solutions/, never edited by hand.

In a solution notebook's code cells, the lines between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` become

    # YOUR CODE HERE
    raise NotImplementedError

at the indentation of the BEGIN line.  Outputs are stripped.  Each generated
notebook records a fingerprint of what was generated, so a notebook a learner
has edited is never overwritten unless ``force=True``.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = ("# YOUR CODE HERE", "raise NotImplementedError")


def strip_solution(source: str) -> str:
    out, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError("nested ### BEGIN SOLUTION")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + s for s in STUB]
        elif stripped.startswith(END):
            if not inside:
                raise ValueError("### END SOLUTION without BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("### BEGIN SOLUTION without END")
    return "\n".join(out)


def _fingerprint(nb) -> str:
    return hashlib.sha256(json.dumps([c.source for c in nb.cells]).encode()).hexdigest()[:16]


def make_exercise(solution, links=None) -> nbformat.NotebookNode:
    """The student version of a solution notebook (a NotebookNode).

    ``links``: (old, new) text replaced in markdown cells, e.g. to point the Colab badge
    at exercises/ instead of solutions/.
    """
    nb = copy.deepcopy(solution)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and links:
            cell.source = cell.source.replace(*links)
        if cell.cell_type == "code":
            cell.source = strip_solution(cell.source)
            cell.outputs = []
            cell.execution_count = None
        cell.get("metadata", {}).pop("execution", None)
    nb.metadata.setdefault("flashlab", {})["generated"] = _fingerprint(nb)
    return nb


def is_edited(nb) -> bool:
    """True if a generated notebook's cells no longer match what was generated."""
    mark = nb.metadata.get("flashlab", {}).get("generated")
    return mark is None or mark != _fingerprint(nb)


def assign(solutions="solutions", exercises="exercises", check=False, force=False, log=print) -> int:
    """Generate (or with ``check``, verify) every exercise notebook. Returns a process exit code."""
    src, dst = Path(solutions), Path(exercises)
    paths = sorted(src.glob("*.ipynb"))
    if not paths:
        log(f"no notebooks in {src}/")
        return 1
    problems = 0
    expected = set()
    for path in paths:
        target = dst / path.name
        expected.add(target.name)
        want = make_exercise(nbformat.read(path, as_version=4),
                             links=(f"/{src.resolve().name}/{path.name}", f"/{dst.resolve().name}/{path.name}"))
        if check:
            if not target.exists():
                log(f"missing: {target} (run python -m flashlab assign)")
                problems += 1
            elif [c.source for c in nbformat.read(target, as_version=4).cells] != [c.source for c in want.cells]:
                log(f"out of date: {target} differs from {path} (run python -m flashlab assign)")
                problems += 1
            continue
        if target.exists() and not force:
            current = nbformat.read(target, as_version=4)
            if [c.source for c in current.cells] == [c.source for c in want.cells]:
                continue
            if is_edited(current):
                log(f"kept: {target} has been edited since it was generated; use --force to overwrite it")
                continue
        dst.mkdir(parents=True, exist_ok=True)
        nbformat.write(want, target)
        log(f"wrote {target}")
    if check:
        for extra in sorted(p.name for p in dst.glob("*.ipynb")) if dst.exists() else []:
            if extra not in expected:
                log(f"stray: {dst / extra} has no solution notebook")
                problems += 1
        log("exercises are up to date" if not problems else f"{problems} problem(s)")
    return 1 if problems else 0
