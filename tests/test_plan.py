"""The launch plan: its choices per GPU class (simulated device facts), its cache key, and that the launchers
run what it says.  Pure Python except the last tests, which launch tiny problems in the interpreter."""
import math

import pytest
import torch

from flashlab import device, flash_attention, kernels
from flashlab.accuracy import check_attention
from flashlab.kernels import plan as P
from flashlab.kernels import tiles
from flashlab.kernels.tiles import C

DEV = device.DEVICE
fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def autotune_on(monkeypatch):
    """The plan's choices as on a GPU with autotuning on (FLASHLAB_AUTOTUNE may be 0 where the tests run)."""
    monkeypatch.setattr(tiles, "AUTOTUNE", True)


def _fits(step, facts):
    e = tiles.elt(step.tune_key[2])
    return tiles.estimate_shared_memory(step.kind, step.config, step.head_dim, e, facts.cc) <= facts.shared_memory


@pytest.mark.parametrize("facts", [P.T4, P.L4, P.A100, P.H200], ids=["T4", "L4", "A100", "H200"])
@pytest.mark.parametrize("D", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [fp16, fp32])
def test_hand_picked_tiles_fit_every_gpu_class(facts, D, dtype):
    """Below the autotuning bucket every step's tiles fit the GPU's shared memory (the estimate), and the grid
    covers the rows: cdiv(rows, tile rows) * B * H programs."""
    if D == 256 and dtype == fp32 and facts.shared_memory < 99 * 1024:
        pytest.skip("head dim 256 in fp32 is not promised on 64 KB (a clear error there)")
    for causal in (False, True):
        p = P.plan(2, 3, 300, 170, D, dtype, causal, facts=facts)
        for st in p.forward + p.backward[1:]:
            assert st.config is not None and not st.autotune, st
            assert _fits(st, facts), (st.kernel, st.config, facts.name)
            block = st.config.block_n if st.kind in ("dkdv", "bwd") else st.config.block_m
            assert st.grid == (math.ceil((170 if st.kind in ("dkdv", "bwd") else 300) / block) * 6,)


def test_choices_on_a_t4_an_l4_and_an_h200(monkeypatch):
    """Through device_facts (as plan_for uses it): the versions, autotuning and flags each GPU class gets."""
    for facts, long_fwd, long_bwd in ((P.T4, "v2", "v2"), (P.L4, "v2", "v2"), (P.H200, "v3", "v4")):
        monkeypatch.setattr(P, "device_facts", lambda f=facts: f)
        p = P.plan(4, 16, 4096, 4096, 64, fp16, True)
        assert (p.fwd_version, p.bwd_version) == (long_fwd, long_bwd), facts.name
        assert p.forward[0].autotune and p.forward[0].config is None and "autotuned" in p.forward[0].reason
        assert p.tma_reduce == (facts is P.H200) and not p.spread
        assert [s.kind for s in p.backward] == (["pre", "bwd"] if long_bwd == "v4" else ["pre", "dkdv", "dq"])
        short = P.plan(1, 1, 128, 128, 64, fp16, False)                # the small problem: hand-picked, v1 forward
        assert short.fwd_version == "v1" and short.bwd_version == "v2" and not short.forward[0].autotune
        assert short.forward[0].config == C(128, 64, 4, 3)       # fits 64 KB too (the estimate: exactly 64 KB)
        b6 = "v6" if facts is P.H200 and P.backward_v6.AVAILABLE else None           # Gluon's backward v6 at D = 128
        assert P.plan(4, 16, 4096, 4096, 128, fp16, True).bwd_version == (b6 or "v2")   # D = 128 causal: v4 spills
        assert P.plan(4, 16, 4096, 4096, 128, fp16, False).bwd_version == (b6 or long_bwd)
        assert P.plan(4, 16, 4096, 4096, 64, fp32, True).fwd_version == "v1"         # fp32: v1, not autotuned
        assert not P.plan(4, 16, 4096, 4096, 64, fp32, True).forward[0].autotune
        assert P.plan(4, 16, 4096, 4096, 64, fp16, True, deterministic=True).bwd_version == "v2"
    t4 = P.plan(1, 1, 512, 512, 128, fp16, False, facts=P.T4)
    assert t4.forward[0].config == C(64, 32, 4, 2)            # the T4 pick that compiled_kib says fits 64 KB


def test_layout_decides_whether_descriptors_run():
    h = P.H200
    p = P.plan(4, 16, 4096, 4096, 64, fp16, True, layout=P.Layout(no_zero_stride=False), facts=h)
    assert p.bwd_version == "v3" and "stride 0" in p.reasons["bwd"] and p.fwd_version == "v3"
    p = P.plan(4, 16, 4096, 4096, 64, fp16, True, layout=P.Layout(tma=False), facts=h)
    assert (p.fwd_version, p.bwd_version) == ("v2", "v2") and "descriptors" in p.reasons["fwd"]
    old = P.DeviceFacts("H200 with a Triton lacking host descriptors", (9, 0), 227 * 1024, False, 0, False)
    assert P.plan(4, 16, 4096, 4096, 64, fp16, True, facts=old).bwd_version == "v2"


def test_a_triton_without_descriptors_runs_the_pointer_versions_and_says_why():
    """Before Triton 3.4 there are no tensor descriptors (tl.make_tensor_descriptor, triton.tools.tensor_descriptor):
    forward v3 and backward v3 / v4 hand over to v2, forced or not, and the variant kernels load by pointers."""
    old = P.DeviceFacts("H200 with Triton 3.2", (9, 0), 227 * 1024, False, 0, False, False)
    p = P.plan(4, 16, 4096, 4096, 64, fp16, True, facts=old)
    assert (p.fwd_version, p.bwd_version) == ("v2", "v2")
    assert "no tensor descriptors" in p.reasons["fwd"] and "Triton >= 3.4" in p.reasons["bwd"]
    p = P.plan(4, 16, 4096, 4096, 64, fp16, True, facts=old, forward_version="v3", backward_version="v3")
    assert (p.fwd_version, p.bwd_version) == ("v2", "v2") and "no tensor descriptors" in p.reasons["bwd"]
    p = P.plan(4, 16, 4096, 4096, 64, fp16, True, facts=old, variant=P.Variant(kv_groups=2))
    assert (p.fwd_version, p.bwd_version) == ("v4", "v5") and "through pointers, not TMA" in p.reasons["fwd"]
    assert "through pointers, not TMA" in p.reasons["bwd"]
    p = P.plan(16, 16, 1024, 1024, 64, fp16, True, facts=old)          # the 1024 bucket: v5 wanted, v2 runs
    assert p.fwd_version == "v2" and "v5 wanted" in p.reasons["fwd"] and "Triton >= 3.4" in p.reasons["fwd"]


def test_forward_v5_in_the_1024_bucket_and_its_fallbacks():
    """Forward v5 (host descriptors) on Hopper in the 1024 bucket only (v6 at D = 128 non-causal): v3 from 2048, v1 / v2 below 1024 and on
    other GPUs; a layout host descriptors cannot span (stride 0, misaligned) runs v2, forced or not, and says why."""
    for causal in (False, True):
        assert P.plan(16, 16, 1024, 1024, 64, fp16, causal, facts=P.H200).fwd_version == "v5"
        d128 = "v6" if P.forward_v6.AVAILABLE and not causal else "v5"   # D = 128 non-causal: Gluon's v6
        assert P.plan(16, 16, 1000, 700, 128, bf16, causal, facts=P.H200).fwd_version == d128
        assert P.plan(8, 16, 2048, 2048, 64, fp16, causal, facts=P.H200).fwd_version == "v3"
        assert P.plan(32, 16, 512, 512, 64, fp16, causal, facts=P.H200).fwd_version == ("v2" if causal else "v1")
        assert P.plan(16, 16, 1024, 1024, 64, fp16, causal, facts=P.A100).fwd_version == "v2"
    p = P.plan(16, 16, 1024, 1024, 64, fp16, True, facts=P.H200)
    assert "host" in p.reasons["fwd"] and "1024" in p.reasons["fwd"]
    for layout in (P.Layout(no_zero_stride=False), P.Layout(tma=False)):
        for forced in (None, "v5"):
            p = P.plan(16, 16, 1024, 1024, 64, fp16, True, facts=P.H200, layout=layout, forward_version=forced)
            assert p.fwd_version == "v2" and "v5 wanted" in p.reasons["fwd"], (layout, forced)


def test_the_cache_key():
    """Same inputs, same plan object; every field of the key makes a plan of its own."""
    a = P.plan(1, 2, 1000, 1000, 64, fp16, True, facts=P.H200)
    assert P.plan(1, 2, 1000, 1000, 64, fp16, True, facts=P.H200) is a
    others = [P.plan(1, 2, 1000, 1000, 64, fp16, False, facts=P.H200),
              P.plan(1, 2, 1000, 1000, 64, bf16, True, facts=P.H200),
              P.plan(1, 2, 1000, 999, 64, fp16, True, facts=P.H200),
              P.plan(1, 2, 1000, 1000, 64, fp16, True, facts=P.L4),
              P.plan(1, 2, 1000, 1000, 64, fp16, True, facts=P.H200, layout=P.Layout(no_zero_stride=False)),
              P.plan(1, 2, 1000, 1000, 64, fp16, True, facts=P.H200, deterministic=True),
              P.plan(1, 2, 1000, 1000, 64, fp16, True, facts=P.H200, allow_tf32=True)]
    assert len({id(x) for x in [a] + others}) == 1 + len(others)


def test_small_problems_keep_backward_v2():
    """Backward v4 only from ONE_PASS_MIN_ROWS K/V rows (B * H * Nk) on: the README demo's shape (B 1, H 16, D 64,
    causal) measured v2 faster at N = 2048; the plan says why, with the numbers."""
    limit = P.ONE_PASS_MIN_ROWS
    for B, H, N in ((1, 16, 2048), (1, 16, 4096), (1, 16, 8192), (2, 16, 8192), (4, 16, 4096), (1, 64, 4096)):
        p = P.plan(B, H, N, N, 64, fp16, True, facts=P.H200)
        rows = B * H * N
        assert p.fwd_version == "v3"
        assert p.bwd_version == ("v4" if rows >= limit else "v2"), (B, H, N)
        if rows < limit:
            assert f"B * H * Nk = {rows} < {limit}" in p.reasons["bwd"] and "B * H * Nk" in str(p)
    assert P.plan(1, 16, 2048, 2048, 64, fp16, True, facts=P.H200, backward_version="v4").bwd_version == "v4"
    gqa = P.plan(1, 32, 8192, 8192, 64, fp16, True, facts=P.H200, variant=P.Variant(kv_groups=8))
    assert gqa.bwd_version == "v5"                       # variants keep their kernel whatever the size
    # the rule counts K/V rows: Nk, not Nq (a few queries over a long cache are still a big backward)
    assert P.plan(1, 16, 512, 32768, 64, fp16, True, facts=P.H200).bwd_version == "v4"


def test_stride_zero_kv_never_reaches_v4():
    """plan_for reads the stride class off the tensors: K, V expanded over heads plan v3, the same K, V
    contiguous plan v4 (H200 facts, 4096 keys; nothing is launched), and a misaligned view plans v2."""
    q = torch.empty(1, 64, 4096, 64, dtype=fp16)           # 64 heads: a problem big enough for the one-pass kernel
    k1 = torch.empty(1, 1, 4096, 64, dtype=fp16)
    ke = k1.expand(1, 64, 4096, 64)
    pe = P.plan_for(q, ke, ke, True, facts=P.H200)
    pc = P.plan_for(q, ke.contiguous(), ke.contiguous(), True, facts=P.H200)
    assert pe is not pc and pe.bwd_version == "v3" and pc.bwd_version == "v4"
    buf = torch.empty(1 * 64 * 4096 * 64 + 1, dtype=fp16)
    qm = buf[1:].view(1, 64, 4096, 64)                    # base 2 bytes past a 16-byte boundary
    pm = P.plan_for(qm, ke.contiguous(), ke.contiguous(), True, facts=P.H200)
    assert (pm.fwd_version, pm.bwd_version) == ("v2", "v2")


def test_variants_are_the_extension_point(monkeypatch):
    """A variant feature no version implements is a clear error; a version that declares it is chosen."""
    from flashlab.kernels import backward_v5, forward_v4
    gqa = P.Variant(kv_groups=4)
    assert gqa.features() == {"gqa"} and P.PLAIN.features() == frozenset()
    monkeypatch.setattr(forward_v4, "SUPPORTS", forward_v4.SUPPORTS - {"gqa"})
    with pytest.raises(ValueError, match="gqa"):
        P.plan(1, 8, 264, 264, 64, fp16, False, variant=gqa, facts=P.H200)
    monkeypatch.setattr(backward_v5, "SUPPORTS", frozenset())
    with pytest.raises(ValueError, match="window"):
        P.plan(1, 8, 264, 264, 64, fp16, False, variant=P.Variant(window=(8, 0)), facts=P.H200)
    monkeypatch.undo()

    class V9:                      # a kernel module as the registry sees one
        SUPPORTS = frozenset({"gqa", "window"})
        config_lists = staticmethod(lambda D, dt, limit, cc: {"fwd": ([C(64, 64)], []), "bwd": ([C(64, 64)], []),
                                                              "dkdv": ([C(64, 64)], []), "dq": ([C(64, 64)], [])})
        launched = []
        launch = staticmethod(lambda plan, *tensors, **variant_args: V9.launched.append((plan, variant_args)))
    monkeypatch.setitem(P.FORWARD, "v9", V9)
    monkeypatch.setitem(P.BACKWARD, "v9", V9)
    p = P.plan(1, 8, 256, 256, 64, fp16, False, variant=gqa, facts=P.H200)
    assert (p.fwd_version, p.bwd_version) == ("v9", "v9") and "gqa" in str(p)
    q = torch.zeros(1, 8, 40, 32, device=DEV, dtype=fp16)
    kv = torch.zeros(1, 2, 40, 32, device=DEV, dtype=fp16)        # 2 K/V heads for 8 query heads
    kernels.launch_forward(q, kv, kv, q.clone(), q[..., 0].float(), False, 0.2, variant=gqa, window_seed=7)
    (got, args), = V9.launched
    assert got.fwd_version == "v9" and got.variant == gqa and args == {"window_seed": 7}


# today's hand-picked first configs on the H200 (D = 128: forward v3's autotuned pick at long sequences)
V4_FWD = {64: C(128, 64, 4, 3), 128: C(128, 128, 8, 3)}
V5_BWD = {64: (C(32, 64, 4, 3), C(64, 32, 4, 3)), 128: (C(64, 128, 8, 3), C(128, 64, 8, 3))}


@pytest.mark.parametrize("facts", [P.T4, P.L4, P.H200], ids=["T4", "L4", "H200"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [fp16, fp32])
def test_variant_choices_on_a_t4_an_l4_and_an_h200(facts, D, dtype):
    """Variants plan forward v4 / backward v5 with hand-picked tiles that fit (on the H200: V4_FWD, V5_BWD), the
    dK/dV grid over the K/V heads, except GQA, windows and soft-cap where v6 runs (the H200 at D = 128, fp16 / bf16); the
    same shape without a feature keeps the plain choice."""
    B, H, N = 2, 32, 8192
    plain = P.plan(B, H, N, N, D, dtype, True, facts=facts)
    for var in (P.Variant(window=(1023, 0)), P.Variant(kv_groups=4), P.Variant(kv_groups=8, softcap=True, alibi=True,
                mask="bool", dropout=True), P.Variant(varlen=True, window=(-1, 64))):
        p = P.plan(B, H, N, N, D, dtype, True, variant=var, facts=facts)
        v6_here = facts is P.H200 and dtype == fp16 and D == 128 and P.forward_v6.AVAILABLE
        if v6_here and var.features() <= P.V6_PLANNED:   # GQA, a window (and soft-cap): v6's constexpr branches
            assert (p.fwd_version, p.bwd_version) == ("v6", "v6"), (var, p)
            assert [s.kernel for s in p.forward + p.backward] == ["fwd v6", "preprocess", "bwd v6"]
            assert p.backward[1].grid == (-(-N // 128) * B * (H // var.kv_groups),)    # a program per K/V head's tile
            assert "constexpr branches" in p.reasons["fwd"] and "constexpr branches" in p.reasons["bwd"]
            continue
        assert (p.fwd_version, p.bwd_version) == ("v4", "v5"), (var, p)
        assert [s.kernel for s in p.forward + p.backward] == ["fwd v4", "preprocess", "dkdv v5", "dq v5"]
        for s in p.forward + p.backward[1:]:
            assert not s.autotune and s.config is not None and _fits(s, facts), (s.kernel, s.config, facts.name)
            assert "never autotunes" in s.reason or dtype == fp32
        fwd, dkdv, dq = p.forward[0], p.backward[1], p.backward[2]
        assert fwd.grid == (-(-N // fwd.config.block_m) * B * H,)
        assert dkdv.grid == (-(-N // dkdv.config.block_n) * B * (H // var.kv_groups),)
        assert dq.grid == (-(-N // dq.config.block_m) * B * H,)
        if facts is P.H200 and dtype == fp16:
            assert fwd.config == V4_FWD[D] and (dkdv.config, dq.config) == V5_BWD[D]
        if facts is P.T4 and dtype == fp16 and D == 128:
            assert fwd.config != C(128, 64, 8, 3)              # 128 x 64 does not fit 64 KB: the plan fits
        assert "variant features" in p.reasons["fwd"] and "v4" in str(p) and "v5" in str(p)
    assert P.plan(B, H, N, N, D, dtype, True, facts=facts) is plain           # plain plans untouched and cached
    v6 = "v6" if P.forward_v6.AVAILABLE else "v3"       # forward v6 (Gluon) where this Triton has it
    b6 = "v6" if P.backward_v6.AVAILABLE else "v2"      # backward v6 (Gluon) likewise; v2 at D = 128 causal before it
    want = {(P.H200, fp16, 64): ("v3", "v4"), (P.H200, fp16, 128): (v6, b6)}.get((facts, dtype, D))
    want = want or (("v1", "v1") if dtype == fp32 else ("v2", "v2"))
    assert (plain.fwd_version, plain.bwd_version) == want
    assert "v4" not in P.FORWARD_VERSIONS and "v5" not in P.BACKWARD_VERSIONS   # scripts compare the plain ones
    assert "v6" not in P.FORWARD_VERSIONS and "v6" in P.FORWARD   # sm_90 only: not among those every machine runs


def test_variant_band_and_key():
    """causal and window make one band, as flash_attention's; the window is part of the plan key."""
    assert P.Variant().band(True) == (-1, 0) and P.Variant().band(False) is None
    assert P.Variant(window=(5, 3)).band(True) == (5, 0) and P.Variant(window=(5, -1)).band(False) == (5, -1)
    assert P.Variant(window=[4, 0]) == P.Variant(window=(4, 0))
    with pytest.raises(ValueError, match="mask"):
        P.Variant(mask="float")
    a = P.plan(1, 4, 300, 300, 64, fp16, True, variant=P.Variant(window=(63, 0)), facts=P.L4)
    b = P.plan(1, 4, 300, 300, 64, fp16, True, variant=P.Variant(window=(127, 0)), facts=P.L4)
    assert a is not b and "(63, 0)" in str(a) and "(127, 0)" in str(b)
    with pytest.raises(ValueError, match="kv_groups"):
        P.plan(1, 6, 300, 300, 64, fp16, True, variant=P.Variant(kv_groups=4), facts=P.L4)


def test_autotuned_step_says_what_it_picked():
    key = ("fwd", "v3", fp16, 0, 8192, 64, False, "ieee", tiles.grid_class(16, 8192, P.H200.sms))
    import triton
    tiles.BEST[key] = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3)
    try:
        p = P.plan(1, 16, 8192, 8192, 64, fp16, False, facts=P.H200, forward_version="v3")
        st = p.forward[0]
        assert st.config == C(128, 64, 4, 3) and "autotuning picked 128x64" in str(p)
    finally:
        tiles.BEST.pop(key)


def test_grid_class_keys_autotuning_apart():
    """Tiles autotuned on a small grid are not reused for a large one of the same length bucket: on the H200 a
    forward tuned first at B 2, H 3, N 4096 then ran B 4, H 16 at 410 TFLOP/s where 128 x 128 tiles give 500."""
    small = P.plan(2, 3, 4096, 4096, 128, fp16, False, facts=P.H200, backward_version="v4")   # v4 autotunes
    large = P.plan(4, 16, 4096, 4096, 128, fp16, False, facts=P.H200, backward_version="v4")
    ks, kl = small.forward[0].tune_key, large.forward[0].tune_key
    assert ks[:-1] == kl[:-1] and (ks[-1], kl[-1]) == (1, 2)
    assert "grid class 2 (more than four waves)" in str(large) and "grid class 1 (one to four waves)" in str(small)
    # 128-row tiles over the multiprocessors: the README demo's B 1, H 16 fills less than a wave at N = 1024
    assert [tiles.grid_class(16, n, 132) for n in (1024, 2048, 4096, 16384)] == [0, 1, 1, 2]
    assert tiles.grid_class(16, 1024, None) == 0          # the interpreter: one class (it does not autotune)
    assert P.plan(1, 16, 1024, 1024, 64, fp16, True, facts=P.T4).forward[0].tune_key[-1] == 1   # 3.2 waves on 40
    gqa = P.plan(1, 32, 4096, 4096, 128, fp16, True, variant=P.Variant(kv_groups=8, alibi=True), facts=P.H200)
    dkdv, dq = gqa.step("dkdv"), gqa.step("dq")   # dK/dV runs over the 4 K/V heads: 0.97 waves; dQ over 32
    assert (dkdv.bh, dkdv.tune_key[-1], dq.bh, dq.tune_key[-1]) == (4, 0, 32, 2)


def test_cli_prints_the_plan(capsys):
    from flashlab.__main__ import main
    assert main(["plan", "--shape", "2,4,1000,80", "--causal", "--device", "h200", "--nk", "700"]) == 0
    out = capsys.readouterr().out
    assert "Nq=1000 Nk=700 D=128" in out and "padded to 128" in out
    assert ("forward  v5" if P.device_facts().host_descriptors       # Hopper's 1024 bucket; this Triton's facts
            else "forward  v2: v5 wanted, but host tensor descriptors need") in out
    assert "dkdv v2" in out and "dq v2" in out and "227 KB" in out
    assert main(["plan", "--shape", "4,16,4096,64", "--device", "h200", "--kv-expanded"]) == 0
    out = capsys.readouterr().out            # a simulated GPU runs this Triton: before 3.4 no descriptors
    assert ("backward v3" if P.DEVICE_DESCRIPTORS else "backward v2: v4 wanted, but this Triton has no host") in out
    assert main(["plan", "--shape", "1,2,3"]) == 2


def test_cli_prints_a_variant_plan(capsys):
    from flashlab.__main__ import main
    assert main(["plan", "--shape", "2,32,8192,128", "--causal", "--window", "1023,0", "--alibi",
                 "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "window (left, right) = (1023, 0)" in out and "forward  v4" in out and "backward v5" in out
    assert "fwd v4       128x128, 8 warps, 3 stages, grid 4096" in out     # cdiv(8192, 128) * 2 * 32
    assert "dkdv v5      64x128, 8 warps, 3 stages, grid 4096" in out and "dq v5" in out
    assert main(["plan", "--shape", "2,32,1000,80", "--gqa", "4", "--varlen", "--dropout", "0.1", "--mask", "float",
                 "--softcap", "--alibi", "--device", "t4"]) == 0
    out = capsys.readouterr().out
    assert "gqa (8 query heads per K/V head)" in out and "additive mask" in out and "varlen" in out
    assert "dropout" in out and "softcap" in out and "alibi" in out and "64 KB" in out and "packed" in out
    assert "dkdv v5      32x32, 4 warps, 1 stages, grid 256" in out       # cdiv(1000, 32) * B 2 * 4 K/V heads
    for bad in (["--gqa", "5"], ["--window", "1,2,3"], ["--window", "-2,0"], ["--dropout", "1.5"]):
        assert main(["plan", "--shape", "2,32,1000,64"] + bad) == 2
        assert bad[0] in capsys.readouterr().err


# ------------------------------------------------------------------------------- the launchers obey the plan

@pytest.fixture
def spy(monkeypatch):
    """Every kernel launch tiles.run makes, as (kernel function name, config launched, grid)."""
    seen = []
    real = tiles._launch

    def launch(kern, args, consts, cfg, grid_of, *a):
        seen.append((kern.fn.__name__, cfg, grid_of(cfg)))
        return real(kern, args, consts, cfg, grid_of, *a)
    monkeypatch.setattr(tiles, "_launch", launch)
    return seen


KERNELS = {"fwd v1": "flash_fwd_kernel", "fwd v2": "flash_fwd_kernel_v2", "fwd v3": "flash_fwd_kernel_v3",
           "preprocess": "flash_bwd_preprocess", "dkdv v1": "flash_bwd_dkdv_kernel", "dq v1": "flash_bwd_dq_kernel",
           "dkdv v2": "flash_bwd_dkdv_kernel_v2", "dq v2": "flash_bwd_dq_kernel_v2", "bwd v3": "flash_bwd_kernel_v3",
           "bwd v4": "flash_bwd_kernel_v4"}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [fp16, fp32])
def test_the_op_runs_its_plan(rng, spy, causal, dtype):
    """flash_attention forward and backward launch exactly the plan's steps, kernels, tiles and grids."""
    q, k, v = (torch.randn(2, 2, n, 32, device=DEV).to(dtype).requires_grad_() for n in (70, 45, 45))
    _ = check_attention(lambda *a: flash_attention(*a[:3], causal=a[3], scale=a[4], return_lse=True), q, k, v, causal)
    from flashlab import attention
    p = P.plan_for(q.detach(), k.detach(), v.detach(), causal)
    assert any(c.plan is p for c in attention._FWD.values())
    assert any(b.plan is p for c in attention._FWD.values() for b in c.bwd.values())
    want = {(KERNELS[s.kernel], s.config, s.grid) for s in p.forward + p.backward}
    assert set(spy) == want, (spy, want)


def _band_reference(q, k, v, scale, left, right, softcap):
    """float64 attention with GQA, a top-left band (-1 unbounded) and soft-capping; rows that see no key give 0."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None, :]
    ok = torch.ones_like(i - j, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    s = s.masked_fill(~ok.to(s.device), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


@pytest.mark.parametrize("window,causal,softcap", [((5, 0), True, None), ((-1, 7), False, 3.0), (None, True, None)])
def test_variant_calls_run_the_plans_steps(rng, spy, monkeypatch, window, causal, softcap):
    """flash_attention with variants goes through kernels.launch_forward / launch_backward with a plan, and runs
    exactly that plan's steps (forward v4, backward v5: kernels, tiles, grids); the result matches float64."""
    plans = []
    real_f, real_b = kernels.launch_forward, kernels.launch_backward
    monkeypatch.setattr(kernels, "launch_forward", lambda *a, **kw: (plans.append(kw["plan_"]), real_f(*a, **kw)))
    monkeypatch.setattr(kernels, "launch_backward", lambda *a, **kw: (plans.append(kw["plan_"]), real_b(*a, **kw)))
    q = torch.randn(1, 4, 70, 32, device=DEV, requires_grad=True)
    k, v = (torch.randn(1, 2, 45, 32, device=DEV, requires_grad=True) for _ in range(2))
    o = flash_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True, window=window, softcap=softcap)
    do = torch.randn_like(o)
    o.backward(do)
    pf, pb = plans
    assert pf is pb and (pf.fwd_version, pf.bwd_version) == ("v4", "v5") and pf.variant.kv_groups == 2
    assert pf.variant.softcap == (softcap is not None) and pf.causal == causal
    names = {"fwd v4": "flash_fwd_kernel_v4", "preprocess": "flash_bwd_delta_v5", "dkdv v5": "flash_bwd_dkdv_kernel_v5",
             "dq v5": "flash_bwd_dq_kernel_v5"}
    want = [(names[s.kernel], s.config, s.grid) for s in pf.forward + pf.backward]
    assert spy == want, (spy, want)
    assert spy[2][2] == (2 * 1 * 2,)                           # dK/dV: cdiv(45, 32) tiles x B x 2 K/V heads
    left, right = window or (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _band_reference(qd, kd, vd, 0.3, left, right, softcap)
    ref.backward(do.double())
    assert (o.double() - ref).abs().max() < 1e-4
    for got, w in zip((q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
        assert (got.double() - w).abs().max() < 1e-3


def test_packed_variant_call_runs_the_plans_steps(rng, spy):
    """flash_attention_varlen plans B = the number of sequences, Nq / Nk = the longest; its steps run with the plan's
    tiles and grids (Delta's grid over every packed row); the result matches float64 sequence by sequence."""
    from flashlab.variants import flash_attention_varlen
    lens = [5, 37, 0, 20]
    cu = torch.tensor([0, 5, 42, 42, 62], dtype=torch.int32, device=DEV)
    q = torch.randn(62, 4, 16, device=DEV, requires_grad=True)
    k, v = (torch.randn(62, 2, 16, device=DEV, requires_grad=True) for _ in range(2))
    o = flash_attention_varlen(q, k, v, cu, cu, 40, 40, is_causal=True, enable_gqa=True, scale=0.25)
    do = torch.randn_like(o)
    o.backward(do)
    p = P.plan(4, 4, 40, 40, 16, fp32, True, variant=P.Variant(kv_groups=2, varlen=True))
    assert (p.fwd_version, p.bwd_version) == ("v4", "v5") and "packed" in str(p)
    got = [(fn, cfg, grid) for fn, cfg, grid in spy]
    assert [g[0] for g in got] == ["flash_fwd_kernel_v4", "flash_bwd_delta_v5", "flash_bwd_dkdv_kernel_v5",
                                   "flash_bwd_dq_kernel_v5"]
    assert got[0][1:] == (p.forward[0].config, p.forward[0].grid)
    assert got[0][2] == (-(-40 // p.forward[0].config.block_m) * 4 * 4,)                        # cdiv(40, BLOCK_M) B H
    assert got[1][2] == (-(-62 // p.backward[0].config.block_m) * 4,)
    assert got[2][1:] == (p.backward[1].config, p.backward[1].grid)
    assert got[2][2] == (-(-40 // p.backward[1].config.block_n) * 4 * 2,)                      # over the K/V heads
    assert got[3][1:] == (p.backward[2].config, p.backward[2].grid)
    start = 0
    for n in lens:
        sl, start = slice(start, start + n), start + n
        if n == 0:                                   # an empty sequence: nothing to compare
            continue
        qd, kd, vd = (t[sl].detach().double().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
        ref = _band_reference(qd, kd, vd, 0.25, -1, 0, None)
        ref.backward(do[sl].double().transpose(0, 1)[None])
        assert (o[sl].double().transpose(0, 1)[None] - ref).abs().max() < 1e-4
        for g, w in zip((q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
            assert (g[sl].double().transpose(0, 1)[None] - w).abs().max() < 1e-3


@pytest.mark.parametrize("fv,bv", [("v1", "v1"), ("v2", "v2"), pytest.param("v3", "v3", marks=pytest.mark.descriptors), pytest.param("v3", "v4", marks=pytest.mark.descriptors)])
def test_forced_versions_and_tiles_run_as_planned(rng, spy, monkeypatch, fv, bv):
    monkeypatch.setattr(kernels, "_RUNNERS", {})   # no runner kept by an earlier test: every launch is planned here
    q, k, v = (torch.randn(1, 2, n, 32, device=DEV, dtype=fp16) for n in (50, 40, 40))
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=DEV)
    kernels.launch_forward(q, k, v, o, lse, True, 0.2, version=fv, config=C(16, 32))
    do = torch.randn_like(q)
    g = [torch.empty_like(t) for t in (q, k, v)]
    kernels.launch_backward(q, k, v, o, lse, do, *g, True, 0.2, version=bv, config=(C(16, 32), C(32, 16)))
    names = [(fn, cfg) for fn, cfg, _ in spy]
    assert names[0] == (KERNELS[f"fwd {fv}"], C(16, 32)) and spy[0][2] == (4 * 2,)    # cdiv(50, 16) * B * H
    assert names[1][0] == "flash_bwd_preprocess"
    if bv in ("v3", "v4"):
        assert names[2:] == [(KERNELS[f"bwd {bv}"], C(16, 32))] and spy[2][2] == (2 * 2,)   # cdiv(40, 32) * 2
    else:
        assert names[2:] == [(KERNELS[f"dkdv {bv}"], C(16, 32)), (KERNELS[f"dq {bv}"], C(32, 16))]
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=0.2)
    ref.backward(do.double())
    assert (o.double() - ref).abs().max() < 2e-3
    for got, want in zip(g, (qq.grad, kk.grad, vv.grad)):
        assert (got.double() - want).abs().max() < 2e-2


@pytest.mark.parametrize("fv,bv", [("v1", "v1"), ("v2", "v2"), pytest.param("v3", "v3", marks=pytest.mark.descriptors), pytest.param("v3", "v4", marks=pytest.mark.descriptors),
                                   ("v4", "v5")])
def test_runner_arguments_are_every_parameter_in_order(rng, monkeypatch, fv, bv):
    """What a compiled kernel's runner is given after the first launch (tiles._Runner): the launcher's
    positional arguments are exactly the kernel's non-constexpr parameters, in order, and every constexpr
    after them is set by the launch or has a default, so the runner gets every parameter, as
    JITFunction.run passes them (triton >= 3.3)."""
    import inspect

    import triton.language as tl
    seen = []
    real = tiles._launch

    def launch(kern, args, consts, cfg, grid_of, *a):
        seen.append((kern, args(cfg) if callable(args) else args, dict(consts, BLOCK_M=cfg.block_m,
                                                                       BLOCK_N=cfg.block_n)))
        return real(kern, args, consts, cfg, grid_of, *a)
    monkeypatch.setattr(tiles, "_launch", launch)
    monkeypatch.setattr(kernels, "_RUNNERS", {})   # no runner kept by an earlier test (its launches skip _launch)
    q, k, v, do = (torch.randn(1, 2, 40, 32, device=DEV, dtype=fp16) for _ in range(4))
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=DEV)
    kernels.launch_forward(q, k, v, o, lse, True, 0.2, version=fv)
    kernels.launch_backward(q, k, v, o, lse, do, *[torch.empty_like(t) for t in (q, k, v)], True, 0.2, version=bv)
    assert len(seen) >= 3
    for kern, a, full in seen:
        params = list(inspect.signature(kern.fn).parameters.values())
        const = [p.annotation is tl.constexpr or p.annotation == "tl.constexpr" for p in params]   # (string: postponed)
        assert len(params) == len(kern.arg_names) and not any(const[:len(a)]) and all(const[len(a):]), kern
        assert all(p.name in full or p.default is not p.empty for p in params[len(a):]), kern


def test_call_cache_is_bounded(rng, monkeypatch):
    """Ragged lengths make a kind of call per length: the cache starts over at MAX_CALLS instead of growing,
    and a call whose cache entry was dropped still differentiates."""
    from flashlab import attention
    monkeypatch.setattr(attention, "MAX_CALLS", 2)
    attention._FWD.clear()
    q = torch.randn(1, 1, 20, 16, device=DEV, requires_grad=True)
    o = flash_attention(q, q, q, True)
    for n in (21, 22, 23):
        flash_attention(*(torch.randn(1, 1, n, 16, device=DEV),) * 3)
        assert len(attention._FWD) <= 2
    o.sum().backward()                          # its call was dropped from the cache, not from the graph
    qd = q.detach().double().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(qd, qd, qd, is_causal=True).sum().backward()
    assert (q.grad.double() - qd.grad).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------ GPU only

def _fresh_calls():
    from flashlab import attention
    attention._FWD.clear()
    attention._BWD.clear()
    kernels._RUNNERS.clear()


@pytest.mark.gpu
def test_gpu_plan_here():
    f = P.device_facts()
    assert f.cc == device.capability() and f.shared_memory == device.shared_memory_per_block() and not f.interpret
    p = P.plan(4, 16, 4096, 4096, 64, fp16, True)
    assert p.fwd_version == ("v3" if f.hopper else "v2") and p.bwd_version == ("v4" if f.hopper else "v2")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [fp16, bf16])
def test_gpu_fast_launch_is_taken_and_gives_the_same_bits(rng, monkeypatch, causal, dtype):
    """After a call's first launch its compiled kernels run through their own runners (tiles.STATS["fast"]
    counts them), with the same bits as Triton's launch path gives (FLASHLAB_FAST_LAUNCH=0)."""
    q, k, v, do = (torch.randn(1, 2, 300, 64, device=DEV, dtype=dtype) for _ in range(4))

    def once():
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        o = flash_attention(qg, kg, vg, causal)
        return (o, *torch.autograd.grad(o, (qg, kg, vg), do))
    monkeypatch.setattr(tiles, "FAST", False)
    _fresh_calls()
    slow = [once() for _ in range(2)]
    monkeypatch.setattr(tiles, "FAST", True)
    _fresh_calls()
    first = once()
    before = tiles.STATS["fast"]
    again = [once() for _ in range(3)]
    p = P.plan_for(q, k, v, causal)
    assert tiles.STATS["fast"] - before == 3 * (len(p.forward) + len(p.backward)), "not every launch took the runner"
    for got in [first] + again:
        assert all(torch.equal(a, b) for a, b in zip(got, slow[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("fv,bv", [("v3", "v3"), ("v3", "v4")])
def test_gpu_descriptor_versions_through_the_runner(rng, fv, bv):
    """Forward v3 (descriptors made on the device, the allocator's scratch) and backward v3 / v4 (descriptors
    made on the host, the config's tiles) launched again through the runners agree with the reference."""
    q, k, v, do = (torch.randn(2, 3, 700, 64, device=DEV, dtype=fp16) for _ in range(4))
    _fresh_calls()
    before = tiles.STATS["fast"]
    for _ in range(3):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=DEV)
        kernels.launch_forward(q, k, v, o, lse, False, 0.125, version=fv, config=C(64, 64, 4, 2))
        g = [torch.empty_like(t) for t in (q, k, v)]
        kernels.launch_backward(q, k, v, o, lse, do, *g, False, 0.125, version=bv, config=C(64, 64, 4, 2))
    assert tiles.STATS["fast"] - before >= 2 * 3
    qq, kk, vv = (t.float().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, scale=0.125)
    ref.backward(do.float())
    assert (o.float() - ref).abs().max() < 1e-2
    for got, want in zip(g, (qq.grad, kk.grad, vv.grad)):
        assert (got.float() - want).abs().max() < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cuda_graph_capture_forward_and_backward(rng, causal):
    """The op's forward and backward, captured in a CUDA graph and replayed on new inputs, match eager."""
    q, k, v, do = (torch.randn(2, 4, 256, 64, device=DEV, dtype=fp16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def step():
        o = flash_attention(qg, kg, vg, causal)
        return (o, *torch.autograd.grad(o, (qg, kg, vg), do))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t, src in zip((qg, kg, vg), (torch.randn_like(q) for _ in range(3))):
        with torch.no_grad():
            t.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    for a, b in zip(outs, want):
        assert (a.float() - b.float()).abs().max() < 1e-3


def test_a_remembered_config_is_per_variant_and_causal_mode():
    """A hand-picked config that compiled for one call is not taken as compiling for a call whose kernel needs
    more shared memory: forward v4's 128 x 128 tiles fit the plain GQA call on an H200 but not a mask's tile
    beside them (seen on the H200), so the mask's plan starts from the top of the list with its fallbacks."""
    P.forget()
    try:
        gqa = P.Variant(kv_groups=4)
        mask = P.Variant(kv_groups=4, mask="bool")
        first = P.plan(2, 8, 1008, 704, 128, bf16, True, variant=gqa, facts=P.H200).forward[0]
        assert first.version == "v4" and not first.verified and first.fallbacks   # the 1024 bucket: v4, not v6
        first.fell_back(first.config, [])                       # it compiled and ran: remembered
        again = P.plan(2, 8, 1000, 1000, 128, bf16, True, variant=gqa, facts=P.H200).forward[0]
        assert again.verified and again.config == first.config and not again.fallbacks
        for v, causal in ((mask, True), (gqa, False)):
            other = P.plan(2, 8, 1008, 704, 128, bf16, causal, variant=v, facts=P.H200).forward[0]
            assert not other.verified and other.fallbacks, (v, causal)
    finally:
        P.forget()
