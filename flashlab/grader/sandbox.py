"""Run a piece of a learner's code in a forked child, so that a crash becomes a report.

In Triton's interpreter an out-of-bounds store writes into the Python heap; the
process dies later with a segmentation fault or "double free or corruption".
Forking keeps the notebook's state (the candidate function, its kernels) in the
child without pickling them; whatever the child does, the parent survives.

Only used on the CPU: a CUDA context cannot be used in a forked child, and on a
GPU an out-of-bounds access raises a CUDA error instead of corrupting the heap.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

CAN_FORK = hasattr(os, "fork")


@dataclass
class Outcome:
    status: str                 # "ok", "error", "not implemented", "crash", "timeout"
    value: Any = None
    error: str = ""             # short traceback, or what killed the child


def short_traceback(exc: BaseException, skip_dirs=()) -> str:
    """The learner's frames only (not the grader's), and the exception line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not any(d in (f.filename or "") for d in skip_dirs)]
    lines = traceback.format_list(frames[-3:])
    return ("".join(lines) + "".join(traceback.format_exception_only(type(exc), exc))).rstrip()


def _skip_dirs():
    """Frames from these places are not the learner's: the grader, Triton's and torch's internals."""
    here = os.path.dirname(os.path.abspath(__file__))
    return (here, os.sep + "triton" + os.sep, os.sep + "torch" + os.sep)


class _TimeLimit(BaseException):
    """Raised inside a candidate that ran past its time limit (a BaseException: a learner's
    ``except Exception`` does not swallow it)."""


def _can_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def _alarm(seconds):
    """Raise _TimeLimit in this (main) thread after ``seconds``, and every second after that."""
    if not seconds:
        yield
        return

    def ring(signum, frame):
        raise _TimeLimit()

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3), 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def timeout_message(seconds: float) -> str:
    return (f"did not finish in {seconds:.0f} s: an endless loop (a bound that never changes?), "
            f"or far more work than the case needs")


def call(fn: Callable[[], Any], timeout: float | None = None) -> Outcome:
    """Run ``fn`` here, turning exceptions into an Outcome; never raises.

    ``timeout`` (seconds): in the main thread a timer interrupts ``fn`` (between Python
    bytecodes, or in a sleep); elsewhere ``fn`` runs in a forked child that is killed at
    the limit (or without a limit, where neither is possible)."""
    if timeout and not _can_alarm() and CAN_FORK:
        return call_isolated(fn, timeout)
    try:
        with _alarm(timeout if _can_alarm() else None):
            return Outcome("ok", fn())
    except _TimeLimit:
        return Outcome("timeout", error=timeout_message(timeout))
    except NotImplementedError:
        return Outcome("not implemented")
    except (SystemExit, KeyboardInterrupt) as e:   # a learner's exit() or an interrupt: report, never propagate
        what = type(e).__name__ + (f"({e.code!r})" if isinstance(e, SystemExit) and e.code is not None else "")
        return Outcome("error", error=f"your code raised {what}"
                       + (" (exit() / sys.exit() stops the program: return a value instead)"
                          if isinstance(e, SystemExit) else " (grading was interrupted)"))
    except Exception as e:  # the learner's bug: report it, never raise
        return Outcome("error", error=short_traceback(e, _skip_dirs()))
    except BaseException as e:  # anything else a candidate can raise (GeneratorExit, ...)
        return Outcome("error", error=f"your code raised {type(e).__name__}: {e}")


def call_isolated(fn: Callable[[], Any], timeout: float = 120.0) -> Outcome:
    """Run ``fn`` in a forked child and return its Outcome; never raises, never dies."""
    if not CAN_FORK:
        return call(fn)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            import faulthandler
            import warnings
            faulthandler.disable()          # a crash here is expected and reported; no dump to stderr
            warnings.simplefilter("ignore")  # the interpreter's RuntimeWarnings (overflow in exp, ...) would
            import numpy as np               # print around the report; what went wrong is in the report itself
            np.seterr(all="ignore")
            import torch
            torch.set_num_threads(1)
            out = call(fn)
            data = pickle.dumps(out)
        except BaseException as e:  # pragma: no cover - pickling trouble
            data = pickle.dumps(Outcome("error", error=f"could not send the result back: {e!r}"))
            code = 1
        try:
            view = memoryview(data)
            while view:
                n = os.write(w, view)
                view = view[n:]
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline, timed_out = [], time.monotonic() + timeout, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            continue
        chunk = os.read(r, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return Outcome("timeout", error=timeout_message(timeout))
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return Outcome("crash", error=f"the process running your code was killed by {name}: "
                                      "almost always an out-of-bounds store (a tl.store without a mask, "
                                      "or with wrong offsets) that corrupted memory")
    try:
        return pickle.loads(b"".join(chunks))
    except Exception:
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        return Outcome("crash", error=f"the process running your code exited (status {code}) "
                                      "without a result: memory corruption from an out-of-bounds store?")
