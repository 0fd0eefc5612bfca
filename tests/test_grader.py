"""The grader: right answers pass, known bugs fail with their hint, unknown bugs fail,
stubs and exceptions are reported, out-of-bounds accesses are caught without killing us."""
import math
import os

import numpy as np
import pytest
import torch

from flashlab import reference as R
from flashlab.grader import bugs as B
from flashlab.grader import exercises, grade
from flashlab.kernels import launch_backward, launch_forward

from buggy_kernels import make_forward


def _hint_names(result, title):
    return any(title in h for h in result.hints)


# ---------------------------------------------------------------- passing variants

def test_every_exercise_has_a_contract():
    ex = exercises()
    for name in ("online_softmax_update", "online_softmax", "attention_naive", "attention_tiled",
                 "flash_forward", "flash_backward"):
        assert name in ex and "->" in ex[name]


@pytest.mark.parametrize("name,fn", [
    ("online_softmax_update", R.online_softmax_update),
    ("online_softmax", R.online_softmax),
    ("attention_naive", lambda q, k, v, c: R.attention_naive(q, k, v, c)[0]),
    ("attention_tiled", R.attention_fa2),
    ("attention_tiled", R.attention_fa1),
])
def test_reference_code_is_refused_with_the_reason(name, fn):
    """The references are what a NumPy exercise is compared with: handing them in is not an answer."""
    r = grade(name, fn)
    assert not r.passed
    assert all(c.message == "right answer, wrong algorithm" for c in r.cases), str(r)
    assert "asks for your own" in "\n".join(r.first_failure().details)


def own_online_softmax(x, b):
    m, l = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
    for j in range(0, x.shape[1], b):
        m_new = np.maximum(m, x[:, j:j + b].max(1))
        l = np.exp(m - m_new) * l + np.exp(x[:, j:j + b] - m_new[:, None]).sum(1)
        m = m_new
    return np.exp(x - m[:, None]) / l[:, None]


def test_own_code_passes():
    r = grade("online_softmax", own_online_softmax)
    assert r.passed, str(r)
    assert "all cases pass" in str(r) and "✅" in r._repr_html_()


def _fwd(q, k, v, o, lse, causal):
    launch_forward(q, k, v, o, lse, causal, 1 / math.sqrt(q.shape[-1]))


def _bwd(q, k, v, o, lse, do, dq, dk, dv, causal):
    launch_backward(q, k, v, o, lse, do, dq, dk, dv, causal, 1 / math.sqrt(q.shape[-1]))


def test_flashlab_kernels_pass_their_own_exercises():
    r = grade("flash_forward", _fwd, seed=1)
    assert r.passed, str(r)
    r = grade("flash_backward", _bwd, seed=1)
    assert r.passed, str(r)


def test_learner_style_kernel_with_other_blocks_passes():
    assert grade("flash_forward", make_forward(BM=32, BN=64), seed=2).passed


# ---------------------------------------------------------------- known bugs are named

def _np_attention_bug(key):
    fn = {k: f for k, _, _, f in B.attention_bugs()}[key]

    def cand(q, k, v, causal, bq=None, bk=16):
        o, lse = fn(q, k, v, causal, 1 / math.sqrt(q.shape[1]), bk)
        return o, lse
    return cand


ATTN_BUG_TITLES = {k: t for k, t, _, _ in B.attention_bugs()}


@pytest.mark.parametrize("key", [k for k, _, _, _ in B.attention_bugs() if k != "no_max"])   # every one
def test_tiled_known_bugs_fail_with_their_hint(key):
    fn = {k: f for k, _, _, f in B.attention_bugs()}[key]

    def cand(q, k, v, causal, bq, bk):
        with np.errstate(all="ignore"):
            return fn(q, k, v, causal, 1 / math.sqrt(q.shape[1]), bk)
    r = grade("attention_tiled", cand, seed=3)
    assert not r.passed
    assert _hint_names(r, ATTN_BUG_TITLES[key]), str(r)


def test_no_max_subtraction_fails_on_large_logits():
    def cand(q, k, v, causal):
        with np.errstate(all="ignore"):
            s = q @ k.T / math.sqrt(q.shape[1])
            if causal:
                s = np.where(R.causal_mask(*s.shape), s, -np.inf)
            p = np.exp(s)
            return (p / p.sum(1, keepdims=True)) @ v
    r = grade("attention_naive", cand, seed=4)
    assert not r.passed
    failing = [c for c in r.cases if not c.passed]
    # large logits overflow e^S; rows whose scores are all below -800 underflow it to 0/0
    assert failing and all("large logits" in c.params or "below -800" in c.params for c in failing)
    assert any("large logits" in c.params for c in failing)
    assert any("maximum" in h or "max" in h for h in r.hints), str(r)


def test_softmax_wrong_axis_is_named():
    def cand(q, k, v, causal):
        s = q @ k.T / math.sqrt(q.shape[1])
        if causal:
            s = np.where(R.causal_mask(*s.shape), s, -np.inf)
        with np.errstate(all="ignore"):
            p = np.exp(s - s.max(0, keepdims=True))
            return (p / p.sum(0, keepdims=True)) @ v
    r = grade("attention_naive", cand, seed=5)
    assert not r.passed and _hint_names(r, "wrong axis"), str(r)


@pytest.mark.parametrize("key,title", [(k, t) for k, t, _, _ in B.online_softmax_update_bugs()])
def test_online_softmax_update_bugs(key, title):
    fn = {k: f for k, _, _, f in B.online_softmax_update_bugs()}[key]

    def cand(m, l, x):
        with np.errstate(all="ignore"):
            return fn(m, l, x)
    r = grade("online_softmax_update", cand, seed=6)
    assert not r.passed and _hint_names(r, title), str(r)


@pytest.mark.parametrize("key,title", [(k, t) for k, t, _, _ in B.online_softmax_bugs()])
def test_online_softmax_bugs(key, title):
    fn = {k: f for k, _, _, f in B.online_softmax_bugs()}[key]
    r = grade("online_softmax", fn, seed=7)
    assert not r.passed and _hint_names(r, title), str(r)


def test_lse_base2_is_named():
    def cand(q, k, v, causal, bq, bk):
        o, lse = R.attention_fa2(q, k, v, causal, bq, bk)
        return o, lse / math.log(2)
    r = grade("attention_tiled", cand, seed=8)
    assert not r.passed and _hint_names(r, "LSE in base 2"), str(r)


@pytest.mark.parametrize("kw,title", [
    (dict(rescale=False), "accumulator not rescaled"),
    (dict(lse_base2=True), "LSE in base 2"),
    (dict(strict=True), "off by one"),
    (dict(scale_fn=lambda d: 1.0), "missing softmax scale"),
])
def test_kernel_bugs_are_named(kw, title):
    r = grade("flash_forward", make_forward(**kw), seed=9)
    assert not r.passed and _hint_names(r, title), str(r)


def _torch_bwd_candidate(bug_key):
    fn = {k: f for k, _, _, f in B.backward_bugs()}[bug_key]

    def cand(q, k, v, o, lse, do, dq, dk, dv, causal):
        f64 = [t.detach().double().cpu().numpy() for t in (q, k, v, do)]
        s = 1 / math.sqrt(q.shape[-1])
        for b in range(q.shape[0]):
            for h in range(q.shape[1]):
                g = fn(*(t[b, h] for t in f64), causal, s)
                for out, val in zip((dq, dk, dv), g):
                    out[b, h] = torch.from_numpy(val).to(out)
    return cand


@pytest.mark.parametrize("key,title", [(k, t) for k, t, _, _ in B.backward_bugs() if k != "causal_ignored_bwd"])
def test_backward_bugs_are_named(key, title):
    r = grade("flash_backward", _torch_bwd_candidate(key), seed=10)
    assert not r.passed and _hint_names(r, title), str(r)


def test_unknown_bug_still_fails():
    def cand(q, k, v, causal, bq, bk):
        o, lse = R.attention_fa2(q, k, v, causal, bq, bk)
        o[-1, 0] += 1e-3                                   # a single wrong element, matching no known bug
        return o, lse
    r = grade("attention_tiled", cand, seed=11)
    assert not r.passed
    assert all("looks like" not in h for h in r.hints)
    fail = r.first_failure()
    assert "query row" in "\n".join(fail.details) and "column 0" in "\n".join(fail.details)


def test_wrong_heads_get_an_offset_hint():
    r = grade("flash_forward", make_forward(ignore_bh=True), seed=12)
    assert not r.passed and any("(batch, head)" in h for h in r.hints), str(r)


def test_failure_report_has_location_fraction_and_heatmap():
    r = grade("flash_forward", make_forward(rescale=False), seed=13)
    fail = r.first_failure()
    text = "\n".join(fail.details)
    assert "program_id(0)" in text and "program_id(1)" in text and "% of the elements" in text
    assert fail.heatmap is not None and fail.heatmap.ndim == 2
    html = r._repr_html_()
    assert "❌" in html and "data:image/png;base64" in html


# ---------------------------------------------------------------- robustness

def test_stub_reports_not_implemented():
    def stub(*args):
        raise NotImplementedError
    for name in exercises():
        r = grade(name, stub)
        assert not r.passed and r.not_implemented
        assert "not implemented yet" in str(r) and "not implemented yet" in r._repr_html_()


def test_exception_is_reported_not_raised():
    def cand(q, k, v, causal, bq, bk):
        return q[10_000]
    r = grade("attention_tiled", cand)
    assert not r.passed
    fail = r.first_failure()
    assert fail.status == "error" and any("IndexError" in d for d in fail.details)
    assert any("cand" in d for d in fail.details)     # the learner's own frame is shown


def test_wrong_return_type_is_explained():
    r = grade("attention_tiled", lambda q, k, v, c, bq, bk: q)
    assert not r.passed and "tuple (o, lse)" in "\n".join(r.first_failure().details)


def test_out_of_bounds_write_is_caught():
    r = grade("flash_forward", make_forward(mask_store=False), seed=14)
    assert not r.passed
    assert any("out-of-bounds write" in "\n".join(c.details) for c in r.cases if not c.passed)


def test_the_grader_checks_the_padding_itself_on_the_buffers_that_come_back():
    """A store one element past each row, with the run's own stray-write report switched off in the
    process that ran it (the child): the grader finds the overwritten padding on the buffers the child
    sends back; a run that sends none back fails too."""
    r = grade("softmax_kernel", _softmax_hiding(), seed=14)
    assert not r.passed and any("were overwritten" in "\n".join(c.details) for c in r.cases), str(r)
    r = grade("softmax_kernel", _softmax_hiding(send_back=False), seed=14)
    assert not r.passed and any("did not come back whole" in "\n".join(c.details) for c in r.cases), str(r)


def _softmax_hiding(send_back=True):
    """softmax_kernel storing one element past each row, the run's own stray report switched off (and,
    without ``send_back``, no buffer sent back either)."""
    import importlib

    from buggy_primer import make_softmax
    part2 = importlib.import_module("flashlab.grader.exercises.part2")
    inner = make_softmax(store_past=True)

    def softmax(x, y):
        part2._strays = lambda *a, **k: []
        if not send_back:
            part2.returned = lambda buffers: {}
        inner(x, y)
    return softmax


def test_out_of_bounds_read_shows_nan_hint():
    r = grade("flash_forward", make_forward(mask_tail=False), seed=15)
    assert not r.passed
    assert any("NaN" in h for h in r.hints), str(r)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_wild_store_crash_becomes_a_report():
    from flashlab import device
    if device.DEVICE.type == "cuda":
        pytest.skip("on a GPU a wild store is a CUDA error, not a heap corruption")
    r = grade("flash_forward", make_forward(wild_store=True), seed=16)
    assert not r.passed
    assert r.cases[0].status == "crash" and any("out-of-bounds" in d for d in r.cases[0].details)
    from flashlab.grader.exercises import EXERCISES
    n_cases = len(EXERCISES["flash_forward"].make_cases(np.random.default_rng(16)))
    # each case runs and its crash is reported; a store 100 MB past a buffer can land in memory that is mapped
    # (a large allocation of an earlier test), so now and then a case survives it (seen once: 17 of 18 crashed)
    assert len(r.cases) == n_cases and sum(c.status == "crash" for c in r.cases) >= n_cases - 2, str(r)
    assert grade("online_softmax", own_online_softmax).passed       # and this process still grades


def test_unknown_exercise_and_non_callable():
    with pytest.raises(ValueError, match="unknown exercise"):
        grade("nope", lambda: 0)
    with pytest.raises(TypeError, match="function"):
        grade("online_softmax", 3)


# ---------------------------------------------------------------- hints only on evidence, by kind

def _fake_results(cases, failing):
    from flashlab.grader.report import CaseResult
    return [CaseResult(f"case {i}", c.describe(), "fail" if i in failing else "pass",
                       "wrong", ["`o`: 3 element(s) are NaN or inf where the answer is finite"] if i in failing else [])
            for i, c in enumerate(cases)]


def test_case_property_hints_need_the_evidence():
    """Two failing cases that happen to be causal, among many causal cases that pass, are no evidence that
    "only causal cases fail"; every causal case failing (and non-causal ones passing) is."""
    from flashlab.grader.core import Case, symptom_hints
    from flashlab.grader.exercises import EXERCISES
    ex = EXERCISES["flash_forward"]
    cases = [Case({"B": 1, "H": 1, "Nq": 64, "Nk": 64, "D": 16, "causal": c, "dtype": "fp32"}, {})
             for c in (True, True, True, True, True, False, False, False)]
    coincidence = symptom_hints(ex, _fake_results(cases, {1, 3}), cases)
    assert not any("Only causal" in h for h in coincidence), coincidence
    evidence = symptom_hints(ex, _fake_results(cases, {0, 1, 2, 3, 4}), cases)
    assert any("Only causal" in h for h in evidence), evidence


def test_hints_speak_the_exercises_kind():
    """A NumPy hint ("0/0 in NumPy") never on a Triton exercise (the 2-D primer's cases have no B), nor on
    causal_loop_bounds (plain integers)."""
    from flashlab.grader.core import Case, symptom_hints
    from flashlab.grader.exercises import EXERCISES
    cases = [Case({"M": 5, "N": n, "dtype": "fp32"}, {}) for n in (7, 16, 33, 64)]
    hints = symptom_hints(EXERCISES["softmax_kernel"], _fake_results(cases, {0}), cases)
    assert hints and not any("NumPy" in h for h in hints) and any("load read past" in h for h in hints), hints
    r = grade("causal_loop_bounds", lambda s, bm, bn, nq, nk: (float("nan"), min((s + 1) * bm, nk)))
    assert not r.passed and not any("NumPy" in h or "Triton" in h or "kernel" in h for h in r.hints), r.hints


def test_the_offsets_hint_needs_whole_heads_right_and_wrong():
    from flashlab.grader.core import Case, compare
    from flashlab.grader.exercises import EXERCISES
    ex = EXERCISES["flash_forward"]
    case = Case({"B": 1, "H": 2, "Nq": 8, "Nk": 8, "D": 4, "causal": False, "dtype": "fp32"}, {})
    ref = {"o": np.random.default_rng(0).standard_normal((1, 2, 8, 4)), "lse": np.zeros((1, 2, 8))}
    few = {"o": ref["o"].copy(), "lse": ref["lse"]}
    few["o"][0, 0, 7, :2] += 1.0                          # two wrong elements in head 0, head 1 right
    ok, msg, details, _ = compare(ex, case, few, ref)
    assert not ok and not any("batch/head offsets" in d for d in details), details
    whole = {"o": ref["o"].copy(), "lse": ref["lse"]}
    whole["o"][0, 1] = ref["o"][0, 0]                     # head 1 computed from head 0's data
    ok, msg, details, _ = compare(ex, case, whole, ref)
    assert not ok and any("batch/head offsets" in d for d in details), details


def test_a_2d_exercises_stray_write_speaks_of_rows():
    import torch
    from flashlab.grader.memory import stray_writes
    from flashlab.grader.exercises.part2 import output_2d
    buf = output_2d("y", (3, 5), torch.float32)
    buf.flat[buf.flat.numel() // 2] = 0.0 if buf.view.stride(0) > 5 else buf.flat[0]
    s = stray_writes(buf)
    assert s is not None and "(batch, head)" not in str(s), s
