"""The graded exercises of notebook 04 (Triton primer): ``softmax_kernel`` and ``matmul_kernel``.

Both hand the learner torch tensors that are *views into poisoned buffers*
(:mod:`flashlab.grader.memory`): 2-D matrices whose rows have 8 padding columns
after them (NaN around inputs, a sentinel around outputs), some of them
transposed views.  A kernel that ignores ``.stride()``, or reads past the end of
a row, reads NaN; one that stores past it changes a sentinel.  In the
interpreter every case runs in a forked child, so a wild store is a report.

Known mistakes are runnable NumPy (or torch) code that computes what a kernel
*with that mistake* returns on a case, so the grader can name it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .. import device
from .core import Bug, Case, Exercise
from .memory import SENTINEL, padded, stray_writes, unwritten

_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


class MatrixCase(Case):
    """A case on 2-D matrices: described by its sizes, dtype and the layout of each operand."""

    def describe(self) -> str:
        p = self.params
        bits = [f"{k}={p[k]}" for k in ("M", "N", "K") if k in p] + [p["dtype"]]
        bits += [f"{k} transposed" for k in ("x", "a", "b") if p.get(k) == "transposed"]
        if self.large:
            bits.append("|x| ~ 1e4")
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
    for m, n, dt, layout, mag, vis in spec:
        x = torch.from_numpy(mag * rng.standard_normal((m, n))).to(device=device.DEVICE, dtype=_DTYPES[dt])
        cases.append(MatrixCase({"M": m, "N": n, "dtype": dt, "x": layout}, {"x": x}, vis, mag > 100))
    return cases


def _softmax_buffers(case):
    return guarded_2d("x", case.inputs["x"], case.params["x"])


def _softmax_run(f, case):
    x = _softmax_buffers(case)
    y = output_2d("y", x.view.shape, x.view.dtype, case.params["x"])
    f(x.view, y.view)
    _sync()
    return {"y": _f64(y.view), "_stray": _strays({"x": x}, {"y": y}, case),
            "_unwritten": {"y": unwritten(y).cpu().numpy()}}


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
    ]


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
    ]
    if device.DEVICE.type == "cuda":
        spec += [(1000, 1000, 1000, "fp16", "rows", "rows", False),
                 (513, 257, 1031, "bf16", "transposed", "rows", False),
                 (300, 200, 129, "fp32", "rows", "transposed", False)]
    cases = []
    for m, n, k, dt, la, lb, vis in spec:
        dtype = _DTYPES[dt]
        a = torch.from_numpy(rng.standard_normal((m, k))).to(device=device.DEVICE, dtype=dtype)
        b = torch.from_numpy(rng.standard_normal((k, n))).to(device=device.DEVICE, dtype=dtype)
        cases.append(MatrixCase({"M": m, "N": n, "K": k, "dtype": dt, "a": la, "b": lb}, {"a": a, "b": b}, vis))
    return cases


def _matmul_buffers(case):
    p = case.params
    return {"a": guarded_2d("a", case.inputs["a"], p["a"]), "b": guarded_2d("b", case.inputs["b"], p["b"])}


def _matmul_run(f, case):
    ins = _matmul_buffers(case)
    a, b = ins["a"].view, ins["b"].view
    c = output_2d("c", (a.shape[0], b.shape[1]), a.dtype)
    f(a, b, c.view)
    _sync()
    return {"c": _f64(c.view), "_stray": _strays(ins, {"c": c}, case),
            "_unwritten": {"c": unwritten(c).cpu().numpy()}}


def _matmul_ref(case):
    return {"c": _f64(case.inputs["a"]) @ _f64(case.inputs["b"])}


def _matmul_tol_rel(case):
    dt = case.params["dtype"]
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

    return [
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
# the exercises
# ----------------------------------------------------------------------------

CONTRACTS = {
    "softmax_kernel": "f(x, y) -> None. torch; x (M, N) float32 or float16, any strides; launch a Triton kernel that "
                      "writes softmax(x) along the last axis into y ((M, N), the dtype of x), in place. x and y are "
                      "views with padding around them (some transposed): use their strides; N need not be a "
                      "power of two.",
    "matmul_kernel": "f(a, b, c) -> None. torch; a (M, K), b (K, N), float32 or float16, any strides; launch a "
                     "Triton kernel that writes C = A B into c ((M, N), the dtype of a), in place, accumulating in "
                     "float32 (fp32 inputs: tl.dot(..., input_precision=\"ieee\")). The tensors are views with "
                     "padding around them (some transposed): use their strides.",
}


def build() -> dict:
    """name -> Exercise, registered by :mod:`flashlab.grader.exercises`."""
    return {
        "softmax_kernel": Exercise(
            "softmax_kernel", CONTRACTS["softmax_kernel"], _softmax_cases, _softmax_run, _softmax_ref,
            _tol(lambda c: {"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3}[c.params["dtype"]]), _softmax_locate,
            _softmax_bugs(), isolate=device.INTERPRET),
        "matmul_kernel": Exercise(
            "matmul_kernel", CONTRACTS["matmul_kernel"], _matmul_cases, _matmul_run, _matmul_ref,
            _tol(_matmul_tol_rel), _matmul_locate, _matmul_bugs(), isolate=device.INTERPRET),
    }
