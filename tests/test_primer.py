"""Notebook 04's exercises: right kernels pass (any block shape), classic mistakes fail with their name,
stubs say "not implemented", out-of-bounds accesses are reported."""
import numpy as np
import pytest
import torch

from flashlab import device
from flashlab.grader import exercises, grade
from flashlab.grader.exercises.part2 import guarded_2d, softmax_rows
from flashlab.kernels import primer

from buggy_primer import make_matmul, make_softmax


def _named(result, title):
    return any(title in h for h in result.hints)


def test_contracts_are_registered():
    ex = exercises()
    assert "->" in ex["softmax_kernel"] and "->" in ex["matmul_kernel"]


@pytest.mark.parametrize("name,fn", [
    ("softmax_kernel", primer.softmax),
    ("softmax_kernel", make_softmax(block_factor=2)),            # a larger block than needed is fine
    ("matmul_kernel", primer.matmul),
    ("matmul_kernel", make_matmul(BM=16, BN=32, BK=16)),
    ("matmul_kernel", make_matmul(BM=32, BN=16, BK=32)),
])
def test_right_kernels_pass(name, fn):
    r = grade(name, fn, seed=1)
    assert r.passed, str(r)


@pytest.mark.parametrize("kw,title", [
    (dict(other_zero=True), "masked lanes loaded as 0"),
    (dict(no_max=True), "no max subtraction"),
    (dict(contiguous=True), "strides ignored"),
])
def test_softmax_mistakes_are_named(kw, title):
    r = grade("softmax_kernel", make_softmax(**kw), seed=2)
    assert not r.passed and _named(r, title), str(r)


@pytest.mark.parametrize("kw,title", [
    (dict(drop_tail=True), "K tail dropped"),
    (dict(contiguous=True), "strides ignored"),
])
def test_matmul_mistakes_are_named(kw, title):
    r = grade("matmul_kernel", make_matmul(**kw), seed=3)
    assert not r.passed and _named(r, title), str(r)


def test_unmasked_store_is_reported():
    def cand(x, y):
        y.as_strided((y.shape[0], y.shape[1] + 1), y.stride()).fill_(0.5)   # one column too many
    r = grade("softmax_kernel", cand, seed=4)
    assert not r.passed
    assert any("out-of-bounds write" in "\n".join(c.details) for c in r.cases if not c.passed)


def test_stubs_are_not_implemented():
    def stub(*args):
        raise NotImplementedError
    for name in ("softmax_kernel", "matmul_kernel"):
        assert grade(name, stub).not_implemented


def test_hidden_cases_cover_the_issue(rng):
    from flashlab.grader.exercises import EXERCISES as ex
    sm = ex["softmax_kernel"].make_cases(rng)
    assert any(c.params["N"] % 2 and c.params["N"] < 16 for c in sm)          # not a power of two, short
    assert any(c.large and c.inputs["x"].abs().max() > 5e3 for c in sm)        # around +-1e4
    assert any(c.params["x"] == "transposed" for c in sm) and any(c.params["dtype"] == "fp16" for c in sm)
    mm = ex["matmul_kernel"].make_cases(rng)
    assert any(c.params["K"] % 16 for c in mm) and any(c.params["M"] % 16 and c.params["N"] % 16 for c in mm)
    assert any(c.params["a"] == "transposed" for c in mm) and any(c.params["b"] == "transposed" for c in mm)


def test_transposed_view_is_padded_and_strided():
    x = torch.arange(12.0).view(3, 4).to(device.DEVICE)
    buf = guarded_2d("x", x, "transposed")
    assert torch.equal(buf.view, x) and buf.view.stride() == (1, 3 + 8)
    assert torch.isnan(buf.flat).sum() == buf.flat.numel() - 12


def test_softmax_reference_with_phantom_zeros():
    x = np.array([[1.0, 2.0, 3.0]])
    np.testing.assert_allclose(softmax_rows(x).sum(), 1.0)
    ph = softmax_rows(x, extra_zeros=1)
    e = np.exp(x - 3)
    np.testing.assert_allclose(ph, e / (e.sum() + np.exp(-3.0)))


def test_no_interpreter_warning_is_printed_around_the_report():
    """The interpreter's RuntimeWarnings (e^x overflowing without the max subtraction) stay out of the
    notebook's output: what went wrong is in the report.  (In a child process: pytest records warnings.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.path.insert(0, 'tests')\n"
            "from flashlab.grader import grade\nfrom buggy_primer import make_softmax\n"
            "r = grade('softmax_kernel', make_softmax(no_max=True), seed=2)\nprint('passed', r.passed)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert "passed False" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "Warning" not in out.stderr, out.stderr[-2000:]


def test_torch_math_handed_in_is_refused():
    """Right values without a kernel: torch's softmax or matmul copied into the output is refused, naming
    what was done on which tensor."""
    def torch_softmax(x, y):
        y.copy_(torch.softmax(x.float(), -1).to(y.dtype))

    def torch_matmul(a, b, c):
        c.copy_(a @ b)
    for name, fn, what in (("softmax_kernel", torch_softmax, "softmax on `x`"),
                           ("matmul_kernel", torch_matmul, "matmul on `a`")):
        r = grade(name, fn, seed=5)
        assert not r.passed, str(r)
        text = str(r)
        assert "no Triton kernel was launched" in text and what in text, text


@pytest.mark.parametrize("BK", [16, 64])
def test_an_fp16_accumulator_fails_the_accumulation_case(BK):
    """The contract asks for float32 accumulation; the positive-entries case with K = 2048 exposes an fp16
    accumulator (its rounding per chunk exceeds the tolerance, which float32 accumulation provably meets)."""
    r = grade("matmul_kernel", make_matmul(BK=BK, acc_fp16=True), seed=6)
    assert not r.passed
    assert any("accumulator in fp16" in h for h in r.hints), str(r)
    assert [c for c in r.cases if not c.passed and "fp32 accumulation" in c.params]


def test_the_accumulation_case_separates_fp32_from_fp16_accumulation():
    """On fresh draws: float32 accumulation is within the case's tolerance, an fp16 accumulator (any
    BLOCK_K up to 256) is not."""
    from flashlab.grader.exercises import EXERCISES
    ex = EXERCISES["matmul_kernel"]
    fp16_acc = next(b for b in ex.bugs if b.key == "fp16_accumulator")
    for seed in range(5):
        case = next(c for c in ex.make_cases(np.random.default_rng(seed)) if "check" in c.params)
        ref = ex.reference(case)["c"]
        tol = ex.tolerance(case, "c", ref)
        a, b = (case.inputs[n].float().numpy() for n in "ab")
        assert np.abs((a @ b).astype(np.float16).astype(np.float64) - ref).max() < tol
        assert all(np.abs(alt["c"] - ref).max() > tol for alt in fp16_acc.outputs(case))


def test_y_stored_with_xs_strides_fails_naming_both():
    """Some cases lay y out unlike x, so a kernel storing y with x's strides fails there, named."""
    r = grade("softmax_kernel", make_softmax(y_strides_from_x=True), seed=7)
    assert not r.passed
    assert any("`y` stored with `x`'s strides" in h for h in r.hints), str(r)
    assert any("y transposed" in c.params or "x transposed" in c.params for c in r.cases if not c.passed)


def test_a_kernel_failure_offers_to_trace_the_kernel_and_a_numpy_one_does_not():
    r = grade("softmax_kernel", make_softmax(no_max=True))
    assert not r.passed and "viz.trace_call(YOUR_FUNCTION, x, y)" in str(r) and "viz.trace_call" in r._repr_html_()
    assert grade("softmax_kernel", make_softmax()).trace_hint() == ""           # nothing to offer on a pass
    numpy_fail = grade("attention_naive", lambda q, k, v, causal: q * 0)
    assert not numpy_fail.passed and "trace" not in str(numpy_fail)


def test_a_softmax_summing_in_float16_is_named():
    """x kept in float16 (only tl.exp, which takes float32 alone, sees float32): the values pass the
    tolerance in the interpreter, so the interpreter's record of the dtype tl.sum adds in names it."""
    r = grade("softmax_kernel", make_softmax(no_upcast=True), seed=5)
    assert not r.passed
    bad = [c for c in r.cases if not c.passed]
    assert bad and all("fp16" in c.params for c in bad), str(r)
    assert "a tl.sum adds float16 values" in str(r), str(r)
