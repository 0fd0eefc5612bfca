"""Attacks on the clean run (flashlab.grader.clean), found by attacking it as a hostile student would: each
notebook below was accepted by clean.extract, and its clean run passed grading without the work the
exercise asks for (a Triton kernel of its own / NumPy code of its own), or crashed or stalled the grader.
Each is now refused, quickly, with the reason."""
import json
import time

import pytest

from flashlab.grader import clean


def _nb(*cells) -> bytes:
    return json.dumps({"cells": [{"cell_type": "code", "source": c, "metadata": {}, "outputs": []} for c in cells],
                       "metadata": {}, "nbformat": 4, "nbformat_minor": 5}).encode()


PRE = "import torch, triton, triton.language as tl\n"

# -- NumPy mode: escapes to __import__ (reference call with the call watcher / tracemalloc switched off)
NP_GIFRAME = '''import numpy as np
def attention_naive(q, k, v, causal):
    b = (i for i in ()).gi_frame.f_builtins
    imp = b["__import__"]
    imp("sys").setprofile(None)
    ref = imp("flashlab.reference", None, None, ["attention_naive"])
    return ref.attention_naive(np.asarray(q), np.asarray(k), np.asarray(v), causal)[0]
grade("attention_naive", attention_naive)
'''

NP_GIFRAME_TILED = '''import numpy as np
def attention_tiled(q, k, v, causal, block_q, block_k):
    b = (i for i in ()).gi_frame.f_builtins
    imp = b["__import__"]
    imp("sys").setprofile(None)
    imp("tracemalloc").stop()
    ref = imp("flashlab.reference", None, None, ["attention_naive"])
    return ref.attention_naive(np.asarray(q), np.asarray(k), np.asarray(v), causal)
grade("attention_tiled", attention_tiled)
'''

NP_DEFAULT_ARG_FRAME = '''import numpy as np
def attention_naive(q, k, v, causal, fr=(i for i in ()).gi_frame):
    imp = fr.f_builtins["__import__"]
    imp("sys").setprofile(None)
    return imp("flashlab.reference", None, None, ["x"]).attention_naive(np.asarray(q), np.asarray(k), np.asarray(v), causal)[0]
grade("attention_naive", attention_naive)
'''

NP_MTRAND_OPERATOR = '''import numpy as np
def attention_naive(q, k, v, causal):
    mt = np.random.mtrand
    op = mt.operator
    bi = op.attrgetter("__self__")(print)
    imp = op.attrgetter("__import__")(bi)
    imp("sys").setprofile(None)
    ref = imp("flashlab.reference", None, None, ["x"])
    return ref.attention_naive(np.asarray(q), np.asarray(k), np.asarray(v), causal)[0]
grade("attention_naive", attention_naive)
'''

NP_UNBOUND_TOFILE = '''import numpy as np
def attention_naive(q, k, v, causal):
    np.ndarray.tofile(np.asarray(q), "/tmp/leak.bin")
    s = q @ k.T / np.sqrt(q.shape[1])
    if causal:
        s = np.where(np.arange(k.shape[0])[None, :] <= np.arange(q.shape[0])[:, None], s, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True) @ v
grade("attention_naive", attention_naive)
'''

NP_TEST_RUNNER = '''import numpy as np
def attention_naive(q, k, v, causal):
    np.test(extra_argv=["-p", "flashlab.reference"])
    return q
grade("attention_naive", attention_naive)
'''

# -- kernel mode: the math is done by torch, not by a Triton kernel
K_CONSTEXPR_TORCH = PRE + '''
@triton.jit
def fake(X: tl.constexpr, Y: tl.constexpr):
    t = X.to(torch.float32)
    m = t.max(1, keepdim=True)[0]
    e = 2.718281828459045 ** (t - m)
    Y[:, :] = e / e.sum(1, keepdim=True)

def softmax(x, y):
    fake[(1,)](x, y)
grade("softmax_kernel", softmax)
'''

K_CONSTEXPR_MATMUL = PRE + '''
@triton.jit
def fake(A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    C[:, :] = A.to(torch.float32) @ B.to(torch.float32)

def matmul(a, b, c):
    fake[(1,)](a, b, c)
grade("matmul_kernel", matmul)
'''

K_ALIAS_HOST_MATH = PRE + '''
@triton.jit
def copy2d(S, D, M, N, ssm, ssn, sdm, sdn, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    v = tl.load(S + row * ssm + cols * ssn, mask=cols < N, other=0.0)
    tl.store(D + row * sdm + cols * sdn, v.to(D.dtype.element_ty), mask=cols < N)

def softmax(x, y):
    M, N = x.shape
    s = torch.empty((M, N), dtype=torch.float32)
    copy2d[(M,)](x, s, M, N, *x.stride(), *s.stride(), BLOCK=triton.next_power_of_2(N))
    t, yy = (s, y)
    m = t[:, 0:1]
    for j in range(N):
        c = t[:, j:j + 1]
        m = (m + c + abs(m - c)) / 2
    e = 2.718281828459045 ** (t - m)
    tot = e[:, 0:1] * 0.0
    for j in range(N):
        tot = tot + e[:, j:j + 1]
    yy[:, :] = e / tot
grade("softmax_kernel", softmax)
'''

K_GRID_LAMBDA = PRE + '''
@triton.jit
def nothing(X):
    pid = tl.program_id(0)

def work(x, y):
    xx, yy = (x, y)
    t, = (torch.empty(x.shape, dtype=torch.float32),)
    t[:, :] = xx
    m = t[:, 0:1]
    for j in range(t.shape[1]):
        c = t[:, j:j + 1]
        m = (m + c + abs(m - c)) / 2
    e = 2.718281828459045 ** (t - m)
    tot = e[:, 0:1] * 0.0
    for j in range(t.shape[1]):
        tot = tot + e[:, j:j + 1]
    yy[:, :] = e / tot
    return (1,)

def softmax(x, y):
    nothing[lambda meta: work(x, y)](x)
grade("softmax_kernel", softmax)
'''


@pytest.mark.parametrize("cell,exercise,mode", [
    (NP_GIFRAME, "attention_naive", "numpy"),
    (NP_GIFRAME_TILED, "attention_tiled", "numpy"),
    (NP_DEFAULT_ARG_FRAME, "attention_naive", "numpy"),
    (NP_MTRAND_OPERATOR, "attention_naive", "numpy"),
    (NP_UNBOUND_TOFILE, "attention_naive", "numpy"),
    (NP_TEST_RUNNER, "attention_naive", "numpy"),
    (K_CONSTEXPR_TORCH, "softmax_kernel", "kernel"),
    (K_CONSTEXPR_MATMUL, "matmul_kernel", "kernel"),
    (K_ALIAS_HOST_MATH, "softmax_kernel", "kernel"),
    (K_GRID_LAMBDA, "softmax_kernel", "kernel"),
], ids=["np-genexp-gi_frame-f_builtins", "np-tiled-tracemalloc-stop", "np-default-arg-frame",
        "np-random-mtrand-operator-attrgetter", "np-unbound-ndarray-tofile", "np-test-pytest-runner",
        "kernel-constexpr-torch-tensor", "kernel-constexpr-matmul", "kernel-alias-untracked-host-math",
        "kernel-grid-lambda-inside-launch"])
def test_bypass_is_refused(cell, exercise, mode):
    with pytest.raises(clean.Refused):
        clean.extract(_nb(cell), exercise, mode)


def test_deep_constant_does_not_crash_the_clean_notebook():
    """A 500-term constant passes extract (its _constant check recurses once per term) but ast.unparse in
    clean.notebook() needs ~3 frames per term: RecursionError outside batch's try around extract."""
    cell = (K_CONSTEXPR_TORCH.replace("def softmax(x, y):\n", "def softmax(x, y):\n    z = A\n")
            .replace('grade("softmax_kernel", softmax)\n', "")
            + "A = " + "+".join(["1"] * 500) + "\ngrade('softmax_kernel', softmax)\n")
    try:
        parts, fn = clean.extract(_nb(cell), "softmax_kernel")
    except clean.Refused:
        return
    clean.notebook({"softmax_kernel": (parts, fn, "kernel")})     # must not raise


def test_tensor_fixpoint_is_not_quadratic():
    """Names bound to tensors in reverse order make the fix-point loop walk the function once per name."""
    n = 2000
    body = "".join(f"    a{i} = a{i + 1}\n" for i in range(n)) + f"    a{n} = torch.empty_like(x)\n"
    t0 = time.monotonic()
    try:
        clean.extract(_nb(PRE + "def softmax(x, y):\n" + body + "grade('softmax_kernel', softmax)\n"), "softmax_kernel")
    except clean.Refused:
        pass
    assert time.monotonic() - t0 < 6.0      # about 0.5 s alone; 2.2 s seen on a machine busy with other tests
