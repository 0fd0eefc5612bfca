"""Graded exercises: ``grade(name, candidate)`` checks a learner's function and says what is wrong.

    >>> from flashlab.grader import grade, exercises
    >>> exercises()                          # name -> contract
    >>> grade("online_softmax", my_online_softmax)

The result shows ✅/❌ per case (one visible case, the rest hidden and freshly
drawn), and for the first failure: the largest error and where it is, the
fraction of wrong elements, a heatmap over tiles, and a hint.  A candidate that
raises is reported, never re-raised; a stub that raises NotImplementedError shows
"not implemented yet", so "Run All" goes through.

Under batch grading (``python -m flashlab grade``), the call instead hands the
function to the instructor's grader, which sends it freshly drawn cases and
computes the verdict itself (see :mod:`flashlab.grader.batch`); ``seed`` is then
ignored and the call returns a receipt, not a verdict.

``leaderboard(name, fn)`` grades ``fn`` for a timed kernel exercise and, on a GPU, times it beside
flashlab's op and SDPA's backends (:mod:`flashlab.grader.ranking`; the class's: ``python -m flashlab grade --leaderboard``).
"""
from __future__ import annotations

import os

from .core import grade as _grade
from .exercises import EXERCISES
from .ranking import leaderboard
from .report import CaseResult, Result

__all__ = ["grade", "exercises", "leaderboard", "Result", "CaseResult"]


def exercises() -> dict:
    """Exercise name -> its contract (what the function takes and returns)."""
    return {name: ex.contract for name, ex in EXERCISES.items()}


def grade(name: str, candidate, *, seed: int | None = None):
    """Grade ``candidate`` for the exercise ``name``; returns a Result (``.passed``, ``.hints``, ``.cases``)."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; the exercises are: {', '.join(EXERCISES)}")
    if not callable(candidate):
        raise TypeError(f"grade({name!r}, candidate): candidate must be a function, got {type(candidate).__name__}")
    if EXERCISES[name].needs_triton:
        from .. import device
        device.require_triton(f"The {name} exercise")
    from . import protocol
    if os.environ.get(protocol.SOCKET_ENV):      # inside a batch-grading sandbox: the grader decides
        return protocol.serve_cases(EXERCISES[name], candidate)
    return _grade(EXERCISES[name], candidate, seed=seed)
