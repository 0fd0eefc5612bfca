"""Exercise ``causal_loop_bounds`` (notebook 06): the two-stage causal loop of the forward kernel.

The learner writes f(start_m, block_m, block_n, nq, nk) -> (unmasked_end, end) for one Q tile;
the grader calls it for every Q tile of each case and compares with
:func:`flashlab.kernels.bounds.causal_tile_ranges` (plain integers, no Triton, so it runs
anywhere in a fraction of a second).
"""
from __future__ import annotations

import numpy as np

from .core import Bug, Case, Exercise


def causal_tile_ranges(*args):
    """flashlab.kernels.bounds.causal_tile_ranges, imported when used (flashlab.kernels needs Triton;
    the exercise list must load without it)."""
    from ..kernels.bounds import causal_tile_ranges as ranges
    return ranges(*args)


CONTRACT = ("f(start_m, block_m, block_n, nq, nk) -> (unmasked_end, end). Python ints. For the causal Q tile "
            "start_m (rows start_m*block_m ... (start_m+1)*block_m - 1): keys [0, unmasked_end) are whole, full "
            "K tiles of block_n keys that every row of the tile sees (no mask); keys [unmasked_end, end) are "
            "the tiles that need the mask; keys from end on are never loaded. Tightest bounds: the largest "
            "unmasked_end and the smallest end.")

# (nq, nk, block_m, block_n): block_m != block_n both ways, Nq != Nk, ragged last tiles
SHAPES = [(256, 256, 64, 64), (300, 300, 128, 64), (300, 300, 32, 64), (100, 250, 64, 32),
          (250, 100, 64, 128), (129, 129, 128, 32), (1, 1, 16, 16), (515, 515, 128, 128), (77, 200, 32, 16)]


def _cases(rng):
    cases = []
    for i, (nq, nk, bm, bn) in enumerate(SHAPES):
        cases.append(Case({"Nq": nq, "Nk": nk, "block_q": bm, "block_k": bn}, {}, visible=(i == 0)))
    nq, nk = (int(x) for x in rng.integers(50, 700, size=2))        # fresh, ragged
    bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
    cases.append(Case({"Nq": nq, "Nk": nk, "block_q": bm, "block_k": bn}, {}))
    return cases


def _collect(fn, case):
    p = case.params
    rows = []
    for start_m in range(-(-p["Nq"] // p["block_q"])):
        out = fn(start_m, p["block_q"], p["block_k"], p["Nq"], p["Nk"])
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"return a pair (unmasked_end, end), got {out!r}")
        rows.append([float(out[0]), float(out[1])])
    a = np.asarray(rows, dtype=np.float64)
    return {"unmasked_end": a[:, 0], "end": a[:, 1]}


def _run(f, case):
    return _collect(f, case)


def _ref(case):
    return _collect(lambda s, bm, bn, nq, nk: causal_tile_ranges(s, bm, bn, nq, nk, True), case)


def _locate(case, name, idx):
    s = idx[0]
    bm = case.params["block_q"]
    return f"Q tile {s} (rows {s * bm} to {(s + 1) * bm - 1})"


def _bug(fn):
    return lambda case: _collect(fn, case)


BUGS = [
    Bug("end_not_clipped", "end not clipped to Nk",
        "the last Q tiles would read K/V rows past Nk (or loop over nothing): end = min((start_m + 1) * block_m, nk).",
        _bug(lambda s, bm, bn, nq, nk: causal_tile_ranges(s, bm, bn, nq, nk)[0:1] + ((s + 1) * bm,))),
    Bug("unmasked_not_whole_tiles", "unmasked_end not a whole number of K tiles",
        "with block_m != block_n, start_m * block_m may fall inside a K tile: that tile crosses the diagonal and "
        "needs the mask. Round down to a multiple of block_n.",
        _bug(lambda s, bm, bn, nq, nk: (min(s * bm, nk // bn * bn), min((s + 1) * bm, nk)))),
    Bug("ragged_tile_unmasked", "the ragged last K tile counted as unmasked",
        "a K tile that runs past Nk needs the mask on its loads (and scores): cap unmasked_end at "
        "(nk // block_n) * block_n.",
        _bug(lambda s, bm, bn, nq, nk: (s * bm // bn * bn, min((s + 1) * bm, nk)))),
    Bug("wrong_block_size", "the Q tile's end measured in K tiles",
        "the last key a row of this tile can see is its last row, (start_m + 1) * block_m - 1: use block_m.",
        _bug(lambda s, bm, bn, nq, nk: (causal_tile_ranges(s, bm, bn, nq, nk)[0], min((s + 1) * bn, nk)))),
]

EXERCISES = {
    "causal_loop_bounds": Exercise(
        "causal_loop_bounds", CONTRACT, _cases, _run, _ref, lambda case, name, ref: 0.0, _locate, BUGS),
}
