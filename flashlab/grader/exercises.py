"""The graded exercises: contracts, cases, references, tolerances, known bugs.

NumPy exercises work on one (batch, head) slice in float64.  Triton exercises
get torch tensors (B, H, N, D) that the grader allocates inside poisoned padding
(:mod:`flashlab.grader.memory`), and in the interpreter they run in a forked
child (:mod:`flashlab.grader.sandbox`).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import device
from .. import reference as R
from . import bugs as B
from .core import Bug, Case, Exercise
from .memory import output_buffer, padded, stray_writes, unwritten

# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------


def _qkv(rng, nq, nk, d, large=False):
    q, k, v = rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, d))
    if large:  # scores past 700: e^S overflows float64 unless the max is subtracted
        s_max = np.abs(q @ k.T).max() / math.sqrt(d)
        q = q * (1200.0 / max(s_max, 1e-9))
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


def _probe_v(nk, d):
    """V whose column c is the indicator of key block c: then O[i, c] = probability mass row i puts
    on key block c, so the error of O becomes an error per (query, key block)."""
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
    m_new, l_new = f(i["m"].copy(), i["l"].copy(), i["x_block"].copy())
    return {"m": np.asarray(m_new, dtype=np.float64), "l": np.asarray(l_new, dtype=np.float64)}


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
    for (r, n, b, large, vis) in [(4, 20, 8, False, True), (3, 16, 4, False, False), (5, 37, 8, False, False),
                                   (2, 10, 1, False, False), (3, 9, 32, False, False), (4, 50, 16, True, False),
                                   (1, 1, 4, False, False)]:
        x = (1000.0 if large else 3.0) * rng.standard_normal((r, n))
        cases.append(Case({"R": r, "N": n, "block_size": b}, {"x": x}, vis, large))
    return cases


def _os_run(f, case):
    return {"p": np.asarray(f(case.inputs["x"].copy(), case.params["block_size"]), dtype=np.float64)}


def _os_ref(case):
    return {"p": R.online_softmax(case.inputs["x"], case.params["block_size"])}


def _os_probe(f, case):
    got = _os_run(f, case)["p"]
    ref = _os_ref(case)["p"]
    if got.shape != ref.shape:
        return None
    with np.errstate(invalid="ignore"):
        err = np.abs(got - ref)
    err = np.where(np.isnan(err), np.inf, err)
    return _block_heat(err, 1, case.params["block_size"]), ("row", "column block")


def _os_bugs():
    return [Bug(key, title, hint, (lambda fn: lambda c: {"p": fn(c.inputs["x"], c.params["block_size"])})(fn))
            for key, title, hint, fn in B.online_softmax_bugs()]


# ----------------------------------------------------------------------------
# attention_naive and attention_tiled (NumPy, one head)
# ----------------------------------------------------------------------------

def _attn_cases(rng, tiled):
    spec = [  # Nq, Nk, D, causal, large, block_q, block_k, visible
        (32, 32, 16, False, False, 8, 8, True),
        (32, 32, 16, True, False, 8, 8, False),
        (37, 37, 16, True, False, 16, 16, False),
        (40, 70, 8, False, False, 16, 8, False),
        (40, 70, 8, True, False, 8, 16, False),
        (70, 40, 16, True, False, 16, 16, False),
        (48, 48, 16, True, True, 16, 16, False),
        (1, 1, 8, True, False, 4, 4, False),
        (20, 20, 32, False, False, 64, 64, False),
    ]
    cases = []
    for nq, nk, d, causal, large, bq, bk, vis in spec:
        q, k, v = _qkv(rng, nq, nk, d, large)
        params = {"Nq": nq, "Nk": nk, "D": d, "causal": causal}
        if tiled:
            params.update(block_q=bq, block_k=bk)
        cases.append(Case(params, {"q": q, "k": k, "v": v}, vis, large))
    return cases


def _naive_run(f, case):
    i = case.inputs
    return {"o": np.asarray(f(i["q"].copy(), i["k"].copy(), i["v"].copy(), case.params["causal"]), dtype=np.float64)}


def _tiled_call(f, case, v):
    p, i = case.params, case.inputs
    out = f(i["q"].copy(), i["k"].copy(), v.copy(), p["causal"], p["block_q"], p["block_k"])
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"attention_tiled must return a tuple (o, lse), got {type(out).__name__}")
    return np.asarray(out[0], dtype=np.float64), np.asarray(out[1], dtype=np.float64)


def _tiled_run(f, case):
    o, lse = _tiled_call(f, case, case.inputs["v"])
    return {"o": o, "lse": lse}


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
        v, width, nblocks = _probe_v(p["Nk"], p["D"])
        got = _tiled_call(f, case, v)[0] if tiled else np.asarray(
            f(i["q"].copy(), i["k"].copy(), v, p["causal"]), dtype=np.float64)
        ref = R.attention_naive(i["q"], i["k"], v, p["causal"])[0]
        if got.shape != ref.shape:
            return None
        rows = p.get("block_q", 8)
        return _heat_from_mass(got, ref, width, nblocks, rows), (f"query block ({rows} rows)",
                                                                 f"key block ({width} keys)")
    return probe


def _attn_bugs(with_lse: bool, per_slice):
    """Wrap the attention bug library for an exercise; ``per_slice`` maps a slice function over the case."""
    out = []
    for key, title, hint, fn in B.attention_bugs():
        def outputs(case, fn=fn):
            alts = []
            for bk in _block_sizes(case):
                res = per_slice(case, lambda q, k, v, c, s: fn(q, k, v, c, s, bk))
                if res is None:
                    return None
                alts.append(res if with_lse else {"o": res["o"]})
                if key not in ("forgot_alpha", "forgot_alpha_l", "divide_alpha", "unmasked_tail"):
                    break
            return alts
        out.append(Bug(key, title, hint, outputs))
    if with_lse:
        for key, title, hint, fn in B.lse_bugs():
            def outputs(case, fn=fn):
                def one(q, k, v, c, s):
                    o, lse = R.attention_naive(q, k, v, c, s)
                    return fn(o, lse, B.row_max(q, k, c, s))
                return per_slice(case, one)
            out.append(Bug(key, title, hint, outputs))
    return out


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
    cases = []
    for b, h, nq, nk, d, causal, dt, large, vis in spec:
        mag = 10.0 if large else 1.0
        q = mag * rng.standard_normal((b, h, nq, d))
        k = mag * rng.standard_normal((b, h, nk, d))
        v = rng.standard_normal((b, h, nk, d))
        dtype = _TORCH_DTYPES[dt]
        t = {n: torch.from_numpy(x).to(device=device.DEVICE, dtype=dtype) for n, x in (("q", q), ("k", k), ("v", v))}
        if backward:
            t["do"] = torch.from_numpy(rng.standard_normal((b, h, nq, d))).to(device=device.DEVICE, dtype=dtype)
        params = {"B": b, "H": h, "Nq": nq, "Nk": nk, "D": d, "causal": causal, "dtype": dt}
        cases.append(Case(params, t, vis, large))
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


def _guard_inputs(case, names):
    return {n: padded(n, case.inputs[n]) for n in names}


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
    o = output_buffer("o", q.shape, q.dtype, q.device)
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


def _bwd_run(f, case):
    p = case.params
    o_t, lse_t = _bwd_inputs(case)
    case.inputs.setdefault("o", o_t)
    case.inputs.setdefault("lse", lse_t)
    ins = {n: padded(n, case.inputs[n], row_dim=-1 if n == "lse" else -2) for n in ("q", "k", "v", "o", "lse", "do")}
    outs = {n: output_buffer(n, case.inputs[src].shape, case.inputs[src].dtype, device.DEVICE)
            for n, src in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
    f(ins["q"].view, ins["k"].view, ins["v"].view, ins["o"].view, ins["lse"].view, ins["do"].view,
      outs["dq"].view, outs["dk"].view, outs["dv"].view, p["causal"])
    _sync()
    strays = [s for s in (stray_writes(b) for b in outs.values()) if s] + _input_strays(ins, case)
    res = {n: _f64(b.view) for n, b in outs.items()}
    res["_stray"] = [str(s) for s in strays]
    res["_unwritten"] = {n: unwritten(b).cpu().numpy() for n, b in outs.items()}
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


def _bwd_bugs():
    return [Bug(key, title, hint, (lambda fn: lambda case: _bwd_per_slice(case, fn))(fn))
            for key, title, hint, fn in B.backward_bugs()]


# ----------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------

_CONTRACTS = {
    "online_softmax_update": "f(m, l, x_block) -> (m_new, l_new). m, l: (R,); x_block: (R, C), float64. The running "
                             "max and sum after seeing x_block (start: m = -inf, l = 0).",
    "online_softmax": "f(x, block_size) -> p. softmax of x (R, N) along the last axis, in one pass over blocks of "
                      "block_size columns.",
    "attention_naive": "f(q, k, v, causal) -> o. NumPy float64; q (Nq, D), k and v (Nk, D); scale 1/sqrt(D); "
                       "causal top-left (query i sees keys j <= i).",
    "attention_tiled": "f(q, k, v, causal, block_q, block_k) -> (o, lse). NumPy, FA2 loop order (outer loop over Q "
                       "tiles); lse is the natural-log log-sum-exp of each row's scaled scores.",
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
    ex["online_softmax_update"] = Exercise(
        "online_softmax_update", _CONTRACTS["online_softmax_update"], _osu_cases, _osu_run, _osu_ref, _np_tol,
        lambda c, n, idx: f"row {idx[0]}", _osu_bugs())
    ex["online_softmax"] = Exercise(
        "online_softmax", _CONTRACTS["online_softmax"], _os_cases, _os_run, _os_ref, _np_tol,
        lambda c, n, idx: f"row {idx[0]}, column {idx[1]} (block {idx[1] // c.params['block_size']})",
        _os_bugs(), probe=_os_probe)
    ex["attention_naive"] = Exercise(
        "attention_naive", _CONTRACTS["attention_naive"], lambda rng: _attn_cases(rng, False), _naive_run,
        lambda c: {"o": _attn_ref(c)["o"]}, _np_tol, _attn_locate_np,
        _attn_bugs(False, _np_per_slice) + [Bug("wrong_axis", "softmax along the wrong axis",
                                                "normalise each row of S (axis=-1): each query's weights sum to 1.",
                                                lambda c: {"o": _wrong_axis(c)})],
        probe=_np_attn_probe(False))
    ex["attention_tiled"] = Exercise(
        "attention_tiled", _CONTRACTS["attention_tiled"], lambda rng: _attn_cases(rng, True), _tiled_run,
        _attn_ref, _np_tol, _attn_locate_np, _attn_bugs(True, _np_per_slice), probe=_np_attn_probe(True))
    ex["flash_forward"] = Exercise(
        "flash_forward", _CONTRACTS["flash_forward"], _kernel_cases, _fwd_run, _fwd_ref, _kernel_tol,
        _kernel_locate, _attn_bugs(True, _kernel_per_slice), probe=_fwd_probe,
        isolate=device.INTERPRET)
    ex["flash_backward"] = Exercise(
        "flash_backward", _CONTRACTS["flash_backward"], lambda rng: _kernel_cases(rng, backward=True), _bwd_run,
        _bwd_ref, _kernel_tol, _kernel_locate, _bwd_bugs(), isolate=device.INTERPRET, timeout=240.0)
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
