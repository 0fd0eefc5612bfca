"""Checks of *how* a NumPy candidate computes its answer, not only of the answer.

A right answer can come from the wrong algorithm: a two-pass softmax passes
``online_softmax``'s comparison, naive attention plus a logsumexp passes
``attention_tiled``'s.  So the NumPy exercises hand the candidate instrumented
inputs and watch it run:

* :class:`Tracked` arrays record each *read*: which elements of the input enter
  a computation (a ufunc such as ``@``, ``-`` or ``.max()``, or a NumPy function
  such as ``np.einsum``).  Slicing and transposing are free (they are views, like
  pointer arithmetic in a kernel); a read happens where the data is used.  From
  the reads: how many columns of ``x`` were used at once, how many rows of ``k``
  and ``v`` were used at once, which query tiles loaded each key tile.  A copy of
  the whole input, or the whole input scaled by a number (``k / np.sqrt(d)``), is
  tracked as the input itself.
* a memory bound (``tracemalloc``): on a large case, the peak memory may not
  approach the size of the Nq x Nk score matrix.
* a call watcher (``sys.setprofile``): a candidate that calls flashlab's
  reference code or PyTorch's attention is told that the exercise asks for its
  own code.

Everything here runs inside ``Exercise.run``; what it finds comes back in the
output dict as ``"_violations"`` (a list of sentences), so the verdict is made
by the grader core from plain data, whoever executed the candidate.

What it cannot see: data taken out of the instrumented array with
``np.asarray(k)``/``np.array(k)`` (a base-class copy or view) is no longer
tracked; the memory bound still applies to it.
"""
from __future__ import annotations

import os
import sys
import tracemalloc
from contextlib import contextmanager

import numpy as np
from numpy.lib.stride_tricks import as_strided

# ----------------------------------------------------------------------------
# recording reads
# ----------------------------------------------------------------------------


class Recorder:
    """The reads of one input array: a list of events, each the flat indices it used."""

    def __init__(self, name: str, arr: np.ndarray):
        self.name = name
        self.shape = arr.shape
        self.size = arr.size
        self.buffers = []          # (address, nbytes, itemsize) of the input and of copies made of it
        self.events = []           # each: sorted unique flat indices of the elements used
        self.flat = np.arange(arr.size, dtype=np.int64)

    def add_buffer(self, arr: np.ndarray, derive=None) -> None:
        """``arr`` (C-contiguous, the input's shape) holds the input's elements, or ``derive(values)`` of them."""
        self.buffers.append((arr.__array_interface__["data"][0], arr.nbytes, arr.itemsize))

    def derivation(self, a: np.ndarray):
        """How the buffer ``a`` lies in derives from the input's values (identity here)."""
        return None

    def _buffer_of(self, a: np.ndarray):
        addr = a.__array_interface__["data"][0]
        for base, nbytes, itemsize in self.buffers:
            if base <= addr < base + max(nbytes, 1) and a.itemsize == itemsize:
                return base, itemsize
        return None

    def flat_indices(self, a: np.ndarray):
        """The input's flat element indices for each element of the view ``a`` (same shape), or None."""
        buf = self._buffer_of(a)
        if buf is None:
            return None
        base, itemsize = buf
        off = (a.__array_interface__["data"][0] - base) // itemsize
        strides = [s // itemsize * self.flat.itemsize for s in a.strides]
        return as_strided(self.flat[off:], shape=a.shape, strides=strides)

    def record(self, a: np.ndarray, index=None) -> None:
        idx = self.flat_indices(a)
        if idx is None:
            return
        if index is not None:
            idx = idx[index]
        idx = np.unique(np.asarray(idx).ravel())
        if idx.size:
            self.use(idx)
            self.events.append(idx)

    def use(self, idx: np.ndarray) -> None:
        """Called before the elements ``idx`` are used (a served input fetches them here)."""


class Served(Recorder):
    """An input the batch grader serves on request: it starts as NaN, and before each read the elements
    it uses are asked for (``fetch(name, flat indices) -> values``).  The grader logs every request, and
    its own log, not this recorder, is what its requirement checks rest on: data the candidate takes
    out of the array any other way (or a patched exercise) is NaN, so its answer is wrong."""

    def __init__(self, name: str, arr: np.ndarray, fetch):
        super().__init__(name, arr)
        self.fetch = fetch
        self.copies = []             # (C-contiguous array, derive): filled with derive(values) on every fetch

    def add_buffer(self, arr: np.ndarray, derive=None) -> None:
        super().add_buffer(arr)
        if arr.flags.c_contiguous and arr.shape == self.shape:
            self.copies.append((arr, derive))

    def derivation(self, a: np.ndarray):
        addr = a.__array_interface__["data"][0]
        for arr, derive in self.copies:
            base = arr.__array_interface__["data"][0]
            if base <= addr < base + max(arr.nbytes, 1):
                return derive
        return None

    def use(self, idx: np.ndarray) -> None:
        values = np.asarray(self.fetch(self.name, idx), dtype=np.float64).reshape(-1)
        if values.shape != idx.shape:
            raise RuntimeError("the grader sent the wrong number of values")
        for arr, derive in self.copies:
            arr.reshape(-1)[idx] = values if derive is None else derive(values)


def served(name: str, shape, fetch):
    """A Tracked array of ``shape`` whose elements are fetched from the grader when used."""
    arr = np.full(tuple(shape), np.nan)
    rec = Served(name, arr, fetch)
    t = arr.view(Tracked)
    t._rec = rec
    rec.add_buffer(arr)
    return t


def _plain(x):
    if isinstance(x, Tracked):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(y) for y in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _record_all(x) -> None:
    if isinstance(x, Tracked):
        if x._rec is not None:
            x._rec.record(x.view(np.ndarray))
    elif isinstance(x, (list, tuple)):
        for y in x:
            _record_all(y)
    elif isinstance(x, dict):
        for y in x.values():
            _record_all(y)


# NumPy functions that look at an array's shape or type, not at its values
_NO_READ = {"shape", "ndim", "size", "result_type", "can_cast", "min_scalar_type", "iscomplexobj", "isrealobj",
            "may_share_memory", "shares_memory", "empty_like", "zeros_like", "ones_like", "full_like",
            "broadcast_shapes"}


# NumPy functions that copy an array whole (tracked as the input itself)
_COPIES = {"copy", "array", "asarray", "ascontiguousarray", "asanyarray", "require", "astype"}


class Tracked(np.ndarray):
    """An input array that records which of its elements are used, and when.

    Views (slices, ``.T``, ``reshape``) stay Tracked and cost nothing; a copy of the
    whole input (``.copy()``, ``.astype``) stays Tracked too.  Using the data in a
    ufunc or a NumPy function records the elements used, and returns plain arrays.
    """

    _rec: Recorder | None = None

    def __array_finalize__(self, obj):
        rec = getattr(obj, "_rec", None)
        self._rec = None
        if rec is None:
            return
        if rec._buffer_of(self) is not None:
            self._rec = rec                                     # a view of the input
        elif self.shape == rec.shape and self.flags.c_contiguous:
            src = obj.view(np.ndarray) if isinstance(obj, np.ndarray) else None
            rec.add_buffer(self, _copy_derivation(rec, src, self.dtype))  # a whole copy: track it as the input
            self._rec = rec

    def __getitem__(self, index):
        res = np.ndarray.__getitem__(self.view(np.ndarray), index)
        if type(self) is Tainted:
            return _taint(res)
        if isinstance(res, np.ndarray) and self._rec is not None and np.may_share_memory(res, self.view(np.ndarray)):
            out = res.view(Tracked)                             # a view: no read yet
            out._rec = self._rec
            return out
        if self._rec is not None:                               # a copy (fancy index) or a scalar: a read
            self._rec.record(self.view(np.ndarray), index)
            res = np.ndarray.__getitem__(self.view(np.ndarray), index)   # (after a served input's fetch)
        return res

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        rec = self._rec
        if (rec is not None and method == "__call__" and ufunc.nout == 1 and "out" not in kwargs
                and self.shape == rec.shape and sum(isinstance(x, Tracked) for x in inputs) == 1
                and all(isinstance(x, Tracked) or np.ndim(x) == 0 for x in inputs)):
            # the whole input, transformed element by element with scalars (k / sqrt(d), k * 1.0,
            # np.float64(k)): a transformed copy of the input, not a use of it; keep tracking the copy
            res = getattr(ufunc, method)(*_plain(inputs), **kwargs)
            if isinstance(res, np.ndarray) and res.shape == rec.shape and res.flags.c_contiguous:
                rec.add_buffer(res, _ufunc_derivation(rec, ufunc, inputs, kwargs))
                out = res.view(Tracked)
                out._rec = rec
                return out
            return res
        _record_all(inputs)
        if "out" in kwargs:
            kwargs["out"] = _plain(kwargs["out"])
        res = getattr(ufunc, method)(*_plain(inputs), **kwargs)
        return _taint(res) if _is_served(inputs) else res

    def __array_function__(self, func, types, args, kwargs):
        res = func(*_plain(args), **_plain(kwargs))
        name = getattr(func, "__name__", "")
        if name in _NO_READ:
            return res
        rec = self._rec
        if (name in _COPIES and rec is not None and isinstance(res, np.ndarray) and res.shape == rec.shape
                and res.flags.c_contiguous and not isinstance(res, Tracked)):
            if rec._buffer_of(res) is None:                     # np.copy(k): a copy of the whole input
                src = next((a for a in args if isinstance(a, Tracked)), None)
                rec.add_buffer(res, _copy_derivation(rec, None if src is None else src.view(np.ndarray),
                                                     res.dtype))
            out = res.view(Tracked)
            out._rec = rec
            return out
        views = res if isinstance(res, (list, tuple)) else [res]
        if rec is not None and all(isinstance(r, np.ndarray) and rec._buffer_of(r) is not None for r in views):
            wrapped = []                                        # np.split, np.transpose, ...: views, no read yet
            for r in views:
                w = r.view(Tracked)
                w._rec = rec
                wrapped.append(w)
            return type(res)(wrapped) if isinstance(res, (list, tuple)) else wrapped[0]
        _record_all(args)
        _record_all(kwargs)
        if _is_served(args) or _is_served(kwargs):             # computed again on the fetched values
            res = _taint(func(*_plain(args), **_plain(kwargs)))
        return res

    def dot(self, b, out=None):
        _record_all((self, b))
        res = np.dot(_plain(self), _plain(b), out=out)
        return _taint(res) if _is_served((self, b)) else res

    def __reduce__(self):
        return np.asarray(self.view(np.ndarray)).__reduce__()


def _copy_derivation(rec, src, dtype):
    """A copy of ``src`` (a buffer of the input, or None for the input): the same derivation, then ``dtype``."""
    parent = rec.derivation(src) if src is not None else None
    if parent is None and np.dtype(dtype) == np.float64:
        return None
    return lambda values: np.asarray(values if parent is None else parent(values)).astype(dtype)


def _ufunc_derivation(rec, ufunc, inputs, kwargs):
    """The input transformed element by element with scalars (k / sqrt(d)): the same ufunc on fetched values."""
    parts = []
    for x in inputs:
        if isinstance(x, Tracked):
            if not x.flags.c_contiguous:
                return lambda values: np.full(values.shape, np.nan)   # a transposed view: not followed
            parts.append(rec.derivation(x.view(np.ndarray)) or (lambda v: v))
        else:
            parts.append(x)
    kw = {k: v for k, v in kwargs.items() if k != "out"}
    return lambda values: ufunc(*[p(values) if callable(p) else p for p in parts], **kw)


class Tainted(Tracked):
    """Under batch grading, what is computed from a served input: plain values, but every operation
    on them still goes through Tracked's hooks, so that ``p.dot(v)`` (a method of a plain array, which
    no hook of ``v`` sees) fetches ``v``'s elements before using them."""


def _is_served(x) -> bool:
    if isinstance(x, Tracked):
        return type(x) is Tainted or isinstance(x._rec, Served)
    if isinstance(x, (list, tuple)):
        return any(_is_served(y) for y in x)
    if isinstance(x, dict):
        return any(_is_served(y) for y in x.values())
    return False


def _taint(res):
    if isinstance(res, np.ndarray) and not isinstance(res, Tracked):
        return res.view(Tainted)
    if isinstance(res, tuple):
        return tuple(_taint(r) for r in res)
    if isinstance(res, list):
        return [_taint(r) for r in res]
    return res


def track(name: str, arr: np.ndarray):
    """A Tracked copy of ``arr`` and its Recorder (a served input: itself and its recorder)."""
    if isinstance(arr, Tracked) and isinstance(arr._rec, Served):
        return arr, arr._rec
    arr = np.ascontiguousarray(arr).copy()
    rec = Recorder(name, arr)
    t = arr.view(Tracked)
    t._rec = rec
    rec.add_buffer(arr)
    return t, rec


def episodes(rec: Recorder, unit) -> np.ndarray:
    """For each unit (e.g. row of k), how many separate times it was loaded: a run of consecutive
    reads of the same unit counts once (a tile used for S and then for P V is one load)."""
    n_units = int(unit(np.array([rec.size - 1]))[0]) + 1 if rec.size else 0
    count = np.zeros(n_units, dtype=np.int64)
    prev = np.zeros(n_units, dtype=bool)
    for ev in rec.events:
        now = np.zeros(n_units, dtype=bool)
        now[np.unique(unit(ev))] = True
        count += now & ~prev
        prev = now
    return count


# ----------------------------------------------------------------------------
# rules
# ----------------------------------------------------------------------------

def online_softmax_rule(rec: Recorder, block: int) -> list:
    """One pass over blocks of ``block`` columns to build (m, l), then the write-out."""
    if not rec.events:
        return []
    r, n = rec.shape
    if n <= block:
        return []
    seen = np.zeros(rec.size, dtype=bool)
    done = np.zeros(r, dtype=bool)                 # rows whose every element has been read once
    for ev in rec.events:
        per_row = np.bincount(ev // n, minlength=r)
        wide = (per_row > block) & ~done
        if wide.any():
            return [f"`x` was read {int(per_row[wide].max())} columns at a time (for example `x.max(axis=1)` "
                    f"over the whole row) before every block of the row had been read once: online_softmax "
                    f"must build (m, ℓ) in one pass over blocks of block_size = {block} columns, folding each "
                    f"block in with online_softmax_update; only then is the whole row read again, to write "
                    f"e^(x − m)/ℓ."]
        seen[ev] = True
        done = seen.reshape(r, n).all(axis=1)
        if done.all():
            break
    times = episodes(rec, lambda ev: ev).max()
    if times > 2:
        return [f"some elements of `x` were read {times} times, in separate passes: the online softmax "
                f"reads each block once to update (m, ℓ) (one pass), then once more to write "
                f"e^(x − m)/ℓ. A separate pass for the max and another for the sum is the three-pass "
                f"softmax this exercise replaces."]
    return []


def tiled_attention_rule(recs: dict, nq: int, nk: int, causal: bool, bq: int, bk: int) -> list:
    """K and V are read one tile of at most ``bk`` rows at a time; causal tiles above the diagonal never."""
    out = []
    for name in ("k", "v"):
        rec = recs[name]
        d = rec.shape[1]
        for ev in rec.events:
            rows = np.unique(ev // d)
            if rows.size > bk:
                what = "q @ k.T over all keys" if name == "k" else "P @ v over all keys"
                out.append(f"`{name}` was read {rows.size} rows at a time (for example {what}): "
                           f"attention_tiled never forms the {nq}×{nk} score matrix; load K and V one tile "
                           f"of block_k = {bk} rows at a time, in the inner loop.")
                return out
    if not causal:
        return out
    tr = -(-nq // bq)
    for name in ("k", "v"):
        rec = recs[name]
        d = rec.shape[1]
        loads = episodes(rec, lambda ev: ev // d)
        for r in range(0, nk):
            j0 = (r // bk) * bk
            allowed = sum(1 for i in range(tr) if j0 <= min((i + 1) * bq, nq) - 1)
            if loads[r] > allowed:
                hi = min(j0 + bk, nk) - 1
                out.append(f"with causal=True, the `{name}` tile of keys {j0}–{hi} was loaded {loads[r]} times, "
                           f"but only {allowed} query tile(s) have a query that may see one of those keys "
                           f"(query tiles whose last row is ≥ {j0}). A key tile that lies entirely above the "
                           f"diagonal contributes e^(−∞) = 0: skip it without loading it, by comparing the "
                           f"tile's first key (j·block_k) with the query tile's last row "
                           f"(min((i+1)·block_q, Nq) − 1).")
                return out
    return out


def memory_rule(peak: int, nq: int, nk: int) -> list:
    s_bytes = nq * nk * 8
    if peak > s_bytes // 2:
        return [f"your code's memory peaked at {peak / 2**20:.2f} MiB on this {nq}×{nk} case, and the whole "
                f"{nq}×{nk} score matrix (float64) is {s_bytes / 2**20:.2f} MiB: attention_tiled must hold only "
                f"one block_q × block_k tile of scores at a time, never S or P whole."]
    return []


# ----------------------------------------------------------------------------
# watching for reference calls
# ----------------------------------------------------------------------------

def _flashlab_dir():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_ALLOWED_REFERENCE = {"causal_mask", "_scale",
                      "dropout_keep", "philox4x32", "dropout_threshold"}   # the dropout mask handed in (08)


def _forbidden_files():
    root = _flashlab_dir()
    return {os.path.join(root, "reference.py"): "flashlab.reference",
            os.path.join(root, "attention.py"): "flashlab.attention",
            os.path.join(root, "grader", "bugs.py"): "flashlab.grader.bugs"}


def _forbidden_builtins():
    found = {}
    try:
        import torch
        import torch.nn.functional as F
        found[id(F.scaled_dot_product_attention)] = "torch.nn.functional.scaled_dot_product_attention"
        found[id(torch._C._nn.scaled_dot_product_attention)] = "torch.nn.functional.scaled_dot_product_attention"
    except Exception:  # pragma: no cover - torch is a core dependency
        pass
    return found


def _is_autograd(code) -> bool:
    fn = code.co_filename.replace(os.sep, "/")
    return ((fn.endswith("/torch/_tensor.py") and code.co_name == "backward")
            or ("/torch/autograd/" in fn and code.co_name in ("backward", "grad", "vjp", "jacobian")))


@contextmanager
def watch_calls(found: list, *, files: dict | None = None, dirs: dict | None = None, own: tuple | None = None,
                autograd: bool = False):
    """Append to ``found`` the first call into code that already holds the answer: flashlab's references,
    its kernels or PyTorch's attention, and what an exercise adds: ``files`` {path: module name} (any function
    in them), ``dirs`` {folder: package name}, ``own`` (path, module name, allowed function names: the
    exercise module's own reference answers), ``autograd`` (torch's autograd, for a backward written out)."""
    files = {**_forbidden_files(), **(files or {})}
    dirs = dirs or {}
    builtins = _forbidden_builtins()
    kernels = os.path.join(_flashlab_dir(), "kernels") + os.sep

    def hook(frame, event, arg):
        if found:
            return
        if event == "call":
            code = frame.f_code
            fn = code.co_filename
            if fn in files and code.co_name not in _ALLOWED_REFERENCE:
                found.append(f"{files[fn]}.{code.co_name}")
            elif own is not None and fn == own[0] and code.co_name not in own[2]:
                found.append(f"the grader's own answer ({own[1]}.{code.co_name})")
            elif fn.startswith(kernels):
                found.append("flashlab's Triton kernels")
            elif autograd and _is_autograd(code):
                found.append("torch's autograd (.backward / torch.autograd.grad)")
            else:
                for d, name in dirs.items():
                    if fn.startswith(d):
                        found.append(f"{name} ({os.path.basename(fn)}: {code.co_name})")
                        break
        elif event == "c_call" and id(arg) in builtins:
            found.append(builtins[id(arg)])

    old = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(old)


def reference_message(found: list, exercise: str) -> list:
    if not found:
        return []
    return [f"your code calls {found[0]}: the exercise asks for your own {exercise}, written with NumPy "
            f"operations (the reference is what your answer is compared with)."]


@contextmanager
def peak_memory(result: list):
    """Append the peak traced memory (bytes) of the block to ``result``; nothing if already tracing."""
    if tracemalloc.is_tracing():
        yield
        return
    tracemalloc.start()
    try:
        yield
    finally:
        result.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
