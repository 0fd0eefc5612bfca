"""Figures for the notebooks: every function returns a matplotlib Figure.

``flashlab.viz`` is a package:

- :mod:`flashlab.viz.figures`: the course's figures (notebooks 01-03 and 06) and their widgets;
  everything in it is importable from ``flashlab.viz`` directly (``viz.fig_tiles``, ...).
- :mod:`flashlab.viz.trace`: :func:`trace` runs a Triton kernel in the interpreter with its loads and
  stores recorded (:func:`trace_call`: the kernels a launcher starts); :mod:`flashlab.viz.trace_figure`
  draws which elements each program read and wrote (notebooks 04 and 05).  ``flashlab.viz.trace`` is
  the function; the module is ``sys.modules["flashlab.viz.trace"]``.

The figures of notebooks 04-07 live beside it, in ``flashlab.viz_triton``, ``flashlab.viz_speed`` and
``flashlab.viz_backward``.
"""
from . import figures
from .figures import *  # noqa: F401,F403  (the public figures: viz.fig_tiles, viz.hbm_traffic, ...)
from .figures import _finish_loglog, _png, _register_ipython_display  # noqa: F401  (used by flashlab.demo, tests)
from .trace import KernelTrace, trace, trace_call, trace_hint  # noqa: F401
from .trace_figure import interact_trace  # noqa: F401
