"""The clean run (flashlab.grader.clean): what it takes from a notebook, what it refuses and why, and that the
code it builds grades like the notebook did.  The batch grader's use of it is in test_batch_attacks.py."""
import json
from pathlib import Path

import pytest

from flashlab.grader import clean

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"04_triton_primer": ("softmax_kernel", "matmul_kernel"),
           "05_flash_forward": ("flash_forward", "flash_forward_tails", "flash_forward_causal"),
           "07_backward": ("flash_backward",)}

SMAX = '''import triton, triton.language as tl
import numpy as np
@triton.jit
def smax(X, Y, N, sxm, sxn, sym, syn, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * sxm + cols * sxn, mask=cols < N, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(Y + row * sym + cols * syn, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=cols < N)
'''


def _nb(*cells) -> bytes:
    return json.dumps({"cells": [{"cell_type": "code", "source": c, "metadata": {}, "outputs": []} for c in cells],
                       "metadata": {}, "nbformat": 4, "nbformat_minor": 5}).encode()


def _softmax(body: str, extra: str = "") -> bytes:
    return _nb(SMAX, extra + "def softmax(x, y):\n" + body + "\ngrade('softmax_kernel', softmax)\n")


RIGHT = "    smax[(x.shape[0],)](x, y, x.shape[1], *x.stride(), *y.stride(), BLOCK=triton.next_power_of_2(x.shape[1]))"


@pytest.mark.parametrize("notebook,exercise", [(nb, e) for nb, es in KERNELS.items() for e in es])
def test_every_solution_kernel_is_taken_as_it_is(notebook, exercise):
    parts, fn = clean.extract((ROOT / "solutions" / f"{notebook}.ipynb").read_bytes(), exercise)
    source = clean.source_of(parts)
    compile(clean.PREAMBLE["kernel"] + source, "<clean>", "exec")
    assert "@triton.jit" in source and f"def {fn}(" in source and "grade(" not in source


def test_only_the_graded_function_and_what_it_names_is_taken():
    data = _nb(SMAX, "UNUSED = 3\nSCALE = 2 ** 0.5\ndef helper(n):\n    return triton.next_power_of_2(n)\n",
               "def softmax(x, y):\n    smax[(x.shape[0],)](x, y, x.shape[1], *x.stride(), *y.stride(), "
               "BLOCK=helper(x.shape[1]))\n",
               "import os\nos.environ['X'] = '1'\ngrade('softmax_kernel', softmax)\n")
    parts, fn = clean.extract(data, "softmax_kernel")
    source = clean.source_of(parts)
    assert fn == "softmax" and "def helper" in source and "def smax" in source
    assert "UNUSED" not in source and "os.environ" not in source and "numpy" not in source


def test_the_last_definition_counts():
    data = _nb(SMAX, "def softmax(x, y):\n    y.copy_(x)\n", "def softmax(x, y):\n" + RIGHT + "\n",
               "grade('softmax_kernel', softmax)\n")
    source = clean.source_of(clean.extract(data, "softmax_kernel")[0])
    assert "copy_" not in source and "smax[" in source


@pytest.mark.parametrize("body,extra,says", [
    ("    y.copy_(torch.softmax(x, -1))", "", ".copy_"),
    ("    smax[(1,)](torch.softmax(x, -1), y, 1, 1, 1, 1, 1, BLOCK=1)", "", "torch.softmax"),
    ("    y.copy_(x)", "", ".copy_"),
    ("    y[:] = x", "", "indexing a tensor"),
    ("    t = x.contiguous()\n    y[:, 0] = t[:, 0]", "", "indexing a tensor"),
    ("    z = torch.empty_like(x)\n    w = z * 2", "", "arithmetic on a tensor"),
    ("    w = x @ x", "", "`@` in host code"),
    ("    w = -x", "", "arithmetic on a tensor"),
    ("    for row in x:\n        pass", "", "iterating over a tensor"),
    ("    w = [float(v) for v in x]", "", "iterating over a tensor"),
    ("    w = int(x)", "", "`int()` of a tensor"),
    ("    np.exp(x)", "", "`np` is not available"),
    ("    f = getattr(torch, 'softmax')", "", "`getattr` is not available"),
    ("    import torch.nn.functional as F", "", "`import` is not allowed"),
    ("    x.__class__", "", "`.__class__`"),
    ("    torch.nn.functional.softmax(x, -1, out=y)", "", "torch.nn"),
    ("    smax.fn(x, y)", "", "`.fn`"),
    ("    grade('softmax_kernel', softmax)", "", "`grade` is not available"),
    ("    exec('y.copy_(x)')", "", "`exec` is not available"),
    ("    try:\n        pass\n    except Exception:\n        pass", "", "`try` is not allowed"),
    ("    def inner():\n        pass", "", "helper functions at the top level"),
    # a helper of the notebook's own may hand back a tensor: what it returns is treated as one
    ("    t = same(x)\n    w = t * 2", "def same(a):\n    return a\n", "arithmetic on a tensor"),
    ("    same(y)[:, 0] = 0.0", "def same(a):\n    return a\n", "indexing a tensor"),
    ("    w = same(x) + 1", "def same(a):\n    return a\n", "arithmetic on a tensor"),
    ("    (t := x.contiguous())\n    w = t / 2", "", "arithmetic on a tensor"),
    (RIGHT + "\n    t = torch.empty_like(x)", "def torch():\n    pass\n", "names a module"),
])
def test_what_a_host_function_may_not_do_is_refused_with_its_reason(body, extra, says):
    with pytest.raises(clean.Refused) as e:
        clean.extract(_softmax(body, extra), "softmax_kernel")
    assert says in str(e.value), str(e.value)
    assert "line" in str(e.value) or "cell" in str(e.value)


@pytest.mark.parametrize("kernel_line,says", [
    ("    v = X.handle", "`.handle`"),
    ("    v = tl.core.builtins", "`tl.core"),
    ("    v = np.ones(4)", "`np` is not available"),
    ("    v = torch.ones(4)", "`torch.ones` is not available"),
    ("    f = lambda a: a", "no lambda inside a kernel"),
])
def test_what_a_kernel_may_not_do_is_refused(kernel_line, says):
    bad = SMAX.replace("    row = tl.program_id(0)\n", "    row = tl.program_id(0)\n" + kernel_line + "\n")
    with pytest.raises(clean.Refused) as e:
        clean.extract(_nb(bad, "def softmax(x, y):\n" + RIGHT + "\ngrade('softmax_kernel', softmax)\n"),
                      "softmax_kernel")
    assert says in str(e.value), str(e.value)


def test_only_triton_decorators_make_a_kernel():
    """A decorator of its own would let a plain function pass for a kernel (kernels may compute): refused."""
    for deco in ("@keep\n", "@triton.jit\n@keep\n", "@triton.jit\n@triton.jit\n"):
        data = _nb("def keep(f):\n    return f\n", deco + "def softmax(x, y):\n    y[:] = x\n"
                   "grade('softmax_kernel', softmax)\n")
        with pytest.raises(clean.Refused, match="only decorators"):
            clean.extract(data, "softmax_kernel")


def test_a_function_not_defined_with_def_is_refused():
    for cell in ("grade('softmax_kernel', lambda x, y: None)\n",
                 "def make():\n    return None\nsoftmax = make()\ngrade('softmax_kernel', softmax)\n"):
        with pytest.raises(clean.Refused, match="defined with `def`"):
            clean.extract(_nb(SMAX, cell), "softmax_kernel")
    with pytest.raises(clean.Refused, match="no grade"):
        clean.extract(_nb(SMAX), "softmax_kernel")


def test_the_clean_notebook_grades_a_right_kernel_and_fails_a_wrong_one():
    """The one-cell notebook it builds, run as a script here (grade() in process, the interpreter)."""
    for body, passed in ((RIGHT, True), (RIGHT.replace("x.shape[1], *x.stride()", "x.shape[1] - 1, *x.stride()"),
                                         False)):
        parts, fn = clean.extract(_softmax(body), "softmax_kernel")
        nb = json.loads(clean.notebook({"softmax_kernel": (parts, fn, "kernel")}))
        (cell,) = nb["cells"]
        code = cell["source"].replace("\ngrade('softmax_kernel', softmax)\n", "\nRESULT = grade('softmax_kernel', softmax)\n")
        ns = {}
        exec(compile(code, "<clean-run>", "exec"), ns)
        assert ns["RESULT"].passed is passed


NUMPY_SOLUTIONS = {"01_naive_attention": ("attention_naive",), "02_online_softmax": ("online_softmax", "online_softmax_update"),
                   "03_tiled_attention": ("attention_tiled",), "06_causal_and_speed": ("causal_loop_bounds",),
                   "08_variants": ("dropout_backward", "gqa_head_map", "varlen_program_map", "window_tile_bounds"),
                   "09_beyond_one_kernel": ("merge_partials", "ring_step", "zigzag_indices")}


@pytest.mark.parametrize("notebook", list(NUMPY_SOLUTIONS))
def test_every_numpy_solution_is_taken_and_one_notebook_grades_them_all(notebook):
    data = (ROOT / "solutions" / f"{notebook}.ipynb").read_bytes()
    graded = {}
    for ex in NUMPY_SOLUTIONS[notebook]:
        parts, fn = clean.extract(data, ex, "numpy")
        graded[ex] = (parts, fn, "numpy")
    (cell,) = json.loads(clean.notebook(graded))["cells"]
    compile(cell["source"], notebook, "exec")
    assert cell["source"].count("grade(") == len(graded) and "import numpy as np" in cell["source"]


@pytest.mark.parametrize("line,says", [
    ("    from flashlab import reference", "`importfrom` is not allowed"),
    ("    return reference.attention_naive(q, k, v, causal)", "`reference` is not available"),
    ("    return np.load('answers.npy')", "`np.load`"),
    ("    return np.lib.stride_tricks.as_strided(q, (1,), (0,))", "`np.lib"),
    ("    return q.ctypes.data", "`.ctypes`"),
    ("    return q.__class__", "`.__class__`"),
    ("    return open('x').read()", "`open` is not available"),
    ("    return getattr(np, 'exp')(q)", "`getattr` is not available"),
    ("    return __import__('flashlab')", "`__import__`"),
])
def test_what_numpy_code_may_not_do_is_refused(line, says):
    data = _nb("import numpy as np\ndef attention_naive(q, k, v, causal):\n" + line +
               "\ngrade('attention_naive', attention_naive)\n")
    with pytest.raises(clean.Refused) as e:
        clean.extract(data, "attention_naive", "numpy")
    assert says in str(e.value), str(e.value)


def test_numpy_code_may_use_numpy_math_helpers_and_nested_functions():
    data = _nb("import numpy as np\nimport math\nEPS = 1e-9\ndef helper(s):\n    return np.exp(s - s.max(1, keepdims=True))\n",
               "def attention_naive(q, k, v, causal):\n    def norm(p):\n        return p / (p.sum(1, keepdims=True) + EPS)\n"
               "    s = q @ k.T / math.sqrt(q.shape[1])\n    with np.errstate(over='ignore'):\n        p = norm(helper(s))\n"
               "    return p @ v\ngrade('attention_naive', attention_naive)\n")
    parts, fn = clean.extract(data, "attention_naive", "numpy")
    assert [p[2] for p in parts] == ["EPS", "helper", "attention_naive"] and fn == "attention_naive"


def test_a_clean_run_refuses_a_tensor_handed_to_a_constexpr():
    """The interpreter hands a tl.constexpr argument to the kernel as it is: a torch tensor there would let the
    kernel compute with torch. The clean run's preamble makes such a launch raise."""
    import torch
    import triton
    import triton.language as tl

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    @triton.jit
    def k(X, Y: tl.constexpr):
        pass
    saved = InterpretedFunction.run, JITFunction.run
    try:
        clean.guard_launches()
        clean.guard_launches()                               # once is enough; twice changes nothing
        x = torch.zeros(4)
        k[(1,)](x, 3)
        with pytest.raises(TypeError, match="tl.constexpr `Y`"):
            k[(1,)](x, x)
    finally:
        InterpretedFunction.run, JITFunction.run = saved
