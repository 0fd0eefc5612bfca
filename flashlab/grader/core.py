"""The grading loop: run a candidate on each case, compare, explain, diagnose.

An :class:`Exercise` says how to make cases, how to call a candidate on one
(``run``), what the right answer is (``reference``), how to name an index in the
kernel's terms (``locate``) and which known bugs to try (``bugs``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import sandbox
from .report import NOT_RUN, WRONG_ALGORITHM, CaseResult, Result


@dataclass
class Case:
    params: dict                     # shown to the learner (shapes, flags, dtype)
    inputs: dict                     # the data (NumPy arrays or torch tensors)
    visible: bool = False
    large: bool = False              # logits large enough that exp overflows without the max
    precision: str = ""              # a case only 16-bit arithmetic fails: what to say when it fails

    def describe(self) -> str:
        p = self.params
        bits = []
        if "causal" in p:
            bits.append("causal" if p["causal"] else "non-causal")
        for key in ("B", "H", "R", "C", "N", "Nq", "Nk", "D", "p", "block_size", "block_q", "block_k"):
            if key in p:
                bits.append(f"{key}={p[key]}")
        if "dtype" in p:
            bits.append(p["dtype"])
        if self.large:
            bits.append("large logits")
        for key in ("rows", "check"):
            if key in p:
                bits.append(str(p[key]))
        return ", ".join(bits)


@dataclass
class Bug:
    """A known mistake: ``outputs(case)`` returns what a candidate with this bug returns
    (or a list of alternatives, e.g. one per block size; None where it does not apply)."""
    key: str
    title: str
    hint: str
    outputs: Callable
    nan_ok: bool = False             # may be named for an all-NaN output (only where the hint explains NaN)


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
    timeout: float = 120.0              # per case (seconds): past it the case is stopped, and grading too
    budget: float = 400.0               # the whole grade() call (seconds), well under a notebook cell's limit
    dtype: str | None = None            # the dtype every output must have (NumPy exercises: "float64")
    needs_triton: bool = False          # grade() says Triton is missing (and where to run) instead of failing
    notebook: str = ""                  # the notebook that asks for it ("05")
    requirements: tuple = ()            # what is checked beyond the values (sentences, for the docs and reports)
    served: Callable | None = None      # served(case) -> names of inputs batch grading serves on request
    check: Callable | None = None       # check(case, {name: Recorder}) -> violations, from the reads served
    timing: object | None = None        # how the leaderboard times a passing candidate (grader.ranking.Timing)
    module: str = ""                    # the registering module (set by the registry)
    hint: str = ""                      # said when nothing more specific applies (default: GENERIC_HINT)
    bugs_exact: bool = False            # a named bug's outputs are exact wherever it gives them (plain Python, float64
                                        # formulas): a failing case that is not its output shows a second mistake

    def __post_init__(self):
        if not self.module:
            import sys
            frame = sys._getframe(2)    # the module that declared it (through the dataclass __init__)
            self.module = frame.f_globals.get("__name__", "")


GENERIC_HINT = ("Compare your code with the equations above the exercise, line by line, on the failing case's "
                "sizes.")


def _errors(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got - ref|; inf where exactly one of them is not finite, 0 where neither is."""
    got = got.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(got - ref)
    fin_g, fin_r = np.isfinite(got), np.isfinite(ref)
    err = np.where(~fin_g & ~fin_r, 0.0, err)
    return np.where(fin_g != fin_r, np.inf, err)


def _check_types(ex: Exercise, out: dict, ref: dict):
    """Type and shape problems of the outputs, before any value is compared: (message, details) or None."""
    contract = list(out.get("_contract", []))
    if contract:
        return contract[0].split(":")[0], contract
    for name, r in ref.items():
        if name not in out or out[name] is None:
            return f"no `{name}` returned", [f"expected `{name}` with shape {r.shape}"]
        g = out[name]
        if not isinstance(g, np.ndarray):
            g = np.asarray(g)
        if np.iscomplexobj(g):
            return f"`{name}` is complex", [
                f"`{name}` has dtype {g.dtype}: attention and softmax are real, so a complex result means "
                f"something went wrong (np.sqrt or np.log of a negative number, or an np.fft/np.linalg call "
                f"that returns complex). Return real float64 values."]
        if g.dtype.kind not in "fiub":
            return f"`{name}` is not an array of numbers", [f"`{name}` has dtype {g.dtype}; expected {r.dtype}"]
        if g.shape != r.shape:
            return f"`{name}` has shape {g.shape}", [f"expected `{name}` with shape {r.shape}, got {g.shape}"]
        if ex.dtype is not None and g.dtype != np.dtype(ex.dtype):
            return f"`{name}` is {g.dtype}, not {ex.dtype}", [
                f"`{name}` has dtype {g.dtype}, but the inputs are {ex.dtype} and so must be the result. "
                f"{g.dtype} keeps about {_digits(g.dtype)} significant digits, so its values differ from the "
                f"answer by more than the tolerance even when the algorithm is right. Keep {ex.dtype} throughout "
                f"(no .astype(np.float32), no dtype=np.float32 when you allocate)."]
    return None


def _digits(dt) -> str:
    try:
        return str(np.finfo(dt).precision)
    except ValueError:
        return "no fractional"


def compare(ex: Exercise, case: Case, out: dict, ref: dict):
    """Returns (ok, message, details, max_err)."""
    details = []
    problem = _check_types(ex, out, ref)
    if problem is not None:
        return False, problem[0], problem[1], np.inf
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
                # the offsets hint needs whole heads right and whole heads wrong: a head with a few wrong
                # elements (a tail, a diagonal) is the same bug in every head, not an offset
                frac = bad.reshape(bad.shape[0], bad.shape[1], -1).mean(-1)
                per_bh = frac > 0
                if not per_bh.all() and (frac[per_bh] >= 0.5).all():
                    wrong = [tuple(int(x) for x in ix) for ix in np.argwhere(per_bh)]
                    right = [tuple(int(x) for x in ix) for ix in np.argwhere(~per_bh)]
                    lines.append(f"only some (batch, head) pairs are wrong: {wrong[:6]}; right: {right[:6]} "
                                 "-> check the batch/head offsets")
            details += lines
            if m > worst[0]:
                worst = (m, f"`{name}` max error {m:.2g}", "")
    violations = list(out.get("_violations", []))
    if violations:
        lines = ["Requirement not met: " + v for v in violations]
        msg = WRONG_ALGORITHM if not details else worst[1] + "; and a requirement is not met"
        return False, msg, lines + details, worst[0] if details else 0.0
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
        if g.shape != b.shape or np.iscomplexobj(g) or g.dtype.kind not in "fiub":
            return False
        if (_errors(g, b) > ex.tolerance(case, name, b)).any():
            return False
    return True


def _differs(ex: Exercise, case: Case, alt: dict, ref: dict) -> bool:
    return any(_errors(np.asarray(v), ref[k]).max() > ex.tolerance(case, k, ref[k]) for k, v in alt.items())


def _alternatives(bug: Bug, case: Case, ref: dict):
    try:
        alts = bug.outputs(case)
    except Exception:
        return []
    if alts is None:
        return []
    return [{k: v for k, v in a.items() if k in ref} for a in (alts if isinstance(alts, list) else [alts])
            if a is not None]


def diagnose(ex: Exercise, case: Case, out: dict, ref: dict, passed=()):
    """The first known bug whose output this candidate's output matches, or None.

    ``passed``: cases the candidate got right; a bug that would have got one of them wrong is
    not this candidate's (e.g. "no max subtraction" when the large-logit case passed)."""
    for bug in ex.bugs:
        for alt in _alternatives(bug, case, ref):
            if not bug.nan_ok and not all(np.isfinite(np.asarray(v)).any() for v in alt.values()):
                continue  # all-NaN outputs match too many mistakes to name one
            if _differs(ex, case, alt, ref) and _matches(out, alt, ex, case):
                if any(all(_differs(ex, c, a, ex.reference(c)) for a in _alternatives(bug, c, ex.reference(c)))
                       and _alternatives(bug, c, ex.reference(c)) for c in passed):
                    break
                return bug
    return None


def _contradicts(ex: Exercise, bug: Bug, case: Case, out: dict, ref: dict) -> bool:
    """Whether the bug says what its output on this case is (it may not: e.g. a dropout bug at p = 0) and the
    candidate's wrong output is not that: then the candidate has another mistake besides."""
    alts = _alternatives(bug, case, ref)
    return bool(alts) and not any(_differs(ex, case, a, ref) and _matches(out, a, ex, case) for a in alts)


def _explains(prop, results, cases) -> bool:
    """Whether a property of the cases (causal, ragged, large logits) explains the failures: every failing
    case has it, at least two thirds of the cases that have it fail, and at least two cases without it
    pass (two failing cases that happen to share a property are not evidence)."""
    failing = [c for r, c in zip(results, cases) if r.status == "fail"]
    if not failing or not all(prop(c) for c in failing):
        return False
    with_prop = [c for c in cases if prop(c)]
    passing_without = [c for r, c in zip(results, cases) if r.status == "pass" and not prop(c)]
    return 3 * len(failing) >= 2 * len(with_prop) and len(passing_without) >= 2


def symptom_hints(ex: Exercise, results, cases) -> list:
    """Hints from the pattern of failures, when no known bug matched; each only for the exercise's kind
    (a Triton kernel, NumPy code, or neither) and only on the evidence of enough cases."""
    hints = []
    failing = [(r, c) for r, c in zip(results, cases) if r.status == "fail"]
    if not failing:
        return hints
    kernel = ex.needs_triton
    numpy_code = ex.dtype is not None
    if not (kernel or numpy_code):
        return hints
    results = list(results)[:len(cases)]
    if _explains(lambda c: c.large, results, cases):
        hints.append("Only the cases with large logits fail: subtract the (running) row maximum "
                     "before exponentiating, or e^S overflows.")
    if _explains(lambda c: c.params.get("causal") is True, results, cases):
        tiles = any("block_q" in c.params for c in cases) or kernel
        hints.append("Only causal cases fail: query i may see keys j <= i (top-left aligned, also when Nq != Nk)"
                     + (", and a key tile may be skipped only when its first key comes after the query tile's "
                        "last query (compare positions, not tile numbers: the tiles have different sizes)."
                        if tiles else "."))
    if _explains(_is_ragged, results, cases):
        if kernel:
            hints.append("Only cases whose sizes are not multiples of the block size fail: "
                         "mask the tail (loads with other=0 and scores set to -inf past N).")
        elif any("block_q" in c.params or "block_size" in c.params for c in cases):
            hints.append("Only cases whose sizes are not multiples of the tile size fail: the last tile is "
                         "shorter. Slicing (x[:, j:j + b]) already stops at the end; use the slice's own length "
                         "(not the block size) for anything you allocate or index per tile.")
    nan_fail = any("NaN" in " ".join(r.details) for r, _ in failing)
    if nan_fail and kernel:
        hints.append("NaN appeared where the answer is finite. The grader surrounds every input with NaN, "
                     "so this usually means a load read past the end of a row block (mask loads with "
                     "offs < N, other=0) or used the wrong strides; it can also be 0/0, e.g. dividing by "
                     "alpha = 0 on the first tile.")
    elif nan_fail:
        hints.append("NaN appeared where the answer is finite. In NumPy that is 0/0 or inf − inf: a running sum "
                     "ℓ = 0 (a running max started at 0 instead of −inf, so that e^(S − m) underflows to 0 for a "
                     "row whose scores are all very negative), a division by α = e^(−inf) = 0, or −inf − (−inf).")
    if kernel and any("batch/head offsets" in " ".join(r.details) for r, _ in failing):
        hints.append("Some (batch, head) pairs are right and others wrong: each program must offset its "
                     "pointers by b * stride_b + h * stride_h, with b = program_id(1) // H and "
                     "h = program_id(1) % H.")
    return hints


def _is_ragged(case: Case) -> bool:
    p = case.params
    for n in (p.get("N"), p.get("Nq"), p.get("Nk")):
        if n is not None and n % 16:
            return True
    return False


def _not_run(result: Result, cases, first: int, hidden_no: int) -> None:
    """A row for each case from ``first`` on, which grading stopped before: the verdict is never a pass."""
    n_run = first
    for case in cases[first:]:
        if case.visible:
            label = "visible case"
        else:
            hidden_no += 1
            label = f"hidden case {hidden_no}"
        result.cases.append(CaseResult(label, case.describe(), NOT_RUN,
                                       f"not run (incomplete: {n_run} of {len(cases)} cases ran)"))


def _check_buffers(ex: Exercise, case: Case, out: dict) -> None:
    """The padded buffers' canaries, checked here on the buffers the run sent back (``_buffers``), against
    the layout this process makes for the case itself: writes around a buffer, unwritten output elements,
    modified inputs.  What the run reported of them stays and can only add."""
    from . import memory
    buffers = out.pop("_buffers", None)
    layout = memory.layout_of(ex.run, case)
    if layout:
        memory.merge_checks(out, *memory.check_returned(layout, buffers))


def local_executor(ex: Exercise, candidate, deadline: float | None = None):
    """How a candidate is run in the learner's own session: ``execute(kind, case) -> Outcome``
    with kind "run" (``ex.run``) or "probe" (``ex.probe``), in a forked child when the exercise
    asks for isolation, and always within ``ex.timeout`` seconds (and before ``deadline``, a
    ``time.monotonic()`` value).  Batch grading passes another executor, which runs the candidate
    in a sandboxed process and receives plain arrays back; the verdict below never changes with it."""
    def execute(kind: str, case: Case):
        fn = ex.run if kind == "run" else ex.probe
        job = lambda: fn(candidate, case)  # noqa: E731
        limit = ex.timeout
        if deadline is not None:
            limit = max(1.0, min(limit, deadline - time.monotonic()))
        return sandbox.call_isolated(job, limit) if ex.isolate else sandbox.call(job, limit)
    return execute


def grade(ex: Exercise, candidate=None, seed: int | None = None, *, execute=None) -> Result:
    """Grade ``candidate`` on freshly drawn cases.  The cases, the references, the comparison and
    the diagnosis are computed here; only ``execute(kind, case)`` runs the learner's code.

    Grading stops at the first case that times out, and before a case would start past
    ``ex.budget`` seconds."""
    start = time.monotonic()
    cases = ex.make_cases(np.random.default_rng(seed))
    result = Result(ex.name)
    execute = execute or local_executor(ex, candidate, deadline=start + ex.budget)

    hidden_no = 0
    failures, passed = [], []          # (case, out, ref) of the wrong answers; cases with right values
    malformed = 0                      # cases whose outputs broke the contract (type, shape, ...): no values to compare
    stopped, probed = None, False
    for n_case, case in enumerate(cases):
        if case.visible:
            label = "visible case"
        else:
            hidden_no += 1
            label = f"hidden case {hidden_no}"
        if time.monotonic() - start > ex.budget:
            stopped = (f"Grading stopped after {time.monotonic() - start:.0f} s, before {label} "
                       f"(incomplete: {n_case} of {len(cases)} cases ran): the cases together may take "
                       f"at most {ex.budget:.0f} s. Make your code faster and grade again.")
            _not_run(result, cases, n_case, hidden_no - (0 if case.visible else 1))
            break
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
            if ex.needs_triton and isinstance(out, dict):
                _check_buffers(ex, case, out)
            ref = ex.reference(case)
            ok, msg, details, max_err = compare(ex, case, out, ref)
            if ok or max_err == 0:          # the values are right (a requirement may still be missed)
                passed.append(case)
            if not ok:
                cr.status, cr.message, cr.details, cr.max_err = "fail", msg, details, max_err
                typed = _check_types(ex, out, ref) is None
                if typed and max_err > 0:
                    failures.append((case, out, ref))
                malformed += not typed
                if (ex.probe is not None and typed and not probed and not out.get("_stray") and max_err > 0):
                    probed = True
                    probe = execute("probe", case)
                    if probe.status == "ok" and probe.value is not None:
                        heat = probe.value[0]
                        if not np.isfinite(heat).all() or heat.max() > 1e-3:  # only when O itself is wrong
                            cr.heatmap, cr.heat_labels = probe.value
        result.cases.append(cr)
        if cr.status == "timeout":
            rest = len(cases) - n_case - 1
            _not_run(result, cases, n_case + 1, hidden_no)
            stopped = (f"Grading stopped at {label}, which ran past its time limit"
                       + (f" ({rest} more case(s) not run)" if rest else "") + ". "
                       + ("These NumPy cases take well under a second, so this is a hang: a loop that never ends "
                          "(a while loop whose condition never changes, a step of 0?)."
                          if ex.dtype is not None else
                          "Look for a loop that never ends in your kernel or host code, or a grid far larger "
                          "than the problem."))
            break
    diagnosed = None
    for failure in failures:  # the first failing case a known bug explains (some bugs show only on some cases)
        diagnosed = diagnose(ex, *failure, passed=passed)
        if diagnosed is not None:
            break
    plain = []                           # (result, case) of the cases not built for a precision rule
    for case_result, case in zip(result.cases, cases):   # a precision case names the rule it was built for
        said = getattr(case, "precision", "")
        if not said:
            plain.append((case_result, case))
        elif case_result.status == "fail" and said not in result.hints:
            result.hints.append(said)
    if diagnosed is not None:
        several, other = "", 0
        if ex.bugs_exact:   # cases failing otherwise (not as the bug would, broken contract, raising): two mistakes
            other = (sum(_contradicts(ex, diagnosed, *f) for f in failures) + malformed
                     + sum(c.status in ("error", "crash") for c in result.cases))
        if other:
            several = f" (one of possibly several: {other} failing case{'s fail' if other > 1 else ' fails'} otherwise)"
        result.hints.append(f"This looks like a known bug{several}, {diagnosed.title}: {diagnosed.hint}")
    elif plain:   # the symptoms of the other cases (a precision case's inf says nothing about masks or strides)
        result.hints += symptom_hints(ex, [r for r, _ in plain], [c for _, c in plain])
    if stopped:
        result.hints.insert(0, stopped)
    if any(c.status == "fail" and c.message == WRONG_ALGORITHM for c in result.cases) and diagnosed is None:
        result.hints.append("Where the values are right, what is missing is how they are computed: the lines "
                            "starting 'Requirement not met' say which requirement of the exercise your code misses.")
    if any(c.status == "crash" for c in result.cases):
        result.hints.append("The process running your kernel crashed: in the interpreter an unmasked or "
                            "mis-offset tl.store writes outside every buffer. Check each store's mask "
                            "(rows < N) and its pointer arithmetic.")
    errors = [c for c in result.cases if c.status == "error"]
    if errors and not result.hints:
        shown = any('File "' in d for c in errors for d in c.details)
        result.hints.append("Your code did not run to the end on some cases: fix the first error shown"
                            + (" (the lines above are from your code, the last one is where it failed)"
                               if shown else "") + " and grade again.")
    if failures and not result.hints:   # (a broken contract already says what is wrong: nothing to add)
        result.hints.append(ex.hint or GENERIC_HINT)
    return result
