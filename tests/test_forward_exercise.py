"""flash_forward's hidden cases (notebook 05) and the classic forward-kernel mistakes, each named."""
import numpy as np
import pytest
import torch

from flashlab.grader import grade
from flashlab.grader.exercises import EXERCISES
from flashlab.grader.exercises.part2 import _fwd_run, _guard_4d

from buggy_kernels import make_forward


def _named(result, title):
    return any(title in h for h in result.hints)


def test_hidden_cases_cover_the_issue(rng):
    cases = EXERCISES["flash_forward"].make_cases(rng)
    p = [c.params for c in cases]
    assert any(x.get("layout") == "BNHD" for x in p)                       # (B, N, H, D) views
    assert any(x["causal"] and x["Nq"] < x["Nk"] for x in p)
    assert any(x["causal"] and x["Nq"] > x["Nk"] for x in p)
    assert any(x["H"] == 3 for x in p) and any(x["Nq"] == 1 and x["Nk"] > 1 for x in p)
    assert {17, 33, 65} <= {x["Nk"] for x in p}                            # BLOCK_N + 1 for 16, 32, 64
    big = [c for c in cases if c.large and "layout" not in c.params and c.params["D"] == 32]
    s = big[0].inputs["q"].double() @ big[0].inputs["k"].double().transpose(-1, -2) / 32 ** 0.5
    assert 900 < s.abs().max().item() <= 1000.5                           # |S| ~ 1000
    back = EXERCISES["flash_backward"].make_cases(rng)
    assert all(c.params.get("layout") in (None, "mixed1", "mixed2") for c in back)   # the backward's cases are its own
    from flashlab.grader.exercises.part2 import layouts_of
    for cs in (cases, back):                     # some cases lay every same-shaped tensor out differently
        mixed = [layouts_of(c) for c in cs if c.params.get("layout", "").startswith("mixed")]
        assert mixed and all(len({m["k"], m["v"]}) == 2 and m["o"] != m["q"] for m in mixed)


def test_transposed_layout_buffers():
    x = torch.randn(2, 3, 5, 4)
    buf = _guard_4d("q", x, "BNHD")
    assert torch.equal(buf.view, x)
    assert buf.view.stride(1) == 4 and buf.view.stride(2) == 3 * 4       # heads inside a row: (B, N, H, D)


def test_output_view_is_transposed_too(rng):
    case = next(c for c in EXERCISES["flash_forward"].make_cases(rng) if c.params.get("layout") == "BNHD")
    seen = {}

    def spy(q, k, v, o, lse, causal):
        seen.update(q=q.stride(), o=o.stride())
        o.zero_()
        lse.zero_()
    _fwd_run(spy, case)
    assert seen["q"][2] > seen["q"][1] and seen["o"][2] > seen["o"][1]   # N is the outer axis in memory


@pytest.mark.parametrize("bm,bn", [(64, 16), (16, 32)])
def test_right_kernel_with_other_tiles_passes(bm, bn):
    r = grade("flash_forward", make_forward(BM=bm, BN=bn), seed=20)
    assert r.passed, str(r)


@pytest.mark.parametrize("kw,title", [
    (dict(rescale=False), "accumulator not rescaled"),
    (dict(causal_keep=2), "causal mask on the wrong side"),
    (dict(causal_keep=1), "causal mask reversed"),
    (dict(mask_scores=False), "ragged tail not masked"),
    (dict(kv_q_strides=True), "wrong stride"),
    (dict(lse_base2=True), "LSE in base 2"),
])
def test_classic_mistakes_fail_with_their_name(kw, title):
    with np.errstate(all="ignore"):
        r = grade("flash_forward", make_forward(**kw), seed=21)
    assert not r.passed and _named(r, title), str(r)


def test_record_script_times_the_solution_notebooks_kernel():
    """scripts/record_part2.py times the kernel of solutions/05 as "learner": it must extract it and it must pass."""
    import importlib.util
    from pathlib import Path

    from flashlab import bench
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("record_part2", root / "scripts" / "record_part2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    learner = mod.learner_kernel()
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    o = bench.contract_provider(learner)(q, k, v, True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (o - ref).abs().max().item() < 1e-5


def test_attention_in_torch_copied_into_o_is_refused():
    """softmax(S) V and a logsumexp in torch, copied into o and lse: right values, no kernel: refused."""
    from flashlab import reference as R

    def torch_forward(q, k, v, o, lse, causal):
        out, l = R.attention_naive_torch(q.float(), k.float(), v.float(), causal)
        o.copy_(out)
        lse.copy_(torch.logsumexp(l[..., None], -1))
    r = grade("flash_forward", torch_forward, seed=1)
    assert not r.passed
    assert "no Triton kernel was launched" in str(r) and "on `q`" in str(r), str(r)


@pytest.mark.parametrize("swap,title", [({"v": "k"}, "`v` read with `k`'s strides"),
                                        ({"o": "q"}, "`o` stored with `q`'s strides")])
def test_a_stride_mix_up_between_same_shaped_tensors_fails_naming_both(swap, title):
    """Same-shaped tensors get different layouts in some cases, so V read with K's strides, or O stored
    with Q's, is wrong there (outside the grader one (B, N, H, D) view among contiguous tensors is enough),
    and the report names the two tensors."""
    r = grade("flash_forward", make_forward(strides_from=swap), seed=3)
    assert not r.passed
    assert any(title in h for h in r.hints), str(r)
    failing = [c for c in r.cases if not c.passed]
    assert any("(H, B, N, D)" in c.params or "(B, N, H, D)" in c.params or "D + 8" in c.params for c in failing)


def test_a_load_past_the_end_is_reported_even_when_its_values_are_discarded():
    """Q loaded without its row mask: rows past Nq come from the padding, but they are never stored, so the
    values are right; the read itself is reported (on a GPU it can fault or read another tensor)."""
    r = grade("flash_forward", make_forward(mask_q=False), seed=2)
    assert not r.passed
    assert "past the edges of `q`" in str(r), str(r)
    r = grade("flash_forward", make_forward(), seed=2)
    assert r.passed, str(r)


@pytest.mark.parametrize("acc16,named", [(1, "a tl.dot accumulates in float16"), (2, None)])
def test_a_float16_accumulator_fails_naming_the_rule(acc16, named):
    """acc allocated in the inputs' dtype (tl.dot then accumulates in float16: the interpreter names it),
    or rounded to it after every tile (the dot in float32): the case with V ~ 2000 over 128 nearly equally
    weighted keys overflows such an acc (inf), and the report says which rule."""
    with np.errstate(all="ignore"):
        r = grade("flash_forward", make_forward(acc16=acc16), seed=22)
    assert not r.passed
    assert any("a 16-bit accumulator fails this case" in h and "keep acc in float32" in h for h in r.hints), str(r)
    assert any("65504" in c.params for c in r.cases if not c.passed)
    if named:
        assert named in str(r), str(r)


def test_the_accumulator_case_overflows_only_a_float16_accumulator():
    """On fresh draws: the unnormalised sum of P V (P = e^(S - row max), what acc holds after the last
    tile) passes 65504 on every row while O stays near 2000 (representable), so a float16 acc is inf
    whatever the tile size."""
    from flashlab.grader.exercises.part2 import _acc_overflow_case
    for seed in range(5):
        case = _acc_overflow_case(np.random.default_rng(seed))
        q, k, v = (case.inputs[n][0, 0].double().numpy() for n in "qkv")
        s = q @ k.T / 4.0
        p = np.exp(s - s.max(1, keepdims=True))
        assert (p @ v).min() > 65504 and np.abs((p @ v) / p.sum(1, keepdims=True)).max() < 3000
