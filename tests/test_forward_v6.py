"""Forward v6 (FlashAttention-3's warp specialisation in Gluon, Hopper only): where the plan runs it, that it
compiles for sm_90 with this Triton (no GPU needed), and on an sm_90 GPU its accuracy against float64."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from flashlab import device
from flashlab.accuracy import check_attention
from flashlab.kernels import forward_v6, launch_forward
from flashlab.kernels import plan as P
from flashlab.kernels.tiles import C

needs_gluon = pytest.mark.skipif(not forward_v6.AVAILABLE, reason="this Triton has no Gluon warp specialisation")
H200 = P.SIMULATED["h200"]


@needs_gluon
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_plan_runs_v6_on_hopper_at_d128(dtype, causal):
    """From the 2048 bucket in both modes, and in the 1024 bucket when not causal (where it measured faster
    than v5; causal, v5 was)."""
    p = P.plan(2, 8, 4096, 4096, 128, dtype, causal, facts=H200)
    assert p.fwd_version == "v6" and "warp specialisation" in p.reasons["fwd"]
    assert p.forward[0].config == C(128, 128, 4, 3)
    assert P.plan(16, 8, 1024, 1000, 128, dtype, causal, facts=H200).fwd_version == ("v5" if causal else "v6")


@needs_gluon
@pytest.mark.parametrize("why,kw", [
    ("D = 64", dict(D=64)),
    ("fp32", dict(dtype=torch.float32)),
    ("short", dict(N=512)),
    ("1024, causal", dict(N=1024, causal=True)),
    ("A100", dict(facts=P.SIMULATED["a100"])),
    ("sm_100", dict(facts=P.DeviceFacts("Blackwell (simulated)", (10, 0), 227 * 1024, False, 0, sms=148))),
    ("stride 0", dict(layout=P.Layout(no_zero_stride=False))),
    ("no TMA", dict(layout=P.Layout(tma=False))),
])
def test_plan_keeps_other_versions_where_v6_cannot_run(why, kw):
    a = dict(D=128, dtype=torch.float16, N=4096, facts=H200, layout=P.Layout(), causal=False)
    a.update(kw)
    p = P.plan(2, 8, a["N"], a["N"], a["D"], a["dtype"], a["causal"], facts=a["facts"], layout=a["layout"])
    assert p.fwd_version != "v6", why


def test_forcing_v6_where_it_cannot_run_says_why():
    p = P.plan(2, 8, 4096, 4096, 128, torch.float16, True, facts=P.SIMULATED["a100"], forward_version="v6")
    assert p.fwd_version != "v6" and p.reasons["fwd"].startswith("v6 wanted, but it is written for Hopper")
    if forward_v6.AVAILABLE:
        p = P.plan(2, 8, 4096, 4096, 128, torch.float16, True, facts=H200, forward_version="v6",
                   layout=P.Layout(no_zero_stride=False))
        assert p.fwd_version == "v3" and "stride 0" in p.reasons["fwd"]


def test_forced_versions_must_implement_the_call():
    """A forced version that lacks one of the call's variant features is an error, not a silent wrong answer
    (v6 ignoring an ALiBi call's slopes)."""
    with pytest.raises(ValueError, match="does not implement alibi"):
        P.plan(2, 8, 4096, 4096, 128, torch.float16, True, facts=H200, forward_version="v6",
               variant=P.Variant(kv_groups=4, alibi=True))
    with pytest.raises(ValueError, match="backward v4 does not implement window"):
        P.plan(2, 8, 4096, 4096, 64, torch.float16, True, facts=H200, backward_version="v4",
               variant=P.Variant(window=(128, 0)))


@needs_gluon
def test_where_v6_cannot_run_the_plan_picks_as_without_it():
    """Stride 0 at N = 1024: v6 would have run (non-causal D = 128); without it the 1024 bucket's choice, v5,
    whose host descriptors cannot span a stride 0 either: v2 (not v3, which measured slower there)."""
    p = P.plan(16, 16, 1024, 1024, 128, torch.float16, False, facts=H200, layout=P.Layout(no_zero_stride=False))
    assert p.fwd_version == "v2", p.reasons["fwd"]


def _ptxas():
    import triton
    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return here if os.access(here, os.X_OK) else shutil.which("ptxas")


def compile_in_child(code: str, causal: bool) -> dict:
    """Run ``code`` (it compiles a Gluon kernel for sm_90 and prints a JSON line) in a child process in compiled mode:
    Gluon has no interpreter, and the child's Triton must not be the interpreter's."""
    if _ptxas() is None:
        pytest.skip("no ptxas with this Triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code, "1" if causal else "0"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def check_launch_arguments(kern, args, consts: dict) -> dict:
    """A Gluon kernel's launch as a launcher builds it, checked against the kernel's signature without a GPU: one
    positional argument per parameter that is not a constexpr (in order: they come first), each ``*_desc`` a TMA
    descriptor, every other a tensor or a number, and every constexpr without a default named.  Returns the arguments
    by name."""
    params = kern.params
    n_args = sum(not p.is_constexpr for p in params)
    assert all(not p.is_constexpr for p in params[:n_args]), "the constexprs come last"
    assert len(args) == n_args, (len(args), [p.name for p in params[:n_args]])
    named = {p.name: a for p, a in zip(params, args)}
    for name, a in named.items():
        if name.endswith("_desc"):
            assert type(a).__name__ == "TensorDescriptor", (name, type(a))
        else:
            assert isinstance(a, (torch.Tensor, int, float)) and not isinstance(a, bool), (name, type(a))
    defaults = {p.name for p in params[n_args:] if p.has_default}
    missing = {p.name for p in params[n_args:]} - set(consts) - defaults
    assert not missing, missing
    return named


@needs_gluon
@pytest.mark.parametrize("kind", ["causal", "window, gqa", "packed, window"])
def test_launch_passes_the_kernel_its_arguments(kind, monkeypatch):
    """Without a GPU, the launcher up to the kernel: the launch it would make (descriptors, strides, the variant's
    scalars, the grid) matches flash_fwd_kernel_v6's signature, with the plan's stages and grid; a window on a
    persistent grid of at most one program a multiprocessor."""
    seen = []
    monkeypatch.setattr(forward_v6.tiles, "launch_cached", lambda kern, grid, args, consts, runners, key:
                        seen.append((kern, grid, args, consts)))
    H, D, f16, H200 = 4, 128, torch.float16, P.SIMULATED["h200"]
    if kind.startswith("packed"):
        cu = torch.tensor([0, 700, 900, 2300], dtype=torch.int32)
        q, k, v, o = (torch.randn(2300, H, D, dtype=f16) for _ in range(4))
        lse = torch.empty(H, 2300)
        plan = P.plan(3, H, 1400, 1400, D, f16, True, variant=P.Variant(varlen=True, window=(300, 0)), facts=H200)
        extra = dict(cu_q=cu, cu_k=cu)
    else:
        var = P.Variant(kv_groups=2, window=(300, 0)) if kind.startswith("window") else P.Variant()
        q, o = (torch.randn(2, H, 2100, D, dtype=f16) for _ in range(2))
        k, v = (torch.randn(2, H // var.kv_groups, 2100, D, dtype=f16) for _ in range(2))
        lse = torch.empty(2, H, 2100)
        plan = P.plan(2, H, 2100, 2100, D, f16, True, variant=var, facts=H200)
        extra = {}
    assert plan.fwd_version == "v6"
    forward_v6.launch(plan, q, k, v, o, lse, 0.1, **extra)
    (kern, grid, args, consts), = seen
    named = check_launch_arguments(kern, args, consts)
    step = plan.forward[0]
    assert consts["STAGES"] == step.config.num_stages and grid == step.grid
    assert consts["PERSIST"] == ("window" in kind) and (grid[0] <= H200.sms) == consts["PERSIST"]
    assert named["H"] == H and named["KV_GROUP"] == plan.variant.kv_groups and consts["VARLEN"] == ("packed" in kind)


COMPILE = """
import json, sys
from flashlab.kernels import forward_v6
k = forward_v6.compile_sm90(causal=sys.argv[1] == "1")
ptx = k.asm["ptx"]
print(json.dumps(dict(warps=k.metadata.num_warps, shared=k.metadata.shared,
                      producer_gives_back="setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx,
                      wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx)))
"""


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_v6_compiles_for_sm90(causal):
    """Gluon has no interpreter: compiling for sm_90 (no GPU needed, in a child process in compiled mode) is what
    a CPU machine can check of v6 -- this Triton still takes its warp specialisation, barriers, TMA copies and
    wgmmas, and it fits in an H200's shared memory."""
    got = compile_in_child(COMPILE, causal)
    assert got["warps"] == 12                                  # 4 + 4 consumers, the producer's warpgroup
    assert got["shared"] <= H200.shared_memory
    assert got["producer_gives_back"] and got["wgmma"] and got["tma"]


COMPILE_FP8 = """
import json, sys
from flashlab.kernels import forward_v6
k = forward_v6.compile_sm90(causal=sys.argv[1] == "1", dtype="fp8e4nv", stages=5)
ptx = k.asm["ptx"]
print(json.dumps(dict(warps=k.metadata.num_warps, shared=k.metadata.shared,
                      e4m3_wgmma=sum("wgmma.mma_async" in l and "e4m3.e4m3" in l for l in ptx.splitlines()),
                      wgmma=ptx.count("wgmma.mma_async"))))
"""


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_v6_fp8_compiles_for_sm90(causal):
    """The FP8 forward on v6's schedule (forward_v6.launch_fp8: e4m3 Q, K, V^T, P through shared memory) compiles
    for sm_90 with every product in e4m3 (K steps of 32: 4 wgmmas a product; 2 products, each written twice, for
    the first key tile and in the loop; 2 consumers) and fits at 5 stages."""
    got = compile_in_child(COMPILE_FP8, causal)
    assert got["warps"] == 12
    assert got["shared"] <= H200.shared_memory
    assert got["wgmma"] == 2 * 2 * 4 * 2 and got["e4m3_wgmma"] == got["wgmma"]


sm90 = pytest.mark.skipif(not (device.DEVICE.type == "cuda" and P.device_facts().sm90 and forward_v6.AVAILABLE),
                          reason="needs an sm_90 GPU (H100, H200) and Gluon")


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 3, 1000, 1008), (1, 4, 2, 1900, 704)])
def test_gpu_v6_fp8_matches_float64(shape, causal):
    """launch_fp8 against float64 attention of the dequantised inputs it was given (ragged, Nq != Nk, GQA, logits
    x 4): no worse than the FP8 `tl` kernel on the same inputs (both round P to e4m3), and within absolute bounds
    (the H200 measured O errors 0.052-0.076 and LSE errors 0.010-0.020 for both kernels at these logits:
    scripts/fp8_v6_probe.py)."""
    from flashlab.fp8 import dequantize_fp8, flash_attention_fp8, quantize_fp8
    B, H, Hkv, nq, nk = shape
    torch.manual_seed(0)
    q = 4 * torch.randn(B, H, nq, 128, device="cuda", dtype=torch.bfloat16)
    k = 2 * torch.randn(B, Hkv, nk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, nk, 128, device="cuda", dtype=torch.bfloat16)
    (q8, qs), (k8, ks), (vt8, vs) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v, transpose=True)
    o = torch.empty(B, H, nq, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(B, H, nq, device="cuda")
    forward_v6.launch_fp8(q8, k8, vt8, o, lse, 128 ** -0.5, qs, ks, vs, causal)
    qd, kd = dequantize_fp8(q8, qs), dequantize_fp8(k8, ks).repeat_interleave(H // Hkv, 1)
    vd = dequantize_fp8(vt8, vs, transposed=True).repeat_interleave(H // Hkv, 1)
    s = (qd @ kd.transpose(-1, -2)) * 128 ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ vd
    o_tl, lse_tl = flash_attention_fp8(q8, k8, vt8, qs, ks, vs, causal, return_lse=True)
    err, err_tl = ((x.double() - ref).abs().max().item() for x in (o, o_tl))
    assert torch.isfinite(o).all() and err <= 1.5 * err_tl + 1e-3 and err <= 0.15, (err, err_tl)
    lerr, lerr_tl = ((x.double() - torch.logsumexp(s, -1)).abs().max().item() for x in (lse, lse_tl))
    assert lerr <= 1.5 * lerr_tl + 1e-3 and lerr <= 0.05, (lerr, lerr_tl)


def test_v6_fp8_refuses_what_it_cannot_take():
    """launch_fp8's checks run before anything touches a GPU: a wrong dtype, a V^T of the wrong length, scales of
    the wrong shape, keys that are not a multiple of 16."""
    e4 = torch.float8_e4m3fn
    q8, k8 = torch.zeros(1, 2, 64, 128, dtype=e4), torch.zeros(1, 1, 32, 128, dtype=e4)
    vt8 = torch.zeros(1, 1, 128, 32, dtype=e4)
    o, lse = torch.empty(1, 2, 64, 128, dtype=torch.bfloat16), torch.empty(1, 2, 64)
    s2, s1 = torch.ones(1, 2), torch.ones(1, 1)
    with pytest.raises(TypeError, match="float8"):
        forward_v6.launch_fp8(q8.to(torch.bfloat16), k8, vt8, o, lse, 1.0, s2, s1, s1, False)
    with pytest.raises(ValueError, match="vt8"):
        forward_v6.launch_fp8(q8, k8, vt8[..., :16], o, lse, 1.0, s2, s1, s1, False)
    with pytest.raises(ValueError, match="k_scale"):
        forward_v6.launch_fp8(q8, k8, vt8, o, lse, 1.0, s2, s2, s1, False)
    with pytest.raises(ValueError, match="multiple of 16"):
        forward_v6.launch_fp8(q8, k8[:, :, :24], vt8[..., :24], o, lse, 1.0, s2, s1, s1, False)


def _v6(q, k, v, causal, scale):
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    launch_forward(q, k, v, o, lse, causal, 1 / math.sqrt(q.shape[-1]) if scale is None else scale, version="v6")
    return o, lse


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(4096, 4096), (1000, 1000), (2050, 2050), (700, 1900), (1900, 700), (130, 64)])
def test_gpu_v6_accuracy(rng, dtype, causal, nq, nk):
    """Ragged tiles on both sides, Nq != Nk both ways (top-left causal), logits 4x larger than unit."""
    q, k, v = (torch.randn(2, 3, n, 128, device="cuda") for n in (nq, nk, nk))
    q, k = 4 * q, 2 * k
    p = P.plan_for(q.to(dtype), k.to(dtype), v.to(dtype), causal, forward_version="v6")
    assert p.fwd_version == "v6", p.reasons["fwd"]
    checks = check_attention(_v6, q.to(dtype), k.to(dtype), v.to(dtype), causal, backward=False)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.gpu
@sm90
def test_gpu_v6_strided_views_and_the_op(rng):
    """(B, N, H, D) storage seen as (B, H, N, D) (nanoGPT's transpose): v6 takes the strides as they are; and
    the op runs v6 by default at D = 128, N = 4096, forward and backward."""
    import flashlab
    x = torch.randn(2, 4096, 3, 3, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    assert P.plan_for(q, k, v, True).fwd_version == "v6"
    checks = check_attention(lambda q, k, v, c, s: flashlab.flash_attention(q, k, v, causal=c, return_lse=True),
                             q, k, v, True, backward=True)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("cfg", [C(64, 64, 4, 2), C(128, 128, 8, 3), C(128, 128, 4, 1)])
def test_gpu_v6_refuses_other_tiles(cfg):
    """Its tiles and warps are the design; one stage would deadlock the ring (a consumer holds V_{j-1} while it
    waits for K_j in the same stage)."""
    q = torch.randn(1, 1, 256, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="128 x 128"):
        launch_forward(q, q, q, torch.empty_like(q), torch.empty(1, 1, 256, device="cuda"), False, 0.1,
                       version="v6", config=cfg)


@pytest.mark.gpu
@sm90
def test_gpu_v6_no_keys_and_many_heads():
    """Nk = 0 (no key tile: the consumers would wait for ever): O = 0, LSE = -inf.  B * H = 70,000 programs per
    tile row, past grid axis 1's 65,535: the 1-D grid takes them."""
    q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.float16)
    kv = torch.empty(1, 2, 0, 128, device="cuda", dtype=torch.float16)
    o, lse = torch.full_like(q, 7.0), torch.zeros(1, 2, 256, device="cuda")
    launch_forward(q, kv, kv, o, lse, False, 0.1, version="v6")
    assert (o == 0).all() and (lse == float("-inf")).all()
    q, k, v = (torch.randn(70000, 1, 130, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    o, lse = _v6(q, k, v, True, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q[-3:].float(), k[-3:].float(), v[-3:].float(),
                                                           is_causal=True)
    assert (o[-3:].float() - ref).abs().max().item() < 2e-2


def test_head_group_rule():
    """Causal v6 grids: sections of about one wave of programs (the multiprocessors over the tiles of a head), at
    least 2 heads, never more than B * H; tiles.HEAD_GROUP overrides it (the timing scripts compare sizes)."""
    from flashlab.kernels import tiles

    def group(B, H, n_tiles):
        return tiles.head_group(B * H, n_tiles, P.H200.sms)
    assert P.H200.sms == 132
    assert group(4, 16, 32) == 4                 # N = 4096: the H200's best in docs/BENCHMARKS.md, 2026-12-03
    assert group(1, 16, 128) == 2                # N = 16384
    assert group(1, 1, 128) == 1                 # one head: one section
    assert group(2, 3, 8) == 6                   # N = 1024: 16 heads would fill a wave; there are 6
    tiles.HEAD_GROUP = 5
    try:
        assert group(4, 16, 32) == 5 and group(1, 2, 32) == 2
    finally:
        tiles.HEAD_GROUP = None
