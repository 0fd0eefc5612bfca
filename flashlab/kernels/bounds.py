"""The causal loop bounds, in plain Python: they live in :mod:`flashlab.bounds` (importable without
Triton, as the grader needs them); this name stays for the notebooks and the kernels' readers."""
from ..bounds import causal_tile_ranges, tile_kinds  # noqa: F401
