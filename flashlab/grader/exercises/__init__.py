"""The graded exercises: one module per part of the course, each exercise declared once.

    part1.py   notebooks 01-03 (NumPy): attention_naive, online_softmax_update, online_softmax, attention_tiled
    part2.py   notebooks 04-06 (Triton): softmax_kernel, matmul_kernel, flash_forward; causal_loop_bounds
               (plain Python: graded without Triton)
    part3.py   notebook 07 (Triton): flash_backward

A module declares each of its exercises with ``register(Exercise(...))`` (or ``@exercise`` on a
function that returns one): the name, the contract the learner reads, how cases are drawn, how a
candidate is run on one (``run``), the reference, the tolerance, how an index is named in the
kernel's terms, the known bugs, the requirements checked beyond the values (``requirements``:
sentences), whether it needs Triton (``needs_triton``: ``grade()`` then says what is missing on a
machine without it) and its notebook.  ``grade()``, ``exercises()``, batch grading and the CLI read
only :data:`EXERCISES`, filled here.

A new notebook adds its exercises in one place: a new module in this folder (``variants.py`` for
notebook 08, ``beyond.py`` for 09), which is loaded because it is here; nothing else changes.
Modules load in the order of :data:`ORDER`, then any other module in alphabetical order; a name
registered twice is an error.
"""
from __future__ import annotations

import importlib
import pkgutil

from ..core import Exercise

EXERCISES: dict = {}        # name -> Exercise, in course order
ORDER = ("part1", "part2", "part3", "variants", "beyond")


def register(ex: Exercise) -> Exercise:
    """Add ``ex`` to the registry (returns it).  Raises ValueError for a name already taken."""
    if not isinstance(ex, Exercise):
        raise TypeError(f"register(ex): ex must be an Exercise, got {type(ex).__name__}")
    if not ex.name.isidentifier():
        raise ValueError(f"exercise name {ex.name!r}: use a Python identifier (it is what grade() is called with)")
    if ex.name in EXERCISES:
        raise ValueError(f"exercise {ex.name!r} is registered twice (by {EXERCISES[ex.name].module} and "
                         f"{ex.module}): rename one")
    if not ex.contract.strip():
        raise ValueError(f"exercise {ex.name!r} has no contract: say what f takes and returns")
    EXERCISES[ex.name] = ex
    return ex


def exercise(build):
    """Decorator form of :func:`register`: ``@exercise`` on a function of no arguments returning an Exercise."""
    register(build())
    return build


def _load() -> None:
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    for name in sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        importlib.import_module(f"{__name__}.{name}")


_load()
