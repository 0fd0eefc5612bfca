"""Part 2 (notebooks 04-06, Triton): softmax_kernel and matmul_kernel (the primer, notebook 04),
flash_forward (notebook 05), causal_loop_bounds (notebook 06; plain Python, no Triton needed).

The kernel exercises hand the learner torch tensors that are *views into poisoned buffers*
(:mod:`flashlab.grader.memory`): NaN around inputs, a sentinel around outputs, some of them
transposed views.  A kernel that ignores ``.stride()``, or reads past the end of a row, reads NaN;
one that stores past it changes a sentinel.  In the interpreter every case runs in a forked
child (:mod:`flashlab.grader.sandbox`), so a wild store is a report.  Known mistakes are runnable
NumPy (or torch) code that computes what a kernel *with that mistake* returns on a case, so the
grader can name it.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ... import device
from ... import reference as R
from ...bounds import causal_tile_ranges
from .. import kernel_bugs as KB
from .. import launches, ranking
from ..core import Bug, Case, Exercise
from ..memory import SENTINEL, hand_over, output_buffer, padded, returned, stray_writes, unwritten
from . import register
from .part1 import _attn_bugs, _heat_from_mass, _probe_v

# ----------------------------------------------------------------------------
# notebook 04: 2-D matrices
# ----------------------------------------------------------------------------

_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


class MatrixCase(Case):
    """A case on 2-D matrices: described by its sizes, dtype and the layout of each operand."""

    def describe(self) -> str:
        p = self.params
        bits = [f"{k}={p[k]}" for k in ("M", "N", "K") if k in p] + [p["dtype"]]
        bits += [f"{k} transposed" for k in ("x", "y", "a", "b") if p.get(k) == "transposed"]
        if self.large:
            bits.append("|x| ~ 1e4")
        if "check" in p:
            bits.append(p["check"])
        return ", ".join(bits)


# ----------------------------------------------------------------------------
# buffers: 2-D views with padding columns, row-major or transposed
# ----------------------------------------------------------------------------

def guarded_2d(name: str, values: torch.Tensor, layout: str = "rows", fill: float | None = None):
    """A Padded whose ``view`` holds ``values`` (M, N).

    layout "rows": the buffer is (M, N + 8), the view its first N columns: strides (N + 8, 1).
    layout "transposed": the buffer is (N, M + 8) and the view its transpose: strides (1, M + 8).
    """
    if layout == "rows":
        return padded(name, values, fill, row_dim=-1)
    buf = padded(name, values.t(), fill, row_dim=-1)
    return dataclasses.replace(buf, view=buf.view.t())


def output_2d(name: str, shape, dtype, layout: str = "rows"):
    full = torch.full(tuple(shape), SENTINEL[dtype], dtype=dtype, device=device.DEVICE)
    return guarded_2d(name, full, layout, SENTINEL[dtype])


def as_contiguous_read(buf) -> np.ndarray | None:
    """What a kernel reads if it assumes ``buf.view`` is a contiguous (M, N) matrix (strides (N, 1))
    starting at the view's first element: float64, NaN where that lands in padding; None if it
    would run off the allocation."""
    m, n = buf.view.shape
    start = (buf.view.data_ptr() - buf.flat.data_ptr()) // buf.view.element_size()
    if start + m * n > buf.flat.numel():
        return None
    return buf.flat[start:start + m * n].view(m, n).double().cpu().numpy()


def _f64(t):
    return t.detach().double().cpu().numpy()


def _sync():
    if device.DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _strays(inputs: dict, outputs: dict, case) -> list:
    out = [str(s) for s in (stray_writes(b) for b in outputs.values()) if s]
    for n, b in inputs.items():
        if not torch.equal(torch.nan_to_num(b.view, 7.0), torch.nan_to_num(case.inputs[n], 7.0)):
            out.append(f"the input `{n}` was modified (inputs are read-only)")
    return out


def _tol(rel_by_dtype):
    def tol(case, name, ref):
        mag = max(1.0, float(np.nanmax(np.abs(np.where(np.isfinite(ref), ref, 0)))))
        return rel_by_dtype(case) * mag
    return tol


# ----------------------------------------------------------------------------
# softmax_kernel:  y = softmax(x) along the last axis
# ----------------------------------------------------------------------------

def _softmax_cases(rng):
    spec = [  # M, N, dtype, layout, magnitude, visible
        (8, 100, "fp32", "rows", 3.0, True),
        (5, 37, "fp32", "rows", 3.0, False),       # N not a power of two
        (6, 5, "fp32", "rows", 3.0, False),        # N shorter than any sensible block
        (4, 300, "fp32", "rows", 1e4, False),      # values around +-1e4: e^x overflows without the max
        (7, 50, "fp32", "transposed", 3.0, False),  # x and y are transposed views: stride (1, M + 8)
        (9, 77, "fp16", "rows", 3.0, False),
        (3, 33, "fp16", "transposed", 1e4, False),
        (1, 1, "fp32", "rows", 3.0, False),
    ]
    if device.DEVICE.type == "cuda":
        spec += [(512, 3000, "fp16", "rows", 3.0, False), (300, 1000, "bf16", "transposed", 3.0, False),
                 (1000, 4097, "fp32", "rows", 1e4, False)]
    cases = []
    for i, (m, n, dt, layout, mag, vis) in enumerate(spec):
        x = torch.from_numpy(mag * rng.standard_normal((m, n))).to(device=device.DEVICE, dtype=_DTYPES[dt])
        params = {"M": m, "N": n, "dtype": dt, "x": layout}
        if i in (2, 6):   # y laid out unlike x (y = a transposed view of its buffer, or x is): y with x's strides fails
            params["y"] = "rows" if layout == "transposed" else "transposed"
        cases.append(MatrixCase(params, {"x": x}, vis, mag > 100))
    return cases


def _softmax_buffers(case):
    return guarded_2d("x", case.inputs["x"], case.params["x"])


def _softmax_run(f, case):
    x = _softmax_buffers(case)
    y = output_2d("y", x.view.shape, x.view.dtype, case.params.get("y", case.params["x"]))
    with launches.watch({"x": x, "y": y}, outputs=("y",)) as w:
        f(x.view, y.view)
    _sync()
    return {"y": _f64(y.view), "_stray": _strays({"x": x}, {"y": y}, case),
            "_unwritten": {"y": unwritten(y).cpu().numpy()}, "_violations": w.violations(["y"]),
            "_buffers": returned({"x": x, "y": y})}


def softmax_rows(x: np.ndarray, extra_zeros: int = 0, subtract_max: bool = True, dtype=np.float64):
    """Row softmax of x (M, N) in ``dtype``; ``extra_zeros`` phantom zeros per row join the max and sum."""
    x = x.astype(dtype)
    with np.errstate(all="ignore"):
        m = x.max(1, keepdims=True) if subtract_max else np.zeros((x.shape[0], 1), dtype)
        if extra_zeros:
            m = np.maximum(m, 0)
        e = np.exp(x - m)
        total = e.sum(1, keepdims=True) + extra_zeros * np.exp(-m)
        return (e / total).astype(np.float64)


def _softmax_ref(case):
    return {"y": softmax_rows(_f64(case.inputs["x"]))}


def _pow2_at_least(n):
    return 1 << max(0, (n - 1).bit_length())


def _softmax_bugs():
    def other_zero(case):
        x, n = _f64(case.inputs["x"]), case.params["N"]
        blocks = sorted({_pow2_at_least(n), max(16, _pow2_at_least(n)), 2 * _pow2_at_least(n), 1024})
        return [{"y": softmax_rows(x, b - n)} for b in blocks if b >= n]  # b == n: the bug has no effect

    def strides_ignored(case):
        x = as_contiguous_read(_softmax_buffers(case))
        return None if x is None else {"y": softmax_rows(x)}

    return [
        Bug("no_max", "no max subtraction",
            "e^x overflows (float32: x > 88; here |x| ~ 1e4): subtract the row max first, "
            "softmax(x) = e^(x - max x) / sum e^(x - max x).",
            lambda c: {"y": softmax_rows(_f64(c.inputs["x"]), subtract_max=False, dtype=np.float32)}),
        Bug("other_zero", "masked lanes loaded as 0 instead of -inf",
            "the lanes past N must not count: load with other=-float('inf') so that they do not raise the max "
            "and add e^(-inf) = 0 to the sum (with other=0 each adds e^(0 - max)).", other_zero),
        Bug("wrong_axis", "softmax along the wrong axis",
            "each row of y must sum to 1: reduce along axis 1 (the columns of one row).",
            lambda c: {"y": softmax_rows(_f64(c.inputs["x"]).T).T}),
        Bug("strides_ignored", "strides ignored (x read as if it were contiguous)",
            "x is a view: element (i, j) is at x_ptr + i * x.stride(0) + j * x.stride(1). Pass the strides "
            "to the kernel and use them, for y too.", strides_ignored),
        Bug("y_strides_from_x", "`y` stored with `x`'s strides",
            "x and y have their own strides (here one is a transposed view and the other is not): store with "
            "y.stride(0) and y.stride(1).", lambda c: _y_stored_with_x_strides(c)),
    ]


def _y_stored_with_x_strides(case):
    """What y holds when the kernel stores it with x's strides (sentinel where it never wrote)."""
    x = _softmax_buffers(case)
    y = output_2d("y", x.view.shape, x.view.dtype, case.params.get("y", case.params["x"]))
    if x.view.stride() == y.view.stride():
        return None
    start = (y.view.data_ptr() - y.flat.data_ptr()) // y.view.element_size()
    if start + sum((n - 1) * st for n, st in zip(y.view.shape, x.view.stride())) >= y.flat.numel():
        return None
    ref = _softmax_ref(case)["y"]
    torch.as_strided(y.flat, y.view.shape, x.view.stride(), start).copy_(torch.from_numpy(ref).to(y.flat.dtype))
    return {"y": _f64(y.view)}


def _softmax_locate(case, name, idx):
    return (f"row {idx[0]}, column {idx[1]}: the program with program_id(0) = {idx[0]} if each program "
            f"does one row")


# ----------------------------------------------------------------------------
# matmul_kernel:  C = A B, float32 accumulator
# ----------------------------------------------------------------------------

def _matmul_cases(rng):
    spec = [  # M, N, K, dtype, layout of a, layout of b, visible
        (64, 48, 32, "fp32", "rows", "rows", True),
        (37, 45, 53, "fp32", "rows", "rows", False),          # ragged M, N, K: a K tail
        (50, 70, 33, "fp16", "rows", "rows", False),
        (40, 24, 56, "fp32", "transposed", "rows", False),    # a = a_t.T
        (33, 40, 20, "fp16", "rows", "transposed", False),    # b = b_t.T
        (20, 20, 7, "fp32", "transposed", "transposed", False),  # K shorter than a block
        (24, 40, 1, "fp32", "rows", "rows", False),           # K = 1: one partial block
        (1, 1, 1, "fp32", "rows", "rows", False),
        (16, 24, FP32_ACC_K, "fp16", "rows", "rows", False),   # positive entries: checks fp32 accumulation
    ]
    if device.DEVICE.type == "cuda":
        spec += [(1000, 1000, 1000, "fp16", "rows", "rows", False),
                 (513, 257, 1031, "bf16", "transposed", "rows", False),
                 (300, 200, 129, "fp32", "rows", "transposed", False)]
    cases = []
    for m, n, k, dt, la, lb, vis in spec:
        dtype = _DTYPES[dt]
        params = {"M": m, "N": n, "K": k, "dtype": dt, "a": la, "b": lb}
        if k == FP32_ACC_K:
            params["check"] = "positive entries (fp32 accumulation)"
            a, b = rng.uniform(0.5, 1.5, (m, k)), rng.uniform(0.5, 1.5, (k, n))
        else:
            a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        a, b = (torch.from_numpy(x).to(device=device.DEVICE, dtype=dtype) for x in (a, b))
        cases.append(MatrixCase(params, {"a": a, "b": b}, vis))
    return cases


# The fp32-accumulation case: fp16 inputs, K = 2048 entries in [0.5, 1.5], so |C| ~ 2100.  Accumulating in
# float32 and rounding once at the store is off by at most 2^-11 |C| (the rounding) + K 2^-24 sum|a||b|
# (the sums) <= 6.1e-4 max|C|; its tolerance is 8e-4 max|C|.  An fp16 accumulator rounds after every
# BLOCK_K chunk, at a spacing of 1-2 near |C| ~ 1000-2100: 1.0e-3 to 5e-3 max|C| for BLOCK_K 16 to 256
# (tests/test_primer.py checks it on fresh draws).
FP32_ACC_K = 2048
FP32_ACC_REL = 8e-4


def _matmul_buffers(case):
    p = case.params
    return {"a": guarded_2d("a", case.inputs["a"], p["a"]), "b": guarded_2d("b", case.inputs["b"], p["b"])}


def _matmul_run(f, case):
    ins = _matmul_buffers(case)
    a, b = ins["a"].view, ins["b"].view
    c = output_2d("c", (a.shape[0], b.shape[1]), a.dtype)
    with launches.watch({**ins, "c": c}, outputs=("c",)) as w:
        f(a, b, c.view)
    _sync()
    return {"c": _f64(c.view), "_stray": _strays(ins, {"c": c}, case),
            "_unwritten": {"c": unwritten(c).cpu().numpy()}, "_violations": w.violations(["c"]),
            "_buffers": returned({**ins, "c": c})}


def _matmul_ref(case):
    return {"c": _f64(case.inputs["a"]) @ _f64(case.inputs["b"])}


def _matmul_tol_rel(case):
    dt = case.params["dtype"]
    if "check" in case.params:
        return FP32_ACC_REL
    if dt == "fp32":
        return 1e-5 if device.INTERPRET else 5e-3     # on a GPU, tl.dot on fp32 may use TF32
    return {"fp16": 1e-2, "bf16": 4e-2}[dt]


def _matmul_bugs():
    def k_tail_dropped(case):
        a, b, k = _f64(case.inputs["a"]), _f64(case.inputs["b"]), case.params["K"]
        cuts = sorted({k // bk * bk for bk in (16, 32, 64, 128)})
        return [{"c": a[:, :kf] @ b[:kf]} for kf in cuts]  # kf == K: no tail, the bug has no effect

    def strides_ignored(case):
        ins = _matmul_buffers(case)
        a, b = as_contiguous_read(ins["a"]), as_contiguous_read(ins["b"])
        if a is None or b is None:
            return None
        with np.errstate(all="ignore"):
            return {"c": a @ b}

    def fp16_accumulator(case):
        if case.params["dtype"] != "fp16":
            return None
        a, b = (case.inputs[n].float().cpu().numpy() for n in "ab")
        alts = []
        for bk in (16, 32, 64, 128, 256):
            acc = np.zeros((a.shape[0], b.shape[1]), np.float16)
            for k0 in range(0, a.shape[1], bk):
                acc = (acc.astype(np.float32) + a[:, k0:k0 + bk] @ b[k0:k0 + bk]).astype(np.float16)
            alts.append({"c": acc.astype(np.float64)})
        return alts

    return [
        Bug("fp16_accumulator", "accumulator in fp16",
            "with fp16 inputs the accumulator must still be float32 (acc = tl.zeros(..., dtype=tl.float32), "
            "acc = tl.dot(a, b, acc)), cast to C's dtype once, at the store: an fp16 accumulator rounds after "
            "every BLOCK_K chunk, and with |C| in the thousands its spacing is 1 or 2.", fp16_accumulator),
        Bug("k_tail_dropped", "K tail dropped",
            "the loop over K must cover cdiv(K, BLOCK_K) blocks, the last one masked "
            "(offs_k < K, other=0.0), so the tail's products are added.", k_tail_dropped),
        Bug("strides_ignored", "strides ignored (a or b read as if contiguous)",
            "a and b are views, some of them transposed: element (i, k) of a is at "
            "a_ptr + i * a.stride(0) + k * a.stride(1). Use all four strides.", strides_ignored),
    ]


def _matmul_locate(case, name, idx):
    i, j = idx
    return (f"C[{i}, {j}]: the program for the tile (pid_m, pid_n) = ({i} // BLOCK_M, {j} // BLOCK_N), "
            f"row {i} % BLOCK_M and column {j} % BLOCK_N of its tile")




# ----------------------------------------------------------------------------
# notebook 05: flash_forward (torch tensors (B, H, N, D) in poisoned padding)
# ----------------------------------------------------------------------------

_TORCH_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


class KernelCase(Case):
    """A flash_forward / flash_backward case: names every tensor not in the plain layout (each is a view
    into a padded buffer; see LAYOUTS)."""

    def describe(self) -> str:
        text = super().describe()
        lay = layouts_of(self)
        odd = [f"{n} {LAYOUT_WORDS[l]}" for n, l in lay.items() if l != "BHND"]
        if odd:
            text += ", " + ", ".join(odd)
        return text


# How a (B, H, N, D) tensor lies in its padded buffer.  Same-shaped tensors get different layouts in the
# "mixed" cases, so that a kernel addressing one with another's strides reads or writes the wrong places.
LAYOUTS = ("BHND", "BNHD", "HBND", "BHND+D")
LAYOUT_WORDS = {"BHND": "(B, H, N, D)", "BNHD": "a (B, N, H, D) view", "HBND": "an (H, B, N, D) buffer",
                "BHND+D": "rows padded to D + 8"}
MIXED = {   # tensor -> layout, per mixed case kind
    "mixed1": {"q": "BNHD", "k": "HBND", "v": "BHND+D", "o": "BHND", "do": "HBND", "dq": "BHND+D",
               "dk": "BNHD", "dv": "BHND"},
    "mixed2": {"q": "BHND+D", "k": "BHND", "v": "BNHD", "o": "HBND", "do": "BNHD", "dq": "HBND",
               "dk": "BHND+D", "dv": "BNHD"},
}


def layouts_of(case) -> dict:
    """Tensor name -> layout for a kernel case."""
    p = case.params
    kind = p.get("layout", "BHND")
    names = ["q", "k", "v", "o"] + (["do", "dq", "dk", "dv"] if "do" in case.inputs else [])
    if kind in MIXED:
        return {n: MIXED[kind][n] for n in names}
    out = {n: kind for n in names}
    if p.get("dO layout") == "bnhd":
        out["do"] = "BNHD"
    return out


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
            (2, 2, 40, 40, 16, False, "fp32", None, "mixed1"),  # q, k, v, o each in its own layout
            (1, 2, 33, 47, 16, True, "fp16", None, "mixed2"),   # another assignment, Nq != Nk
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
    if not backward:
        cases.append(_acc_overflow_case(rng))
    return cases


FP16_ACC = ("Only a 16-bit accumulator fails this case ({}), and yours does: keep {} in float32 "
            "(tl.zeros(..., dtype=tl.float32)) and add every tile's tl.dot to it in float32; convert to the "
            "output's dtype once, when storing.")


def _acc_overflow_case(rng):
    """fp16, V ~ 2000 with one sign, Q ~ 1e-3 (attention nearly uniform over 128 keys): the unnormalised
    sum of P V reaches ~2.6e5, past float16's 65504, after a few tiles, while O ~ 2000 is representable.
    A float32 acc gets O to fp16's rounding; an acc kept in float16 (allocated so, or rounded every tile)
    turns into inf."""
    b, h, nq, nk, d = 1, 1, 16, 128, 16
    q = 1e-3 * rng.standard_normal((b, h, nq, d))
    k = rng.standard_normal((b, h, nk, d))
    v = 2000.0 + 20.0 * rng.standard_normal((b, h, nk, d))
    t = {n: torch.from_numpy(x).to(device=device.DEVICE, dtype=torch.float16)
         for n, x in (("q", q), ("k", k), ("v", v))}
    params = {"B": b, "H": h, "Nq": nq, "Nk": nk, "D": d, "causal": False, "dtype": "fp16",
              "check": "V ~ 2000: the running sum of P V passes 65504"}
    return KernelCase(params, t, False, False,
                      FP16_ACC.format("the running sum of P V reaches ~2.6e5, past float16's largest 65504", "acc"))


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
    """A poisoned buffer for a (B, H, N, D) tensor laid out as ``layout`` (LAYOUTS): "BHND" rows padded
    (N + 8 per (batch, head)); "BNHD": a (B, N + 8, H, D) buffer seen transposed, as a model's activations
    passed as q.transpose(1, 2); "HBND": an (H, B, N + 8, D) buffer seen permuted (stride_b < stride_h);
    "BHND+D": (B, H, N + 8, D + 8), each row padded too (stride_n = D + 8)."""
    if layout == "BNHD":
        buf = padded(name, values.transpose(1, 2), fill, row_dim=1)
        return dataclasses.replace(buf, view=buf.view.transpose(1, 2))
    if layout == "HBND":
        buf = padded(name, values.transpose(0, 1), fill)
        return dataclasses.replace(buf, view=buf.view.transpose(0, 1))
    if layout == "BHND+D":
        b, h, n, d = values.shape
        fill_v = float("nan") if fill is None else fill
        wide = torch.full((b, h, n, d + 8), fill_v, dtype=values.dtype, device=values.device)
        wide[..., :d] = values
        buf = padded(name, wide, fill)
        return dataclasses.replace(buf, view=buf.view[..., :d])
    return padded(name, values, fill)


def _guard_inputs(case, names):
    lay = layouts_of(case)
    return {n: _guard_4d(n, case.inputs[n], lay.get(n, "BHND")) for n in names}


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
                  layouts_of(case)["o"], SENTINEL[q.dtype])
    lse = output_buffer("lse", q.shape[:3], torch.float32, q.device, row_dim=-1)
    with launches.watch({**ins, "o": o, "lse": lse}, outputs=("o", "lse")) as w:
        f(q, ins["k"].view, ins["v"].view, o.view, lse.view, p["causal"])
    _sync()
    strays = [s for s in (stray_writes(o), stray_writes(lse)) if s]
    if v_override is None:
        strays += _input_strays(ins, case)
    return {"o": _f64(o.view), "lse": _f64(lse.view), "_stray": [str(s) for s in strays],
            "_unwritten": {"o": unwritten(o).cpu().numpy(), "lse": unwritten(lse).cpu().numpy()},
            "_violations": w.violations(["o", "lse"]),
            "_buffers": returned({**ins, "o": o, "lse": lse}) if v_override is None else {}}


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
    return _fwd_from(case, _f64(case.inputs["q"]), k, v)


def _fwd_from(case, q, k, v):
    p = case.params
    s = 1.0 / math.sqrt(p["D"])
    o, lse = np.empty(q.shape), np.empty(q.shape[:3])
    with np.errstate(all="ignore"):
        for b in range(p["B"]):
            for h in range(p["H"]):
                o[b, h], lse[b, h] = R.attention_naive(q[b, h], k[b, h], v[b, h], p["causal"], s)
    return {"o": o, "lse": lse}


def _read_with(case, target, source):
    """``target`` read with ``source``'s strides (both inputs), the others right."""
    ins = _guard_inputs(case, "qkv")
    if ins[target].view.stride() == ins[source].view.stride():
        return None
    bad = KB.read_with_strides(ins[target], ins[source].view.stride())
    if bad is None:
        return None
    t = {n: (bad if n == target else _f64(case.inputs[n])) for n in "qkv"}
    return _fwd_from(case, t["q"], t["k"], t["v"])


def _o_stored_with(case, source):
    """O stored with ``source``'s strides from o's base pointer: what o then holds (sentinel where not written)."""
    ins = _guard_inputs(case, "qkv")
    q = ins["q"].view
    o = _guard_4d("o", torch.full(q.shape, SENTINEL[q.dtype], dtype=q.dtype, device=q.device),
                  layouts_of(case)["o"], SENTINEL[q.dtype])
    strides = ins[source].view.stride()
    if strides == o.view.stride():
        return None
    ref = _fwd_ref(case)
    start = (o.view.data_ptr() - o.flat.data_ptr()) // o.view.element_size()
    hi = start + sum((n - 1) * st for n, st in zip(o.view.shape, strides))
    if hi >= o.flat.numel():
        return None
    torch.as_strided(o.flat, o.view.shape, strides, start).copy_(torch.from_numpy(ref["o"]).to(o.flat.dtype))
    return {"o": _f64(o.view), "lse": ref["lse"]}


def _stride_pair_bugs():
    """One known bug per pair of same-shaped tensors: read (or stored) with the other's strides."""
    out = []
    for target, source in (("v", "k"), ("k", "v"), ("k", "q"), ("v", "q"), ("q", "k")):
        out.append(Bug(f"strides_{target}_{source}", f"`{target}` read with `{source}`'s strides",
                       f"each tensor has its own strides (the grader lays out q, k, v, o differently): address "
                       f"`{target}` with {target}.stride(...), not with {source}'s.",
                       (lambda t, s: lambda case: _read_with(case, t, s))(target, source)))
    for source in ("q", "k", "v"):
        out.append(Bug(f"strides_o_{source}", f"`o` stored with `{source}`'s strides",
                       f"each tensor has its own strides: store O with o.stride(...), not with {source}'s.",
                       (lambda s: lambda case: _o_stored_with(case, s))(source)))
    return out


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
            Bug(*KB.WRONG_STRIDE, _fwd_wrong_stride)] + _stride_pair_bugs()


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



# ----------------------------------------------------------------------------
# notebook 06: causal_loop_bounds, f(start_m, block_m, block_n, nq, nk) -> (unmasked_end, end) for one Q
# tile, compared for every Q tile with flashlab.bounds.causal_tile_ranges (plain integers)
# ----------------------------------------------------------------------------


# (nq, nk, block_m, block_n): block_m != block_n both ways, Nq != Nk, ragged last tiles
CAUSAL_SHAPES = [(256, 256, 64, 64), (300, 300, 128, 64), (300, 300, 32, 64), (100, 250, 64, 32),
          (250, 100, 64, 128), (129, 129, 128, 32), (1, 1, 16, 16), (515, 515, 128, 128), (77, 200, 32, 16)]


def _causal_cases(rng):
    cases = []
    for i, (nq, nk, bm, bn) in enumerate(CAUSAL_SHAPES):
        cases.append(Case({"Nq": nq, "Nk": nk, "block_q": bm, "block_k": bn}, {}, visible=(i == 0)))
    nq, nk = (int(x) for x in rng.integers(50, 700, size=2))        # fresh, ragged
    bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
    cases.append(Case({"Nq": nq, "Nk": nk, "block_q": bm, "block_k": bn}, {}))
    return cases


def _causal_collect(fn, case):
    p = case.params
    rows = []
    for start_m in range(-(-p["Nq"] // p["block_q"])):
        out = fn(start_m, p["block_q"], p["block_k"], p["Nq"], p["Nk"])
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"return a pair (unmasked_end, end), got {out!r}")
        rows.append([float(out[0]), float(out[1])])
    a = np.asarray(rows, dtype=np.float64)
    return {"unmasked_end": a[:, 0], "end": a[:, 1]}


def _causal_run(f, case):
    return _causal_collect(f, case)


def _causal_ref(case):
    return _causal_collect(lambda s, bm, bn, nq, nk: causal_tile_ranges(s, bm, bn, nq, nk, True), case)


def _causal_locate(case, name, idx):
    s = idx[0]
    bm = case.params["block_q"]
    return f"Q tile {s} (rows {s * bm} to {(s + 1) * bm - 1})"


def _causal_bug(fn):
    return lambda case: _causal_collect(fn, case)


CAUSAL_BUGS = [
    Bug("end_not_clipped", "end not clipped to Nk",
        "the last Q tiles would read K/V rows past Nk (or loop over nothing): end = min((start_m + 1) * block_m, nk).",
        _causal_bug(lambda s, bm, bn, nq, nk: causal_tile_ranges(s, bm, bn, nq, nk)[0:1] + ((s + 1) * bm,))),
    Bug("unmasked_not_whole_tiles", "unmasked_end not a whole number of K tiles",
        "with block_m != block_n, start_m * block_m may fall inside a K tile: that tile crosses the diagonal and "
        "needs the mask. Round down to a multiple of block_n.",
        _causal_bug(lambda s, bm, bn, nq, nk: (min(s * bm, nk // bn * bn), min((s + 1) * bm, nk)))),
    Bug("ragged_tile_unmasked", "the ragged last K tile counted as unmasked",
        "a K tile that runs past Nk needs the mask on its loads (and scores): cap unmasked_end at "
        "(nk // block_n) * block_n.",
        _causal_bug(lambda s, bm, bn, nq, nk: (s * bm // bn * bn, min((s + 1) * bm, nk)))),
    Bug("wrong_block_size", "the Q tile's end measured in K tiles",
        "the last key a row of this tile can see is its last row, (start_m + 1) * block_m - 1: use block_m.",
        _causal_bug(lambda s, bm, bn, nq, nk: (causal_tile_ranges(s, bm, bn, nq, nk)[0], min((s + 1) * bn, nk)))),
]


# ----------------------------------------------------------------------------
# the exercises of part 2
# ----------------------------------------------------------------------------

_KERNEL = dict(isolate=device.INTERPRET, needs_triton=True)

register(Exercise(
    "softmax_kernel",
    "f(x, y) -> None. torch; x (M, N) float32 or float16, any strides; launch a Triton kernel that "
                          "writes softmax(x) along the last axis into y ((M, N), the dtype of x), in place. x and y are "
                          "views with padding around them (some transposed): use their strides; N need not be a "
                          "power of two.",
    _softmax_cases, _softmax_run, _softmax_ref,
    _tol(lambda c: {"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3}[c.params["dtype"]]), _softmax_locate,
    _softmax_bugs(), notebook="04", **_KERNEL))

register(Exercise(
    "matmul_kernel",
    "f(a, b, c) -> None. torch; a (M, K), b (K, N), float32 or float16, any strides; launch a "
                         "Triton kernel that writes C = A B into c ((M, N), the dtype of a), in place, accumulating in "
                         "float32 (fp32 inputs: tl.dot(..., input_precision=\"ieee\")). The tensors are views with "
                         "padding around them (some transposed): use their strides.",
    _matmul_cases, _matmul_run, _matmul_ref, _tol(_matmul_tol_rel), _matmul_locate, _matmul_bugs(),
    notebook="04", **_KERNEL))

register(Exercise(
    "flash_forward",
    "f(q, k, v, o, lse, causal) -> None. torch; q (B, H, Nq, D), k and v (B, H, Nk, D); launch a "
                         "Triton kernel that writes O into o (shape and dtype of q) and the LSE into lse ((B, H, Nq), "
                         "float32), in place. The tensors are views with padding around them: use their strides. "
                         "Only the tensors the grader passes are guarded; scratch buffers you allocate yourself "
                         "are not (in the interpreter your kernel runs in a child process, so a crash is still "
                         "reported rather than killing the notebook).",
    _kernel_cases, _fwd_run, _fwd_ref, _kernel_tol, _kernel_locate,
    _attn_bugs(True, _kernel_per_slice) + _fwd_kernel_bugs(), probe=_fwd_probe, notebook="05",
    timing=ranking.FORWARD, **_KERNEL))

register(Exercise(
    "causal_loop_bounds",
    ("f(start_m, block_m, block_n, nq, nk) -> (unmasked_end, end). Python ints. For the causal Q tile "
                "start_m (rows start_m*block_m ... (start_m+1)*block_m - 1): keys [0, unmasked_end) are whole, full "
                "K tiles of block_n keys that every row of the tile sees (no mask); keys [unmasked_end, end) are "
                "the tiles that need the mask; keys from end on are never loaded. Tightest bounds: the largest "
                "unmasked_end and the smallest end."),
    _causal_cases, _causal_run, _causal_ref, lambda case, name, ref: 0.0, _causal_locate, CAUSAL_BUGS,
    notebook="06"))


# ----------------------------------------------------------------------------
# notebook 05, the staged build: the lecture's one-head kernel (flashlab.teaching.one_head), then one
# thing added per exercise: flash_forward_tails (B, H, strides, ragged N) -> flash_forward_causal (the mask
# and block skipping) -> flash_forward (the LSE, above)
# ----------------------------------------------------------------------------

SKIP_SLACK = 256   # a causal program may load keys up to its last row + this (tiles of up to 256 keys)


def _staged_tails_cases(rng):
    """flash_forward's cases without the mask: every size, stride and magnitude, non-causal."""
    cases, seen = [], set()
    for c in _kernel_cases(rng):
        c.params = {**c.params, "causal": False}
        key = tuple(sorted(c.params.items())) + (c.large,)
        if key not in seen:          # a causal case and its non-causal twin become one
            seen.add(key)
            cases.append(c)
    return cases


def _staged_causal_cases(rng):
    """flash_forward's cases, plus one causal case with many more keys than queries: the skipping probe."""
    cases = _kernel_cases(rng)
    nq, nk, d = 64, 64 + 2 * SKIP_SLACK, 16
    t = {n: torch.from_numpy(rng.standard_normal((1, 1, m, d))).to(device=device.DEVICE, dtype=torch.float32)
         for n, m in (("q", nq), ("k", nk), ("v", nk))}
    cases.append(KernelCase({"B": 1, "H": 1, "Nq": nq, "Nk": nk, "D": d, "causal": True, "dtype": "fp32"}, t))
    return cases


def _skips_tiles(case) -> bool:
    p = case.params
    return bool(p["causal"]) and p["Nk"] >= p["Nq"] + 2 * SKIP_SLACK


def skipping_violations(f, case) -> list:
    """Trace ``f(q, k, v, o, True)`` (flashlab.viz.trace) and report a program that loads keys far past its
    last query row: key tiles entirely above the diagonal, which block skipping never loads.  [] when every
    program stops in time, or when the trace cannot run (then the values are still graded)."""
    import warnings
    try:
        from ...viz.trace import trace_call
    except ImportError:
        return []
    p = case.params
    q, k, v = (case.inputs[n].clone() for n in "qkv")
    o = torch.empty_like(q)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traces = trace_call(f, q, k, v, o, True)
    except Exception:
        return []
    for t in traces if isinstance(traces, list) else [traces]:
        kv = [a for a, (shape, _) in t.args.items() if len(shape) == 4 and shape[2] == p["Nk"]]
        outs = [a for a, (shape, _) in t.args.items() if len(shape) == 4 and shape[2] == p["Nq"]]
        for prog in t.programs:
            rows = {i[2] for a in outs for i in t.writes(prog, a)}
            keys = {i[2] for a in kv for i in t.reads(prog, a)}
            if rows and keys and max(keys) > max(rows) + SKIP_SLACK:
                return [f"key tiles above the diagonal are loaded: the program that writes query rows "
                        f"{min(rows)}-{max(rows)} loads keys up to {max(keys)} (traced with flashlab.viz.trace on a "
                        f"causal case with Nq = {p['Nq']}, Nk = {p['Nk']}). Those tiles are masked entirely: stop "
                        f"the key loop at min((start_m + 1) * BLOCK_M, Nk) and they are never loaded (block "
                        f"skipping, half the work at large N)."]
    return []


def _staged_run(f, case, with_causal: bool):
    p = case.params
    ins = _guard_inputs(case, "qkv")
    q = ins["q"].view
    o = _guard_4d("o", torch.full(q.shape, SENTINEL[q.dtype], dtype=q.dtype, device=q.device),
                  p.get("layout", "BHND"), SENTINEL[q.dtype])
    hand_over({**ins, "o": o}, outputs=("o",))
    f(q, ins["k"].view, ins["v"].view, o.view, *((p["causal"],) if with_causal else ()))
    _sync()
    strays = [s for s in (stray_writes(o),) if s] + _input_strays(ins, case)
    out = {"o": _f64(o.view), "_stray": [str(s) for s in strays], "_unwritten": {"o": unwritten(o).cpu().numpy()},
           "_buffers": returned({**ins, "o": o})}
    if with_causal and _skips_tiles(case):
        out["_violations"] = skipping_violations(f, case)
    return out


def _o_ref(case):
    return {"o": _fwd_ref(case)["o"]}


def _staged_probe(with_causal):
    def probe(f, case):
        g = (lambda q, k, v, o, lse, causal: f(q, k, v, o, causal)) if with_causal else \
            (lambda q, k, v, o, lse, causal: f(q, k, v, o))
        return _fwd_probe(g, case)
    return probe


_TAILS_BUGS = _attn_bugs(False, _kernel_per_slice) + [Bug(*KB.WRONG_STRIDE, _fwd_wrong_stride)]

register(Exercise(
    "flash_forward_tails",
    "f(q, k, v, o) -> None. torch; q (B, H, Nq, D), k and v (B, H, Nk, D), non-causal; launch a Triton kernel "
    "that writes O = softmax(Q K^T / sqrt(D)) V into o (shape and dtype of q), in place. Nq and Nk are any sizes "
    "(not multiples of your tiles), the tensors are views with padding around them (some transposed from "
    "(B, N, H, D)): use every tensor's own strides, mask the loads past Nq and Nk, and set the scores past Nk "
    "to -inf.",
    _staged_tails_cases, lambda f, case: _staged_run(f, case, False), _o_ref, _kernel_tol, _kernel_locate,
    _TAILS_BUGS, probe=_staged_probe(False), notebook="05",
    requirements=("O matches float64 attention on ragged sizes, strided views and |S| ~ 1000",
                  "nothing is written outside o, the inputs are not modified"), **_KERNEL))

register(Exercise(
    "flash_forward_causal",
    "f(q, k, v, o, causal) -> None. torch; as flash_forward_tails, plus causal: with causal=True query i sees "
    "keys j <= i (top-left, also when Nq != Nk), and key tiles entirely above the diagonal are never loaded "
    "(block skipping: checked by tracing your kernel on a causal case with Nk much larger than Nq).",
    _staged_causal_cases, lambda f, case: _staged_run(f, case, True), _o_ref, _kernel_tol, _kernel_locate,
    _attn_bugs(False, _kernel_per_slice) + _fwd_kernel_bugs(), probe=_staged_probe(True), notebook="05",
    requirements=("O matches float64 attention, causal both ways, Nq != Nk both ways",
                  "a causal program loads no key tile entirely above the diagonal (traced)"), **_KERNEL))
