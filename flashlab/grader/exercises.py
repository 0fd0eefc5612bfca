"""The graded exercises: contracts, cases, references, tolerances, known bugs.

NumPy exercises work on one (batch, head) slice in float64.  Their inputs are
instrumented (:mod:`flashlab.grader.requirements`), so that the grader checks
the algorithm the exercise asks for, not only the answer.  Triton exercises
get torch tensors (B, H, N, D) that the grader allocates inside poisoned padding
(:mod:`flashlab.grader.memory`), and in the interpreter they run in a forked
child (:mod:`flashlab.grader.sandbox`).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .. import device
from .. import reference as R
from . import bugs as B
from . import requirements as Rq
from . import ex_causal, ex_primer
from . import kernel_bugs as KB
from . import bugs_backward as BB
from .core import Bug, Case, Exercise
from .memory import SENTINEL, Padded, output_buffer, padded, stray_writes, unwritten

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


# ----------------------------------------------------------------------------
# flash_forward and flash_backward (Triton, torch tensors in poisoned padding)
# ----------------------------------------------------------------------------

_TORCH_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


class KernelCase(Case):
    """A flash_forward / flash_backward case: says when the tensors are transposed views."""

    def describe(self) -> str:
        text = super().describe()
        if self.params.get("layout") == "BNHD":
            text += ", (B, N, H, D) views"
        return text


def _kernel_cases(rng, backward=False):
    spec = [  # B, H, Nq, Nk, D, causal, dtype, large, visible
        (1, 2, 64, 64, 16, False, "fp32", False, True),
        (1, 2, 64, 64, 16, True, "fp32", False, False),
        (1, 1, 37, 37, 16, True, "fp32", False, False),
        (2, 3, 40, 70, 32, False, "fp16", False, False),
        (1, 2, 70, 40, 32, True, "fp16", False, False),
        (1, 1, 50, 50, 16, True, "fp16", True, False),
        (1, 1, 1, 1, 16, False, "fp32", False, False),
    ]
    if device.DEVICE.type == "cuda":  # realistic sizes, and bf16 (meaningless in the interpreter)
        spec.append((2, 4, 1000, 1000, 64, True, "fp16", False, False))
    if device.bf16_supported():       # not on a T4 (compute capability 7.5: no bf16 tl.dot)
        spec.append((1, 2, 300, 300, 64, False, "bf16", False, False))
    extra = []  # forward only: B, H, Nq, Nk, D, causal, dtype, max |S| (None: ordinary), layout
    if not backward:
        extra = [
            (2, 3, 45, 45, 16, True, "fp32", None, "BNHD"),    # (B, N, H, D) tensors transposed to (B, H, N, D)
            (1, 2, 40, 70, 16, True, "fp32", None, "BHND"),    # causal, Nq < Nk
            (1, 3, 1, 50, 16, False, "fp32", None, "BHND"),    # Nq = 1, H = 3
            (1, 1, 1, 37, 16, True, "fp16", None, "BHND"),     # Nq = 1 causal: sees key 0 only
            (1, 1, 24, 65, 16, False, "fp32", None, "BHND"),   # Nk = BLOCK_N + 1 for BLOCK_N = 64
            (1, 2, 40, 33, 16, True, "fp32", None, "BHND"),    # Nk = 32 + 1, causal with Nq > Nk
            (1, 1, 17, 17, 16, False, "fp16", None, "BNHD"),   # Nk = 16 + 1
            (1, 2, 45, 45, 32, True, "fp32", 1000.0, "BHND"),  # |S| ~ 1000
        ]
        if device.DEVICE.type == "cuda":
            extra += [(2, 8, 513, 129, 128, False, "fp16", None, "BNHD"),
                      (1, 4, 129, 513, 64, True, "bf16", 1000.0, "BHND"),
                      (2, 4, 1024, 1024, 64, True, "bf16", None, "BNHD")]
    cases = []
    for b, h, nq, nk, d, causal, dt, large, vis, *rest in [s + (None, "BHND") for s in spec] + \
            [s[:7] + (s[7] is not None, False) + s[7:] for s in extra]:
        s_max, layout = rest
        mag = 10.0 if (large and s_max is None) else 1.0
        q = mag * rng.standard_normal((b, h, nq, d))
        k = mag * rng.standard_normal((b, h, nk, d))
        v = rng.standard_normal((b, h, nk, d))
        if s_max is not None:  # scale Q so that the largest |S| is s_max: e^S overflows even float64 at 710
            q *= s_max / max(np.abs(q @ k.swapaxes(-1, -2)).max() / math.sqrt(d), 1e-9)
        dtype = _TORCH_DTYPES[dt]
        t = {n: torch.from_numpy(x).to(device=device.DEVICE, dtype=dtype) for n, x in (("q", q), ("k", k), ("v", v))}
        if backward:
            t["do"] = torch.from_numpy(rng.standard_normal((b, h, nq, d))).to(device=device.DEVICE, dtype=dtype)
        params = {"B": b, "H": h, "Nq": nq, "Nk": nk, "D": d, "causal": causal, "dtype": dt}
        if layout != "BHND":
            params["layout"] = layout
        cases.append(KernelCase(params, t, vis, large))
    return cases


def _f64(t):
    return t.detach().double().cpu().numpy()


def _kernel_per_slice(case, fn):
    """Apply a one-head NumPy function to every (batch, head) of a kernel case."""
    q, k, v = (_f64(case.inputs[n]) for n in "qkv")
    p = case.params
    s = 1.0 / math.sqrt(p["D"])
    o = np.empty(q.shape)
    lse = np.empty(q.shape[:3])
    for b in range(p["B"]):
        for h in range(p["H"]):
            res = fn(q[b, h], k[b, h], v[b, h], p["causal"], s)
            if res is None:
                return None
            o[b, h], lse[b, h] = res
    return {"o": o, "lse": lse}


def _fwd_ref(case):
    return _kernel_per_slice(case, lambda q, k, v, c, s: R.attention_naive(q, k, v, c, s))


def _sync():
    if device.DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _guard_4d(name, values, layout="BHND", fill=None):
    """A poisoned buffer for a (B, H, N, D) tensor; layout "BNHD": the buffer is (B, N + 8, H, D) and the
    view its transpose, as when a model's (B, N, H, D) activations are passed as q.transpose(1, 2)."""
    if layout != "BNHD":
        return padded(name, values, fill)
    buf = padded(name, values.transpose(1, 2), fill, row_dim=1)
    return dataclasses.replace(buf, view=buf.view.transpose(1, 2))


def _guard_inputs(case, names):
    return {n: _guard_4d(n, case.inputs[n], case.params.get("layout", "BHND")) for n in names}


def _input_strays(bufs, case):
    strays = [s for s in (stray_writes(b) for b in bufs.values()) if s]
    for n, b in bufs.items():
        if not torch.equal(torch.nan_to_num(b.view, 7.0), torch.nan_to_num(case.inputs[n], 7.0)):
            strays.append(f"the input `{n}` was modified (inputs are read-only)")
    return strays


def _fwd_run(f, case, v_override=None):
    p = case.params
    ins = _guard_inputs(case, "qkv")
    if v_override is not None:
        ins["v"].view.copy_(v_override)
    q = ins["q"].view
    o = _guard_4d("o", torch.full(q.shape, SENTINEL[q.dtype], dtype=q.dtype, device=q.device),
                  p.get("layout", "BHND"), SENTINEL[q.dtype])
    lse = output_buffer("lse", q.shape[:3], torch.float32, q.device, row_dim=-1)
    f(q, ins["k"].view, ins["v"].view, o.view, lse.view, p["causal"])
    _sync()
    strays = [s for s in (stray_writes(o), stray_writes(lse)) if s]
    if v_override is None:
        strays += _input_strays(ins, case)
    return {"o": _f64(o.view), "lse": _f64(lse.view), "_stray": [str(s) for s in strays],
            "_unwritten": {"o": unwritten(o).cpu().numpy(), "lse": unwritten(lse).cpu().numpy()}}


def _fwd_probe(f, case):
    p = case.params
    vnp, width, nblocks = _probe_v(p["Nk"], p["D"])
    v = torch.from_numpy(np.broadcast_to(vnp, (p["B"], p["H"], p["Nk"], p["D"])).copy()).to(
        case.inputs["v"].dtype).to(device.DEVICE)
    got = _fwd_run(f, case, v_override=v)["o"]
    q, k = _f64(case.inputs["q"]), _f64(case.inputs["k"])
    heat = None
    for b in range(p["B"]):
        for h in range(p["H"]):
            ref = R.attention_naive(q[b, h], k[b, h], vnp, p["causal"])[0]
            hb = _heat_from_mass(got[b, h], ref, width, nblocks, 16)
            heat = hb if heat is None else np.maximum(heat, hb)
    return heat, ("query block (16 rows)", f"key block ({width} keys)")


def _fwd_wrong_stride(case):
    """K and V read with Q's strides (a copy-pasted pointer line), on the grader's own buffers."""
    ins = _guard_inputs(case, "qkv")
    q = ins["q"].view
    k, v = (KB.read_with_strides(ins[n], q.stride()) for n in "kv")
    if k is None or v is None or q.stride() == ins["k"].view.stride():
        return None
    qn = _f64(case.inputs["q"])
    p = case.params
    s = 1.0 / math.sqrt(p["D"])
    o, lse = np.empty(qn.shape), np.empty(qn.shape[:3])
    with np.errstate(all="ignore"):
        for b in range(p["B"]):
            for h in range(p["H"]):
                o[b, h], lse[b, h] = R.attention_naive(qn[b, h], k[b, h], v[b, h], p["causal"], s)
    return {"o": o, "lse": lse}


def _fwd_kernel_bugs():
    """Kernel-only mistakes (flashlab.grader.kernel_bugs), tried after the algorithm's."""
    def tiled(fn):
        def outputs(case):
            if not case.params["causal"]:
                return None
            return [_kernel_per_slice(case, lambda q, k, v, c, s: fn(q, k, v, c, s, bk)) for bk in (16, 32, 64, 128)]
        return outputs
    return [Bug(*KB.CAUSAL_REVERSED, tiled(KB.causal_wrong_side("reversed"))),
            Bug(*KB.CAUSAL_INVERTED, tiled(KB.causal_wrong_side("inverted"))),
            Bug(*KB.WRONG_STRIDE, _fwd_wrong_stride)]


def _kernel_tol(case, name, ref):
    dt = case.params["dtype"]
    mag = max(1.0, float(np.nanmax(np.abs(np.where(np.isfinite(ref), ref, 0)))))
    if dt == "fp32":
        rel = 1e-4 if device.INTERPRET else 5e-3   # on a GPU, allow TF32 dot products
    elif dt == "bf16":
        rel = 2e-3 if name == "lse" else 4e-2
    else:
        rel = 2e-3 if name == "lse" else 1e-2
    return rel * mag


def _kernel_locate(case, name, idx):
    p = case.params
    b, h, row = idx[0], idx[1], idx[2]
    pid1 = b * p["H"] + h
    if name in ("dk", "dv"):
        where = (f"batch {b}, head {h}, key row {row}: in the dK/dV kernel, the program with "
                 f"program_id(1) = b*H + h = {pid1} and program_id(0) = {row} // BLOCK_N")
    else:
        where = (f"batch {b}, head {h}, query row {row}: the program with program_id(1) = b*H + h = {pid1} "
                 f"and program_id(0) = {row} // BLOCK_M (row {row} % BLOCK_M of its tile)")
    return where + (f", column {idx[3]}" if len(idx) > 3 else "")


def _bwd_inputs(case):
    """O (in the input dtype) and LSE (float32) from the float64 reference, as the forward would give."""
    ref = _fwd_ref(case)
    q = case.inputs["q"]
    return (torch.from_numpy(ref["o"]).to(device=q.device, dtype=q.dtype),
            torch.from_numpy(ref["lse"]).to(device=q.device, dtype=torch.float32))


def _bwd_cases(rng):
    """The shared kernel cases (with a dO), plus the ones only a backward can get wrong."""
    cases = _kernel_cases(rng, backward=True)
    spec = [  # B, H, Nq, Nk, D, causal, dtype, max |S| (None: ordinary data), dO layout
        (1, 2, 40, 100, 16, True, "fp32", None, "bhnd"),    # keys 40..99 are seen by no query: dK = dV = 0, written
        (1, 1, 48, 48, 32, True, "fp32", 1000.0, "bhnd"),   # |S| ~ 1000: P = e^(S - L) must subtract first
        (2, 2, 45, 45, 16, False, "fp32", None, "bnhd"),    # dO non-contiguous: a (B, N, H, D) buffer, transposed
        (1, 1, 33, 50, 128, True, "fp16", None, "bhnd"),    # D = 128
    ]
    if device.DEVICE.type == "cuda":  # realistic sizes; bf16 only means something on a GPU
        spec.append((1, 2, 200, 1000, 64, True, "fp16", None, "bhnd"))
        spec.append((2, 2, 300, 400, 128, True, "bf16", None, "bnhd"))
        spec.append((1, 2, 256, 256, 16, False, "bf16", None, "bhnd"))
    for b, h, nq, nk, d, causal, dt, s_max, layout in spec:
        q, k, v, do = (rng.standard_normal((b, h, n, d)) for n in (nq, nk, nk, nq))
        if s_max is not None:  # scale Q so that the largest |S_ij| is s_max
            q = q * (s_max / (np.abs(np.einsum("bhid,bhjd->bhij", q, k)).max() / math.sqrt(d)))
        dtype = _TORCH_DTYPES[dt]
        t = {n: torch.from_numpy(x).to(device=device.DEVICE, dtype=dtype)
             for n, x in (("q", q), ("k", k), ("v", v), ("do", do))}
        params = {"B": b, "H": h, "Nq": nq, "Nk": nk, "D": d, "causal": causal, "dtype": dt}
        if layout != "bhnd":
            params["dO layout"] = layout
        cases.append(Case(params, t, False, s_max is not None))
    for case in cases:
        case.inputs["o"], case.inputs["lse"] = _bwd_inputs(case)
    return cases


def _bwd_tol(case, name, ref):
    """The kernel tolerance, plus the recomputed-P term of the accuracy rule: every P_ij of row i carries
    the float32 rounding of L_i, |L_i| 2^-24 (visible only when |S| is in the hundreds)."""
    lse_max = float(case.inputs["lse"].abs().max()) if "lse" in case.inputs else 0.0
    mag = max(1.0, float(np.nanmax(np.abs(np.where(np.isfinite(ref), ref, 0)))))
    # half precision with large logits: P and dS are rounded to 16 bits before the dK/dQ products, and a
    # row's few dominant probabilities carry that rounding whole (the canonical kernel reached 1.7e-2 of the
    # largest |dK| on about one draw in 30 at |S| ~ 100): twice the kernel tolerance there
    widen = 2.0 if case.large and case.params["dtype"] in ("fp16", "bf16") else 1.0
    return widen * _kernel_tol(case, name, ref) + 4 * lse_max * 2.0**-24 * mag


def _bwd_do_buffer(case):
    """dO inside poisoned padding; for the layout "bnhd" its buffer is (B, N, H, D), handed over transposed
    to (B, H, N, D): strides unlike those of q and o (as autograd can hand a backward)."""
    do = case.inputs["do"]
    if case.params.get("dO layout") != "bnhd":
        return padded("do", do)
    buf = padded("do", do.transpose(1, 2), row_dim=1)
    return Padded("do", buf.flat, buf.view.transpose(1, 2), buf.fill)


def _bwd_run(f, case):
    p = case.params
    if "o" not in case.inputs:
        case.inputs["o"], case.inputs["lse"] = _bwd_inputs(case)
    ins = {n: padded(n, case.inputs[n], row_dim=-1 if n == "lse" else -2) for n in ("q", "k", "v", "o", "lse")}
    ins["do"] = _bwd_do_buffer(case)
    outs = {n: output_buffer(n, case.inputs[src].shape, case.inputs[src].dtype, device.DEVICE)
            for n, src in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
    f(ins["q"].view, ins["k"].view, ins["v"].view, ins["o"].view, ins["lse"].view, ins["do"].view,
      outs["dq"].view, outs["dk"].view, outs["dv"].view, p["causal"])
    _sync()
    strays = [s for s in (stray_writes(b) for b in outs.values()) if s] + _input_strays(ins, case)
    res = {n: _f64(b.view) for n, b in outs.items()}
    res["_stray"] = [str(s) for s in strays]
    res["_unwritten"] = {n: unwritten(b).cpu().numpy() for n, b in outs.items()}
    for n in ("dq", "dk", "dv"):      # what was never written is NaN, not the sentinel, for the diagnosis
        res[n][res["_unwritten"][n]] = np.nan
    return res


def _bwd_per_slice(case, fn):
    q, k, v, do = (_f64(case.inputs[n]) for n in ("q", "k", "v", "do"))
    p = case.params
    s = 1.0 / math.sqrt(p["D"])
    out = {n: np.empty(t.shape) for n, t in (("dq", q), ("dk", k), ("dv", v))}
    for b in range(p["B"]):
        for h in range(p["H"]):
            res = fn(q[b, h], k[b, h], v[b, h], do[b, h], p["causal"], s)
            if res is None:
                return None
            for n, g in zip(("dq", "dk", "dv"), res):
                out[n][b, h] = g
    return out


def _bwd_ref(case):
    return _bwd_per_slice(case, lambda q, k, v, do, c, s: R.attention_backward_naive(q, k, v, do, c, s))


def _bwd_variants(case, variants):
    """Every variant of one mistake on this case, as the grader's output dicts (None: does not apply)."""
    q, k, v, do = (_f64(case.inputs[n]) for n in ("q", "k", "v", "do"))
    p = case.params
    s = 1.0 / math.sqrt(p["D"])
    per = [[variants(q[b, h], k[b, h], v[b, h], do[b, h], p["causal"], s) for h in range(p["H"])]
           for b in range(p["B"])]
    if any(alts is None for row in per for alts in row):
        return None
    n_alt = min(len(alts) for row in per for alts in row)
    out = []
    for a in range(n_alt):
        alt = {n: np.empty(_f64(case.inputs[src]).shape) for n, src in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
        for b in range(p["B"]):
            for h in range(p["H"]):
                for n, g in zip(("dq", "dk", "dv"), per[b][h][a]):
                    alt[n][b, h] = g
        out.append(alt)
    return out or None


def _bwd_bugs():
    return [Bug(key, title, hint, (lambda var: lambda case: _bwd_variants(case, var))(var))
            for key, title, hint, var in BB.backward_bug_variants()]


# ----------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------

_CONTRACTS = {
    "online_softmax_update": "f(m, l, x_block) -> (m_new, l_new). m, l: (R,); x_block: (R, C), float64. The running "
                             "max and sum after seeing x_block (start: m = -inf, l = 0).",
    "online_softmax": "f(x, block_size) -> p. softmax of x (R, N) along the last axis: (m, l) built in one pass "
                      "over blocks of block_size columns, then the write-out e^(x - m)/l. Checked: x is read "
                      "block by block, and your own code does it.",
    "attention_naive": "f(q, k, v, causal) -> o. NumPy float64; q (Nq, D), k and v (Nk, D); scale 1/sqrt(D); "
                       "causal top-left (query i sees keys j <= i).",
    "attention_tiled": "f(q, k, v, causal, block_q, block_k) -> (o, lse). NumPy, FA2 loop order (outer loop over Q "
                       "tiles); lse is the natural-log log-sum-exp of each row's scaled scores. Checked: K and V "
                       "are read one block_k tile at a time (never the Nq x Nk score matrix), and with causal=True "
                       "no key tile above the diagonal is loaded.",
    "flash_forward": "f(q, k, v, o, lse, causal) -> None. torch; q (B, H, Nq, D), k and v (B, H, Nk, D); launch a "
                     "Triton kernel that writes O into o (shape and dtype of q) and the LSE into lse ((B, H, Nq), "
                     "float32), in place. The tensors are views with padding around them: use their strides. "
                     "Only the tensors the grader passes are guarded; scratch buffers you allocate yourself "
                     "are not (in the interpreter your kernel runs in a child process, so a crash is still "
                     "reported rather than killing the notebook).",
    "flash_backward": "f(q, k, v, o, lse, do, dq, dk, dv, causal) -> None. torch; Triton kernels write dQ, dK, dV "
                      "into dq, dk, dv in place. The tensors are views with padding around them: use their strides. "
                      "Scratch you allocate yourself (e.g. Delta) is not guarded by the grader's padding.",
}


def _build():
    ex = {}
    np_limits = dict(timeout=NUMPY_TIMEOUT, budget=NUMPY_BUDGET, dtype="float64")
    ex["online_softmax_update"] = Exercise(
        "online_softmax_update", _CONTRACTS["online_softmax_update"], _osu_cases, _osu_run, _osu_ref, _np_tol,
        lambda c, n, idx: f"row {idx[0]}", _osu_bugs(), **np_limits)
    ex["online_softmax"] = Exercise(
        "online_softmax", _CONTRACTS["online_softmax"], _os_cases, _os_run, _os_ref, _np_tol,
        lambda c, n, idx: f"row {idx[0]}, column {idx[1]} (block {idx[1] // c.params['block_size']})",
        _os_bugs(), probe=_os_probe, **np_limits)
    ex["attention_naive"] = Exercise(
        "attention_naive", _CONTRACTS["attention_naive"], lambda rng: _attn_cases(rng, False), _naive_run,
        lambda c: {"o": _attn_ref(c)["o"]}, _np_tol, _attn_locate_np,
        _attn_bugs(False, _np_per_slice, tiles=False) + [
            Bug("wrong_axis", "softmax along the wrong axis",
                "normalise each row of S (axis=-1): each query's weights sum to 1.",
                lambda c: {"o": _wrong_axis(c)})],
        probe=_np_attn_probe(False), **np_limits)
    ex["attention_tiled"] = Exercise(
        "attention_tiled", _CONTRACTS["attention_tiled"], lambda rng: _attn_cases(rng, True), _tiled_run,
        _attn_ref, _np_tol, _attn_locate_np, _tile_skip_bugs() + _attn_bugs(True, _np_per_slice),
        probe=_np_attn_probe(True), **np_limits)
    ex.update(ex_primer.build())  # notebook 04: softmax_kernel, matmul_kernel (contracts in ex_primer.CONTRACTS)
    ex["flash_forward"] = Exercise(
        "flash_forward", _CONTRACTS["flash_forward"], _kernel_cases, _fwd_run, _fwd_ref, _kernel_tol,
        _kernel_locate, _attn_bugs(True, _kernel_per_slice) + _fwd_kernel_bugs(), probe=_fwd_probe,
        isolate=device.INTERPRET)
    ex["flash_backward"] = Exercise(
        "flash_backward", _CONTRACTS["flash_backward"], _bwd_cases, _bwd_run,
        _bwd_ref, _bwd_tol, _kernel_locate, _bwd_bugs(), isolate=device.INTERPRET, timeout=240.0)
    return ex


def _wrong_axis(case):
    i = case.inputs
    s = (i["q"] @ i["k"].T) / math.sqrt(case.params["D"])
    if case.params["causal"]:
        s = np.where(R.causal_mask(*s.shape), s, -np.inf)
    with np.errstate(all="ignore"):
        p = np.exp(s - s.max(0, keepdims=True))
        return (p / p.sum(0, keepdims=True)) @ i["v"]


EXERCISES = _build()
EXERCISES.update(ex_causal.EXERCISES)  # notebook 06: causal_loop_bounds
