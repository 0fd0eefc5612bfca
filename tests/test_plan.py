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
        p = P.plan(1, 16, 4096, 4096, 64, fp16, True)
        assert (p.fwd_version, p.bwd_version) == (long_fwd, long_bwd), facts.name
        assert p.forward[0].autotune and p.forward[0].config is None and "autotuned" in p.forward[0].reason
        assert p.tma_reduce == (facts is P.H200) and not p.spread
        assert [s.kind for s in p.backward] == (["pre", "bwd"] if long_bwd == "v4" else ["pre", "dkdv", "dq"])
        short = P.plan(1, 1, 128, 128, 64, fp16, False)                # the small problem: hand-picked, v1 forward
        assert short.fwd_version == "v1" and short.bwd_version == "v2" and not short.forward[0].autotune
        assert short.forward[0].config == C(128, 64, 4, 3)       # fits 64 KB too (the estimate: exactly 64 KB)
        assert P.plan(1, 16, 4096, 4096, 128, fp16, True).bwd_version == "v2"        # D = 128 causal spills
        assert P.plan(1, 16, 4096, 4096, 128, fp16, False).bwd_version == long_bwd
        assert P.plan(1, 16, 4096, 4096, 64, fp32, True).fwd_version == "v1"         # fp32: v1, not autotuned
        assert not P.plan(1, 16, 4096, 4096, 64, fp32, True).forward[0].autotune
        assert P.plan(1, 16, 4096, 4096, 64, fp16, True, deterministic=True).bwd_version == "v2"
    t4 = P.plan(1, 1, 512, 512, 128, fp16, False, facts=P.T4)
    assert t4.forward[0].config == C(64, 32, 4, 2)            # the T4 pick that compiled_kib says fits 64 KB


def test_layout_decides_whether_descriptors_run():
    h = P.H200
    p = P.plan(1, 16, 4096, 4096, 64, fp16, True, layout=P.Layout(no_zero_stride=False), facts=h)
    assert p.bwd_version == "v3" and "stride 0" in p.reasons["bwd"] and p.fwd_version == "v3"
    p = P.plan(1, 16, 4096, 4096, 64, fp16, True, layout=P.Layout(tma=False), facts=h)
    assert (p.fwd_version, p.bwd_version) == ("v2", "v2") and "descriptors" in p.reasons["fwd"]
    old = P.DeviceFacts("H200 with a Triton lacking host descriptors", (9, 0), 227 * 1024, False, 0, False)
    assert P.plan(1, 16, 4096, 4096, 64, fp16, True, facts=old).bwd_version == "v2"


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


def test_stride_zero_kv_never_reaches_v4():
    """plan_for reads the stride class off the tensors: K, V expanded over heads plan v3, the same K, V
    contiguous plan v4 (H200 facts, 4096 keys; nothing is launched), and a misaligned view plans v2."""
    q = torch.empty(1, 4, 4096, 64, dtype=fp16)
    k1 = torch.empty(1, 1, 4096, 64, dtype=fp16)
    ke = k1.expand(1, 4, 4096, 64)
    pe = P.plan_for(q, ke, ke, True, facts=P.H200)
    pc = P.plan_for(q, ke.contiguous(), ke.contiguous(), True, facts=P.H200)
    assert pe is not pc and pe.bwd_version == "v3" and pc.bwd_version == "v4"
    buf = torch.empty(1 * 4 * 4096 * 64 + 1, dtype=fp16)
    qm = buf[1:].view(1, 4, 4096, 64)                     # base 2 bytes past a 16-byte boundary
    pm = P.plan_for(qm, ke.contiguous(), ke.contiguous(), True, facts=P.H200)
    assert (pm.fwd_version, pm.bwd_version) == ("v2", "v2")


def test_variants_are_the_extension_point(monkeypatch):
    """A variant feature no version implements is a clear error; a version that declares it is chosen."""
    gqa = P.Variant(kv_groups=4)
    assert gqa.features() == {"gqa"} and P.PLAIN.features() == frozenset()
    with pytest.raises(ValueError, match="gqa"):
        P.plan(1, 8, 256, 256, 64, fp16, False, variant=gqa, facts=P.H200)

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


def test_autotuned_step_says_what_it_picked():
    key = ("fwd", "v3", fp16, 0, 8192, 64, False, "ieee")
    import triton
    tiles.BEST[key] = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3)
    try:
        p = P.plan(1, 16, 8192, 8192, 64, fp16, False, facts=P.H200, forward_version="v3")
        st = p.forward[0]
        assert st.config == C(128, 64, 4, 3) and "autotuning picked 128x64" in str(p)
    finally:
        tiles.BEST.pop(key)


def test_cli_prints_the_plan(capsys):
    from flashlab.__main__ import main
    assert main(["plan", "--shape", "2,4,1000,80", "--causal", "--device", "h200", "--nk", "700"]) == 0
    out = capsys.readouterr().out
    assert "Nq=1000 Nk=700 D=128" in out and "padded to 128" in out and "forward  v2" in out
    assert "dkdv v2" in out and "dq v2" in out and "227 KB" in out
    assert main(["plan", "--shape", "1,16,4096,64", "--device", "h200", "--kv-expanded"]) == 0
    assert "backward v3" in capsys.readouterr().out
    assert main(["plan", "--shape", "1,2,3"]) == 2


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


@pytest.mark.parametrize("fv,bv", [("v1", "v1"), ("v2", "v2"), ("v3", "v3"), ("v3", "v4")])
def test_forced_versions_and_tiles_run_as_planned(rng, spy, fv, bv):
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


@pytest.mark.parametrize("fv,bv", [("v1", "v1"), ("v2", "v2"), ("v3", "v3"), ("v3", "v4")])
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
    q, k, v, do = (torch.randn(1, 2, 40, 32, device=DEV, dtype=fp16) for _ in range(4))
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=DEV)
    kernels.launch_forward(q, k, v, o, lse, True, 0.2, version=fv)
    kernels.launch_backward(q, k, v, o, lse, do, *[torch.empty_like(t) for t in (q, k, v)], True, 0.2, version=bv)
    assert len(seen) >= 3
    for kern, a, full in seen:
        params = list(inspect.signature(kern.fn).parameters.values())
        const = [p.annotation is tl.constexpr for p in params]
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
    p = P.plan(1, 16, 4096, 4096, 64, fp16, True)
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
