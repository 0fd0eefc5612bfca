"""flashlab.teaching.versions says what the plan chooses; the atomic-dQ teaching kernel's two memory orderings."""
import math

import pytest
import torch

import flashlab  # noqa: F401
from flashlab.kernels import plan as P
from flashlab.teaching import versions as V


@pytest.mark.parametrize("facts", ["h200", "a100", "t4"])
def test_versions_are_the_plans(facts):
    for D in (64, 128):
        for causal in (False, True):
            for n in (512, 4096, 16384):
                B, H = 16384 // n, 2048 // D                     # the protocol's call (16k tokens)
                p = P.plan(B, H, n, n, D, torch.float16, causal, facts=P.SIMULATED[facts])
                assert V.versions(D, causal, n, facts) == (p.fwd_version, p.bwd_version)
                assert f"forward {p.fwd_version}" in V.sentence(D, causal, n, facts)
                small = P.plan(2, 3, n, n, D, torch.float16, causal, facts=P.SIMULATED[facts])
                assert V.versions(D, causal, n, facts, B=2, H=3) == (small.fwd_version, small.bwd_version)
    if facts == "h200":   # the protocol's 4096 runs the one-pass backward; one head of 4096 keys is a small problem
        assert V.versions(64, False, 4096, facts)[1] == "v4" and V.versions(64, False, 4096, facts, B=1, H=1)[1] == "v2"


def test_determinism_sentence_follows_the_plan():
    bwd = V.versions(64, False, 16384, "h200")[1]
    det = V.versions(64, False, 16384, "h200", deterministic=True)[1]
    text = V.determinism(64, False, 16384, "h200")
    if bwd in V.ATOMIC_DQ:
        assert "not bitwise repeatable" in text and f"picks {det}" in text
        assert det not in V.ATOMIC_DQ
    else:
        assert "bitwise repeatable" in text
    assert "not bitwise" not in V.determinism(128, False, 512, "h200")
    with pytest.raises(ValueError, match="facts"):
        V.table("h100x")


def test_table_marks_only_atomic_backwards():
    t = V.table("a100")
    assert "*" not in t.split("\n", 2)[2]
    assert ("*" in V.table("h200")) == any(V.versions(d, c, n, "h200")[1] in V.ATOMIC_DQ
                                          for d in (64, 128) for c in (False, True) for n in V.NS)


@pytest.mark.parametrize("sem", ["relaxed", "acq_rel"])
def test_atomic_dq_orderings_give_the_two_kernel_gradients(sem):
    pytest.importorskip("triton")
    from flashlab.kernels import launch_backward, launch_forward
    from flashlab.teaching import atomic_dq
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, n, 32, generator=g) for n in (45, 70, 70, 45))
    o, lse = torch.empty_like(q), torch.empty(1, 2, 45)
    launch_forward(q, k, v, o, lse, True, 1 / math.sqrt(32))
    ref = [torch.empty_like(t) for t in (q, k, v)]
    launch_backward(q, k, v, o, lse, do, *ref, True, 1 / math.sqrt(32), version="v2")
    got = [torch.empty_like(t) for t in (q, k, v)]
    atomic_dq.launch_backward_atomic(q, k, v, o, lse, do, *got, True, 1 / math.sqrt(32), sem=sem)
    for a, b in zip(got, ref):
        assert (a - b).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="sem"):
        atomic_dq.launch_backward_atomic(q, k, v, o, lse, do, *got, True, 0.1, sem="seq")
