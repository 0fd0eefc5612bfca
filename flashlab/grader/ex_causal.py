"""Old home of the causal_loop_bounds exercise; it is declared in :mod:`flashlab.grader.exercises.part2`."""
from .exercises.part2 import CAUSAL_BUGS as BUGS  # noqa: F401
