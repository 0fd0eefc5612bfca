"""The grading loop: run a candidate on each case, compare, explain, diagnose.

An :class:`Exercise` says how to make cases, how to call a candidate on one
(``run``), what the right answer is (``reference``), how to name an index in the
kernel's terms (``locate``) and which known bugs to try (``bugs``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import sandbox
from .report import CaseResult, Result


@dataclass
class Case:
    params: dict                     # shown to the learner (shapes, flags, dtype)
    inputs: dict                     # the data (NumPy arrays or torch tensors)
    visible: bool = False
    large: bool = False              # logits large enough that exp overflows without the max

    def describe(self) -> str:
        p = self.params
        bits = []
        if "causal" in p:
            bits.append("causal" if p["causal"] else "non-causal")
        for key in ("B", "H", "R", "C", "N", "Nq", "Nk", "D", "block_size", "block_q", "block_k"):
            if key in p:
                bits.append(f"{key}={p[key]}")
        if "dtype" in p:
            bits.append(p["dtype"])
        if self.large:
            bits.append("large logits")
        return ", ".join(bits)


@dataclass
class Bug:
    """A known mistake: ``outputs(case)`` returns what a candidate with this bug returns
    (or a list of alternatives, e.g. one per block size; None where it does not apply)."""
    key: str
    title: str
    hint: str
    outputs: Callable


@dataclass
class Exercise:
    name: str
    contract: str
    make_cases: Callable[[np.random.Generator], list]
    run: Callable                       # run(candidate, case) -> dict name -> np.ndarray (+ "_stray")
    reference: Callable                 # reference(case) -> dict name -> np.ndarray (float64)
    tolerance: Callable                 # tolerance(case, out_name, ref_array) -> float
    locate: Callable                    # locate(case, out_name, index tuple) -> str
    bugs: list = field(default_factory=list)
    probe: Callable | None = None       # probe(candidate, case) -> (heatmap, labels) or None
    isolate: bool = False               # run in a forked child (Triton kernels in the interpreter)
    timeout: float = 120.0


def _errors(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got - ref|; inf where exactly one of them is not finite, 0 where neither is."""
    got = got.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(got - ref)
    fin_g, fin_r = np.isfinite(got), np.isfinite(ref)
    err = np.where(~fin_g & ~fin_r, 0.0, err)
    return np.where(fin_g != fin_r, np.inf, err)


def compare(ex: Exercise, case: Case, out: dict, ref: dict):
    """Returns (ok, message, details, max_err)."""
    details = []
    for stray in out.get("_stray", []):
        details.append(f"out-of-bounds write: {stray}. Mask your tl.store with the row bound "
                       f"(offs < N) and use the strides you are given.")
    if details:
        return False, "wrote out of bounds", details, np.inf
    worst = (0.0, "", "")
    for name, r in ref.items():
        if name not in out or out[name] is None:
            return False, f"no `{name}` returned", [f"expected `{name}` with shape {r.shape}"], np.inf
        g = np.asarray(out[name])
        if g.shape != r.shape:
            return False, f"`{name}` has shape {g.shape}", [f"expected `{name}` with shape {r.shape}, "
                                                           f"got {g.shape}"], np.inf
        unw = out.get("_unwritten", {}).get(name)
        if unw is not None and unw.any():
            idx = tuple(int(i) for i in np.argwhere(unw)[0])
            return False, f"`{name}` not written everywhere", [
                f"{int(unw.sum())} of {unw.size} elements of `{name}` were never written; "
                f"the first is {ex.locate(case, name, idx)}",
                "Check the grid covers every tile (cdiv(N, BLOCK)) and the store mask is not too strict."], np.inf
        tol = ex.tolerance(case, name, r)
        err = _errors(g, r)
        bad = err > tol
        if bad.any():
            idx = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape))
            m = float(err[idx])
            lines = [f"`{name}`: max error {m:.3g} (tolerance {tol:.2g}) at {ex.locate(case, name, idx)}: "
                     f"got {_fmt(g[idx])}, expected {_fmt(r[idx])}",
                     f"{bad.mean():.1%} of the elements of `{name}` are wrong"]
            nan_in = ~np.isfinite(g) & np.isfinite(r)
            if nan_in.any():
                lines.append(f"{int(nan_in.sum())} element(s) are NaN or inf where the answer is finite")
            if bad.ndim >= 3 and bad.shape[0] * bad.shape[1] > 1:
                per_bh = bad.reshape(bad.shape[0], bad.shape[1], -1).any(-1)
                if not per_bh.all():
                    wrong = [tuple(int(x) for x in ix) for ix in np.argwhere(per_bh)]
                    right = [tuple(int(x) for x in ix) for ix in np.argwhere(~per_bh)]
                    lines.append(f"only some (batch, head) pairs are wrong: {wrong[:6]}; right: {right[:6]} "
                                 "-> check the batch/head offsets")
            details += lines
            if m > worst[0]:
                worst = (m, f"`{name}` max error {m:.2g}", "")
    if details:
        return False, worst[1], details, worst[0]
    return True, "", [], 0.0


def _fmt(x) -> str:
    return f"{float(x):.6g}"


def _matches(out: dict, bug_out: dict, ex: Exercise, case: Case) -> bool:
    for name, b in bug_out.items():
        if name not in out or out[name] is None:
            return False
        g = np.asarray(out[name])
        if g.shape != b.shape:
            return False
        if (_errors(g, b) > ex.tolerance(case, name, b)).any():
            return False
    return True


def diagnose(ex: Exercise, case: Case, out: dict, ref: dict):
    """The first known bug whose output this candidate's output matches, or None."""
    for bug in ex.bugs:
        try:
            alts = bug.outputs(case)
        except Exception:
            continue
        if alts is None:
            continue
        for alt in (alts if isinstance(alts, list) else [alts]):
            if alt is None:
                continue
            alt = {k: v for k, v in alt.items() if k in ref}
            if not all(np.isfinite(np.asarray(v)).any() for v in alt.values()):
                continue  # all-NaN outputs match too many mistakes to name one
            differs = any(_errors(np.asarray(v), ref[k]).max() > ex.tolerance(case, k, ref[k])
                          for k, v in alt.items())
            if differs and _matches(out, alt, ex, case):
                return bug
    return None


def symptom_hints(ex: Exercise, results, cases) -> list:
    """Hints from the pattern of failures, when no known bug matched."""
    hints = []
    failing = [(r, c) for r, c in zip(results, cases) if r.status == "fail"]
    if not failing:
        return hints
    if any(c.large for _, c in failing) and all(c.large for _, c in failing):
        hints.append("Only the cases with large logits fail: subtract the (running) row maximum "
                     "before exponentiating, or e^S overflows.")
    causal_fail = {c.params.get("causal") for _, c in failing}
    if causal_fail == {True} and any(c.params.get("causal") is False for c in cases):
        hints.append("Only causal cases fail: query i may see keys j <= i (top-left aligned), "
                     "and tiles entirely above the diagonal must contribute nothing.")
    ragged = [c for _, c in failing if _is_ragged(c)]
    if ragged and len(ragged) == len(failing) and any(not _is_ragged(c) for c in cases):
        hints.append("Only cases whose sizes are not multiples of the block size fail: "
                     "mask the tail (loads with other=0 and scores set to -inf past N).")
    if any("NaN" in " ".join(r.details) for r, _ in failing) and _is_kernel(cases):
        hints.append("NaN appeared where the answer is finite. The grader surrounds every input with NaN, "
                     "so this usually means a load read past the end of a row block (mask loads with "
                     "offs < N, other=0) or used the wrong strides; it can also be 0/0, e.g. dividing by "
                     "alpha = 0 on the first tile.")
    if any("batch/head offsets" in " ".join(r.details) for r, _ in failing):
        hints.append("Some (batch, head) pairs are right and others wrong: each program must offset its "
                     "pointers by b * stride_b + h * stride_h, with b = program_id(1) // H and "
                     "h = program_id(1) % H.")
    return hints


def _is_kernel(cases) -> bool:
    return any("B" in c.params for c in cases)


def _is_ragged(case: Case) -> bool:
    p = case.params
    for n in (p.get("N"), p.get("Nq"), p.get("Nk")):
        if n is not None and n % 16:
            return True
    return False


def local_executor(ex: Exercise, candidate):
    """How a candidate is run in the learner's own session: ``execute(kind, case) -> Outcome``
    with kind "run" (``ex.run``) or "probe" (``ex.probe``), in a forked child when the exercise
    asks for isolation.  Batch grading passes another executor, which runs the candidate in a
    sandboxed process and receives plain arrays back; the verdict below never changes with it."""
    def execute(kind: str, case: Case):
        fn = ex.run if kind == "run" else ex.probe
        job = lambda: fn(candidate, case)  # noqa: E731
        return sandbox.call_isolated(job, ex.timeout) if ex.isolate else sandbox.call(job)
    return execute


def grade(ex: Exercise, candidate=None, seed: int | None = None, *, execute=None) -> Result:
    """Grade ``candidate`` on freshly drawn cases.  The cases, the references, the comparison and
    the diagnosis are computed here; only ``execute(kind, case)`` runs the learner's code."""
    cases = ex.make_cases(np.random.default_rng(seed))
    result = Result(ex.name)
    execute = execute or local_executor(ex, candidate)

    hidden_no = 0
    diagnosed = None
    for case in cases:
        if case.visible:
            label = "visible case"
        else:
            hidden_no += 1
            label = f"hidden case {hidden_no}"
        outcome = execute("run", case)
        cr = CaseResult(label, case.describe(), "pass")
        if outcome.status == "not implemented":
            result.cases = [CaseResult(label, case.describe(), "not implemented", "not implemented yet")]
            return result
        if outcome.status != "ok":
            cr.status = outcome.status
            cr.message = {"error": "raised an exception", "crash": "crashed", "timeout": "timed out"}[outcome.status]
            cr.details = outcome.error.splitlines()
        else:
            out = outcome.value
            ref = ex.reference(case)
            ok, msg, details, max_err = compare(ex, case, out, ref)
            if not ok:
                cr.status, cr.message, cr.details, cr.max_err = "fail", msg, details, max_err
                if diagnosed is None:
                    diagnosed = diagnose(ex, case, out, ref)
                if ex.probe is not None and result.first_failure() is None and not out.get("_stray"):
                    probe = execute("probe", case)
                    if probe.status == "ok" and probe.value is not None:
                        heat = probe.value[0]
                        if not np.isfinite(heat).all() or heat.max() > 1e-3:  # only when O itself is wrong
                            cr.heatmap, cr.heat_labels = probe.value
        result.cases.append(cr)
    if diagnosed is not None:
        result.hints.append(f"This looks like a known bug, {diagnosed.title}: {diagnosed.hint}")
    else:
        result.hints += symptom_hints(ex, result.cases, cases)
    if any(c.status == "crash" for c in result.cases):
        result.hints.append("The process running your kernel crashed: in the interpreter an unmasked or "
                            "mis-offset tl.store writes outside every buffer. Check each store's mask "
                            "(rows < N) and its pointer arithmetic.")
    if any(c.status in ("error", "timeout") for c in result.cases) and not result.hints:
        result.hints.append("Your code did not run to the end on some cases: fix the first error shown "
                            "(the traceback points at your line) and grade again.")
    if not result.passed and not result.hints:
        result.hints.append("Compare your code with the equations above the exercise, line by line, "
                            "on the failing case's sizes.")
    return result
