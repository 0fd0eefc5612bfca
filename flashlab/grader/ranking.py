"""The class leaderboard: how fast each kernel that passed its exercise runs, beside the references.

    python -m flashlab grade submissions/ --out grades/ --leaderboard       # the instructor, on a GPU
    from flashlab.grader import leaderboard
    leaderboard(name, my_kernel)                 # a learner, in a notebook: name as in grade(name, ...)

What is timed, and what the numbers rest on:

* **Only a kernel whose exercise passed is timed**, and under batch grading only right after the
  grader computed that pass, over the same connection as the ``grade()`` call, in the same sandbox
  (the notebook's own process).  A kernel that is fast because it is wrong never ranks: it failed
  its grade.  The exercises timed are those declared with a ``timing`` (``flash_forward``,
  ``flash_backward``).
* **Shapes** (the course's protocol): 16k tokens (B = 16384 / N), hidden 2048 (H = 2048 / D), fp16,
  N in ``SEQLENS``, D in ``DIMS``, causal both ways.
* **The clock is the grader's.**  For each shape the grader sends a fresh random seed and a number of
  calls; the sandbox draws that many distinct sets of inputs (and output buffers) from the seed, runs
  the candidate once untimed (compilation, autotuning), says "ready" and waits.  The grader starts its
  clock as it sends "go"; the sandbox runs the candidate on every set back to back, then sends one
  checksum per output of every call: the sum of the output times a ±1 tensor drawn from the seed,
  which needs the whole output (there is no cheaper way to it than computing the attention).  The
  clock stops when the checksums arrive.  The grader draws the same inputs itself, computes the same
  checksums of its own reference outputs (flashlab's op) and compares: a checksum off by more than
  the tolerance marks the kernel "wrong at a timed shape", and it never ranks.  The time per call is
  (elapsed − the grader's own time to compute those checksums, at most half of it) / calls; the
  grader times its checksums in the window's turn, just before the clock starts (the fastest of two).
* So a notebook cannot claim a time: it can only be slow (the clock includes one socket round trip
  per shape, against windows of several milliseconds).  The window has the GPU alone as far as the
  grader can see to it (``batch.GpuTurns``: other notebooks' grade() cases wait for it).  It could run the work in another way than its
  kernel (PyTorch's attention, say) — the grader checks answers, not authorship, as for the verdict.
* **The references** (flashlab's op, SDPA's FlashAttention and cuDNN backends) are timed in the
  grader's own process by the same routine, in the same run, after the class was graded.
* **On a CPU** nothing is timed: the interpreter's times would measure NumPy, not a kernel.  Grading
  runs as usual; no leaderboard file is written, and the command says why.
"""
from __future__ import annotations

import csv
import io
import math
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

SEQLENS = (1024, 4096, 16384)
DIMS = (64, 128)
TOKENS, HIDDEN = 16384, 2048
TARGET_FLOPS = 8e12            # work per timed window (~20 ms at 400 TFLOP/s): the round trip is noise
MIN_CALLS, MAX_CALLS = 2, 16   # distinct input sets per window (MAX_CALLS bounds the memory: 8 GiB backward)
SETUP_LIMIT = 300.0            # seconds for the sandbox to draw the inputs and run the untimed call
WINDOW_LIMIT = 60.0            # seconds for the timed calls and the checksums
REFERENCES = ("flashlab", "sdpa-flash", "sdpa-cudnn")
REFERENCE_LABELS = {"flashlab": "flashlab (op)", "sdpa-flash": "SDPA flash", "sdpa-cudnn": "SDPA cuDNN"}
GPU_NEEDED = ("timing needs a CUDA GPU: on this machine kernels run in Triton's interpreter, whose times "
              "measure NumPy, not a kernel")


# ----------------------------------------------------------------------------
# shapes
# ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    N: int
    D: int
    causal: bool
    dtype: str = "fp16"

    @property
    def B(self) -> int:
        return max(1, TOKENS // self.N)

    @property
    def H(self) -> int:
        return max(1, HIDDEN // self.D)

    @property
    def label(self) -> str:
        return f"N={self.N} D={self.D}" + (" causal" if self.causal else "")

    def flops(self, mode: str) -> float:
        """The course's FLOP count: 4·B·H·N²·D, half of it causal, 2.5x for the backward."""
        f = 4.0 * self.B * self.H * self.N * self.N * self.D * (0.5 if self.causal else 1.0)
        return f * (2.5 if mode == "bwd" else 1.0)

    def calls(self, mode: str) -> int:
        """Distinct input sets in one timed window: about TARGET_FLOPS of work."""
        return int(min(MAX_CALLS, max(MIN_CALLS, math.ceil(TARGET_FLOPS / self.flops(mode)))))

    def as_dict(self) -> dict:
        return {"N": self.N, "D": self.D, "causal": self.causal, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d) -> "Shape":
        if not isinstance(d, dict):
            raise ValueError("a shape is a dict")
        n, dim, causal, dtype = d.get("N"), d.get("D"), d.get("causal"), d.get("dtype", "fp16")
        if type(n) is not int or type(dim) is not int or type(causal) is not bool or dtype not in _DTYPE_NAMES:
            raise ValueError(f"bad shape {str(d)[:80]}")
        if not (1 <= n <= 1 << 17 and dim in (16, 32, 64, 128)):
            raise ValueError(f"shape out of range {str(d)[:80]}")
        return cls(n, dim, causal, dtype)


_DTYPE_NAMES = ("fp16", "bf16")


def shapes(seqlens=SEQLENS, dims=DIMS) -> list:
    """The timed shapes: every N and D, non-causal then causal."""
    return [Shape(int(n), int(d), c) for d in dims for n in seqlens for c in (False, True)]


_DEVICE = "cuda"               # where the timed tensors live (tests put the machinery on the CPU)


def _sync():
    import torch
    if _DEVICE == "cuda":
        torch.cuda.synchronize()


def _free():
    import torch
    if _DEVICE == "cuda":
        torch.cuda.empty_cache()


def gpu_available() -> bool:
    from .. import device
    return device.DEVICE.type == "cuda"


# ----------------------------------------------------------------------------
# what is timed, per exercise (an Exercise's ``timing``)
# ----------------------------------------------------------------------------

def _torch_dtype(shape):
    import torch
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]


def _randn(gen, shape, names):
    import torch
    size = (shape.B, shape.H, shape.N, shape.D)
    return {n: torch.randn(size, device=_DEVICE, dtype=_torch_dtype(shape), generator=gen) for n in names}


def _generator(seed: int):
    import torch
    return torch.Generator(device=_DEVICE).manual_seed(int(seed) % (1 << 62))


class Timing:
    """How an exercise's candidate is timed: the inputs it gets, how it is called, what is checked.
    ``mode`` is "fwd" or "bwd" (the FLOP count); ``outputs`` the candidate's checked outputs and
    ``reference_outputs`` a reference provider's (``f(q, k, v, causal) -> o`` as in flashlab.bench)."""
    mode = "fwd"
    outputs: tuple = ()
    reference_outputs: tuple = ()
    tolerance = {"o": 2e-2, "lse": 1e-4, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}   # of the reference's 2-norm

    def inputs(self, shape, seed, i) -> dict:
        raise NotImplementedError

    def run(self, fn, s) -> dict:
        raise NotImplementedError

    def reference(self, s, causal) -> dict:
        """The trusted outputs (flashlab's op) on a set of inputs."""
        raise NotImplementedError

    def prepare_provider(self, provider, s, causal) -> None:
        """Untimed work before a reference provider's timed call (the backward's forward)."""

    def run_provider(self, provider, s, causal) -> dict:
        raise NotImplementedError


class ForwardTiming(Timing):
    """flash_forward: f(q, k, v, o, lse, causal) into the set's own o and lse."""
    mode = "fwd"
    outputs = ("o", "lse")
    reference_outputs = ("o",)

    def inputs(self, shape, seed, i):
        import torch
        s = _randn(_generator(seed + i), shape, ("q", "k", "v"))
        s["o"] = torch.empty_like(s["q"])
        s["lse"] = torch.empty(s["q"].shape[:3], device=_DEVICE, dtype=torch.float32)
        return s

    def run(self, fn, s):
        fn(s["q"], s["k"], s["v"], s["o"], s["lse"], s["causal"])
        return {"o": s["o"], "lse": s["lse"]}

    def reference(self, s, causal):
        import torch
        from ..attention import flash_attention
        with torch.no_grad():
            o, lse = flash_attention(s["q"], s["k"], s["v"], causal, return_lse=True)
        return {"o": o, "lse": lse}

    def run_provider(self, provider, s, causal):
        return {"o": provider(s["q"], s["k"], s["v"], causal)}


class BackwardTiming(Timing):
    """flash_backward: f(q, k, v, o, lse, do, dq, dk, dv, causal); O and the LSE from flashlab's op
    (drawn before the clock starts, on both sides)."""
    mode = "bwd"
    outputs = ("dq", "dk", "dv")
    reference_outputs = ("dq", "dk", "dv")

    def inputs(self, shape, seed, i):
        import torch
        from ..attention import flash_attention
        s = _randn(_generator(seed + i), shape, ("q", "k", "v", "do"))
        with torch.no_grad():
            s["o"], s["lse"] = flash_attention(s["q"], s["k"], s["v"], shape.causal, return_lse=True)
        for n in ("dq", "dk", "dv"):
            s[n] = torch.empty_like(s["q"])
        return s

    def run(self, fn, s):
        fn(s["q"], s["k"], s["v"], s["o"], s["lse"], s["do"], s["dq"], s["dk"], s["dv"], s["causal"])
        return {n: s[n] for n in self.outputs}

    def reference(self, s, causal):
        import torch
        from ..attention import flash_attention
        q, k, v = (s[n].detach().requires_grad_() for n in "qkv")
        grads = torch.autograd.grad(flash_attention(q, k, v, causal), (q, k, v), s["do"])
        return dict(zip(("dq", "dk", "dv"), grads))

    def prepare_provider(self, provider, s, causal):
        s["_leaves"] = tuple(s[n].detach().requires_grad_() for n in "qkv")
        s["_out"] = provider(*s["_leaves"], causal)

    def run_provider(self, provider, s, causal):
        import torch
        grads = torch.autograd.grad(s["_out"], s["_leaves"], s["do"], retain_graph=True)
        return dict(zip(("dq", "dk", "dv"), grads))


FORWARD = ForwardTiming()
BACKWARD = BackwardTiming()


# ----------------------------------------------------------------------------
# one timed window (the same routine in the sandbox, for the references and in a notebook)
# ----------------------------------------------------------------------------

def _weights(shape, seed, names, like: dict) -> dict:
    """The ±1 tensors the checksums multiply by, drawn from the seed (both sides draw the same)."""
    import torch
    gen = _generator(seed ^ 0x5EED)
    out = {}
    for n in names:
        t = like[n]
        w = torch.randint(0, 2, t.shape, device=_DEVICE, generator=gen, dtype=torch.int8)
        out[n] = (w.to(t.dtype) * 2 - 1)
    return out


def checksums(outs: list, weights: dict, names) -> list:
    """[[sum(out[name] * w[name]) for name in names] for out in outs], as floats (the GPU is synchronised)."""
    import torch
    sums = [torch.stack([torch.sum(o[n] * weights[n], dtype=torch.float32) for n in names]) for o in outs]
    return torch.stack(sums).double().cpu().tolist() if sums else []


class Window:
    """``calls`` distinct sets of inputs for one shape and the call to time on them; ``warm()`` runs it
    once untimed, ``run()`` runs it on every set back to back and returns the checksums."""

    def __init__(self, timing: Timing, shape: Shape, seed: int, calls: int, call, names, prepare=None):
        self.timing, self.shape, self.call, self.names = timing, shape, call, tuple(names)
        self.sets = []
        for i in range(calls):
            s = timing.inputs(shape, seed, i)
            s["causal"] = shape.causal
            if prepare is not None:
                prepare(s)
            self.sets.append(s)
        self.weights = None
        self._seed = seed

    def warm(self):
        import torch
        out = self.call(self.sets[0])
        _sync()
        self.weights = _weights(self.shape, self._seed, self.names, out)

    def run(self) -> list:
        outs = [self.call(s) for s in self.sets]
        return checksums(outs, self.weights, self.names)

    def close(self):
        self.sets = []
        self.weights = None
        _free()


@dataclass
class Expected:
    """The grader's side of one window: the reference checksums, their scales, and how long computing
    the checksums takes here (subtracted from the clock).  With ``keep``, :func:`expected` leaves the
    reference outputs here until :meth:`measure` times their checksums (in the timed window's turn: the
    GPU alone, as the sandbox's are timed)."""
    sums: list
    norms: list
    checksum_seconds: float = 0.0
    refs: list | None = None
    weights: dict | None = None

    def measure(self, repeats: int = 2) -> float:
        """Time the checksums of the kept outputs, the fastest of ``repeats`` runs (other work on the machine
        only ever adds time), then let the outputs go."""
        if self.refs is not None:
            names = list(self.weights)
            best = math.inf
            for _ in range(repeats):
                _sync()
                t0 = time.perf_counter()
                checksums(self.refs, self.weights, names)
                best = min(best, time.perf_counter() - t0)
            self.checksum_seconds = best
        self.release()
        return self.checksum_seconds

    def release(self) -> None:
        if self.refs is not None:
            self.refs = self.weights = None
            _free()


def expected(timing: Timing, shape: Shape, seed: int, calls: int, names, keep: bool = False) -> Expected:
    """Draw the same inputs as the sandbox, compute the reference outputs and their checksums, and time the
    checksums exactly as the sandbox computes them (every output at once, one synchronisation): here, or,
    with ``keep``, when the caller calls :meth:`Expected.measure`."""
    import torch
    refs = []
    for i in range(calls):
        s = timing.inputs(shape, seed, i)
        refs.append({n: v for n, v in timing.reference(s, shape.causal).items() if n in names})
        del s
    weights = _weights(shape, seed, names, refs[0])
    sums = checksums(refs, weights, names)
    norms = [[float(torch.linalg.vector_norm(r[n].float()).item()) for n in names] for r in refs]
    exp = Expected(sums, norms, 0.0, refs, weights)
    if not keep:
        exp.measure()
    return exp


def _row(shape, calls) -> dict:
    return {**shape.as_dict(), "B": shape.B, "H": shape.H, "calls": calls, "ms": None, "tflops": None}


def judge(timing: Timing, shape: Shape, names, exp: Expected, got, elapsed: float, calls: int) -> dict:
    """One shape's result from the checksums that came back and the grader's clock."""
    row = _row(shape, calls)
    try:
        got = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        got = None
    if got is None or got.shape != (calls, len(names)):
        return dict(row, status="error", detail="the checksums did not come back whole")
    for i in range(calls):
        for j, n in enumerate(names):
            err = abs(got[i, j] - exp.sums[i][j])
            allowed = timing.tolerance[n] * max(exp.norms[i][j], 1e-30)
            if not err <= allowed:              # NaN fails too
                return dict(row, status="wrong",
                            detail=f"`{n}` is wrong at {shape.label} (call {i + 1} of {calls}: checksum off by "
                                   f"{err / max(exp.norms[i][j], 1e-30):.2g} of its norm, allowed "
                                   f"{timing.tolerance[n]:.0e})")
    # the grader's checksum time is subtracted, at most half the window (a kernel is never free)
    seconds = (elapsed - min(exp.checksum_seconds, 0.5 * elapsed)) / calls
    return dict(row, status="ok", detail="", ms=seconds * 1e3,
                tflops=shape.flops(timing.mode) / seconds / 1e12)


# ----------------------------------------------------------------------------
# the sandbox's side (inside protocol.serve_cases) and the grader's side (batch.Grader)
# ----------------------------------------------------------------------------

def serve_timing(sock, ex, candidate, header) -> None:
    """In the sandbox: draw the inputs the grader asked for, run ``candidate`` once, say "ready",
    wait for "go", run it on every set and send the checksums.  What happens here is the sandbox's
    own account; the grader keeps the clock and checks every checksum."""
    from . import protocol as P
    window = None
    try:
        shape = Shape.from_dict(header.get("shape"))
        seed, calls = int(header["seed"]), int(header["calls"])
        if not 1 <= calls <= MAX_CALLS:
            raise ValueError("bad number of calls")
        timing = ex.timing
        window = Window(timing, shape, seed, calls, lambda s: timing.run(candidate, s), timing.outputs)
        window.warm()
    except Exception as e:
        if window is not None:
            window.close()
        P.send(sock, {"op": "timing", "status": "error", "error": f"{type(e).__name__}: {e}"[:2000]})
        return
    try:
        P.send(sock, {"op": "ready"})
        go, _ = P.recv(sock, time.monotonic() + SETUP_LIMIT + WINDOW_LIMIT)
        if go.get("op") != "go":
            return
        try:
            sums = window.run()
            reply = {"op": "timing", "status": "ok", "sums": sums}
        except Exception as e:
            reply = {"op": "timing", "status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
        P.send(sock, reply)
    finally:
        window.close()


def time_remote(conn, ex, shape_list, deadline: float, turns=None) -> dict:
    """In the grader: time a passing candidate over its grade() connection, shape by shape.  Returns
    {"status": "ok" | "wrong" | "error" | "timed out" | "crashed", "detail", "shapes": [...]}; it stops
    at the first shape that is not "ok".  ``turns`` (batch.GpuTurns): the GPU work before the clock (the
    grader's references, the sandbox's inputs and untimed call) shares the GPU like a grade() case; the
    timed window has it alone."""
    from contextlib import nullcontext

    from . import protocol as P
    from .roster import show
    shared = turns.case if turns is not None else nullcontext
    alone = turns.timed if turns is not None else nullcontext
    timing = ex.timing
    rows = []
    for shape in shape_list:
        calls = shape.calls(timing.mode)
        seed = secrets.randbits(48)
        base = _row(shape, calls)
        try:
            with shared():
                try:
                    exp = expected(timing, shape, seed, calls, timing.outputs, keep=True)
                except Exception as e:   # the grader's own reference failed (out of memory, say): not the student's
                    rows.append(dict(base, status="error",
                                     detail=f"the grader's reference failed: {type(e).__name__}: {e}"[:300]))
                    break
                P.send(conn, {"op": "time", "shape": shape.as_dict(), "seed": seed, "calls": calls},
                       timeout=max(1.0, deadline - time.monotonic()))
                ready, _ = P.recv(conn, min(deadline, time.monotonic() + SETUP_LIMIT))
            if ready.get("op") != "ready":
                exp.release()
                rows.append(dict(base, status="error",
                                 detail="the kernel failed before the clock started: "
                                        + show(ready.get("error", ready.get("op")))[:300]))
                break
            with alone():
                # the grader's checksum time, subtracted from the clock, measured with the GPU as alone as the
                # window's (measured beside other notebooks' cases it came out long: kernels up to 2x too fast)
                exp.measure()
                t0 = time.perf_counter()
                P.send(conn, {"op": "go"}, timeout=10)
                reply, _ = P.recv(conn, min(deadline, time.monotonic() + WINDOW_LIMIT))
                elapsed = time.perf_counter() - t0
        except P.PeerTimeout:
            rows.append(dict(base, status="timed out", detail=f"no answer in time at {shape.label}"))
            break
        except (P.ProtocolError, OSError) as e:
            rows.append(dict(base, status="crashed", detail=f"the notebook stopped answering at {shape.label} ({e})"))
            break
        if reply.get("op") != "timing" or reply.get("status") != "ok":
            rows.append(dict(base, status="error",
                             detail=f"the kernel failed at {shape.label}: " + show(reply.get("error", ""))[:300]))
            break
        row = judge(timing, shape, timing.outputs, exp, reply.get("sums"), elapsed, calls)
        rows.append(row)
        if row["status"] != "ok":
            break
    return _result(rows)


def _result(rows) -> dict:
    """A timing result: the first shape that is not "ok" decides its status."""
    bad = [r for r in rows if r["status"] != "ok"]
    return {"status": bad[0]["status"] if bad else "ok", "detail": bad[0]["detail"] if bad else "", "shapes": rows}


def time_local(ex, call, shape_list, names=None, prepare=None, log=None) -> dict:
    """Time ``call(set) -> outputs`` in this process (the references; a learner's own kernel), checked
    the same way; returns the same structure as :func:`time_remote`."""
    timing = ex.timing
    names = tuple(names or timing.outputs)
    rows = []
    for shape in shape_list:
        calls = shape.calls(timing.mode)
        seed = secrets.randbits(48)
        base = _row(shape, calls)
        window = None
        try:
            exp = expected(timing, shape, seed, calls, names)
            window = Window(timing, shape, seed, calls, call, names, prepare)
            window.warm()
            _sync()
            t0 = time.perf_counter()
            sums = window.run()
            elapsed = time.perf_counter() - t0
            row = judge(timing, shape, names, exp, sums, elapsed, calls)
        except Exception as e:
            row = dict(base, status="error", detail=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        finally:
            if window is not None:
                window.close()
        rows.append(row)
        if log:
            log(f"  {shape.label}: " + (f"{row['tflops']:.0f} TFLOP/s" if row["status"] == "ok" else row["status"]))
        if row["status"] != "ok":
            break
    return _result(rows)


def time_references(exercise: str, shape_list, providers=REFERENCES, log=None) -> dict:
    """{label: timing result} for the reference providers on an exercise's shapes (this process, a GPU)."""
    from .. import bench
    from .exercises import EXERCISES
    ex = EXERCISES[exercise]
    timing = ex.timing
    out = {}
    for name in providers:
        fn = bench.provider_fn(name)
        if log:
            log(f"timing {REFERENCE_LABELS.get(name, name)} ({exercise})")
        out[REFERENCE_LABELS.get(name, name)] = time_local(
            ex, lambda s, fn=fn: timing.run_provider(fn, s, s["causal"]), shape_list,
            names=timing.reference_outputs, prepare=lambda s, fn=fn: timing.prepare_provider(fn, s, s["causal"]),
            log=log)
    return out


# ----------------------------------------------------------------------------
# the table: entries, ranking, CSV
# ----------------------------------------------------------------------------

RANKED, TIMED = "ranked", "timed"
# statuses of an entry that does not rank, in the order they are listed after the ranked ones
UNRANKED_ORDER = ("wrong at a timed shape", "timing failed", "timed out", "crashed", "failed", "error",
                  "not implemented", "rejected", "missing", "not timed")


@dataclass
class Entry:
    """One line of the leaderboard: a student (or the learner) or a reference, for one exercise."""
    exercise: str
    name: str
    kind: str = "student"                 # "student" or "reference"
    status: str = TIMED                   # TIMED until ranked; otherwise why it does not rank
    detail: str = ""
    tflops: dict = field(default_factory=dict)   # shape label -> TFLOP/s
    rank: int | None = None

    def score(self, labels) -> float | None:
        """Geometric mean TFLOP/s over ``labels``; None unless every one was timed."""
        vals = [self.tflops.get(l) for l in labels]
        if not vals or any(v is None or not v > 0 for v in vals):
            return None
        return float(math.exp(sum(math.log(v) for v in vals) / len(vals)))


def entry_from_timing(exercise, name, timing: dict | None, kind="student") -> Entry:
    """An Entry from a timing result (time_remote / time_local); a passing kernel without one is "not timed"."""
    e = Entry(exercise, name, kind)
    if not timing:
        e.status, e.detail = "not timed", "passed; no timing was recorded"
        return e
    for r in timing.get("shapes", []):
        if r.get("status") == "ok" and isinstance(r.get("tflops"), (int, float)):
            e.tflops[Shape.from_dict(r).label] = float(r["tflops"])
    st = timing.get("status")
    if st != "ok":                       # numbers of a kernel that did not finish are not shown
        e.tflops = {}
        e.status = {"wrong": "wrong at a timed shape", "timed out": "timed out", "crashed": "crashed"}.get(
            st, "timing failed")
        e.detail = str(timing.get("detail", ""))
    return e


def entries_from_rows(rows, exercises) -> list:
    """Entries for the students of a graded class (roster.StudentRow), per timed exercise: the verdict that
    counts is the student's (the worst of their notebooks), so a student who failed anywhere never ranks."""
    out = []
    for ex in exercises:
        for r in rows:
            v = r.grades.get(ex)
            status = v.get("status") if v else "missing"
            if status == "pass":
                out.append(entry_from_timing(ex, r.student, v.get("timing")))
                continue
            e = Entry(ex, r.student)
            e.status = {"fail": "failed", "error": "error"}.get(status, status)
            if status in ("fail", "error", "missing") and r.status in ("timed out", "crashed", "rejected"):
                e.status = r.status           # the notebook's fate explains the verdict best
            e.detail = (v or {}).get("message", "") or r.detail
            out.append(e)
    return out


def rank(entries, shape_labels: dict) -> list:
    """Rank the students of each exercise by their geometric-mean TFLOP/s over that exercise's shapes
    (``shape_labels``: exercise -> labels); only a kernel timed at every shape ranks.  Returns the entries
    ordered per exercise: ranked students, references (best first), then the others by UNRANKED_ORDER."""
    ordered = []
    for ex in dict.fromkeys(e.exercise for e in entries):
        labels = shape_labels.get(ex, [])
        mine = [e for e in entries if e.exercise == ex]
        timed = []
        for e in mine:
            if e.kind == "student" and e.status in (TIMED, RANKED):
                if e.score(labels) is None:
                    missing = [l for l in labels if l not in e.tflops]
                    e.status, e.rank = "timing failed", None
                    e.detail = e.detail or f"not timed at {', '.join(missing) or 'every shape'}"
                    e.tflops = {}
                else:
                    timed.append(e)
        timed.sort(key=lambda e: (-e.score(labels), e.name))
        for i, e in enumerate(timed, 1):
            e.status, e.rank = RANKED, i
        refs = sorted((e for e in mine if e.kind == "reference"),
                      key=lambda e: -(e.score(labels) or 0.0))
        rest = [e for e in mine if e.kind == "student" and e.status != RANKED]
        rest.sort(key=lambda e: (UNRANKED_ORDER.index(e.status) if e.status in UNRANKED_ORDER
                                 else len(UNRANKED_ORDER), e.name))
        ordered += timed + refs + rest
    return ordered


CSV_HEAD = ["exercise", "rank", "name", "kind", "status", "tflops_geomean"]


def format_csv(entries, shape_labels: dict) -> str:
    """leaderboard.csv: one row per (exercise, name), ranked; a column of TFLOP/s per shape (empty where not
    timed), the geometric mean, and why an entry does not rank."""
    from .roster import csv_cell
    labels = list(dict.fromkeys(l for ex in shape_labels for l in shape_labels[ex]))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_HEAD + [f"tflops {l}" for l in labels] + ["detail"])
    for e in entries:
        score = e.score(shape_labels.get(e.exercise, []))
        w.writerow([e.exercise, e.rank if e.rank is not None else "", csv_cell(e.name), e.kind, e.status,
                    f"{score:.1f}" if score is not None else ""]
                   + [f"{e.tflops[l]:.1f}" if l in e.tflops else "" for l in labels]
                   + [csv_cell(e.detail)])
    return buf.getvalue()


def format_text(entries, shape_labels: dict) -> str:
    """The leaderboard as a short text table (what the command prints last)."""
    from .roster import show
    lines = []
    for ex in dict.fromkeys(e.exercise for e in entries):
        labels = shape_labels.get(ex, [])
        lines.append(f"{ex}: geometric mean TFLOP/s over {len(labels)} shapes (fp16, 16k tokens)")
        for e in (x for x in entries if x.exercise == ex):
            score = e.score(labels)
            num = f"{score:8.1f}" if score is not None and (e.status == RANKED or e.kind == "reference") else " " * 8
            tag = f"{e.rank:>3}" if e.rank is not None else ("ref" if e.kind == "reference" else "  -")
            why = "" if e.status in (RANKED, TIMED) else f"  {e.status}" + (f": {show(e.detail)[:90]}" if e.detail else "")
            lines.append(f"  {tag}  {show(e.name)[:24]:<24}{num}{why}")
    return "\n".join(lines)


@dataclass
class Leaderboard:
    """A ranked table (``entries``), the shapes of each exercise, and where it was measured."""
    entries: list
    shape_labels: dict
    note: str = ""

    def csv(self) -> str:
        return format_csv(self.entries, self.shape_labels)

    def figure(self):
        from ..viz.figures import fig_leaderboard
        return fig_leaderboard(self)

    def __repr__(self) -> str:
        text = format_text(self.entries, self.shape_labels)
        return (self.note + "\n" + text) if self.note else text


def build(student_entries, references: dict, shape_labels: dict, note: str = "") -> Leaderboard:
    """A ranked Leaderboard from the students' entries and {exercise: {label: timing result}} of the references."""
    entries = list(student_entries)
    for ex, refs in references.items():
        for label, res in refs.items():
            e = entry_from_timing(ex, label, res, kind="reference")
            entries.append(e)
    return Leaderboard(rank(entries, shape_labels), shape_labels, note)


def device_note() -> str:
    import torch
    from .. import device
    if device.DEVICE.type != "cuda":
        return ""
    import triton
    return (f"{torch.cuda.get_device_name()} (torch {torch.__version__}, triton {triton.__version__}), "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


# ----------------------------------------------------------------------------
# a learner's leaderboard (in a notebook) and the class's (after batch grading)
# ----------------------------------------------------------------------------

def leaderboard(exercise: str, candidate, *, seqlens=SEQLENS, dims=DIMS, name: str = "your kernel",
                references=REFERENCES, verbose: bool = True) -> Leaderboard:
    """Grade ``candidate`` for ``exercise`` (``flash_forward`` or ``flash_backward``) and, if it passes and
    this machine has a GPU, time it beside flashlab's op and SDPA's backends on the leaderboard's shapes,
    each checked against flashlab's op on the very inputs it was timed on.  Returns a Leaderboard: print
    it, ``.figure()`` draws it, ``.csv()`` is the table.  On a CPU nothing is graded or timed: it says
    that timing needs a GPU (``grade()`` checks the kernel there)."""
    from . import grade
    from .exercises import EXERCISES
    if exercise not in EXERCISES or EXERCISES[exercise].timing is None:
        timed = [n for n, e in EXERCISES.items() if e.timing is not None]
        raise ValueError(f"leaderboard({exercise!r}, ...): the timed exercises are {', '.join(timed)}")
    ex = EXERCISES[exercise]
    log = print if verbose else None
    shape_list = shapes(seqlens, dims)
    labels = {exercise: [s.label for s in shape_list]}
    if not gpu_available():                            # said first: grading in the interpreter takes a while
        e = Entry(exercise, name, status="not timed", detail=GPU_NEEDED)
        return Leaderboard([e], labels, GPU_NEEDED + "; nothing was timed (grade() checks the kernel here)")
    result = grade(exercise, candidate)
    if getattr(result, "passed", None) is None:       # under batch grading: the grader times it
        return Leaderboard([], labels, "under batch grading the grader times this kernel (--leaderboard)")
    if not result.passed:
        e = Entry(exercise, name, status="failed", detail="it did not pass its grade: fix it first (grade() says how)")
        return Leaderboard([e], labels, "")
    if log:
        log(f"timing {name} on {len(shape_list)} shapes")
    mine = time_local(ex, lambda s: ex.timing.run(candidate, s), shape_list, log=log)
    refs = time_references(exercise, shape_list, references, log=log)
    return build([entry_from_timing(exercise, name, mine)], {exercise: refs}, labels, device_note())


def class_leaderboard(rows, exercises, shape_list, log=None) -> Leaderboard:
    """After batch grading, on a GPU: the students' entries plus the references timed now."""
    labels = {ex: [s.label for s in shape_list] for ex in exercises}
    refs = {ex: time_references(ex, shape_list, log=log) for ex in exercises}
    return build(entries_from_rows(rows, exercises), refs, labels, device_note())


def timed_exercises(exercises=None) -> list:
    """The exercises a leaderboard covers: those with a ``timing`` (among ``exercises`` if given)."""
    from .exercises import EXERCISES
    return [n for n, e in EXERCISES.items() if e.timing is not None and (not exercises or n in exercises)]
