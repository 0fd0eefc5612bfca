"""Part 1 (notebooks 01-03, NumPy): attention_naive, online_softmax_update, online_softmax,
attention_tiled.

They work on one (batch, head) slice in float64.  Their inputs are instrumented
(:mod:`flashlab.grader.requirements`), so that the grader checks the algorithm the exercise asks
for, not only the answer.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ... import reference as R
from .. import bugs as B
from .. import requirements as Rq
from ..core import Bug, Case, Exercise
from . import register

# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------

NUMPY_TIMEOUT = 60.0     # seconds per case: these cases take milliseconds, so past a minute is a hang
NUMPY_BUDGET = 100.0     # seconds for a whole grade() of a NumPy exercise


def _qkv(rng, nq, nk, d, large=False, negative_rows=()):
    q, k, v = rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, d))
    if large:  # scores past 700: e^S overflows float64 unless the max is subtracted
        s_max = np.abs(q @ k.T).max() / math.sqrt(d)
        q = q * (1200.0 / max(s_max, 1e-9))
    if len(negative_rows):  # these query rows score below -800 against every key: e^(S - 0) underflows to 0
        w = np.full(d, 3.0)
        k = k + w
        dots = k @ w
        if dots.min() <= 0:
            k[dots <= 0] += w
            dots = k @ w
        c = 800.0 * math.sqrt(d) / dots.min()
        q[list(negative_rows)] = -c * w
    return q, k, v


def _np_tol(case, name, ref):
    return 1e-8 * max(1.0, float(np.nanmax(np.abs(np.where(np.isfinite(ref), ref, 0)))))


def _block_heat(err2d, rb, cb):
    nr, nc = -(-err2d.shape[0] // rb), -(-err2d.shape[1] // cb)
    heat = np.zeros((nr, nc))
    for i in range(nr):
        for j in range(nc):
            heat[i, j] = err2d[i * rb:(i + 1) * rb, j * cb:(j + 1) * cb].max()
    return heat


def _probe_v(nk, d, width=None):
    """V whose column c is the indicator of key block c: then O[i, c] = probability mass row i puts
    on key block c, so the error of O becomes an error per (query, key block).  ``width``: keys per
    block (the learner's block_k where it fits in d columns)."""
    if width is None or -(-nk // width) > d:
        width = max(8, -(-nk // d))
    nblocks = -(-nk // width)
    v = np.zeros((nk, d))
    v[np.arange(nk), np.arange(nk) // width] = 1.0
    return v, width, nblocks


def _heat_from_mass(got_o, ref_o, width, nblocks, rows_per_block):
    with np.errstate(invalid="ignore"):
        err = np.abs(got_o[:, :nblocks] - ref_o[:, :nblocks])
    err = np.where(np.isnan(err), np.inf, err)
    return _block_heat(err, rows_per_block, 1)


def _describe(x) -> str:
    if isinstance(x, tuple):
        return f"a tuple of {len(x)} item(s)"
    if isinstance(x, np.ndarray):
        return f"an array of shape {x.shape}"
    return f"a {type(x).__name__}"


def _array(name, x, problems):
    """``x`` as a plain numeric ndarray in its own dtype (a float32 or complex result is judged by the
    core, with a message saying so), or None with a sentence appended to ``problems``."""
    if isinstance(x, torch.Tensor):
        problems.append(f"`{name}`: got a torch tensor; return a NumPy array (float64)")
        return None
    try:
        a = np.array(x.view(np.ndarray) if isinstance(x, np.ndarray) else x)
    except Exception:
        a = None
    if a is None or a.dtype == object:
        problems.append(f"`{name}`: expected a NumPy array of numbers, got {_describe(x)}")
        return None
    return a


def _watched(f, *args):
    """Call the candidate, noting any call to flashlab's references or PyTorch's attention."""
    found = []
    with Rq.watch_calls(found):
        out = f(*args)
    return out, found


# ----------------------------------------------------------------------------
# online_softmax_update
# ----------------------------------------------------------------------------

def _osu_cases(rng):
    cases = []

    def make(r, c, start, large=False, visible=False, grow=None):
        mag = 1000.0 if large else 3.0
        prefix = mag * rng.standard_normal((r, 5))
        x = mag * rng.standard_normal((r, c))
        if start:
            m, l = np.full(r, -np.inf), np.zeros(r)
        else:
            m, l = prefix.max(1), np.exp(prefix - prefix.max(1, keepdims=True)).sum(1)
            if grow is True:
                x = x + (m.max() - x.min() + 1.0)
            elif grow is False:
                x = x - (x.max() - m.min() + 1.0)
        cases.append(Case({"R": r, "C": c}, {"m": m, "l": l, "x_block": x}, visible, large))

    make(4, 8, start=False, visible=True)
    make(3, 6, start=True)
    make(5, 7, start=False, grow=True)
    make(5, 7, start=False, grow=False)
    make(6, 9, start=False, large=True)
    make(1, 1, start=False)
    make(7, 33, start=False)
    return cases


def _osu_run(f, case):
    i = case.inputs
    out, found = _watched(f, i["m"].copy(), i["l"].copy(), i["x_block"].copy())
    res = {"_violations": Rq.reference_message(found, "online softmax update"), "_contract": []}
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        res["_contract"].append(f"online_softmax_update must return a pair (m_new, l_new): got {_describe(out)}")
        return res
    for name, x in zip(("m", "l"), out):
        a = _array(name, x, res["_contract"])
        if a is not None:
            res[name] = a
    return res


def _osu_ref(case):
    m, l = R.online_softmax_update(case.inputs["m"], case.inputs["l"], case.inputs["x_block"])
    return {"m": m, "l": l}


def _osu_bugs():
    return [Bug(key, title, hint,
                (lambda fn: lambda c: dict(zip(("m", "l"), fn(c.inputs["m"], c.inputs["l"], c.inputs["x_block"]))))(fn))
            for key, title, hint, fn in B.online_softmax_update_bugs()]


# ----------------------------------------------------------------------------
# online_softmax
# ----------------------------------------------------------------------------

def _os_cases(rng):
    cases = []
    for (r, n, b, large, neg, vis) in [(4, 20, 8, False, False, True), (3, 16, 4, False, False, False),
                                       (5, 37, 8, False, False, False), (2, 10, 1, False, False, False),
                                       (3, 9, 32, False, False, False), (4, 50, 16, True, False, False),
                                       (4, 30, 8, False, True, False), (1, 1, 4, False, False, False)]:
        x = (1000.0 if large else 3.0) * rng.standard_normal((r, n))
        params = {"R": r, "N": n, "block_size": b}
        if neg:  # a row whose values are all below -800: e^(x - 0) underflows to 0
            x[1] = -1000.0 + 3.0 * rng.standard_normal(n)
            params["rows"] = "one row below -800"
        cases.append(Case(params, {"x": x}, vis, large))
    return cases


def _os_run(f, case):
    b = case.params["block_size"]
    x, rec = Rq.track("x", case.inputs["x"])
    out, found = _watched(f, x, b)
    res = {"_violations": Rq.reference_message(found, "online softmax"), "_contract": []}
    a = _array("p", out, res["_contract"])
    if a is not None:
        res["p"] = a
        if not res["_violations"]:
            res["_violations"] = Rq.online_softmax_rule(rec, b)
    return res


def _os_ref(case):
    return {"p": R.online_softmax(case.inputs["x"], case.params["block_size"])}


def _os_probe(f, case):
    got = np.asarray(f(case.inputs["x"].copy(), case.params["block_size"]), dtype=np.float64)
    ref = _os_ref(case)["p"]
    if got.shape != ref.shape:
        return None
    with np.errstate(invalid="ignore"):
        err = np.abs(got - ref)
    err = np.where(np.isnan(err), np.inf, err)
    b = case.params["block_size"]
    return _block_heat(err, 1, b), ("row", f"column block ({b} columns)")


def _os_bugs():
    return [Bug(key, title, hint, (lambda fn: lambda c: {"p": fn(c.inputs["x"], c.params["block_size"])})(fn),
                nan_ok=key in B.ONLINE_SOFTMAX_NAN_OK)
            for key, title, hint, fn in B.online_softmax_bugs()]


# ----------------------------------------------------------------------------
# attention_naive and attention_tiled (NumPy, one head)
# ----------------------------------------------------------------------------

_NEG_ROWS = (0, 3, 17, 18, 33)


def _attn_cases(rng, tiled):
    spec = [  # Nq, Nk, D, causal, data, block_q, block_k, visible
        (32, 32, 16, False, "", 8, 8, True),
        (32, 32, 16, True, "", 8, 8, False),
        (37, 37, 16, True, "", 16, 16, False),
        (40, 70, 8, False, "", 16, 8, False),
        (40, 70, 8, True, "", 8, 16, False),        # causal, block_q < block_k, Nq < Nk, ragged
        (53, 61, 16, True, "", 16, 8, False),       # causal, block_q > block_k, ragged
        (70, 40, 16, True, "", 32, 8, False),       # causal, block_q > block_k, Nq > Nk
        (70, 40, 16, True, "", 16, 16, False),
        (48, 48, 16, True, "large", 16, 16, False),
        (40, 44, 16, True, "negative", 16, 8, False),  # rows whose scores are all below -800
        (1, 1, 8, True, "", 4, 4, False),
        (20, 20, 32, False, "", 64, 64, False),
    ]
    if tiled:  # large enough that S (1.2 MiB) dwarfs what a tiled pass holds: the memory check
        spec.append((300, 520, 16, False, "memory", 32, 64, False))
    cases = []
    for nq, nk, d, causal, data, bq, bk, vis in spec:
        q, k, v = _qkv(rng, nq, nk, d, large=data == "large",
                       negative_rows=[r for r in _NEG_ROWS if r < nq] if data == "negative" else ())
        params = {"Nq": nq, "Nk": nk, "D": d, "causal": causal}
        if tiled:
            params.update(block_q=bq, block_k=bk)
        if data == "negative":
            params["rows"] = "some rows' scores all below -800"
        if data == "memory":
            params["check"] = "peak memory"
        cases.append(Case(params, {"q": q, "k": k, "v": v}, vis, data == "large"))
    return cases


def _naive_run(f, case):
    i = case.inputs
    out, found = _watched(f, i["q"].copy(), i["k"].copy(), i["v"].copy(), case.params["causal"])
    res = {"_violations": Rq.reference_message(found, "attention"), "_contract": []}
    if isinstance(out, tuple):
        res["_contract"].append(f"attention_naive returns only o, one ({case.params['Nq']}, {case.params['D']}) "
                                f"array: got {_describe(out)}" + (" (o, lse)?" if len(out) == 2 else ""))
        return res
    a = _array("o", out, res["_contract"])
    if a is not None:
        res["o"] = a
    return res


def _tiled_outputs(out, case, res):
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        res["_contract"].append(f"attention_tiled must return a tuple (o, lse): got {_describe(out)}")
        return
    for name, x in zip(("o", "lse"), out):
        a = _array(name, x, res["_contract"])
        if a is not None:
            res[name] = a


def _tiled_run(f, case):
    p, i = case.params, case.inputs
    args = (p["causal"], p["block_q"], p["block_k"])
    if p.get("check") == "peak memory":   # plain inputs, memory traced: nothing of ours in the peak
        q, k, v = i["q"].copy(), i["k"].copy(), i["v"].copy()
        peak = []
        with Rq.peak_memory(peak):
            out, found = _watched(f, q, k, v, *args)
        res = {"_violations": Rq.reference_message(found, "tiled attention"), "_contract": []}
        _tiled_outputs(out, case, res)
        if not res["_violations"] and peak:
            res["_violations"] = Rq.memory_rule(peak[0], p["Nq"], p["Nk"])
        return res
    k, rk = Rq.track("k", i["k"])
    v, rv = Rq.track("v", i["v"])
    out, found = _watched(f, i["q"].copy(), k, v, *args)
    res = {"_violations": Rq.reference_message(found, "tiled attention"), "_contract": []}
    _tiled_outputs(out, case, res)
    if not res["_violations"] and not res["_contract"]:
        res["_violations"] = Rq.tiled_attention_rule({"k": rk, "v": rv}, p["Nq"], p["Nk"], p["causal"],
                                                     p["block_q"], p["block_k"])
    return res


def _attn_ref(case):
    i = case.inputs
    o, lse = R.attention_naive(i["q"], i["k"], i["v"], case.params["causal"])
    return {"o": o, "lse": lse}


def _attn_locate_np(case, name, idx):
    p = case.params
    tile = f" (Q tile {idx[0] // p['block_q']})" if "block_q" in p else ""
    return f"query row {idx[0]}{tile}" + (f", column {idx[1]}" if len(idx) > 1 else "")


def _np_attn_probe(tiled):
    def probe(f, case):
        i, p = case.inputs, case.params
        v, width, nblocks = _probe_v(p["Nk"], p["D"], p["block_k"] if tiled else None)
        args = (i["q"].copy(), i["k"].copy(), v.copy(), p["causal"])
        got = f(*args, p["block_q"], p["block_k"]) if tiled else f(*args)
        got = np.asarray(got[0] if tiled else got, dtype=np.float64)
        ref = R.attention_naive(i["q"], i["k"], v, p["causal"])[0]
        if got.shape != ref.shape:
            return None
        rows = p["block_q"] if tiled else 8
        if tiled:
            cols = (f"K tile (block_k = {width} keys)" if width == p["block_k"]
                    else f"keys, {width} per cell (not your tiles)")
            return _heat_from_mass(got, ref, width, nblocks, rows), (f"Q tile (block_q = {rows} rows)", cols)
        return _heat_from_mass(got, ref, width, nblocks, rows), (f"query rows ({rows} per cell)",
                                                                 f"keys ({width} per cell)")
    return probe


def _attn_bugs(with_lse: bool, per_slice, tiles: bool = True):
    """Wrap the attention bug library for an exercise; ``per_slice`` maps a slice function over the case.
    ``tiles=False`` (naive attention): only the mistakes a non-tiled code can make, with their hints."""
    out = []
    for key, title, hint, fn in B.attention_bugs():
        if not tiles and key in B.TILE_ONLY:
            continue
        if not tiles:
            hint = B.NAIVE_HINTS.get(key, hint)

        def outputs(case, fn=fn, key=key):
            alts = []
            for bk in _block_sizes(case):
                res = per_slice(case, lambda q, k, v, c, s: fn(q, k, v, c, s, bk))
                if res is None:
                    return None
                alts.append(res if with_lse else {"o": res["o"]})
                if key not in B.TILE_ONLY:
                    break
            return alts
        # all-NaN is named only for NumPy code: a kernel's all-NaN output is more often a read of the
        # grader's NaN padding (wrong strides or base pointer)
        out.append(Bug(key, title, hint, outputs, nan_ok=key in B.NAN_OK and per_slice is _np_per_slice))
    if with_lse:
        for key, title, hint, fn in B.lse_bugs():
            def outputs(case, fn=fn):
                def one(q, k, v, c, s):
                    o, lse = R.attention_naive(q, k, v, c, s)
                    return fn(o, lse, B.row_max(q, k, c, s))
                return per_slice(case, one)
            out.append(Bug(key, title, hint, outputs))
    return out


def _tile_skip_bugs():
    """Causal tile-skip tests that are wrong when block_q != block_k (attention_tiled only)."""
    def wrap(fn):
        def outputs(case):
            i, p = case.inputs, case.params
            res = fn(i["q"], i["k"], i["v"], p["causal"], 1.0 / math.sqrt(p["D"]), p["block_q"], p["block_k"])
            return None if res is None else {"o": res[0], "lse": res[1]}
        return outputs
    return [Bug(key, title, hint, wrap(fn)) for key, title, hint, fn in B.tile_skip_bugs()]


def _block_sizes(case):
    p = case.params
    if "block_k" in p:
        return [p["block_k"]]
    return [16, 32, 64, 128]


def _np_per_slice(case, fn):
    i, p = case.inputs, case.params
    res = fn(i["q"], i["k"], i["v"], p["causal"], 1.0 / math.sqrt(p["D"]))
    return None if res is None else {"o": res[0], "lse": res[1]}



def _wrong_axis(case):
    i = case.inputs
    s = (i["q"] @ i["k"].T) / math.sqrt(case.params["D"])
    if case.params["causal"]:
        s = np.where(R.causal_mask(*s.shape), s, -np.inf)
    with np.errstate(all="ignore"):
        p = np.exp(s - s.max(0, keepdims=True))
        return (p / p.sum(0, keepdims=True)) @ i["v"]




# ----------------------------------------------------------------------------
# the exercises of part 1
# ----------------------------------------------------------------------------

_NP = dict(timeout=NUMPY_TIMEOUT, budget=NUMPY_BUDGET, dtype="float64", notebook="02")

register(Exercise(
    "attention_naive",
    "f(q, k, v, causal) -> o. NumPy float64; q (Nq, D), k and v (Nk, D); scale 1/sqrt(D); "
                           "causal top-left (query i sees keys j <= i).",
    lambda rng: _attn_cases(rng, False), _naive_run, lambda c: {"o": _attn_ref(c)["o"]}, _np_tol,
    _attn_locate_np,
    _attn_bugs(False, _np_per_slice, tiles=False) + [
        Bug("wrong_axis", "softmax along the wrong axis",
            "normalise each row of S (axis=-1): each query's weights sum to 1.",
            lambda c: {"o": _wrong_axis(c)})],
    probe=_np_attn_probe(False), requirements=("no call to a reference implementation",),
    **dict(_NP, notebook="01")))

register(Exercise(
    "online_softmax_update",
    "f(m, l, x_block) -> (m_new, l_new). m, l: (R,); x_block: (R, C), float64. The running "
                                 "max and sum after seeing x_block (start: m = -inf, l = 0).",
    _osu_cases, _osu_run, _osu_ref, _np_tol, lambda c, n, idx: f"row {idx[0]}", _osu_bugs(),
    requirements=("no call to a reference implementation",), **_NP))

register(Exercise(
    "online_softmax",
    "f(x, block_size) -> p. softmax of x (R, N) along the last axis: (m, l) built in one pass "
                          "over blocks of block_size columns, then the write-out e^(x - m)/l. Checked: x is read "
                          "block by block, and your own code does it.",
    _os_cases, _os_run, _os_ref, _np_tol,
    lambda c, n, idx: f"row {idx[0]}, column {idx[1]} (block {idx[1] // c.params['block_size']})",
    _os_bugs(), probe=_os_probe,
    requirements=("no call to a reference implementation", "x read block by block, in one pass for (m, l)"),
    served=lambda case: ("x",), check=lambda case, reads: Rq.online_softmax_rule(reads["x"], case.params["block_size"]),
    **_NP))

register(Exercise(
    "attention_tiled",
    "f(q, k, v, causal, block_q, block_k) -> (o, lse). NumPy, FA2 loop order (outer loop over Q "
                           "tiles); lse is the natural-log log-sum-exp of each row's scaled scores. Checked: K and V "
                           "are read one block_k tile at a time (never the Nq x Nk score matrix), and with causal=True "
                           "no key tile above the diagonal is loaded.",
    lambda rng: _attn_cases(rng, True), _tiled_run, _attn_ref, _np_tol, _attn_locate_np,
    _tile_skip_bugs() + _attn_bugs(True, _np_per_slice), probe=_np_attn_probe(True),
    requirements=("no call to a reference implementation", "K and V read one block_k tile at a time",
                  "causal: no key tile above the diagonal loaded", "peak memory well under the Nq x Nk scores"),
    served=lambda case: () if case.params.get("check") == "peak memory" else ("k", "v"),
    check=lambda case, reads: Rq.tiled_attention_rule(reads, case.params["Nq"], case.params["Nk"],
                                                      case.params["causal"], case.params["block_q"],
                                                      case.params["block_k"]),
    **dict(_NP, notebook="03")))
