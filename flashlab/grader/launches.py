"""Does a kernel exercise's candidate launch a Triton kernel, and leave the math to it?

A right answer can come without a kernel: ``y.copy_(torch.softmax(x, -1))``, ``c.copy_(a @ b)``,
or attention in torch copied into ``o``.  While the candidate runs, :class:`KernelWatch` (a
``TorchFunctionMode``) sees every torch call of the candidate's host code: those that touch a
tensor the grader handed over (an input or an output, or a view of one) outside a Triton launch
must only read its metadata (shape, strides, dtype, pointer), take views of it, or allocate
like it; anything else (arithmetic, ``softmax``, ``@``, ``copy_`` into an output, ``.numpy()``) is
named in the report.  Triton launches are counted by wrapping the interpreter's grid executor
and the compiled ``JITFunction.run``; while one runs, Triton's own torch calls are not the
candidate's.  A candidate that launches no kernel at all is told so.  In the interpreter, every
masked-on lane of every ``tl.load`` is checked against the grader's padding: a load past a
tensor's edge is reported even when its values are discarded (Q loaded without its row mask,
whose rows past Nq are never stored).  The interpreter also reports the dtypes a ``tl.dot`` accumulates
in and a ``tl.sum`` adds in: the contracts ask for float32 accumulators and float32 row sums (softmax,
Delta) with 16-bit inputs, and a 16-bit one is named.

Like the other checks that run inside the learner's process, under batch grading this is the
sandbox's account: a notebook that switches it off loses only this check (its values are still
compared by the grader).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# what host code may do with the grader's tensors: metadata, views, allocation like them, copies to
# hand a kernel (no arithmetic on the values, no writes)
ALLOWED = {
    "__get__", "__len__", "__repr__", "__format__", "__str__", "__hash__", "__bool__",
    "stride", "size", "dim", "ndimension", "numel", "nelement", "element_size", "data_ptr", "untyped_storage",
    "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "get_device", "type",
    "view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "narrow", "as_strided",
    "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "unflatten", "movedim", "unbind", "select",
    "__getitem__", "contiguous", "clone", "to", "cpu", "cuda", "detach", "requires_grad_",
    "float", "half", "double", "bfloat16",
    "empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full",
    "new_tensor", "empty_strided",
}


class KernelWatch(TorchFunctionMode):
    def __init__(self, tensors: dict, outputs=()):
        super().__init__()
        self.storages = {}               # the inputs' storages: torch math on them is the candidate's, not a kernel's
        self.pads = []                   # (name, first address, element size, padding mask over the allocation)
        for name, t in tensors.items():
            flat = getattr(t, "flat", t)
            if name not in outputs:      # (an output may be finished by torch from a kernel's scratch: dq = s * acc)
                self.storages.setdefault(flat.untyped_storage().data_ptr(), name)
            if hasattr(t, "padding_mask") and flat.device.type == "cpu":
                self.pads.append((name, flat.data_ptr(), flat.element_size(), t.padding_mask().numpy()))
        self.launches = 0
        self.inside = 0
        self.ops = []                    # (function name, tensor name), outside launches
        self.padding_reads = {}          # tensor name -> elements of its padding a load read (masked-on lanes)
        self.low_precision = {}          # "dot" / "sum" -> the 16-bit dtype a tl.dot accumulated / a tl.sum added in

    def loaded(self, addresses) -> None:
        """The interpreter loads from these addresses (the lanes its mask lets through)."""
        import numpy as np
        addr = np.asarray(addresses, dtype=np.uint64).ravel()
        if not addr.size:
            return
        for name, base, size, pad in self.pads:
            end = base + size * pad.size
            inside = addr[(addr >= base) & (addr < end)]
            if inside.size:
                idx = ((inside - base) // size).astype(np.int64)
                n = int(pad[idx].sum())
                if n:
                    self.padding_reads[name] = self.padding_reads.get(name, 0) + n

    def _hit(self, x, depth=0):
        if isinstance(x, torch.Tensor):
            return self.storages.get(x.untyped_storage().data_ptr())
        if depth < 3 and isinstance(x, (list, tuple)):
            for y in x:
                hit = self._hit(y, depth + 1)
                if hit:
                    return hit
        if depth < 3 and isinstance(x, dict):
            return self._hit(list(x.values()), depth + 1)
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside:
            name = getattr(func, "__name__", "") or str(func)
            if name not in ALLOWED and len(self.ops) < 20:
                hit = self._hit(args) or self._hit(kwargs)
                if hit:
                    self.ops.append((_public_name(func, name), hit))
        return func(*args, **kwargs)

    def low(self, op, dtype) -> None:
        """The interpreter ran ``op`` ("dot": a tl.dot's accumulator, "sum": a tl.sum's operand) in ``dtype``."""
        name = getattr(getattr(dtype, "scalar", dtype), "name", str(dtype))
        if name in ("fp16", "bf16"):
            self.low_precision.setdefault(op, {"fp16": "float16", "bf16": "bfloat16"}[name])

    def violations(self, outputs) -> list:
        out = []
        dt = self.low_precision.get("dot")
        if dt:
            out.append(f"a tl.dot accumulates in {dt} (its accumulator, or out_dtype, is {dt}): accumulate in "
                       f"float32 (acc = tl.zeros(..., dtype=tl.float32), and dq, dk, dv alike) and convert to the "
                       f"output's dtype only when storing; a {dt} accumulator rounds after every tile and "
                       f"overflows past {'65504' if dt == 'float16' else '3e38'}.")
        dt = self.low_precision.get("sum")
        if dt:
            out.append(f"a tl.sum adds {dt} values: upcast with .to(tl.float32) before reducing (the softmax's "
                       f"row sum, Delta = rowsum(dO * O)): a {dt} sum rounds after every addition and "
                       f"{'overflows past 65504' if dt == 'float16' else 'keeps 8 bits'}.")
        for name, n in self.padding_reads.items():
            out.append(f"a load read {n} element(s) past the edges of `{name}` (the grader's padding around it), "
                       f"even if those values were then discarded: on a GPU such a read can fault or read another "
                       f"tensor's memory. Mask every tl.load with the bounds of the tensor it reads (offs < N, "
                       f"other=0), rows and columns alike.")
        if not self.launches:
            out.append("no Triton kernel was launched: the exercise asks for a kernel (kernel[grid](...)) that "
                       f"writes {_names(outputs)}; computing the outputs with torch or NumPy is not the exercise.")
        if self.ops:
            seen = []
            for fn, t in self.ops:
                if (fn, t) not in seen:
                    seen.append((fn, t))
            said = ", ".join(f"{fn} on `{t}`" for fn, t in seen[:4])
            out.append(f"your host code computes with torch on the inputs outside a Triton kernel ({said}): the "
                       f"kernel must read the inputs and compute {_names(outputs)} itself; host code may only read "
                       f"shapes and strides, allocate scratch buffers and launch kernels.")
        return out


def _public_name(func, name):
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    if (owner is torch.Tensor or (isinstance(owner, type) and issubclass(owner, torch._C.TensorBase))
            or getattr(func, "__qualname__", "").startswith(("Tensor.", "TensorBase.", "_TensorBase."))):
        return f"Tensor.{name}"
    mod = getattr(func, "__module__", "") or ""
    return f"{mod}.{name}" if mod.startswith("torch") else f"torch.{name}"


def _names(outputs) -> str:
    names = [f"`{n}`" for n in outputs]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


_PATCHED = []


def _wrap_launchers(watch_stack):
    """Wrap Triton's launch entry points once: each launch counts for the innermost active watch."""
    if _PATCHED:
        return
    targets = []
    try:
        from triton.runtime import interpreter
        if hasattr(interpreter, "GridExecutor"):
            targets.append((interpreter.GridExecutor, "__call__"))
    except Exception:  # pragma: no cover - no interpreter module
        pass
    try:
        from triton.runtime.jit import JITFunction
        targets.append((JITFunction, "run"))
    except Exception:  # pragma: no cover
        pass
    try:                                         # loads, in the interpreter: which addresses they read
        from triton.runtime import interpreter
        builder = interpreter.InterpreterBuilder
        orig_load = builder.create_masked_load

        def masked_load(self, ptrs, mask, other, *a, __orig=orig_load, **k):
            w = watch_stack[-1] if watch_stack else None
            if w is not None and w.pads:
                try:
                    import numpy as np
                    m = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data))
                    w.loaded(np.asarray(ptrs.data)[m])
                except Exception:                # pragma: no cover - a layout of handles not seen here
                    pass
            return __orig(self, ptrs, mask, other, *a, **k)
        builder.create_masked_load = masked_load
        _PATCHED.append((builder, "create_masked_load", orig_load))

        orig_dot = builder.create_dot            # the accumulator's dtype is the dot's output dtype

        def create_dot(self, a, b, d, *rest, __orig=orig_dot, **k):
            w = watch_stack[-1] if watch_stack else None
            if w is not None:
                w.low("dot", getattr(d, "dtype", None))
            return __orig(self, a, b, d, *rest, **k)
        builder.create_dot = create_dot
        _PATCHED.append((builder, "create_dot", orig_dot))
    except Exception:  # pragma: no cover - no interpreter
        pass
    try:                                         # reductions, in the interpreter: the dtype tl.sum adds in
        import triton.language as tl
        from triton.runtime.interpreter import ReduceOps
        orig_apply = ReduceOps.apply_impl

        def apply_impl(self, input, __orig=orig_apply):
            w = watch_stack[-1] if watch_stack else None
            if w is not None and self.combine_fn is tl.standard._sum_combine:
                try:
                    w.low("sum", input[0].dtype)
                except Exception:                # pragma: no cover - a layout of operands not seen here
                    pass
            return __orig(self, input)
        ReduceOps.apply_impl = apply_impl
        _PATCHED.append((ReduceOps, "apply_impl", orig_apply))
    except Exception:  # pragma: no cover - no interpreter
        pass
    for cls, attr in targets:
        orig = getattr(cls, attr)

        def wrapped(self, *a, __orig=orig, **k):
            w = watch_stack[-1] if watch_stack else None
            if w is None:
                return __orig(self, *a, **k)
            w.launches += 1
            w.inside += 1
            try:
                return __orig(self, *a, **k)
            finally:
                w.inside -= 1
        setattr(cls, attr, wrapped)
        _PATCHED.append((cls, attr, orig))


_STACK: list = []


@contextmanager
def watch(tensors: dict, outputs=()):
    """``with watch({"x": x_padded, ...}) as w: candidate(...)``; then ``w.violations(outputs)``.  The values are
    the grader's Padded buffers (or plain tensors: then only the torch and launch checks)."""
    from .memory import hand_over
    hand_over(tensors, outputs)          # (the grader recording the buffers' layout: the run stops here)
    _wrap_launchers(_STACK)
    w = KernelWatch(tensors, outputs)
    _STACK.append(w)
    try:
        with w:
            yield w
    finally:
        _STACK.pop()
