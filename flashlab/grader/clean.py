"""The clean run: a kernel exercise graded again from its code alone, in a process the notebook never touched.

A notebook's ``grade()`` runs in the notebook's own process, and the checks that only that process can
make (a kernel was launched, no torch math on the inputs outside a kernel, fp32 accumulation, no read
past an edge: :mod:`flashlab.grader.launches`) run there too, where the notebook's other cells could
switch them off.  So in batch grading a kernel exercise that passed is graded a second time:

1. The grader reads the submitted notebook itself and takes, from its code cells, the function handed
   to the last ``grade("<exercise>", fn)`` and what it needs: the ``@triton.jit`` kernels and helper
   functions it names, and constants (the last definition of each name counts, as when the cells run in
   order) — nothing else of the notebook.
2. It checks that code against a short list (:func:`check`): kernels may use ``tl`` and their own
   names; the host function may read shapes, strides and dtypes, allocate (``torch.empty`` ...), use
   ``math`` and ``triton.cdiv`` and launch kernels — no imports, no other module, no name starting
   with ``_``, no arithmetic, indexing or iteration on tensors, no writes into them.  A refusal names
   the line and what to change.
3. It builds a one-cell notebook of that code behind the grader's own imports and grades it in a fresh
   sandbox like any notebook: its verdict replaces the first one.  Nothing in that process can reach
   the checks, so they hold.

What it does not cover: the NumPy exercises (their requirement checks are the grader's own, from the
reads it serves, or still the notebook's), and a host function that needs more than the list allows
(it is refused, with the reason; the notebook's own verdict is not kept).
"""
from __future__ import annotations

import ast
import json
import re

MODULES = {"tl", "triton", "torch", "math", "device"}
MODULE_ATTRS = {
    "triton": {"cdiv", "next_power_of_2", "jit", "autotune", "Config", "heuristics", "language"},
    "torch": {"empty", "empty_like", "zeros", "zeros_like", "full", "full_like", "empty_strided",
              "float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
              "half", "float", "double"},
    "math": {"sqrt", "log", "log2", "exp", "exp2", "ceil", "floor", "inf", "pi", "e", "isqrt"},
    "device": {"INTERPRET", "DEVICE"},
}
# what host code may ask of a tensor (metadata, and a dense copy for a kernel)
HOST_TENSOR_ATTRS = {"shape", "stride", "dtype", "device", "is_cuda", "size", "numel", "element_size", "dim",
                     "ndim", "is_contiguous", "contiguous", "data_ptr"}
# what a kernel may ask of its values (Triton's tensor methods and dtype fields)
KERNEL_VALUE_ATTRS = {"to", "dtype", "element_ty", "T", "shape", "reshape", "trans", "permute", "broadcast_to",
                      "expand_dims", "view", "split", "load", "store", "cast", "numel", "sum", "max", "min",
                      "argmax", "argmin", "cumsum", "ravel", "flip", "is_ptr", "primitive_bitwidth", "is_floating",
                      "is_int", "fp_mantissa_width", "advance"}
HOST_BUILTINS = {"range", "len", "min", "max", "int", "float", "bool", "tuple", "list", "dict", "abs", "isinstance",
                 "enumerate", "zip", "print", "round", "divmod", "pow", "str", "ValueError", "TypeError",
                 "AssertionError", "RuntimeError"}
KERNEL_BUILTINS = {"range", "min", "max", "float", "int", "bool", "len", "abs", "print", "isinstance"}
# builtins that may read a tensor's values (int(t), iteration): refused on tensors in host code
VALUE_BUILTINS = {"int", "float", "bool", "tuple", "list", "dict", "abs", "enumerate", "zip", "print", "round",
                  "divmod", "pow", "str", "min", "max", "sum"}
ALLOCATORS = {"empty", "empty_like", "zeros", "zeros_like", "full", "full_like", "empty_strided"}
SCALAR_ATTRS = {"shape", "dtype", "device", "is_cuda", "ndim", "element_ty"}            # a tensor's metadata
SCALAR_METHODS = {"stride", "size", "numel", "element_size", "dim", "data_ptr", "is_contiguous"}
TENSOR_RESULTS = {"contiguous"}          # host tensor methods that return a tensor
_FORBIDDEN_NODES = (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.ClassDef, ast.AsyncFunctionDef,
                    ast.Await, ast.Yield, ast.YieldFrom, ast.Delete, ast.With, ast.AsyncWith, ast.Try)


class Refused(Exception):
    """The code cannot be graded on its own; the message says where and why."""


def _tl_modules() -> set:
    try:
        import types

        import triton.language as tl
        return {n for n in dir(tl) if isinstance(getattr(tl, n, None), types.ModuleType)} - {"math"}
    except Exception:   # noqa: BLE001 - no Triton here: the exercise cannot run anyway; refuse the usual ones
        return {"core", "semantic", "standard", "random", "extra", "target_info"}


def _triton_decorator(d) -> str | None:
    """"jit", "autotune" or "heuristics" for @triton.X / @triton.X(...), else None."""
    f = d.func if isinstance(d, ast.Call) else d
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "triton" \
            and f.attr in ("jit", "autotune", "heuristics"):
        return f.attr
    return None


def _is_kernel(fn: ast.FunctionDef) -> bool:
    return bool(fn.decorator_list)       # @triton.jit (and autotune / heuristics on top of it): checked below


def _check_decorators(fn: ast.FunctionDef, cell: int) -> None:
    kinds = [_triton_decorator(d) for d in fn.decorator_list]
    if kinds and (None in kinds or kinds[-1] != "jit" or kinds.count("jit") != 1):
        raise Refused(f"cell {cell}, `{fn.name}`, line {fn.lineno}: a graded function's only decorators are "
                      "@triton.jit (innermost) and @triton.autotune / @triton.heuristics on top of it")


def _chain(node: ast.Attribute):
    """``a.b.c`` -> (["b", "c"], the node of ``a``)."""
    chain, base = [node.attr], node.value
    while isinstance(base, ast.Attribute):
        chain.append(base.attr)
        base = base.value
    chain.reverse()
    return chain, base


class _Checker(ast.NodeVisitor):
    """One function of the extracted code against the list (host function or kernel)."""

    def __init__(self, fn: ast.FunctionDef, top: dict, cell: int):
        self.fn, self.top, self.cell, self.kernel = fn, top, cell, _is_kernel(fn)
        a = fn.args
        params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
        params += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
        self.locals = set(params)
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.locals.add(node.id)
            elif isinstance(node, ast.arg):
                self.locals.add(node.arg)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not fn:
                self.locals.add(node.name)
        # host code: any parameter (its own or a lambda's) may be a tensor
        self.tensors = set() if self.kernel else {x.arg for x in ast.walk(fn) if isinstance(x, ast.arg)}
        self.tl_modules = _tl_modules()

    def refuse(self, node, what: str):
        line = getattr(node, "lineno", self.fn.lineno)
        raise Refused(f"cell {self.cell}, `{self.fn.name}`, line {line}: {what}")

    # -- the tensor-valued expressions of host code (conservative: parameters and what derives from them)
    def is_tensor(self, node) -> bool:
        """Whether a host expression may be a tensor: conservative, so only what is known to be a number, a
        shape, a dtype or a launch is not (a call of the notebook's own helper may return a tensor)."""
        if self.kernel or node is None:
            return False
        if isinstance(node, ast.Name):
            return node.id in self.tensors
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(self.is_tensor(e) for e in node.elts)
        if isinstance(node, ast.Attribute):
            return node.attr not in SCALAR_ATTRS and self.is_tensor(node.value)
        if isinstance(node, ast.Subscript):
            return self.is_tensor(node.value)
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Subscript):                       # kernel[grid](...): a launch returns nothing
                return False
            if isinstance(f, ast.Attribute):
                if isinstance(f.value, ast.Name) and f.value.id in MODULES and f.value.id not in self.locals:
                    return f.value.id == "torch" and f.attr in ALLOCATORS
                return f.attr in TENSOR_RESULTS or f.attr not in SCALAR_METHODS
            if isinstance(f, ast.Name):
                if f.id in self.top and f.id not in self.locals:  # the notebook's own function: may return one
                    return True
                return f.id not in HOST_BUILTINS and f.id not in VALUE_BUILTINS
            return True
        if isinstance(node, ast.BinOp):
            return self.is_tensor(node.left) or self.is_tensor(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.is_tensor(node.operand)
        if isinstance(node, ast.IfExp):
            return self.is_tensor(node.body) or self.is_tensor(node.orelse)
        if isinstance(node, (ast.Starred, ast.NamedExpr)):
            return self.is_tensor(node.value)
        return False

    def check(self):
        for d in self.fn.decorator_list:
            self.visit(d)
        for default in self.fn.args.defaults + [x for x in self.fn.args.kw_defaults if x is not None]:
            self.visit(default)
        if not self.kernel:            # the tensors a host function makes: names bound to tensor expressions
            changed, passes = True, 0
            while changed:
                changed, passes = False, passes + 1
                if passes > 20:
                    self.refuse(self.fn, "too many names bound to one another to follow: simplify the function")
                for node in ast.walk(self.fn):
                    value = getattr(node, "value", None)
                    targets = (node.targets if isinstance(node, ast.Assign) else
                               [node.target] if isinstance(node, (ast.AnnAssign, ast.NamedExpr, ast.AugAssign)) else [])
                    if targets and self.is_tensor(value):
                        for t in targets:
                            for n in ast.walk(t):
                                if isinstance(n, ast.Name) and n.id not in self.tensors:
                                    self.tensors.add(n.id)
                                    changed = True
        for stmt in self.fn.body:
            self.visit(stmt)

    def generic_visit(self, node):
        if isinstance(node, _FORBIDDEN_NODES):
            self.refuse(node, f"`{type(node).__name__.lower()}` is not allowed in graded code (no imports, classes, "
                              "try/with blocks or globals: the kernel and the function that launches it only)")
        if isinstance(node, ast.FunctionDef) and node is not self.fn:
            self.refuse(node, "define helper functions at the top level of a cell, not inside another function")
        if isinstance(node, ast.Lambda) and self.kernel:
            self.refuse(node, "no lambda inside a kernel")
        super().generic_visit(node)

    def visit_Name(self, node):
        n = node.id
        if n.startswith("_") and n != "_":
            self.refuse(node, f"the name `{n}` (names starting with `_` are not allowed in graded code)")
        if isinstance(node.ctx, ast.Load) and n not in self.locals and n not in self.top and n not in MODULES \
                and n not in (KERNEL_BUILTINS if self.kernel else HOST_BUILTINS):
            self.refuse(node, f"`{n}` is not available to graded code: it may use its own kernels, functions and "
                              "constants, `tl`, `triton`, `math`, `torch` (to allocate) and the tensors it is given")
        if n in ("device", "torch", "math") and self.kernel and n not in self.locals:
            self.refuse(node, f"`{n}` is for host code: a kernel computes with `tl`")

    def visit_Attribute(self, node):
        if node.attr.startswith("_"):
            self.refuse(node, f"the attribute `.{node.attr}` (names starting with `_` are not allowed)")
        chain, base = _chain(node)
        if isinstance(base, ast.Name) and base.id in MODULES and base.id not in self.locals:
            mod = base.id
            if mod == "triton" and chain[0] == "language":
                mod, chain = "tl", chain[1:]
            if mod == "tl":
                if not chain or chain[0] in self.tl_modules or (chain[0] == "math" and len(chain) > 2) \
                        or (chain[0] != "math" and len(chain) > 1 and not self._value_attr_ok(chain[1:])):
                    self.refuse(node, f"`tl.{'.'.join(chain)}`: use Triton's language functions (tl.load, tl.dot, "
                                      "tl.math.exp2 ...), not its internals")
            elif chain[0] not in MODULE_ATTRS[mod] or (len(chain) > 1 and not self._value_attr_ok(chain[1:])):
                self.refuse(node, f"`{mod}.{'.'.join(chain)}` is not available to graded code"
                                  + (" (torch: only to allocate, e.g. torch.empty; the computing is the kernel's)"
                                     if mod == "torch" else ""))
            return
        self.visit(base)                  # an unknown name is the better reason
        if not self._value_attr_ok(chain):
            allowed = KERNEL_VALUE_ATTRS if self.kernel else HOST_TENSOR_ATTRS
            self.refuse(node, f"`.{'.'.join(chain)}`: " + (
                "a kernel's values offer Triton's tensor methods (.to, .dtype, .T ...)" if self.kernel else
                "host code may only read a tensor's shape, strides, dtype and device (" +
                ", ".join(sorted(allowed)) + "); the computing is the kernel's"))

    def _value_attr_ok(self, chain) -> bool:
        allowed = KERNEL_VALUE_ATTRS if self.kernel else HOST_TENSOR_ATTRS | {"element_ty"}
        return all(a in allowed for a in chain)

    def _no_tensor(self, node, operand, what):
        if self.is_tensor(operand):
            self.refuse(node, f"{what} a tensor in host code: the kernel computes, the host only launches it")

    def visit_BinOp(self, node):
        if not self.kernel:
            if isinstance(node.op, ast.MatMult):
                self.refuse(node, "`@` in host code: the matrix products are the kernel's (tl.dot)")
            self._no_tensor(node, node.left, "arithmetic on")
            self._no_tensor(node, node.right, "arithmetic on")
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        self._no_tensor(node, node.operand, "arithmetic on")
        self.generic_visit(node)

    def visit_Compare(self, node):
        for x in [node.left] + node.comparators:
            self._no_tensor(node, x, "comparing")
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._no_tensor(node, node.target, "updating")
        self._no_tensor(node, node.value, "arithmetic on")
        self.generic_visit(node)

    def visit_Subscript(self, node):
        if self.kernel and isinstance(node.ctx, ast.Store):
            self.refuse(node, "an indexed assignment in a kernel: a kernel writes memory with tl.store")
        if not self.kernel and self.is_tensor(node.value):
            self.refuse(node, "indexing a tensor in host code (reading or writing its values): pass the tensor to "
                              "the kernel and index there")
        self.generic_visit(node)

    def visit_For(self, node):
        self._no_tensor(node, node.iter, "iterating over")
        self.generic_visit(node)

    def visit_comprehension(self, node):
        self._no_tensor(node, node.iter, "iterating over")
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if not self.kernel and isinstance(f, ast.Name) and f.id in VALUE_BUILTINS | {"sum", "iter", "next"}:
            for a in node.args:
                self._no_tensor(node, a, f"`{f.id}()` of")
        self.generic_visit(node)


def _cells(notebook: bytes) -> list:
    nb = json.loads(notebook)
    out = []
    for i, c in enumerate(nb.get("cells", [])):
        if c.get("cell_type") != "code":
            continue
        src = c.get("source", "")
        src = "".join(src) if isinstance(src, list) else str(src)
        src = "\n".join("" if re.match(r"\s*[%!]", line) else line for line in src.split("\n"))   # magics
        try:
            out.append((i + 1, ast.parse(src)))
        except SyntaxError:
            continue
    return out


def _constant(node) -> bool:
    if sum(1 for _ in ast.walk(node)) > 64:       # a constant is a number or a small tuple, not a deep expression
        return False
    return _constant_expr(node)


def _constant_expr(node) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_constant_expr(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return _constant_expr(node.operand)
    if isinstance(node, ast.BinOp):
        return _constant_expr(node.left) and _constant_expr(node.right)
    return False


def _grade_target(tree, exercise: str):
    found = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "grade" \
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == exercise:
            found = node.args[1] if len(node.args) > 1 else None
    return found


NUMPY_BUILTINS = {"range", "len", "min", "max", "int", "float", "bool", "tuple", "list", "dict", "set", "frozenset",
                  "abs", "isinstance", "enumerate", "zip", "sum", "sorted", "reversed", "map", "filter", "any", "all",
                  "round", "divmod", "pow", "print", "slice", "iter", "next", "str", "ValueError", "TypeError",
                  "AssertionError", "RuntimeError", "ZeroDivisionError", "IndexError", "KeyError"}
NUMPY_SUBMODULES = {"linalg", "fft", "random"}
NUMPY_DENIED = {"load", "save", "savez", "savez_compressed", "fromfile", "memmap", "loadtxt", "savetxt", "genfromtxt",
                "fromregex", "DataSource", "show_config", "show_runtime", "info", "lookfor", "source", "get_include",
                "ctypeslib", "set_printoptions"}
NUMPY_VALUE_DENIED = {"ctypes", "tofile", "dump", "dumps", "setflags", "base", "data"}
NUMPY_DENIED_WORDS = ("load", "save", "file", "test", "info", "source", "print", "doc", "errcall", "memmap", "eval",
                      "who", "buffer", "config", "runtime", "include", "deprecat")


def _numpy_value_attrs() -> set:
    """What NumPy code may ask of a value: an array's public attributes and methods (and a dtype's, finfo's), not
    what reaches files, raw memory or the interpreter (a generator's frame, a function's globals ...)."""
    import numpy as np
    names = {n for n in dir(np.ndarray) if not n.startswith("_")}
    names |= {"eps", "tiny", "kind", "itemsize", "name", "resolution", "bits", "smallest_normal"}
    return names - NUMPY_VALUE_DENIED


def _numpy_modules() -> set:
    import types

    import numpy as np
    return {n for n in dir(np) if isinstance(getattr(np, n, None), types.ModuleType)}


class _NumpyChecker(_Checker):
    """A NumPy exercise's function: NumPy and math as it likes, its own names, Python's safe builtins; no imports,
    no `_` names, no module but `np` and `math` (so no flashlab, no reference to call, nothing to switch off)."""

    def __init__(self, fn, top, cell):
        super().__init__(fn, top, cell)
        self.kernel, self.tensors = False, set()
        self.np_modules = _numpy_modules() - NUMPY_SUBMODULES
        self.value_attrs = _numpy_value_attrs()

    def check(self):
        if self.fn.decorator_list:
            raise Refused(f"cell {self.cell}, `{self.fn.name}`, line {self.fn.lineno}: no decorators on graded code")
        for default in self.fn.args.defaults + [x for x in self.fn.args.kw_defaults if x is not None]:
            self.visit(default)
        for stmt in self.fn.body:
            self.visit(stmt)

    def generic_visit(self, node):
        if isinstance(node, _FORBIDDEN_NODES) and not isinstance(node, (ast.With, ast.Try)):
            self.refuse(node, f"`{type(node).__name__.lower()}` is not allowed in graded code (no imports, classes "
                              "or globals: the function, its helpers and NumPy)")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not self.fn and node.decorator_list:
            self.refuse(node, "no decorators on graded code")
        ast.NodeVisitor.generic_visit(self, node)

    def visit_Name(self, node):
        n = node.id
        if n.startswith("_") and n != "_":
            self.refuse(node, f"the name `{n}` (names starting with `_` are not allowed in graded code)")
        if isinstance(node.ctx, ast.Load) and n not in self.locals and n not in self.top \
                and n not in ("np", "math") and n not in NUMPY_BUILTINS:
            self.refuse(node, f"`{n}` is not available to graded code: it may use its own functions and constants, "
                              "`np` (NumPy), `math` and Python's builtins")

    def visit_Attribute(self, node):
        if node.attr.startswith("_"):
            self.refuse(node, f"the attribute `.{node.attr}` (names starting with `_` are not allowed)")
        chain, base = _chain(node)
        if isinstance(base, ast.Name) and base.id in ("np", "math") and base.id not in self.locals:
            if base.id == "np" and not self._np_chain_ok(chain):
                self.refuse(node, f"`np.{'.'.join(chain)}` is not available to graded code (NumPy's computing "
                                  "functions are; its files, C interfaces, tests and internals are not)")
            if base.id == "math" and len(chain) > 1:
                self.refuse(node, f"`math.{'.'.join(chain)}`: use math's functions and constants")
            return
        self.visit(base)
        bad = [a for a in chain if a not in self.value_attrs]
        if bad:
            self.refuse(node, f"`.{bad[0]}` is not available to graded code (an array's attributes and methods are)")

    def _np_chain_ok(self, chain) -> bool:
        import numpy as np
        first = chain[0]
        if first in self.np_modules or first in NUMPY_DENIED or any(w in first.lower() for w in NUMPY_DENIED_WORDS):
            return False
        rest = chain[1:]
        if first in NUMPY_SUBMODULES:
            if not rest:
                return True
            import types
            second = getattr(getattr(np, first), rest[0], None)
            if isinstance(second, types.ModuleType) or any(w in rest[0].lower() for w in NUMPY_DENIED_WORDS):
                return False
            rest = rest[1:]
        return all(a in self.value_attrs for a in rest)

    def visit_Call(self, node):
        self.generic_visit(node)

    def visit_BinOp(self, node):
        self.generic_visit(node)

    def is_tensor(self, node) -> bool:     # NumPy answers compute on their arrays: that is the exercise
        return False


def extract(notebook: bytes, exercise: str, mode: str = "kernel"):
    """The code a clean run grades for ``exercise``: ([(cell, node)] of the definitions it needs, the name of the
    function handed to the last ``grade(exercise, fn)``), checked.  ``mode``: "kernel" (a Triton exercise)
    or "numpy".  Raises :class:`Refused` with the reason."""
    top, target = {}, None
    for cell, tree in _cells(notebook):
        for stmt in tree.body:
            if isinstance(stmt, ast.FunctionDef):
                top[stmt.name] = ("fn", stmt, cell)
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                if _constant(stmt.value):
                    top[stmt.targets[0].id] = ("const", stmt, cell)
                else:
                    top.pop(stmt.targets[0].id, None)      # rebound to something that is not code we can take
            else:                                          # other bindings of a name (for, with, import ...)
                for n in ast.walk(stmt):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id in top:
                        top.pop(n.id)
                    elif isinstance(n, ast.alias) and (n.asname or n.name.split(".")[0]) in top:
                        top.pop(n.asname or n.name.split(".")[0])
        t = _grade_target(tree, exercise)
        if t is not None:
            target = t
    if target is None:
        raise Refused(f'no grade("{exercise}", fn) call hands it a function')
    if not isinstance(target, ast.Name) or target.id not in top or top[target.id][0] != "fn":
        raise Refused(f'grade("{exercise}", ...) must be handed a function defined with `def` at the top level of a '
                      f"cell (the grader grades that function and what it calls, from its source)")
    need, todo = set(), [target.id]
    while todo:
        n = todo.pop()
        if n in need:
            continue
        need.add(n)
        for sub in ast.walk(top[n][1]):
            if isinstance(sub, ast.Name) and sub.id in top and sub.id not in need:
                todo.append(sub.id)
    reserved = MODULES | HOST_BUILTINS | KERNEL_BUILTINS | {"np", "grade"} | (NUMPY_BUILTINS if mode == "numpy" else set())
    for n in sorted(need):
        kind, node, cell = top[n]
        if n in reserved:
            raise Refused(f"cell {cell}: `{n}` names a module or builtin the graded code relies on: rename it")
        if kind == "fn":
            if mode == "numpy":
                _NumpyChecker(node, top, cell).check()
            else:
                _check_decorators(node, cell)
                _Checker(node, top, cell).check()
    parts = sorted(((top[n][2], top[n][1].lineno, n, top[n][1]) for n in need), key=lambda p: p[:2])
    return parts, target.id


def source_of(parts) -> str:
    return "\n\n\n".join(ast.unparse(node) for *_, node in parts) + "\n"


PREAMBLE = {"numpy": "import math\nimport numpy as np\nfrom flashlab.grader import grade\n",
            "kernel": "import math\nimport torch\nimport triton\nimport triton.language as tl\nfrom flashlab import device\n"
                      "from flashlab.grader import grade\nimport flashlab.grader.clean\n"
                      "flashlab.grader.clean.guard_launches()\n"}


def guard_launches() -> None:
    """In a clean run: a launch that hands a torch tensor to a ``tl.constexpr`` parameter raises (the interpreter
    would give the kernel the tensor itself, to compute on with torch instead of tl)."""
    import inspect

    import torch
    classes = []
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:   # pragma: no cover
        pass
    from triton.runtime.jit import JITFunction
    classes.append(JITFunction)
    for cls in classes:
        orig = cls.run
        if getattr(orig, "flashlab_guard", False):
            continue

        def run(self, *args, _orig=orig, **kwargs):
            sig = inspect.signature(self.fn)
            bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
            for name, val in bound.arguments.items():
                if isinstance(val, torch.Tensor) and "constexpr" in str(sig.parameters[name].annotation):
                    raise TypeError(f"a tensor passed to the kernel's tl.constexpr `{name}`: tensors go to pointer "
                                    "parameters")
            return _orig(self, *args, **kwargs)
        run.flashlab_guard = True
        cls.run = run


def notebook(graded: dict) -> bytes:
    """A one-cell notebook grading ``graded`` = {exercise: (parts, function name, mode)}: the grader's imports,
    the definitions they need (each once, in the notebook's order), then one ``grade(exercise, fn)`` each."""
    modes = {m for _, _, m in graded.values()}
    pre = "".join(dict.fromkeys(line for m in sorted(modes) for line in PREAMBLE[m].splitlines(True)))
    parts = {}
    for ps, _, _ in graded.values():
        for p in ps:
            parts[p[2]] = p
    body = source_of(sorted(parts.values(), key=lambda p: p[:2]))
    calls = "".join(f"grade({ex!r}, {fn})\n" for ex, (_, fn, _) in graded.items())
    cell = {"cell_type": "code", "execution_count": None, "id": "clean-run", "metadata": {}, "outputs": [],
            "source": pre + "\n" + body + "\n\n" + calls}
    nb = {"cells": [cell], "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                       "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(nb).encode()
