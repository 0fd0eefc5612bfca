"""Part 3 (notebook 07, Triton): flash_backward, f(q, k, v, o, lse, do, dq, dk, dv, causal) -> None.

The cases are part 2's kernel cases with a dO, plus the ones only a backward can get wrong; O and
LSE come from the float64 reference.  Known mistakes: :mod:`flashlab.grader.bugs_backward`.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ... import device
from ... import reference as R
from .. import bugs_backward as BB
from .. import kernel_bugs as KB
from .. import launches, ranking
from ..core import Bug, Case, Exercise
from ..memory import SENTINEL, padded, returned, stray_writes, unwritten
from . import register
from .part2 import (_TORCH_DTYPES, FP16_ACC, KernelCase, _f64, _fwd_ref, _guard_4d, _input_strays, _kernel_cases,
                    _kernel_locate, _kernel_tol, _sync, layouts_of)

def _bwd_inputs(case):
    """O (in the input dtype) and LSE (float32) from the float64 reference, as the forward would give."""
    ref = _fwd_ref(case)
    q = case.inputs["q"]
    return (torch.from_numpy(ref["o"]).to(device=q.device, dtype=q.dtype),
            torch.from_numpy(ref["lse"]).to(device=q.device, dtype=torch.float32))


def _bwd_cases(rng):
    """The shared kernel cases (with a dO), plus the ones only a backward can get wrong."""
    cases = _kernel_cases(rng, backward=True)
    spec = [  # B, H, Nq, Nk, D, causal, dtype, max |S| (None: ordinary data), layout (dO's, or mixed)
        (1, 2, 40, 100, 16, True, "fp32", None, "mixed2"),  # keys 40..99 seen by no query: dK = dV = 0, written;
                                                            # every tensor in its own layout
        (1, 1, 48, 48, 32, True, "fp32", 1000.0, "bhnd"),   # |S| ~ 1000: P = e^(S - L) must subtract first
        (2, 2, 45, 45, 16, False, "fp32", None, "bnhd"),    # dO non-contiguous: a (B, N, H, D) buffer, transposed
        (1, 1, 33, 50, 128, True, "fp16", None, "mixed1"),  # D = 128, every tensor in its own layout
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
        if layout == "bnhd":
            params["dO layout"] = layout
        elif layout != "bhnd":
            params["layout"] = layout
        cases.append(KernelCase(params, t, False, s_max is not None))
    cases += _precision_cases(rng)
    for case in cases:
        case.inputs["o"], case.inputs["lse"] = _bwd_inputs(case)
    return cases


def _precision_cases(rng):
    """Two fp16 cases that only 16-bit arithmetic fails, with every input and gradient representable.

    Delta: dO ~ 80 and V ~ 80 (so O ~ 80) of one sign, D = 16: Delta = rowsum(dO o O) ~ 1e5, past float16's
    65504; computed or stored in float16 it is inf, and so are the gradients.  V's spread (~20) keeps
    dP - Delta ~ 6e3 well above what O's own float16 rounding moves Delta by (a few units).
    dQ: Q ~ 1e-3 (P nearly uniform), keys 0..127 at ~1000 with V ~ +40, keys 128..255 at ~750 with V ~ -40:
    dQ_i = scale sum_j dS_ij K_j runs through ~8e4 after the first 128 keys (whatever the tile size, up to
    128) and ends at ~2e4; accumulated in float16 it is inf."""
    b, h, nq, d = 1, 1, 16, 16
    out = []
    nk = 64
    q, k = 0.5 * rng.standard_normal((b, h, nq, d)), rng.standard_normal((b, h, nk, d))
    v, do = 80.0 + 20.0 * rng.standard_normal((b, h, nk, d)), 80.0 + rng.standard_normal((b, h, nq, d))
    out.append(({"q": q, "k": k, "v": v, "do": do}, nk, "dO, O ~ 80: Delta ~ 1e5 passes 65504",
                "Only a 16-bit Delta fails this case (Delta = rowsum(dO * O) ~ 1e5, past float16's "
                "largest 65504), and yours does: load O and dO with .to(tl.float32), sum in float32, and store "
                "Delta in a float32 buffer (torch.empty(..., dtype=torch.float32)), whatever the inputs' dtype."))
    nk, half = 256, 128
    q = 1e-3 * rng.standard_normal((b, h, nq, d))
    k = np.concatenate([1000.0 + rng.standard_normal((b, h, half, d)), 750.0 + rng.standard_normal((b, h, half, d))], 2)
    v = np.concatenate([40.0 + rng.standard_normal((b, h, half, d)), -40.0 + rng.standard_normal((b, h, half, d))], 2)
    do = 1.0 + 0.1 * rng.standard_normal((b, h, nq, d))
    out.append(({"q": q, "k": k, "v": v, "do": do}, nk, "K ~ 1000: the running dQ passes 65504",
                FP16_ACC.format("the running dQ passes ~8e4, past float16's largest 65504, before ending at ~2e4",
                                "dq (and dk, dv)")))
    cases = []
    for arrays, nk, check, said in out:
        t = {n: torch.from_numpy(x).to(device=device.DEVICE, dtype=torch.float16) for n, x in arrays.items()}
        params = {"B": b, "H": h, "Nq": nq, "Nk": nk, "D": d, "causal": False, "dtype": "fp16", "check": check}
        cases.append(KernelCase(params, t, False, False, said))
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
    fixed = widen * _kernel_tol(case, name, ref) + 4 * lse_max * 2.0**-24 * mag
    # the accuracy rule (flashlab/accuracy.py): at least twice the error of the same algorithm in the same
    # precision on this very case. For fp32, FA2's backward itself (P recomputed from the float32 LSE,
    # Delta = rowsum(dO o O), dS = P o (dP - Delta)) in float32: where dP is close to Delta its rounding
    # is amplified, and a fixed 1e-4 of the largest |dK| alone was beaten by a right kernel on an unlucky
    # draw (2.81e-4 against 2.70e-4)
    own = _fp32_algorithm_errors(case).get(name)
    return fixed if own is None else max(fixed, 2.0 * own + 4 * lse_max * 2.0**-24 * mag)


def _fp32_algorithm_errors(case) -> dict:
    """max |grad - float64 reference| of FA2's backward computed in float32 (fp32 cases; cached on the case)."""
    cached = getattr(case, "_fp32_errors", None)
    if cached is not None:
        return cached
    errs = {}
    if case.params["dtype"] == "fp32" and "lse" in case.inputs:
        f32 = {n: case.inputs[n].detach().float().cpu().numpy() for n in ("q", "k", "v", "o", "do", "lse")}
        p = case.params
        scale = np.float32(1.0 / math.sqrt(p["D"]))
        ref = _bwd_ref(case)
        got = {n: np.empty(ref[n].shape) for n in ("dq", "dk", "dv")}
        with np.errstate(all="ignore"):
            for b in range(p["B"]):
                for h in range(p["H"]):
                    q, k, v, o, do, lse = (f32[n][b, h] for n in ("q", "k", "v", "o", "do", "lse"))
                    s = (q @ k.T) * scale
                    if p["causal"]:
                        s = np.where(R.causal_mask(*s.shape), s, np.float32(-np.inf))
                    pm = np.exp(s - lse[:, None]).astype(np.float32)
                    delta = (do * o).sum(1, dtype=np.float32)
                    ds = pm * (do @ v.T - delta[:, None])
                    got["dv"][b, h], got["dq"][b, h], got["dk"][b, h] = pm.T @ do, (ds @ k) * scale, (ds.T @ q) * scale
        errs = {n: float(np.nanmax(np.abs(got[n] - ref[n]))) for n in got if np.isfinite(got[n]).all()}
    case._fp32_errors = errs
    return errs


def _bwd_buffers(case):
    """The inputs and outputs in poisoned padding, each in its layout (layouts_of): in the mixed cases
    dQ, dK, dV and dO each lie unlike q, k, v and o (as autograd can hand a backward)."""
    lay = layouts_of(case)
    ins = {n: _guard_4d(n, case.inputs[n], lay[n]) for n in ("q", "k", "v", "o", "do")}
    ins["lse"] = padded("lse", case.inputs["lse"], row_dim=-1)
    outs = {}
    for n, src in (("dq", "q"), ("dk", "k"), ("dv", "v")):
        t = case.inputs[src]
        outs[n] = _guard_4d(n, torch.full(t.shape, SENTINEL[t.dtype], dtype=t.dtype, device=device.DEVICE),
                            lay[n], SENTINEL[t.dtype])
    return ins, outs


def _bwd_run(f, case):
    p = case.params
    if "o" not in case.inputs:
        case.inputs["o"], case.inputs["lse"] = _bwd_inputs(case)
    ins, outs = _bwd_buffers(case)
    with launches.watch({**ins, **outs}, outputs=tuple(outs)) as w:
        f(ins["q"].view, ins["k"].view, ins["v"].view, ins["o"].view, ins["lse"].view, ins["do"].view,
          outs["dq"].view, outs["dk"].view, outs["dv"].view, p["causal"])
    _sync()
    strays = [s for s in (stray_writes(b) for b in outs.values()) if s] + _input_strays(ins, case)
    res = {n: _f64(b.view) for n, b in outs.items()}
    res["_stray"] = [str(s) for s in strays]
    res["_unwritten"] = {n: unwritten(b).cpu().numpy() for n, b in outs.items()}
    res["_violations"] = w.violations(["dq", "dk", "dv"])
    res["_buffers"] = returned({**ins, **outs})
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
            for key, title, hint, var in BB.backward_bug_variants()] + _bwd_stride_bugs()


def _bwd_read_with(case, target, source):
    """The gradients when the kernels read ``target`` with ``source``'s strides (the rest right)."""
    ins, _ = _bwd_buffers(case)
    if ins[target].view.stride() == ins[source].view.stride() or ins[target].view.shape != ins[source].view.shape:
        return None
    bad = KB.read_with_strides(ins[target], ins[source].view.stride())
    if bad is None:
        return None
    t = {n: (bad if n == target else _f64(case.inputs[n])) for n in ("q", "k", "v", "do")}
    p = case.params
    s = 1.0 / math.sqrt(p["D"])
    out = {n: np.empty(t[src].shape) for n, src in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
    with np.errstate(all="ignore"):
        for b in range(p["B"]):
            for h in range(p["H"]):
                g = R.attention_backward_naive(t["q"][b, h], t["k"][b, h], t["v"][b, h], t["do"][b, h], p["causal"], s)
                for n, x in zip(("dq", "dk", "dv"), g):
                    out[n][b, h] = x
    return out


def _bwd_stored_with(case, target, source):
    """What ``target`` holds when its kernel stores it with ``source``'s strides (NaN where not written)."""
    ins, outs = _bwd_buffers(case)
    buf = outs[target]
    strides = (ins[source] if source in ins else outs[source]).view.stride()
    if strides == buf.view.stride():
        return None
    start = (buf.view.data_ptr() - buf.flat.data_ptr()) // buf.view.element_size()
    if start + sum((n - 1) * st for n, st in zip(buf.view.shape, strides)) >= buf.flat.numel():
        return None
    ref = _bwd_ref(case)
    torch.as_strided(buf.flat, buf.view.shape, strides, start).copy_(torch.from_numpy(ref[target]).to(buf.flat.dtype))
    got = _f64(buf.view)
    got[unwritten(buf).cpu().numpy()] = np.nan
    return {**ref, target: got}


def _as_list(alt):
    return None if alt is None else [alt]


def _bwd_stride_bugs():
    """A tensor addressed with another same-shaped tensor's strides, named by both."""
    out = []
    for target, source in (("v", "k"), ("k", "v"), ("do", "o"), ("do", "q"), ("q", "do")):
        out.append(Bug(f"bwd_strides_{target}_{source}", f"`{target}` read with `{source}`'s strides",
                       f"each tensor has its own strides (the grader lays them out differently): address `{target}` "
                       f"with {target}.stride(...), not with {source}'s.",
                       (lambda t, s: lambda case: _as_list(_bwd_read_with(case, t, s)))(target, source)))
    for target, source in (("dv", "dk"), ("dk", "dv"), ("dq", "q"), ("dk", "k"), ("dv", "v")):
        out.append(Bug(f"bwd_strides_{target}_{source}", f"`{target}` stored with `{source}`'s strides",
                       f"each tensor has its own strides: store {target[1:].upper()} with {target}.stride(...), "
                       f"not with {source}'s.",
                       (lambda t, s: lambda case: _as_list(_bwd_stored_with(case, t, s)))(target, source)))
    return out


# ----------------------------------------------------------------------------
# the exercise of part 3
# ----------------------------------------------------------------------------

register(Exercise(
    "flash_backward",
    "f(q, k, v, o, lse, do, dq, dk, dv, causal) -> None. torch; Triton kernels write dQ, dK, dV "
                          "into dq, dk, dv in place. The tensors are views with padding around them: use their strides. "
                          "Scratch you allocate yourself (e.g. Delta) is not guarded by the grader's padding.",
    _bwd_cases, _bwd_run, _bwd_ref, _bwd_tol, _kernel_locate, _bwd_bugs(), isolate=device.INTERPRET,
    timeout=240.0, notebook="07", needs_triton=True, timing=ranking.BACKWARD))
