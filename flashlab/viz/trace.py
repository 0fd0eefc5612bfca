"""What a Triton kernel reads and writes: every load and store, program by program.

    >>> t = viz.trace(primer.softmax_kernel, (M,), x, y, N, *x.stride(), *y.stride(), BLOCK_N=64)
    >>> t.reads((2,), "X")          # {(2, 0), (2, 1), ..., (2, 36)}: program 2 read row 2
    >>> t.masked((2,), "X")         # {(2, 37), ..., (2, 63)}: the lanes past the row's end
    >>> t.out_of_bounds             # [] when every access stayed inside its tensor
    >>> t.figure((2,))              # a Figure: each tensor as a grid, read / written / masked / out of bounds
    >>> t.table()                   # bytes per tensor and tile loads, one row per program

How.  :func:`trace` runs the kernel's Python function in Triton's interpreter (on a GPU machine too:
the tensors are copied to the CPU, the interpreter runs there, the results are copied back), with the
interpreter's memory operations wrapped: ``create_masked_load`` and ``create_masked_store`` of its
builder (plain loads and stores, block pointers and tensor descriptors all end there) and its atomics.
Each wrapper sees the lanes' addresses and mask before memory is touched.

*Which tensor, which element.*  Every tensor argument is copied into a buffer of its own with a guard
zone on both sides, so an address belongs to exactly one argument; the argument's strides turn the
address into an index tuple.  An access that runs off a tensor is reported in the kernel's terms: a
load is a block of lanes whose addresses are affine in the lane position, so the lanes that stayed
inside the tensor give each lane's *intended* index, e.g. row 37 of a 37-row tensor, not the
address's neighbour.

*Out of bounds, safely.*  An unmasked lane whose address lies outside its argument's allocation is
recorded (program, argument, index) and switched off before the interpreter touches memory: the load
returns ``other`` (0 if none), the store is dropped, so a wild store corrupts nothing.  A lane whose
index lies outside the tensor's shape but whose address is still inside the allocation (a missing
column mask on a contiguous matrix reads the next row) runs as on a GPU and is recorded too.

Limits (honest): meant for the small sizes the interpreter runs (it keeps an index map per tensor
argument); kernels that pass pointers through integers, or reinterpret tensors (``TensorWrapper``), are
not followed; the recorded kernel runs in the interpreter, so its numerics are the interpreter's.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import math
import os
import warnings
from dataclasses import dataclass, field

import numpy as np

from .. import device  # noqa: F401  (settles TRITON_INTERPRET before Triton is imported)

READ, WRITTEN, BOTH, UNTOUCHED = "#4C8BD6", "#F0913A", "#8E5BB5", "#EDEDED"
OOB = "#D62728"
MAX_OOB = 10_000          # out-of-bounds lanes kept one by one; past that only counted


class OutOfBounds(tuple):
    """``(program, arg, index)``: one lane that went past its tensor.

    ``index``: the index tuple the lane meant (it lies outside the tensor's shape), or an int offset
    in elements from the tensor's first element where the strides cannot say.  Also ``op`` ("load",
    "store", "atomic"); ``ran``: whether the access was made (its address was still inside the
    argument's allocation, as when a missing column mask reads the next row: a GPU would make it too)
    or skipped (outside: a GPU would read garbage or fault, and a store would corrupt memory);
    ``lands_at``: the element a made access really hit, None if it hit none.
    """

    def __new__(cls, program, arg, index, op="load", ran=False, lands_at=None):
        return super().__new__(cls, (program, arg, index))

    def __init__(self, program, arg, index, op="load", ran=False, lands_at=None):
        self.op, self.ran, self.lands_at = op, ran, lands_at

    program = property(lambda self: self[0])
    arg = property(lambda self: self[1])
    index = property(lambda self: self[2])

    def __repr__(self):
        where = ("skipped: outside the allocation" if not self.ran else
                 f"made: hit element {self.lands_at}" if self.lands_at is not None else "made: hit no element")
        return f"OutOfBounds(program={self[0]}, arg={self[1]!r}, index={self[2]}, {self.op}, {where})"


@dataclass
class _Arg:
    """One tensor argument, copied to the CPU: its view, address range and index map."""
    name: str
    view: object                # the CPU copy (torch.Tensor) the kernel runs on
    shape: tuple
    strides: tuple
    itemsize: int
    base: int                   # address of element (0, ..., 0)
    alloc: tuple                # (lo, hi) bytes: the memory that exists on a GPU (the original's span)
    region: tuple               # (lo, hi) bytes: the allocation and its guard zones
    inv: np.ndarray = field(repr=False)   # element offset from base -> flat index, -1 where no element
    dense: bool = True

    def decode(self, elem):
        """Element offsets from base (int64 array) -> (n, ndim) index array; rows of -1 where undecodable."""
        out = np.full((len(elem), len(self.shape)), -1, dtype=np.int64)
        ok = (elem >= 0) & (elem < len(self.inv))
        flat = np.full(len(elem), -1, dtype=np.int64)
        flat[ok] = self.inv[elem[ok]]
        ok = flat >= 0
        if ok.any() and self.shape:
            out[ok] = np.stack(np.unravel_index(flat[ok], self.shape), axis=1)
        return out, flat

    def extended(self, elem):
        """Element offsets -> index tuples that may lie outside the shape (dense layouts); None otherwise."""
        if not self.dense or not self.shape:
            return None
        order = sorted(range(len(self.shape)), key=lambda d: -self.strides[d])
        out = np.zeros((len(elem), len(self.shape)), dtype=np.int64)
        rest = elem.copy()
        for d in order:
            s = max(self.strides[d], 1)
            out[:, d] = rest // s
            rest = rest - out[:, d] * s
        return out

    def offset_of(self, idx):
        return idx @ np.asarray(self.strides, dtype=np.int64) if self.shape else np.zeros(len(idx), np.int64)


@dataclass
class _Event:
    program: tuple
    arg: str
    op: str                     # "load", "store" or "atomic"
    lanes: int
    flat: np.ndarray            # flat indices of the elements this access touched (one per active lane)
    masked: np.ndarray          # (k, ndim) intended indices of the masked-off lanes
    rows: np.ndarray            # (n, ndim) indices touched (for tiles and planes)


def _dense(shape, strides):
    """Whether the strides are a permutation of a contiguous layout (no gaps, no overlaps)."""
    dims = sorted((s, n) for s, n in zip(strides, shape) if n > 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def _index_map(shape, strides):
    """Element offset -> flat (C-order) index of a strided view, -1 for offsets no element has."""
    if not shape:
        return np.zeros(1, dtype=np.int64)
    if any(n == 0 for n in shape):
        return np.full(0, -1, dtype=np.int64)
    off = np.zeros(shape, dtype=np.int64)
    for d, (n, s) in enumerate(zip(shape, strides)):
        sh = [1] * len(shape)
        sh[d] = n
        off = off + (np.arange(n, dtype=np.int64) * s).reshape(sh)
    inv = np.full(int(off.max()) + 1, -1, dtype=np.int64)
    inv[off.ravel()] = np.arange(off.size, dtype=np.int64)
    return inv


class _Memory:
    """The CPU copies of a launch's tensor arguments, and the translation of addresses into them."""

    def __init__(self, named):
        import torch
        self.args: dict[str, _Arg] = {}
        self.spans = []             # (the original's bytes, lo, hi, the CPU buffer, guard) per storage
        groups = collections.OrderedDict()
        for name, t in named.items():
            key = (t.device, t.untyped_storage().data_ptr()) if t.untyped_storage().nbytes() else (name,)
            groups.setdefault(key, []).append((name, t))
        for members in groups.values():
            spans = []
            for _, t in members:
                isz = t.element_size()
                lo = t.storage_offset() * isz
                hi = lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * isz if t.numel() else lo
                spans.append((lo, hi))
            lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
            guard = max(hi - lo, 4096)
            guard = -(-guard // 128) * 128
            buf = torch.zeros(guard + (hi - lo) + guard, dtype=torch.uint8)
            # the bytes of the span, gaps and aliases included, so views of one storage stay one memory
            src = torch.empty(0, dtype=torch.uint8, device=members[0][1].device).set_(members[0][1].untyped_storage())
            buf[guard:guard + hi - lo].copy_(src[lo:hi])
            self.spans.append((src, lo, hi, buf, guard))
            start = buf.data_ptr()
            for (name, t), (tlo, _) in zip(members, spans):
                isz = t.element_size()
                view = torch.empty(0, dtype=t.dtype).set_(buf.untyped_storage(), (guard + tlo - lo) // isz,
                                                           tuple(t.shape), tuple(t.stride()))
                self.args[name] = _Arg(name, view, tuple(t.shape), tuple(t.stride()), isz, view.data_ptr(),
                                       (start + guard, start + guard + hi - lo),
                                       (start, start + buf.numel()), _index_map(tuple(t.shape), tuple(t.stride())),
                                       _dense(tuple(t.shape), tuple(t.stride())))
        self._order = sorted(self.args.values(), key=lambda a: a.region[0])

    def copy_back(self):
        """Write the spans back (what the kernel stored, as a launch would), then let the copies go."""
        for src, lo, hi, buf, guard in self.spans:
            src[lo:hi].copy_(buf[guard:guard + hi - lo])
        self.spans = []
        for a in self.args.values():
            a.view = None

    def owner(self, addr, active):
        """The argument a block of lanes belongs to: most active lanes inside its view, else nearest region."""
        best, best_n = None, 0
        for a in self._order:
            inside = (addr >= a.base) & (addr < a.base + len(a.inv) * a.itemsize)
            n = int((inside & active).sum())
            if n > best_n:
                best, best_n = a, n
        if best is not None:
            return best
        for a in self._order:
            n = int(((addr >= a.region[0]) & (addr < a.region[1])).sum())
            if n > best_n:
                best, best_n = a, n
        if best is not None or not self._order:
            return best
        mid = float(np.median(addr.astype(np.float64)))
        return min(self._order, key=lambda a: min(abs(mid - a.alloc[0]), abs(mid - a.alloc[1])))


def _intended(arg, shape, idx, good, elem):
    """Each lane's intended index, from the lanes in ``good`` (decoded ``idx``), if the block is affine.

    Returns an (n, ndim) array, or None when the lanes do not follow one affine map of the lane position.
    """
    nd = len(arg.shape)
    if not good.any() or nd == 0:
        return None
    pos = np.stack(np.unravel_index(np.arange(good.size), shape), axis=1) if shape else np.zeros((1, 0), np.int64)
    g = good.ravel()
    I = idx.reshape(-1, nd)
    deltas = []
    for a in range(len(shape)):
        if shape[a] == 1:
            deltas.append(np.zeros(nd, np.int64))
            continue
        sl0 = [slice(None)] * len(shape)
        sl1 = [slice(None)] * len(shape)
        sl0[a], sl1[a] = slice(0, -1), slice(1, None)
        both = good[tuple(sl0)] & good[tuple(sl1)]
        if not both.any():      # no two neighbouring lanes inside the tensor along this axis
            return None
        i0 = idx[tuple(sl0)][both]
        i1 = idx[tuple(sl1)][both]
        d, counts = np.unique(i1 - i0, axis=0, return_counts=True)
        deltas.append(d[np.argmax(counts)])
    D = np.stack(deltas)                                    # (block ndim, tensor ndim)
    cands = np.flatnonzero(g)
    for anchor in (cands[0], cands[len(cands) // 2]):
        pred = I[anchor] + (pos - pos[anchor]) @ D
        inside = np.all((pred >= 0) & (pred < np.asarray(arg.shape)), axis=1)
        same = np.all(pred == I, axis=1)
        consistent = arg.offset_of(pred) == elem.ravel()      # the address the lane really used
        if np.all(consistent) and np.all(same[g & inside]):
            return pred
    return None


class _Recorder:
    """Wraps the interpreter builder's memory operations while one traced launch runs."""

    def __init__(self, memory, builder, ndim_grid):
        self.mem, self.builder, self.ndim_grid = memory, builder, ndim_grid
        self.events: list[_Event] = []
        self.oob: list[OutOfBounds] = []
        self.oob_total = 0
        self.scratch = np.zeros(64, dtype=np.uint8)

    def program(self):
        return tuple(int(i) for i in self.builder.grid_idx[:self.ndim_grid])

    def _lanes(self, op, ptrs, mask):
        """Record one access; return the mask with the lanes outside every allocation switched off."""
        addr = np.asarray(ptrs.data).astype(np.uint64)
        shape0 = addr.shape
        addr = np.atleast_1d(addr)
        shape = addr.shape
        m = np.ones(shape, dtype=bool) if mask is None else np.broadcast_to(np.asarray(mask.data, dtype=bool), shape)
        arg = self.mem.owner(addr.ravel(), m.ravel())
        if arg is None:
            return m.reshape(shape0)
        rel = addr.astype(np.int64) - np.int64(arg.base)
        elem = rel // arg.itemsize
        aligned = (rel % arg.itemsize) == 0
        idx, flat = arg.decode(elem.ravel())
        idx = idx.reshape(shape + (len(arg.shape),))
        flat = flat.reshape(shape)
        in_view = (flat >= 0) & aligned
        in_alloc = (addr >= arg.alloc[0]) & (addr < arg.alloc[1])
        intended = _intended(arg, shape, idx, in_view & m, elem)
        if intended is None:
            intended = arg.extended(elem.ravel())
        nd = len(arg.shape)
        if intended is not None:
            intended = intended.reshape(shape + (nd,))
            outside = ~np.all((intended >= 0) & (intended < np.asarray(arg.shape, dtype=np.int64)), axis=-1) \
                if nd else np.zeros(shape, bool)
        else:
            outside = ~in_view
        run = m & in_alloc
        bad = m & (outside | ~in_alloc)
        prog = self.program()
        for lane in zip(*np.nonzero(bad)):
            self.oob_total += 1
            if len(self.oob) < MAX_OOB:
                index = tuple(int(i) for i in intended[lane]) if intended is not None else int(elem[lane])
                lands = tuple(int(i) for i in idx[lane]) if (run[lane] and in_view[lane]) else None
                self.oob.append(OutOfBounds(prog, arg.name, index, op, bool(run[lane]), lands))
        touched = run & in_view
        masked = intended[~m] if intended is not None else arg.extended(elem[~m]) if arg.dense else np.zeros((0, nd), np.int64)
        self.events.append(_Event(prog, arg.name, op, int(np.prod(shape)), flat[touched].astype(np.int64),
                                  np.asarray(masked, dtype=np.int64).reshape(-1, nd), idx[touched]))
        return run.reshape(shape0)

    # the builder's methods, wrapped (positional arguments as in Triton 3.6 and 3.9)
    def wrap(self):
        b = self.builder
        orig = {name: getattr(b, name) for name in ("create_masked_load", "create_masked_store",
                                                    "create_atomic_rmw", "create_atomic_cas") if hasattr(b, name)}

        def masked_load(ptrs, mask, other, *rest, **kw):
            run = self._lanes("load", ptrs, mask)
            return orig["create_masked_load"](ptrs, type(mask)(np.ascontiguousarray(run), mask.dtype), other, *rest, **kw)

        def masked_store(ptrs, value, mask, *rest, **kw):
            run = self._lanes("store", ptrs, mask)
            return orig["create_masked_store"](ptrs, value, type(mask)(np.ascontiguousarray(run), mask.dtype), *rest, **kw)

        def atomic_rmw(op, ptr, val, mask, *rest, **kw):
            run = self._lanes("atomic", ptr, mask)
            return orig["create_atomic_rmw"](op, ptr, val, type(mask)(np.ascontiguousarray(run), mask.dtype), *rest, **kw)

        def atomic_cas(ptr, cmp, val, *rest, **kw):
            run = self._lanes("atomic", ptr, None)
            if not run.all():    # no mask to switch lanes off: point the bad ones at a scratch word
                data = np.where(run, np.asarray(ptr.data), np.uint64(self.scratch.ctypes.data))
                ptr = type(ptr)(data.astype(np.uint64), ptr.dtype)
            return orig["create_atomic_cas"](ptr, cmp, val, *rest, **kw)

        new = {"create_masked_load": masked_load, "create_masked_store": masked_store,
               "create_atomic_rmw": atomic_rmw, "create_atomic_cas": atomic_cas}
        return {k: new[k] for k in orig}


@contextlib.contextmanager
def _patched(obj, attrs):
    """Set instance attributes for the duration, restoring exactly what was there."""
    missing = object()
    saved = {k: obj.__dict__.get(k, missing) for k in attrs}
    try:
        for k, v in attrs.items():
            setattr(obj, k, v)
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                obj.__dict__.pop(k, None)
            else:
                obj.__dict__[k] = v


@contextlib.contextmanager
def _interpreter_everywhere():
    """What the traced launch needs of the interpreter, in both modes, undone afterwards."""
    import triton.language as tl
    from triton.runtime import interpreter as I
    patch_lang = I._patch_lang

    def patch_lang_index(fn):
        # Triton 3.6's interpreter converts a loop bound with int(one-element array), which NumPy 2.4
        # refuses; 3.9 squeezes it first.  Same value, both versions; restored with the scope.
        scope = patch_lang(fn)
        scope.set_attr(tl.core.tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
        return scope

    I._patch_lang = patch_lang_index
    try:
        if device.INTERPRET:
            yield
        else:
            with _compiled_helpers(I):
                yield
    finally:
        I._patch_lang = patch_lang


@contextlib.contextmanager
def _compiled_helpers(I):
    """Compiled mode (a GPU machine): let the interpreter run @triton.jit helpers and Triton's own.

    ``tl.max``, ``tl.cdiv`` and a kernel's helpers are JITFunctions there, which refuse to be called
    from Python.  For the traced launch only, a call runs the helper's rewritten Python function, with
    the language patched for the call and restored after it, and ``knobs.runtime.interpret`` reads True.
    """
    import triton
    from triton.runtime.jit import JITFunction
    cache = {}

    def call(self, *args, **kwargs):
        fn = cache.get(self.fn)
        if fn is None:
            fn = cache[self.fn] = I.InterpretedFunction(self.fn)
        scope = I._patch_lang(self.fn)
        try:
            return fn.rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    knobs = getattr(triton, "knobs", None)
    had_env = os.environ.get("TRITON_INTERPRET")
    saved_knob = knobs.runtime.__dict__.get("interpret", None) if knobs is not None else None
    old_call = JITFunction.__call__
    JITFunction.__call__ = call
    try:
        if knobs is not None:
            knobs.runtime.interpret = True
        yield
    finally:
        JITFunction.__call__ = old_call
        if knobs is not None:
            if saved_knob is None:
                knobs.runtime.__dict__.pop("interpret", None)
            else:
                knobs.runtime.__dict__["interpret"] = saved_knob
        if had_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = had_env


def _unwrap(kernel, meta):
    """The Python function under @triton.jit (and autotune/heuristics), and the meta-parameters they add."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    meta = dict(meta)
    heuristics = []
    k = kernel
    while not isinstance(k, (JITFunction, InterpretedFunction)):
        if isinstance(k, Autotuner):
            cfg = k.configs[0]
            for key, v in cfg.kwargs.items():
                meta.setdefault(key, v)
        elif isinstance(k, Heuristics):
            heuristics.append(k.values)
        elif inspect.isfunction(k):
            return k, meta, heuristics
        else:
            raise TypeError(f"trace: kernel must be a @triton.jit function (or autotuned / heuristics-wrapped), "
                            f"got {type(k).__name__}")
        k = k.fn
    return k.fn, meta, heuristics


def trace(kernel, grid, *args, **meta) -> "KernelTrace":
    """Run ``kernel[grid](*args, **meta)`` in Triton's interpreter, recording every load and store.

    ``kernel``: a ``@triton.jit`` function (autotuned or heuristics-wrapped kernels too: the first
    config fills meta-parameters not given).  ``grid``: a tuple, an int, or a callable of the meta dict,
    as for a launch.  Launch options (``num_warps``, ``num_stages``) are accepted and ignored.
    Tensor arguments may live on any device: the kernel runs on CPU copies and the results are copied
    back into them, so ``trace`` also does what the launch does (less the accesses it reports as out of
    bounds and skips).  Returns a :class:`KernelTrace`.
    """
    device.require_triton("flashlab.viz.trace")
    import torch
    from triton.runtime import interpreter as I
    fn, meta, heuristics = _unwrap(kernel, meta)
    sig = inspect.signature(fn)
    for k in ("num_warps", "num_stages", "num_ctas", "maxnreg"):      # launch options: nothing to record
        meta.pop(k, None)
    try:
        bound = sig.bind(*args, **meta)
    except TypeError as e:
        raise TypeError(f"trace: the arguments do not fit {fn.__name__}{sig}: {e}") from None
    named = dict(bound.arguments)
    for values in reversed(heuristics):
        for key, h in values.items():
            if key not in named:
                named[key] = h(dict(named))
    if callable(grid):
        grid = grid(dict(named))
    grid = (grid,) if isinstance(grid, int) else tuple(int(g) for g in grid)
    if not 1 <= len(grid) <= 3 or any(g < 0 for g in grid):
        raise ValueError(f"trace: grid must be 1 to 3 non-negative ints, got {grid}")
    tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
    descs = {}
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        descs = {k: v for k, v in named.items() if isinstance(v, TensorDescriptor)}
    except ImportError:
        TensorDescriptor = None
    mem = _Memory({**tensors, **{k: d.base for k, d in descs.items()}})
    call = dict(named)
    for k in tensors:
        call[k] = mem.args[k].view
    for k, d in descs.items():
        call[k] = TensorDescriptor(mem.args[k].view, d.shape, d.strides, d.block_shape,
                                   *([d.padding] if hasattr(d, "padding") else []))
    rec = _Recorder(mem, I.interpreter_builder, len(grid))
    ifn = I.InterpretedFunction(fn)
    with _interpreter_everywhere(), _patched(I.interpreter_builder, rec.wrap()), torch.no_grad():
        I.GridExecutor(ifn.rewrite(), ifn.arg_names, grid)(**call)
    mem.copy_back()
    t = KernelTrace(fn.__name__, grid, mem, rec, meta)
    if rec.oob_total:
        first = rec.oob[0]
        warnings.warn(f"{fn.__name__}: {rec.oob_total} lane(s) out of bounds; the first: program {first.program} "
                      f"{first.op} {first.arg}{list(first.index) if isinstance(first.index, tuple) else first.index}"
                      f" (shape {tuple(mem.args[first.arg].shape)}). See .out_of_bounds and .figure().",
                      RuntimeWarning, stacklevel=2)
    return t


def trace_call(fn, *args, **kwargs):
    """Call ``fn(*args, **kwargs)`` (a launcher, e.g. an exercise's ``f(x, y)``), tracing every kernel it launches.

    Each ``kernel[grid](...)`` inside ``fn`` runs through :func:`trace` instead of launching.  Returns
    the :class:`KernelTrace` of the one launch, or a list of them when ``fn`` launched several.
    """
    device.require_triton("flashlab.viz.trace_call")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    traces = []

    def run(self, *a, grid, warmup=False, **kw):
        if not warmup:
            traces.append(trace(self, grid, *a, **kw))

    saved = {cls: cls.__dict__.get("run") for cls in (JITFunction, InterpretedFunction)}
    try:
        for cls in saved:
            cls.run = run
        fn(*args, **kwargs)
    finally:
        for cls, r in saved.items():
            if r is None:
                del cls.run
            else:
                cls.run = r
    if not traces:
        raise ValueError(f"trace_call: {getattr(fn, '__name__', fn)} launched no Triton kernel")
    return traces[0] if len(traces) == 1 else traces


def _programs(grid):
    return [p[:len(grid)] for p in np.ndindex(*(tuple(grid) + (1,) * (3 - len(grid))))] if all(grid) else []


def _as_program(p):
    return (int(p),) if isinstance(p, (int, np.integer)) else tuple(int(i) for i in p)


class KernelTrace:
    """The loads and stores of one traced launch (see :func:`trace`)."""

    def __init__(self, name, grid, mem, rec, meta):
        self.name, self.grid, self.meta = name, tuple(grid), dict(meta)
        self.args = {k: (a.shape, a.itemsize) for k, a in mem.args.items()}
        self._arg = mem.args
        self.events = rec.events
        self.out_of_bounds: list[OutOfBounds] = rec.oob
        self.out_of_bounds_total = rec.oob_total
        self.programs = _programs(self.grid)
        self._by = collections.defaultdict(list)
        for e in self.events:
            self._by[(e.program, e.arg)].append(e)

    # --------------------------------------------------------------------------------- queries
    def _check(self, program, arg):
        program = _as_program(program)
        if program not in set(self.programs):
            raise ValueError(f"program must be one of the grid's {len(self.programs)} program ids "
                             f"(tuples of {len(self.grid)} ints below {self.grid}), got {program}")
        if arg not in self._arg:
            raise ValueError(f"arg must name a tensor argument of {self.name}: one of {sorted(self._arg)}; got {arg!r}")
        return program

    def _elements(self, program, arg, ops):
        program = self._check(program, arg)
        shape = self._arg[arg].shape
        flat = [e.flat for e in self._by[(program, arg)] if e.op in ops]
        if not flat:
            return set()
        flat = np.unique(np.concatenate(flat))
        return set(zip(*(a.tolist() for a in np.unravel_index(flat, shape)))) if shape else {()}

    def reads(self, program, arg) -> set:
        """Index tuples of ``arg`` (its parameter name) that ``program`` loaded (atomics count too)."""
        return self._elements(program, arg, ("load", "atomic"))

    def writes(self, program, arg) -> set:
        """Index tuples of ``arg`` that ``program`` stored to (atomics count too)."""
        return self._elements(program, arg, ("store", "atomic"))

    def masked(self, program, arg) -> set:
        """Intended index tuples of the lanes ``program`` masked off in accesses of ``arg`` (may lie outside it)."""
        program = self._check(program, arg)
        ms = [e.masked for e in self._by[(program, arg)] if len(e.masked)]
        return set(map(tuple, np.unique(np.concatenate(ms), axis=0).tolist())) if ms else set()

    def accesses(self, program, arg=None, op=None) -> int:
        """How many load/store instructions ``program`` ran on ``arg`` (all tensors when None)."""
        program = _as_program(program)
        return sum(1 for (p, a), es in self._by.items() if p == program and arg in (None, a)
                   for e in es if op in (None, e.op))

    def bytes(self, program, arg, op="load") -> int:
        """Bytes ``program`` moved in ``op`` accesses of ``arg`` (each lane each time: re-reads count again)."""
        program = self._check(program, arg)
        return sum(len(e.flat) for e in self._by[(program, arg)] if e.op == op) * self._arg[arg].itemsize

    def _tile_axis(self, arg, axis):
        nd = len(self._arg[arg].shape)
        if axis is not None:
            return axis % nd
        if nd == 1:
            return 0
        moved = collections.Counter()
        for (p, a), es in self._by.items():
            if a != arg:
                continue
            loads = [e.rows for e in es if e.op == "load" and len(e.rows)]
            for d in range(nd):
                if len({int(r[:, d].min()) for r in loads}) > 1:
                    moved[d] += 1
        return moved.most_common(1)[0][0] if moved else nd - 2

    def tile_size(self, arg, axis=None) -> int:
        """The tile size along ``axis`` most loads of ``arg`` cover (how many distinct indices one load spans)."""
        ax = self._tile_axis(arg, axis)
        sizes = collections.Counter()
        for e in self.events:
            if e.arg == arg and e.op == "load" and len(e.rows):
                lo, hi = int(e.rows[:, ax].min()), int(e.rows[:, ax].max())
                sizes[hi - lo + 1] += 1
        if not sizes:
            return 1
        size = sizes.most_common(1)[0][0]
        return 1 << (size - 1).bit_length() if size > 1 else 1    # a ragged last tile spans fewer

    def loads_per_tile(self, program, arg, block=None, axis=None) -> list:
        """How many times ``program`` loaded each tile of ``arg``: a list, one count per tile.

        Tiles are ``block`` indices along ``axis`` (default: the axis the loads step along, and the
        tile size most loads cover).  For FA2's forward, ``loads_per_tile(p, "K")`` is one per K/V
        tile the program streamed, 0 for the tiles causal skipping never loads.
        """
        program = self._check(program, arg)
        ax = self._tile_axis(arg, axis)
        block = block or self.tile_size(arg, ax)
        n = self._arg[arg].shape[ax] if self._arg[arg].shape else 1
        counts = [0] * math.ceil(n / block)
        for e in self._by[(program, arg)]:
            if e.op == "load" and len(e.rows):
                for t in np.unique(e.rows[:, ax] // block):
                    counts[int(t)] += 1
        return counts

    def programs_touching(self, arg, index, op="load") -> list:
        """The programs whose ``op`` accesses touched element ``index`` of ``arg``."""
        a = self._arg[arg]
        flat = int(np.ravel_multi_index(tuple(index), a.shape)) if a.shape else 0
        return sorted({e.program for e in self.events if e.arg == arg and e.op == op and flat in set(e.flat.tolist())})

    # --------------------------------------------------------------------------------- table
    def _streamed(self):
        """Arguments some program loads in more than one tile: their tile counts go in the table."""
        out = []
        for arg in self._arg:
            if any(len([e for e in es if e.op == "load"]) > 1 for (p, a), es in self._by.items() if a == arg):
                out.append(arg)
        return out

    def table(self, programs=None) -> "TraceTable":
        """Per program: bytes read and written per tensor, masked lanes, out-of-bounds lanes, and how
        many times each tile of a streamed tensor was loaded (``·`` = never).  Prints as text; in
        Jupyter it displays as an HTML table."""
        progs = self.programs if programs is None else [_as_program(p) for p in programs]
        touched = [a for a in self._arg if any(e.arg == a for e in self.events)]
        streamed = self._streamed()
        blocks = {a: self.tile_size(a) for a in streamed}
        head = ["program"] + [f"{a} read" for a in touched if self._any(a, "load")] \
            + [f"{a} written" for a in touched if self._any(a, "store")] \
            + [f"{a} tiles loaded ({blocks[a]} per tile)" for a in streamed] + ["masked lanes", "out of bounds"]
        oob = collections.Counter(o.program for o in self.out_of_bounds)
        rows = []
        for p in progs:
            row = [str(p if len(p) > 1 else p[0])]
            row += [_size(self.bytes(p, a, "load")) for a in touched if self._any(a, "load")]
            row += [_size(self.bytes(p, a, "store")) for a in touched if self._any(a, "store")]
            row += [" ".join(str(c) if c else "·" for c in self.loads_per_tile(p, a, blocks[a])) for a in streamed]
            row += [str(sum(len(e.masked) for a in touched for e in self._by[(p, a)])), str(oob.get(p, 0) or "")]
            rows.append(row)
        return TraceTable(head, rows, f"{self.name}, grid {self.grid}")

    def _any(self, arg, op):
        return any(e.arg == arg and e.op == op for e in self.events)

    def __repr__(self):
        n_load = sum(e.op == "load" for e in self.events)
        n_store = sum(e.op == "store" for e in self.events)
        return (f"KernelTrace({self.name}, grid {self.grid}: {len(self.programs)} programs, {n_load} loads, "
                f"{n_store} stores, {self.out_of_bounds_total} lanes out of bounds; tensors "
                + ", ".join(f"{k} {tuple(s)}" for k, (s, _) in self.args.items()) + ")")

    # --------------------------------------------------------------------------------- figures
    def figure(self, program=None, args=None, max_programs=6, cell=None):
        """Each tensor as a grid of its elements, for one program or several side by side (a Figure).

        ``program``: a program id (tuple or int), a list of them, or None (all, up to ``max_programs``
        of them, evenly spread).  ``args``: which tensors (default: every tensor the kernel touched).
        Blue: read; orange: written; purple: both; hatched: masked-off lanes; red: out of bounds.
        4-D (B, H, N, D) tensors show the (N, D) plane of the program's (b, h); lanes outside a tensor
        are drawn in the margin around it.  For a streamed tensor (loaded tile by tile) the count of
        loads of each tile is written beside it.
        """
        from .trace_figure import figure
        return figure(self, program, args, max_programs, cell)

    def interact(self, programs=None):
        """A slider over programs (ipywidgets), redrawing :meth:`figure`; the static figure where it is missing."""
        from .trace_figure import interact_trace
        return interact_trace(self, programs)

    def _repr_html_(self):
        return "<p><code>" + _html(repr(self)) + "</code></p>"


def _size(n):
    if n == 0:
        return ""
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1024 ** 2 else f"{n / 1024 ** 2:.1f} MiB"


def _html(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class TraceTable:
    """A small table that prints as text and displays as HTML in Jupyter (no pandas needed)."""

    def __init__(self, head, rows, caption=""):
        self.head, self.rows, self.caption = head, rows, caption

    def __str__(self):
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h) for i, h in enumerate(self.head)]
        line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "\n".join([self.caption, line(self.head), "  ".join("-" * w for w in widths)] + [line(r) for r in self.rows])

    __repr__ = __str__

    def _repr_html_(self):
        th = "".join(f"<th>{_html(h)}</th>" for h in self.head)
        trs = "".join("<tr>" + "".join(f"<td style='text-align:{'left' if i == 0 else 'right'};font-family:monospace'>"
                                       f"{_html(c)}</td>" for i, c in enumerate(r)) + "</tr>" for r in self.rows)
        return f"<table><caption>{_html(self.caption)}</caption><tr>{th}</tr>{trs}</table>"


def trace_hint(exercise: str, program=None) -> str:
    """The lines a failure report offers: how to see what one program of the learner's kernel touched.

    ``exercise``: the grader's exercise name (``softmax_kernel``, ``matmul_kernel``, ``flash_forward``,
    ...); ``program``: the program id the report blames (a tuple or int), or None.  Returns text with a
    ready-to-run :func:`trace_call` of the learner's function on small inputs.
    """
    p = "None" if program is None else repr(_as_program(program))
    calls = {
        "softmax_kernel": "x = torch.randn(5, 37); y = torch.empty_like(x)\nt = viz.trace_call(YOUR_FUNCTION, x, y)",
        "matmul_kernel": ("a, b = torch.randn(40, 24), torch.randn(24, 36); c = torch.empty(40, 36)\n"
                          "t = viz.trace_call(YOUR_FUNCTION, a, b, c)"),
        "flash_forward": ("q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))\n"
                          "o, lse = torch.empty_like(q), torch.empty(1, 2, 40)\n"
                          "t = viz.trace_call(YOUR_FUNCTION, q, k, v, o, lse, True)     # causal"),
        "flash_backward": None,
    }
    call = calls.get(exercise) or "t = viz.trace_call(YOUR_FUNCTION, *small_inputs)   # the arguments the grader passes"
    show = f"display(t.figure({p}))" if program is not None else "display(t.figure())"
    return (f"To see what {'program ' + p if program is not None else 'each program'} of your kernel read and wrote "
            f"(small sizes, in the interpreter; YOUR_FUNCTION is the function you graded as {exercise!r}):\n"
            f"    from flashlab import viz\n"
            + "".join(f"    {line}\n" for line in call.splitlines())
            + f"    {show}; print(t.table()); t.out_of_bounds     # every lane that ran past a tensor")
