"""Grade a class: every submitted notebook runs isolated; the verdicts are the grader's own.

    python -m flashlab grade submissions/ --out grades/

How it works (the rules an instructor can rely on):

* This process never runs student code.  For each notebook it starts a sandbox
  (:mod:`flashlab.grader.isolation`) that executes the notebook with nbclient.
  When the notebook calls ``grade("name", fn)``, that call connects to this
  process (:mod:`flashlab.grader.protocol`), which draws the exercise's cases
  with a fresh random seed, sends each case's inputs, receives ``fn``'s outputs
  as plain arrays, and compares them with its own reference.  The verdict is
  computed here and never sent back; whatever the notebook prints, logs or
  patches inside its own process does not reach it, and a seed it passes is
  ignored.
* An exercise a notebook grades more than once: the last call counts.  An
  exercise it never grades: "missing".  A student with several notebooks grading
  the same exercise: the worst verdict counts, and the summary says so.
* A student is the first folder under the class folder (``class/alice/...``), or
  for a notebook directly in it, the file name without ``.ipynb``; or what the
  instructor's ``--student-pattern`` (a regular expression with a group
  ``student``) captures from the relative path.
* Inputs: regular files ending in ``.ipynb`` (any case) only; symbolic links,
  FIFOs and other special files are listed as skipped and never opened.
* Outputs (in ``--out``): ``results.jsonl`` gets one line per notebook as soon
  as it is graded (flushed and synced), ``grades.csv`` and ``summary.txt`` are
  rewritten atomically after each notebook.  No symbolic link is followed there.
  ``--resume`` keeps the lines of notebooks whose content hash has not changed.
  SIGINT and SIGTERM stop the running sandboxes, write the tables and exit with status 130;
  nothing graded while the run was being stopped is stored (``Interrupted`` is a BaseException:
  no ``except Exception`` on the way, parsing a notebook included, turns it into a verdict), so
  ``--resume`` grades it again.
* Student folders are opened one at a time by file descriptor (``openat`` with ``O_NOFOLLOW |
  O_DIRECTORY``), so a folder swapped for a link after the listing cannot redirect a read.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np

from . import isolation as iso
from . import protocol as P
from . import requirements as Rq
from .roster import (OutDir, Submission, check_notebook, discover, format_csv, format_summary, read_submission,
                     show, student_rows)

RESULTS, CSV_NAME, SUMMARY = "results.jsonl", "grades.csv", "summary.txt"
MAX_CALLS = 64                   # grade() calls served per notebook
MAX_EVENTS = 500                 # connections accepted per notebook
MAX_OUTPUT = 64 << 20            # bytes of arrays in one case's answer


# ----------------------------------------------------------------------------
# grading one notebook
# ----------------------------------------------------------------------------

class Interrupted(BaseException):
    """The run was stopped (SIGINT, SIGTERM): a BaseException, so that no ``except Exception`` on the
    way (reading, parsing, grading a notebook) turns it into a verdict."""


@dataclass
class Config:
    timeout: float = 600.0
    isolation: str = "auto"
    jobs: int = 1
    exercises: list | None = None          # only these exercises count (default: all)
    leaderboard: list | None = None        # shapes at which a passing kernel is timed (None: no timing)
    clean_run: bool = True                 # an exercise that passed is graded again from its code alone
    limits: iso.Limits = field(default_factory=iso.Limits)


def verdict_of(result) -> dict:
    if result.not_implemented:
        status = "not implemented"
    elif result.passed:
        status = "pass"
    elif any(c.status in ("error", "crash", "timeout") for c in result.cases):
        status = "error"
    else:
        status = "fail"
    v = {"status": status, "cases_passed": sum(c.passed for c in result.cases), "cases": len(result.cases)}
    first = result.first_failure()
    if first is not None and status != "not implemented":
        v["message"] = f"{first.label}: {first.message}"[:300]
        if result.incomplete and first.status != "not run":
            v["message"] = (f"incomplete: {result.incomplete[0]} of {result.incomplete[1]} cases ran; "
                            + v["message"])[:300]
    return v


class GpuTurns:
    """Who may use the GPU: the cases of any number of notebooks at once, or one leaderboard's timed window
    alone.  A window waits for the cases being run to end and holds new ones back until it is over (a
    notebook's own GPU work outside grade() is not seen: with --jobs 1 there is none beside a window)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._cases = 0
        self._window = False

    @contextmanager
    def case(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._window)
            self._cases += 1
        try:
            yield
        finally:
            with self._cond:
                self._cases -= 1
                self._cond.notify_all()

    @contextmanager
    def timed(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._window)
            self._window = True                  # from here new cases wait
            self._cond.wait_for(lambda: self._cases == 0)
        try:
            yield
        finally:
            with self._cond:
                self._window = False
                self._cond.notify_all()


class _Run:
    """The state of one notebook's run, filled by the connections it makes."""

    def __init__(self, deadline):
        self.deadline = deadline
        self.grades, self.calls, self.cell_errors, self.notes = {}, {}, [], []
        self.finished = None           # the runner's own account: (status, detail)
        self.connections = 0
        self.selftest = False          # the grader's own self-test notebook: its facts are read
        self.clean_of = None           # the exercises a clean run grades (flashlab.grader.clean), or None
        self.facts = None


class Grader:
    def __init__(self, cfg: Config):
        from ..grader.exercises import EXERCISES
        import flashlab
        self.cfg = cfg
        self.exercises = EXERCISES
        self.mode = iso.choose(cfg.isolation)
        self.pkg = os.path.dirname(os.path.realpath(flashlab.__file__))
        self.python = iso.interpreter()      # a venv's bin/python as named: with the venv's packages
        _remove_stale()
        self.work = tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-")
        os.chmod(self.work, 0o700)
        self.live = {}                 # pid -> Popen
        self._cgroups = {}             # private folder -> its cgroup folders
        self.cgroups = False
        if self.mode == "sandbox":      # can this machine cap a whole submission's memory and processes?
            probe = iso.make_cgroups(f"flashlab-{os.getpid()}-probe", cfg.limits)
            self.cgroups = len(probe) == 2
            iso.remove_cgroups(probe)
        self.lock = threading.Lock()
        self.turns = GpuTurns()
        self.stopping = False

    # -- the sandbox ----------------------------------------------------------
    def _env(self, home, ctl, slot):
        base = {"PATH": os.path.dirname(self.python) + ":/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                "HOME": home, "USER": "student", "LOGNAME": "student", "TMPDIR": "/tmp" if self.mode == "sandbox"
                else home, "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg",
                "JUPYTER_PATH": os.path.join(ctl, "jupyter"), "JUPYTER_CONFIG_DIR": os.path.join(home, ".jupyter"),
                "JUPYTER_DATA_DIR": os.path.join(home, ".jupyter", "data"),
                "JUPYTER_RUNTIME_DIR": os.path.join(home, ".jupyter", "runtime"),
                "IPYTHONDIR": os.path.join(home, ".ipython"), "MPLCONFIGDIR": os.path.join(home, ".matplotlib"),
                "TRITON_CACHE_DIR": os.path.join(home, ".triton"),
                "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, self.cfg.jobs))),
                "PYTHONPATH": iso.PKG if self.mode == "sandbox" else os.path.dirname(self.pkg),
                P.SOCKET_ENV: os.path.join(ctl, iso.SOCKET_NAME)}
        for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES"):
            if k in os.environ:
                base[k] = os.environ[k]
        return base

    def _prepare(self, slot, notebook_bytes, argv_tail):
        """A private folder with the control files; returns (folder, command, listener socket, log fd)."""
        import socket
        d = tempfile.mkdtemp(dir=self.work)
        ctl = os.path.join(d, "ctl")
        kdir = os.path.join(ctl, "jupyter", "kernels", iso.KERNEL_NAME)
        os.makedirs(kdir)
        for p in (ctl, os.path.join(ctl, "jupyter"), os.path.join(ctl, "jupyter", "kernels"), kdir):
            os.chmod(p, 0o755)
        if notebook_bytes is not None:
            with open(os.path.join(ctl, "submission.ipynb"), "wb") as f:
                f.write(notebook_bytes)
            os.chmod(os.path.join(ctl, "submission.ipynb"), 0o644)
        with open(os.path.join(kdir, "kernel.json"), "w") as f:
            json.dump({"argv": [self.python, "-s", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                       "display_name": "flashlab batch grading", "language": "python"}, f)
        os.chmod(os.path.join(kdir, "kernel.json"), 0o644)
        # weak mode: the listening socket in the control folder.  In a sandbox the sandbox makes it on its
        # own tmpfs and sends it back (isolation.Plan.listen_fd); the one here, outside the control folder,
        # is only what the grader listens on if that never comes (no sandbox can reach it)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        where = ctl if self.mode != "sandbox" else d
        listener.bind(os.path.join(where, iso.SOCKET_NAME))
        os.chmod(os.path.join(where, iso.SOCKET_NAME), 0o666)
        listener.listen(16)
        chan = None
        log = os.open(os.path.join(d, "log"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        if self.mode == "sandbox":
            home, ctl_in = iso.HOME, iso.CTL
            runner = [self.python, "-s", f"{iso.PKG}/flashlab/grader/runner.py"]
        else:
            home, ctl_in = os.path.join(d, "home"), ctl
            os.makedirs(home)
            runner = [self.python, "-s", os.path.join(self.pkg, "grader", "runner.py")]
        argv = runner + [a.replace("{ctl}", ctl_in) for a in argv_tail]
        env = self._env(home, ctl_in, slot)
        if self.mode == "sandbox":
            uid = iso.uid_for(slot)
            root = os.path.join(d, "root")
            os.makedirs(root)
            cgroups = iso.make_cgroups(f"flashlab-{os.getpid()}-{os.path.basename(d)}", self.cfg.limits) \
                if self.cgroups else []
            self._cgroups[d] = cgroups
            chan = socket.socketpair()
            plan = iso.Plan(root=root, ctl=ctl, pkg=self.pkg, python=self.python, trees=iso.python_trees(),
                            argv=argv, env=env, uid=uid, gid=uid, limits=asdict(self.cfg.limits),
                            devices=iso.gpu_devices(), cgroups=cgroups, listen_fd=chan[1].fileno())
            with open(os.path.join(d, "plan.json"), "w") as f:
                json.dump(asdict(plan), f)
            cmd, cwd = iso.sandbox_command(os.path.join(d, "plan.json")), d
        else:
            cmd, cwd = iso.weak_command(argv, self.cfg.limits), home
        return d, cmd, cwd, env, listener, log, chan

    def _spawn(self, cmd, cwd, env, log, pass_fds=()):
        proc = subprocess.Popen(cmd, cwd=cwd, env=env if self.mode == "weak" else {"PATH": "/usr/bin:/bin"},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                                start_new_session=True, pass_fds=tuple(pass_fds))
        with self.lock:
            self.live[proc.pid] = proc
        return proc

    def _kill(self, proc):
        """Kill the whole submission: its session here; in a sandbox, its PID namespace with it."""
        inner = _children(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:   # pragma: no cover
            pass
        end = time.monotonic() + 10
        while inner and time.monotonic() < end:      # the namespace's init goes last
            inner = [p for p in inner if os.path.exists(f"/proc/{p}")]
            if inner:
                time.sleep(0.05)
        with self.lock:
            self.live.pop(proc.pid, None)

    def describe(self) -> str:
        if self.mode == "weak":
            return "weak (student code ran as the instructor)"
        mem = f"{self.cfg.limits.memory >> 20} MiB" if self.cfg.limits.memory >= 0 else "unlimited memory"
        return ("sandbox (namespaces, unprivileged uid, " +
                (f"cgroup: {mem} and {self.cfg.limits.processes} processes per notebook)" if self.cgroups else
                 f"no writable cgroup: {mem} address space per process)"))

    def kill_all(self):
        with self.lock:
            procs = list(self.live.values())
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def selftest(self):
        """Before grading anything, grade one notebook of the grader's own, end to end, exactly as a
        student's runs: the interpreter this run uses (a virtual environment's, with its packages),
        the sandbox, the kernel, ``grade()`` over the socket.  Its one cell answers an exercise
        rightly and reports what it can reach; unless the verdict is "pass", the run ran to its end,
        and it ran unprivileged without write access to flashlab or the network, stop here (and, for the
        leaderboard, unless it could use the GPU)."""
        key = (self.mode, self.python, self.pkg, json.dumps(iso.python_trees()), _SELFTEST_CELL,
               json.dumps(asdict(self.cfg.limits)))
        if key in _SELFTESTS_PASSED:          # the same setup, already proven in this process
            return self._gpu_for_leaderboard(_SELFTESTS_PASSED[key])
        res = self._run_notebook(0, _selftest_notebook(), selftest=True)
        run, facts = res["run"], res["run"].facts
        verdict = run.grades.get(SELFTEST_EXERCISE, {}).get("status")
        if facts is None or verdict != "pass" or res["code"] != 0 or res["timed_out"]:
            told = (run.finished[1] if run.finished else "") or ""
            errors = "; ".join(f"cell {c}: {e}" for c, e in run.cell_errors[:3])
            lines = [l for l in (errors, told) if l] + res["log_tail"].strip().splitlines()[-8:]
            if "ModuleNotFoundError" in res["log_tail"] and os.environ.get("PYTHONPATH"):
                lines.append("(graded notebooks see the interpreter's own packages and flashlab, not this "
                             "PYTHONPATH: install what they need into the environment of " + self.python + ")")
            raise iso.IsolationError(
                f"the sandbox could not run Python and flashlab as an unprivileged user with {self.python} "
                f"(a one-cell notebook graded {verdict or 'nothing'}, exit status {res['code']}"
                + (", timed out" if res["timed_out"] else "") + "); its last output:\n  " + "\n  ".join(lines))
        problems = []
        if self.mode == "sandbox" and facts.get("uid") == 0:
            problems.append("it ran as root")
        if self.mode == "sandbox" and facts.get("flashlab_writable"):
            problems.append("it could write to flashlab")
        if self.mode == "sandbox" and facts.get("network"):
            problems.append("it could reach the network")
        if problems:
            raise iso.IsolationError("the sandbox is not isolated: " + ", ".join(problems))
        _SELFTESTS_PASSED[key] = facts
        return self._gpu_for_leaderboard(facts)

    def _gpu_for_leaderboard(self, facts: dict) -> dict:
        """With --leaderboard, the graded code must be able to use the GPU (checked on every run's self-test
        facts, also when they come from the cache of an earlier run without the leaderboard)."""
        if self.cfg.leaderboard and not facts.get("cuda"):
            raise iso.IsolationError("--leaderboard: the grader has a GPU but the code it grades cannot use it "
                                     f"({self.describe()}: CUDA is not available there"
                                     + (f": {facts['cuda_error']}" if facts.get("cuda_error") else "")
                                     + "), so there is nothing to time")
        return facts

    # -- one notebook ------------------------------------------------------------
    def grade(self, sub: Submission, slot: int) -> dict:
        """Grade one notebook; a failure of the grader itself on it is reported in its row, never raised."""
        try:
            return self._grade(sub, slot)
        except Interrupted:
            raise
        except Exception as e:
            if self.stopping:
                raise Interrupted() from None
            return {"student": sub.student, "notebook": sub.notebook, "sha256": "", "status": "crashed",
                    "detail": f"the grader failed on this notebook: {type(e).__name__}: {show(e)[:200]}",
                    "grades": {}, "notes": [], "seconds": 0.0}

    def _run_notebook(self, slot, data: bytes, selftest: bool = False, clean_of: set | None = None) -> dict:
        """Run ``data`` (a notebook) in a sandbox, serving its grade() calls until it ends."""
        start = time.monotonic()
        timeout = SELFTEST_TIMEOUT if selftest else self.cfg.timeout   # (a short --timeout is for students)
        d, cmd, cwd, env, listener, log, chan = self._prepare(
            slot, data, ["{ctl}/submission.ipynb", str(timeout), iso.KERNEL_NAME])
        run = _Run(start + timeout)
        run.selftest = selftest
        run.clean_of = clean_of
        proc = None
        try:
            try:
                proc = self._spawn(cmd, cwd, env, log, pass_fds=[chan[1].fileno()] if chan else [])
            finally:
                if chan:
                    chan[1].close()
            if chan:
                listener = _listener_from(chan[0], proc, run.deadline) or listener
            timed_out = self._serve(proc, listener, run)
            code = proc.poll()
            self._kill(proc)
            self._drain(listener, run)
        finally:
            if proc is not None and proc.poll() is None:
                self._kill(proc)
            listener.close()
            if chan:
                chan[0].close()
            os.close(log)
            log_tail = _tail(os.path.join(d, "log"), 2000)
            cgroups = self._cgroups.pop(d, [])
            hit_memory = iso.cgroup_hit_limit(cgroups)
            iso.remove_cgroups(cgroups)
            shutil.rmtree(d, ignore_errors=True)
        if self.stopping:
            raise Interrupted()
        return {"run": run, "code": code, "timed_out": timed_out, "hit_memory": hit_memory, "log_tail": log_tail,
                "start": start}

    def _grade(self, sub: Submission, slot: int) -> dict:
        rec = {"student": sub.student, "notebook": sub.notebook, "sha256": "", "status": "ok", "detail": "",
               "grades": {}, "notes": [], "seconds": 0.0}
        start = time.monotonic()
        try:
            data = read_submission(sub)
        except (OSError, ValueError) as e:
            rec.update(status="rejected", detail=f"cannot read: {getattr(e, 'strerror', None) or e}")
            return rec
        rec["sha256"] = hashlib.sha256(data).hexdigest()
        why = check_notebook(data)
        if self.stopping:                    # an interrupt while the notebook was read or parsed: no verdict
            raise Interrupted()
        if why:
            rec.update(status="rejected", detail=why)
            return rec
        res = self._run_notebook(slot, data)
        run, code, timed_out, hit_memory, log_tail = (res[k] for k in ("run", "code", "timed_out", "hit_memory",
                                                                        "log_tail"))
        rec["grades"] = run.grades
        passed = [n for n, v in run.grades.items() if v.get("status") == "pass" and self._clean_run_applies(n)]
        if passed:
            run.grades.update(self._clean_run(slot, data, passed, run.grades))
        if hit_memory:
            _note(run, f"reached the memory limit ({self.cfg.limits.memory >> 20} MiB for the whole notebook)")
        rec["notes"] = run.notes[:20]
        # the run's status: the clock is the grader's; the rest is the sandbox's own account (advisory)
        told = run.finished[1] if run.finished else ""
        if timed_out:
            rec["status"] = "timed out"
            rec["detail"] = f"still running after {self.cfg.timeout:.0f} s"
        elif code == 4:
            rec["status"], rec["detail"] = "timed out", told or "a cell ran too long"
        elif code != 0:
            rec["status"] = "crashed"
            why = {120: "the sandbox could not be built", 121: "the runner could not start"}.get(code)
            if code is not None and code > 128:
                why = why or f"killed by {_signame(code - 128)}"
            rec["detail"] = why or told or (f"the notebook's runner ended with status {code}: "
                                            + (_last_line(log_tail) or "no output"))
        if run.cell_errors:
            first = run.cell_errors[0]
            more = f" (+{len(run.cell_errors) - 1} more)" if len(run.cell_errors) > 1 else ""
            text = f"cell {first[0]}: {first[1]}{more}"
            if rec["status"] == "ok":
                rec["status"], rec["detail"] = "cell errors", text
            else:
                rec["detail"] += f"; {text}"
        rec["seconds"] = round(time.monotonic() - start, 1)
        return rec

    def _clean_run_applies(self, name: str) -> bool:
        return bool(self.cfg.clean_run and name in self.exercises)

    def _clean_run(self, slot, data: bytes, names: list, first: dict) -> dict:
        """The exercises that passed in the notebook, graded again from their code alone (flashlab.grader.clean):
        the function handed to each grade() and what it names, checked against clean.py's lists (a Triton
        exercise's, or a NumPy exercise's), then all of them in one fresh sandbox behind the grader's own
        imports.  Returns {exercise: the verdict that replaces the notebook's}."""
        from . import clean
        out, graded = {}, {}
        for name in names:
            mode = "kernel" if self.exercises[name].needs_triton else "numpy"
            try:
                parts, fn = clean.extract(data, name, mode)
            except clean.Refused as e:
                out[name] = {"status": "fail", "cases_passed": 0, "cases": first[name].get("cases", 0),
                             "message": f"not graded from its code alone: {e}"[:300], "clean_run": "refused"}
                continue
            except Exception as e:   # noqa: BLE001 - the notebook's text broke the extraction: never a pass
                out[name] = {"status": "error", "cases_passed": 0, "cases": first[name].get("cases", 0),
                             "message": f"the grader could not read the exercise's code ({type(e).__name__})",
                             "clean_run": "refused"}
                continue
            graded[name] = (parts, fn, mode)
        if not graded:
            return out
        try:
            source = clean.notebook(graded)
        except Exception as e:   # noqa: BLE001 - code too deep to write back out: never a pass
            return {**out, **{name: {"status": "error", "cases_passed": 0, "cases": first[name].get("cases", 0),
                                     "message": f"the grader could not write the exercise's code out "
                                                f"({type(e).__name__})", "clean_run": "refused"} for name in graded}}
        res = self._run_notebook(slot, source, clean_of=set(graded))
        run = res["run"]
        for name in graded:
            v = run.grades.get(name)
            if v is None:
                why = (run.cell_errors[0][1] if run.cell_errors else "timed out" if res["timed_out"]
                       else _last_line(res["log_tail"]) or f"status {res['code']}")
                out[name] = {"status": "error", "cases_passed": 0, "cases": first[name].get("cases", 0),
                             "message": f"the clean run of its code alone gave no verdict: {why}"[:300],
                             "clean_run": "no verdict"}
                continue
            v = dict(v, clean_run="graded")
            if v.get("status") != "pass":
                v["message"] = ("in the clean run of its code alone: " + v.get("message", "")
                                + (f" ({run.cell_errors[0][1]})" if run.cell_errors else ""))[:300]
            out[name] = v
        return out

    def _serve(self, proc, listener, run) -> bool:
        """Answer the sandbox's connections until it exits; True if it ran out of time."""
        import select
        while True:
            left = run.deadline - time.monotonic()
            if self.stopping:
                return False
            if left <= 0:
                return True
            ready, _, _ = select.select([listener], [], [], min(0.2, left))
            if ready:
                conn, _ = listener.accept()
                with conn:
                    self._handle(conn, run, serve=True)
            if proc.poll() is not None:
                return False

    def _drain(self, listener, run):
        """After the sandbox is gone: read the reports still waiting (no grading any more)."""
        listener.setblocking(False)
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, OSError):
                return
            with conn:
                self._handle(conn, run, serve=False)

    def _handle(self, conn, run, serve: bool):
        run.connections += 1
        if run.connections > MAX_EVENTS:
            if run.connections == MAX_EVENTS + 1:
                run.notes.append(f"more than {MAX_EVENTS} connections: the rest were ignored")
            return
        try:
            header, arrays = P.recv(conn, min(run.deadline, time.monotonic() + 10), max_total=1 << 20)
        except P.ProtocolError as e:
            _note(run, f"a connection broke the protocol ({e})")
            return
        op = header.get("op")
        if op == "event":
            kind = header.get("kind")
            if kind == "cell_error" and len(run.cell_errors) < 50:
                cell = header.get("cell")
                run.cell_errors.append((cell if type(cell) is int else "?", show(header.get("error", ""))[:300]))
            elif kind == "selftest" and run.selftest and run.facts is None:
                facts = header.get("facts")
                run.facts = facts if isinstance(facts, dict) else {}
            elif kind == "finished" and run.finished is None:
                status = header.get("status")
                if status in ("ok", "timed out", "crashed"):
                    run.finished = (status, show(header.get("detail", ""))[:300])
        elif op == "grade" and serve:
            self._grade_exercise(conn, header, run)
        elif op == "grade":
            _note(run, "a grade() call came after the notebook stopped: not graded")
        else:
            _note(run, f"unknown request {show(op)[:40]!r}")

    def _grade_exercise(self, conn, header, run):
        from . import core
        from .sandbox import Outcome
        name = header.get("exercise")
        total = sum(run.calls.values())
        if not isinstance(name, str) or name not in self.exercises:
            _note(run, f"grade() of an unknown exercise {show(name)[:60]!r}")
            _send_quiet(conn, {"op": "error", "message": "unknown exercise"})
            return
        if total >= MAX_CALLS:
            _note(run, f"more than {MAX_CALLS} grade() calls: the rest were not graded")
            _send_quiet(conn, {"op": "error", "message": "too many grade() calls"})
            return
        if self.cfg.exercises and name not in self.cfg.exercises and not run.selftest:
            _note(run, f"grade({name!r}) is not part of this assignment: ignored")
            _send_quiet(conn, {"op": "done", "note": "not part of this assignment"})
            return
        run.calls[name] = run.calls.get(name, 0) + 1
        ex = self.exercises[name]
        dead = []

        def remote(kind, case):
            if kind != "run":
                return Outcome("ok", None)          # the heatmap probe: not needed for a verdict
            if dead:
                return Outcome("error", error=dead[0])
            arrays = []
            served = tuple(ex.served(case)) if ex.served is not None else ()
            logs = {n: Rq.Recorder(n, np.asarray(case.inputs[n])) for n in served}
            try:
                inputs = P.pack({n: x for n, x in case.inputs.items() if n not in served}, arrays)
                with self.turns.case():          # (a timed window of the leaderboard waits for it to end)
                    P.send(conn, {"op": "case", "kind": "run", "params": case.params, "inputs": inputs,
                                  "served": {n: list(np.shape(case.inputs[n])) for n in served},
                                  "visible": case.visible, "large": case.large}, arrays,
                           timeout=max(1.0, run.deadline - time.monotonic()))
                    case_deadline = min(run.deadline, time.monotonic() + ex.timeout + 30)
                    while True:
                        reply, out_arrays = P.recv(conn, case_deadline, max_total=MAX_OUTPUT)
                        if reply.get("op") != "read":
                            break
                        _serve_read(conn, reply, out_arrays, case, logs)
                status = reply.get("status")
                if reply.get("op") != "outcome" or status not in ("ok", "error", "not implemented", "crash",
                                                                   "timeout"):
                    raise P.ProtocolError("not an outcome")
                value = P.unpack(reply.get("value"), out_arrays)
                if status == "ok" and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
                    raise P.ProtocolError("the outputs are not a dict of named arrays")
                if status == "ok" and ex.check is not None and served:
                    # the requirement, from the grader's own log of what it served; what the sandbox
                    # reported can only add to it (a notebook that hides a violation gains nothing)
                    own = list(ex.check(case, logs))
                    told = value.get("_violations")
                    told = [show(t)[:1000] for t in told if isinstance(t, str)] if isinstance(told, list) else []
                    value["_violations"] = own + [t for t in told if t not in own][:5]
                return Outcome(status, value if status == "ok" else None, show(reply.get("error", ""))[:4000])
            except P.PeerTimeout:
                dead.append("the notebook did not answer in time")
                return Outcome("timeout", error=dead[0])
            except (P.ProtocolError, OSError) as e:
                dead.append(f"the answer could not be collected ({e})")
                return Outcome("error", error=dead[0])

        try:
            verdict = verdict_of(core.grade(ex, None, seed=None, execute=remote))
        except Exception as e:     # a hostile output that breaks the comparison is an error, never a pass
            verdict = {"status": "error", "cases_passed": 0, "cases": 0,
                       "message": f"the grader could not check the outputs ({type(e).__name__})"}
        if (self.cfg.leaderboard and verdict["status"] == "pass" and ex.timing is not None and not dead
                and not run.selftest and ((run.clean_of and name in run.clean_of) or not self._clean_run_applies(name))):
            from .ranking import time_remote   # the clock and the checks are this process's
            verdict["timing"] = time_remote(conn, ex, self.cfg.leaderboard, run.deadline, self.turns)
            if verdict["timing"]["status"] in ("timed out", "crashed"):
                dead.append("the notebook stopped answering while it was timed")
        run.grades[name] = verdict           # the last call of an exercise counts
        if not dead:
            _send_quiet(conn, {"op": "done"})

    def close(self):
        self.kill_all()
        shutil.rmtree(self.work, ignore_errors=True)


def _listener_from(chan, proc, deadline):
    """The listening socket a sandbox made for the grader (isolation.Plan.listen_fd), or None if the sandbox
    ends, or sends something else, before it comes."""
    import select
    import socket
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([chan], [], [], 0.2)
        if not ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(chan, 16, 2)
        except OSError:
            return None
        for extra in fds[1:]:
            os.close(extra)
        if msg != b"L" or len(fds) != 1:
            if fds:
                os.close(fds[0])
            return None
        s = socket.socket(fileno=fds[0])
        if s.family != socket.AF_UNIX or s.type != socket.SOCK_STREAM:
            s.close()
            return None
        return s
    return None


WORK_PREFIX = "flashlab-batch-"
SELFTEST_EXERCISE = "online_softmax_update"
SELFTEST_TIMEOUT = 300.0
_SELFTESTS_PASSED: dict = {}      # setup -> facts: the self-test runs once per process and setup
_SELFTEST_CELL = """import json, os, socket, sys
import numpy as np
from flashlab.grader import grade, protocol as P
import flashlab
facts = {"uid": os.getuid(), "python": sys.executable, "prefix": sys.prefix, "flashlab": flashlab.__file__,
         "cuda": flashlab.device.DEVICE.type == "cuda"}
if not facts["cuda"]:
    try:
        import torch
        torch.cuda.init()
    except Exception as e:
        facts["cuda_error"] = f"{type(e).__name__}: {e}"[:400]
try:
    with open(flashlab.__file__, "a"):
        facts["flashlab_writable"] = True
except OSError:
    facts["flashlab_writable"] = False
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2).close()
    facts["network"] = True
except OSError:
    facts["network"] = False
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ[P.SOCKET_ENV])
P.send(s, {"op": "event", "kind": "selftest", "facts": facts})
s.close()
def update(m, l, x):
    m_new = np.maximum(m, x.max(1))
    return m_new, np.exp(m - m_new) * l + np.exp(x - m_new[:, None]).sum(1)
print(grade(%r, update))
""" % SELFTEST_EXERCISE


def _selftest_notebook() -> bytes:
    cell = {"cell_type": "code", "execution_count": None, "id": "selftest", "metadata": {}, "outputs": [],
            "source": _SELFTEST_CELL}
    return json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}).encode()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale():
    """What a grader killed with SIGKILL left behind (its work folder, its cgroups): removed once its
    process is gone."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        names = []
    for name in names:
        m = re.fullmatch(re.escape(WORK_PREFIX) + r"(\d+)-\w+", name)
        path = os.path.join(tmp, name)
        if m and not _pid_alive(int(m.group(1))) and os.path.isdir(path) and not os.path.islink(path) \
                and os.lstat(path).st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)
    for ctrl in ("memory", "pids"):
        base = iso._cgroup_v1_base(ctrl)
        if base is None:
            continue
        try:
            names = os.listdir(base)
        except OSError:
            continue
        stale = [os.path.join(base, n) for n in names
                 if (m := re.fullmatch(r"flashlab-(\d+)-\w+", n)) and not _pid_alive(int(m.group(1)))]
        iso.remove_cgroups(stale)


MAX_READS = 20000                 # read requests served per case
MAX_READ_ELEMENTS = 64            # elements served per case, as a multiple of the input's size


def _serve_read(conn, header, arrays, case, logs):
    """A served input's elements, sent on request and logged: the log is what the requirement is checked on."""
    name = header.get("name")
    rec = logs.get(name) if isinstance(name, str) else None
    if rec is None or len(arrays) != 1 or arrays[0].dtype != np.int64 or arrays[0].ndim != 1:
        raise P.ProtocolError("a read request for an input that is not served")
    idx = arrays[0]
    if idx.size and (idx.min() < 0 or idx.max() >= rec.size):
        raise P.ProtocolError("a read request out of the input's bounds")
    served = sum(e.size for ev in logs.values() for e in ev.events)
    if sum(len(r.events) for r in logs.values()) >= MAX_READS or served + idx.size > MAX_READ_ELEMENTS * max(
            1, sum(r.size for r in logs.values())):
        raise P.ProtocolError("too many read requests")
    idx = np.unique(idx)
    if idx.size:
        rec.events.append(idx)
    P.send(conn, {"op": "values"}, [np.asarray(case.inputs[name], dtype=np.float64).reshape(-1)[idx]], timeout=30)


def _note(run, text):
    if len(run.notes) < 50:
        run.notes.append(text)


def _send_quiet(conn, header):
    try:
        P.send(conn, header, timeout=5)
    except (OSError, P.ProtocolError):
        pass


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _children(pid: int) -> list:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _tail(path: str, n: int) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - n))
        return f.read(n).decode("utf-8", "replace")


def _last_line(text: str) -> str:
    lines = [l for l in (text or "").strip().splitlines() if l.strip()]
    return show(lines[-1])[:200] if lines else ""


# ----------------------------------------------------------------------------
# the whole class
# ----------------------------------------------------------------------------

def _load_results(out: OutDir) -> dict:
    done = {}
    for line in out.read(RESULTS).splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue                        # a line cut short by a kill
        if isinstance(r, dict) and {"student", "notebook", "sha256", "status", "grades"} <= set(r) \
                and not r.get("interrupted") and r["sha256"]:
            done[(r["notebook"], r["sha256"])] = r
    return done


def grade_all(paths, out_dir="grades", timeout: float = 600.0, progress: bool = True, *,
              isolation: str = "auto", jobs: int = 1, resume: bool = False, student_pattern=None,
              exercises=None, limits: iso.Limits | None = None, log=None, leaderboard: bool = False,
              leaderboard_shapes=None, clean_run: bool = True):
    """Grade every notebook under ``paths``; returns the student rows (also written to ``out_dir``).

    ``leaderboard``: also time every kernel that passes a timed exercise (on a GPU; see
    :mod:`flashlab.grader.ranking`) at ``leaderboard_shapes`` (default: every N and D of the
    protocol) and write ``leaderboard.csv`` and ``leaderboard.png``; on a CPU, grade and say that
    timing needs a GPU, writing no leaderboard.  ``clean_run``: an exercise that passed is graded again
    from its code alone (:mod:`flashlab.grader.clean`); off only to show what that stops (the tests)."""
    from tqdm.auto import tqdm
    from . import ranking as L
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cfg = Config(timeout=timeout, isolation=isolation, jobs=max(1, int(jobs)), exercises=exercises,
                 limits=limits or iso.Limits(), clean_run=clean_run)
    timing = leaderboard and L.gpu_available()
    if leaderboard and resume:
        raise ValueError("--leaderboard times every kernel and the references in one run: "
                         "it cannot be combined with --resume")
    if leaderboard and not timing:
        log(f"leaderboard: {L.GPU_NEEDED}. Grading only; no leaderboard is written.")
    if timing:
        cfg.leaderboard = list(leaderboard_shapes or L.shapes())
        if cfg.jobs > 1:
            log(f"leaderboard: with --jobs {cfg.jobs}, every timed window waits for the other notebooks' grade() "
                "cases and holds new ones back, but a notebook's own GPU work outside grade() (other cells) can "
                "run beside it: --jobs 1 for the fairest numbers")
    subs, skipped = discover(paths, student_pattern)
    out = OutDir(out_dir)
    grader = Grader(cfg)
    if grader.mode == "weak":
        log("WARNING: weak isolation: student code runs as you, can read and change your files and use the "
            "network, and a process it detaches can outlive the run. Grade untrusted notebooks as root "
            "(sandbox) or in a container per submission.")
    done = _load_results(out) if resume else {}
    records, todo = [], []
    for s in subs:
        try:
            key = (s.notebook, hashlib.sha256(read_submission(s)).hexdigest())
        except (OSError, ValueError):
            key = None
        if key in done:
            records.append(done[key])
        else:
            todo.append(s)
    out.open_append(RESULTS, fresh=not resume)
    header = (f"flashlab batch grading, {time.strftime('%Y-%m-%d %H:%M:%S')}; isolation: {grader.describe()}; "
              f"{len(subs)} notebooks ({len(subs) - len(todo)} kept from an earlier run), {len(skipped)} files skipped")
    lock = threading.Lock()

    def write_tables():
        rows = student_rows(records, exercises)
        out.replace(CSV_NAME, format_csv(rows, exercises))
        out.replace(SUMMARY, format_summary(rows, skipped, exercises, header))
        return rows

    def finish(rec):
        if grader.stopping:               # graded while the run was being interrupted: not a verdict to keep
            raise Interrupted()
        with lock:
            out.append_line(json.dumps(rec, ensure_ascii=True))
            records.append(rec)
            write_tables()

    previous = {}

    def on_signal(signum, frame):
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)     # a second Ctrl-C must not cut the clean-up short
        grader.stopping = True
        grader.kill_all()
        raise Interrupted()

    main = threading.current_thread() is threading.main_thread()
    if main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    bar = tqdm(total=len(todo), desc="grading", unit="notebook", disable=not progress, file=sys.stderr)
    interrupted = False
    try:
        if todo:
            grader.selftest()
        if cfg.jobs == 1:
            for s in todo:
                finish(grader.grade(s, 0))
                bar.update(1)
        else:
            free = list(range(cfg.jobs))
            with ThreadPoolExecutor(cfg.jobs) as pool:
                pending, queue = {}, list(todo)
                try:
                    while queue or pending:
                        while queue and free:
                            slot = free.pop()
                            pending[pool.submit(grader.grade, queue.pop(0), slot)] = slot
                        finished, _ = wait(list(pending), timeout=0.5, return_when=FIRST_COMPLETED)
                        for f in finished:
                            free.append(pending.pop(f))
                            finish(f.result())
                            bar.update(1)
                except BaseException:
                    grader.stopping = True
                    grader.kill_all()
                    raise
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
    finally:
        bar.close()
        if main:
            for sig, h in previous.items():
                signal.signal(sig, h)
        grader.close()
        rows = write_tables()
        out.close()
    if interrupted:
        log(f"interrupted: {len(records)} of {len(subs)} notebooks graded; "
            f"run again with --resume to finish")
        raise KeyboardInterrupt
    if leaderboard and not timing:
        log(f"leaderboard: not written ({L.GPU_NEEDED}); the grades are in {out.path}")
    elif timing:
        write_leaderboard(out_dir, rows, exercises, cfg.leaderboard, log, grader.describe())
    return rows


LEADERBOARD_CSV, LEADERBOARD_PNG = "leaderboard.csv", "leaderboard.png"


def write_leaderboard(out_dir, rows, exercises, shape_list, log, isolation: str = ""):
    """After grading, on a GPU: time the references, rank the class, write leaderboard.csv and .png
    (the figure's title names the GPU, the versions, the date and the isolation the kernels ran under)."""
    from . import ranking as L
    graded = {ex for r in rows for ex in r.grades}
    timed = [ex for ex in L.timed_exercises(exercises) if ex in graded or (exercises and ex in exercises)]
    if not timed:
        log("leaderboard: no notebook graded a timed exercise (" + ", ".join(L.timed_exercises()) + "): not written")
        return None
    board = L.class_leaderboard(rows, timed, shape_list, log=log)
    if isolation:
        board.note = "; ".join(x for x in (board.note, f"students' kernels timed in: {isolation.split(' (')[0]}") if x)
    out = OutDir(out_dir)
    try:
        out.replace(LEADERBOARD_CSV, board.csv())
        from ..viz.figures import _png
        out.replace(LEADERBOARD_PNG, _png(board.figure()))
    finally:
        out.close()
    log(repr(board))
    log(f"wrote {out.path}/{LEADERBOARD_CSV} and {out.path}/{LEADERBOARD_PNG}")
    return board
