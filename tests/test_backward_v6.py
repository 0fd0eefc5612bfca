"""Backward v6 (forward v6's warp specialisation applied to the one-pass backward, Gluon, Hopper only): where the
plan runs it, that it compiles for sm_90 with this Triton (no GPU needed), and on an sm_90 GPU its accuracy
against float64."""

import pytest
import torch

from flashlab import device
from flashlab.accuracy import check_attention
from flashlab.kernels import backward_v6, launch_backward, version_op
from flashlab.kernels import plan as P
from flashlab.kernels.tiles import C

from test_forward_v6 import check_launch_arguments, compile_in_child

DEV = device.DEVICE
needs_gluon = pytest.mark.skipif(not backward_v6.AVAILABLE, reason="this Triton has no Gluon warp specialisation")
H200 = P.SIMULATED["h200"]


def test_v6_is_not_among_the_versions_every_machine_runs():
    assert "v6" in P.BACKWARD and "v6" not in P.BACKWARD_VERSIONS


def test_forcing_backward_v6_where_it_cannot_run_says_why():
    p = P.plan(2, 8, 4096, 4096, 128, torch.float16, False, facts=P.SIMULATED["a100"], backward_version="v6")
    assert p.bwd_version == "v2" and p.reasons["bwd"].startswith("v6 wanted, but it is written for Hopper")
    p = P.plan(2, 8, 4096, 4096, 64, torch.float16, False, facts=H200, backward_version="v6")
    assert p.bwd_version != "v6" and "D = 128 only" in p.reasons["bwd"]
    if backward_v6.AVAILABLE:
        p = P.plan(2, 8, 4096, 4096, 128, torch.float16, False, facts=H200, backward_version="v6",
                   layout=P.Layout(no_zero_stride=False))
        assert p.bwd_version != "v6" and "stride 0" in p.reasons["bwd"]


@needs_gluon
def test_forced_backward_v6_is_one_kernel_after_delta():
    p = P.plan(2, 8, 4096, 4000, 128, torch.bfloat16, True, facts=H200, backward_version="v6")
    assert p.bwd_version == "v6"
    assert [s.kind for s in p.backward] == ["pre", "bwd"]
    assert p.backward[1].config == C(64, 128, 4, 2)
    assert p.backward[1].grid_for(p.backward[1].config) == (32 * 16,)    # cdiv(4000, 128) K tiles x B * H


def _rows_read(desc, row: int, col: int) -> torch.Tensor:
    """What the kernel's TMA copy of a Q tile's LSE or Delta gives: 64 floats of row ``row`` from column ``col``,
    zeros past the descriptor's width."""
    assert desc.block_shape == [1, 64] and desc.strides[-1] == 1 and desc.strides[0] % 4 == 0   # 16-byte rows
    assert desc.shape == list(desc.base.shape)           # what TMA reads as in bounds is what this reads
    got = desc.base[row, col:min(col + 64, desc.shape[1])]
    return torch.cat([got, torch.zeros(64 - got.numel(), dtype=got.dtype)])


@needs_gluon
@pytest.mark.parametrize("kind", ["causal", "window, gqa", "packed"])
def test_launch_passes_the_kernel_its_arguments(kind, monkeypatch):
    """Without a GPU, the launcher up to the kernel: the launch (descriptors, strides, the variant's scalars) matches
    flash_bwd_kernel_v6's signature, with the plan's stages; and every Q tile's LSE and Delta, copied as the producer
    does (row b H + h, columns from the tile's first row; a packed sequence's: row h, from packed_start), are
    that tile's rows (Delta = rowsum(dO o O)) where they are the call's, and zeros (dense) or LSE = +inf, Delta = 0
    (packed) past them."""
    seen = []
    monkeypatch.setattr(backward_v6.tiles, "launch_cached", lambda kern, grid, args, consts, runners, key:
                        seen.append((kern, grid, args, consts)))
    H, D, f16 = 4, 128, torch.float16
    packed = kind == "packed"
    if packed:
        cu = torch.tensor([0, 700, 770, 2300], dtype=torch.int32)
        q, k, v, o, do = (torch.randn(2300, H, D, dtype=f16) for _ in range(5))
        lse = torch.randn(H, 2300)
        plan = P.plan(3, H, 1530, 1530, D, f16, True, variant=P.Variant(varlen=True), facts=H200,
                      backward_version="v6")
        extra = dict(cu_q=cu, cu_k=cu)
    else:
        var = P.Variant(kv_groups=2, window=(300, 0)) if kind.startswith("window") else P.Variant()
        q, o, do = (torch.randn(2, H, 2099, D, dtype=f16) for _ in range(3))     # rows of 2099 floats: padded
        k, v = (torch.randn(2, H // var.kv_groups, 2099, D, dtype=f16) for _ in range(2))
        lse = torch.randn(2, H, 2099)
        plan = P.plan(2, H, 2099, 2099, D, f16, True, variant=var, facts=H200, backward_version="v6")
        extra = {}
    assert plan.bwd_version == "v6"
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward_v6.launch(plan, q, k, v, o, lse, do, dq, dk, dv, 0.1, **extra)
    (kern, grid, args, consts), = seen
    named = check_launch_arguments(kern, args, consts)
    assert consts["STAGES"] == plan.backward[1].config.num_stages and consts["VARLEN"] == packed
    assert named["H"] == H and consts["KV_GROUP"] == plan.variant.kv_groups
    lse_d, delta_d = named["lse_desc"], named["delta_desc"]
    if not packed:   # past Nq TMA gives zeros, never a padded row's uninitialised floats
        assert lse_d.shape == delta_d.shape == [plan.B * H, plan.Nq]
    # the kernel finds a packed sequence's rows where padded_rows put them (packed_start's SPAN)
    span = next(p.default for p in kern.params if p.name == "SPAN")
    assert consts["SPAN"] == span == backward_v6.SPAN
    assert lse_d.block_shape == delta_d.block_shape == [1, 64]
    for b in range(plan.B):
        q0, n = (int(cu[b]), int(cu[b + 1] - cu[b])) if packed else (0, plan.Nq)
        for h in range(H):
            for row0 in range(0, n, 64):
                rows = slice(q0 + row0, q0 + min(row0 + 64, n))
                m = rows.stop - rows.start
                at = (h, backward_v6.packed_start(q0, b) + row0) if packed else (b * H + h, row0)
                assert at[1] % 4 == 0          # a TMA copy's innermost coordinate: 16-byte aligned, or it faults
                want_l = lse[h, rows] if packed else lse[b, h, row0:row0 + m]
                oo, dd = (t[rows, h] if packed else t[b, h, row0:row0 + m] for t in (o, do))
                got_l, got_d = _rows_read(lse_d, *at), _rows_read(delta_d, *at)
                assert torch.equal(got_l[:m], want_l), (b, h, row0)
                torch.testing.assert_close(got_d[:m], (oo.float() * dd.float()).sum(-1), rtol=1e-4, atol=1e-3)
                assert (got_l[m:] == (float("inf") if packed else 0)).all() and (got_d[m:] == 0).all()


COMPILE = """
import json, sys
from flashlab.kernels import backward_v6
k = backward_v6.compile_sm90(causal=sys.argv[1] == "1")
ptx = k.asm["ptx"]
print(json.dumps(dict(warps=k.metadata.num_warps, shared=k.metadata.shared,
                      producer_gives_back="setmaxnreg.dec.sync.aligned.u32 \\t24;" in ptx,
                      wgmma=ptx.count("wgmma.mma_async"), tma_loads="cp.async.bulk.tensor" in ptx,
                      tma_adds="cp.reduce.async.bulk.tensor" in ptx and ".add" in ptx,
                      spills="ld.local" in ptx or "st.local" in ptx)))
"""


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_v6_backward_compiles_for_sm90(causal):
    """What a CPU machine can check of it: this Triton takes its partitions, barriers, TMA copies and adds and
    wgmmas (32 a consumer's loop: S^T and dP^T 8 each, dV and dK 4 each, dQ 8; causal, two loops: the diagonal's
    and the rest), it fits in an H200's shared memory, and its PTX uses no local memory (ptxas may still spill
    a few registers: see backward_v6's docstring)."""
    got = compile_in_child(COMPILE, causal)
    assert got["warps"] == 12
    assert got["shared"] <= H200.shared_memory
    assert got["producer_gives_back"] and got["tma_loads"] and got["tma_adds"] and not got["spills"]
    assert got["wgmma"] == 2 * 32 * (2 if causal else 1)


sm90 = pytest.mark.skipif(not (device.DEVICE.type == "cuda" and P.device_facts().sm90 and backward_v6.AVAILABLE),
                          reason="needs an sm_90 GPU (H100, H200) and Gluon")


def _op():
    return version_op(None, "v6")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(4096, 4096), (1000, 1000), (2050, 2050), (700, 1900), (1900, 700), (130, 64),
                                   (64, 130)])
def test_gpu_backward_v6_accuracy(rng, dtype, causal, nq, nk):
    """Ragged tiles on both sides, Nq != Nk both ways (top-left causal), logits 4x larger than unit."""
    q, k, v = (torch.randn(2, 3, n, 128, device="cuda") for n in (nq, nk, nk))
    q, k = 4 * q, 2 * k
    p = P.plan_for(q.to(dtype), k.to(dtype), v.to(dtype), causal, backward_version="v6")
    assert p.bwd_version == "v6", p.reasons["bwd"]
    checks = check_attention(_op(), q.to(dtype), k.to(dtype), v.to(dtype), causal, backward=True)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.gpu
@sm90
def test_gpu_backward_v6_strided_views(rng):
    """(B, N, H, D) storage seen as (B, H, N, D) (nanoGPT's transpose): the TMA copies take the strides as they
    are, and dK, dV are written in k's strides."""
    x = torch.randn(2, 1500, 3, 3, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    checks = check_attention(_op(), q, k, v, True, backward=True)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_backward_v6_dense_bnhd_memory(rng, causal):
    """Separate (B, N, H, D) tensors seen as (B, H, N, D) (a model's q_proj(x).view(B, N, H, D).transpose(1, 2)):
    dQ's float32 buffer takes dQ's strides, so the TMA adds go through them; rows past N (1500) dropped."""
    q, k, v = (torch.randn(2, 1500, 3, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    checks = check_attention(_op(), q, k, v, causal, backward=True)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def test_dq_buffer_takes_dq_strides():
    """dQ's float32 buffer has dQ's strides when a TMA descriptor can take them ((B, N, H, D) memory), else it is
    contiguous: an ordered final scaling, and never a descriptor with a stride that is not 16 bytes."""
    bnhd = torch.empty(2, 300, 3, 128).transpose(1, 2)
    assert backward_v6.dq_buffer(bnhd).stride() == bnhd.stride()
    assert backward_v6.dq_buffer(torch.empty(2, 3, 300, 128)).is_contiguous()
    sliced = backward_v6.dq_buffer(torch.empty(2, 300, 3, 130)[..., :128].transpose(1, 2))   # not dense
    assert sliced.stride() == (300 * 3 * 128, 128, 3 * 128, 1)           # zeros_like: dense, in its order
    skew = torch.empty(1, 3, 300, 128).as_strided((1, 3, 300, 128), (7, 300 * 128, 128, 1))
    buf = backward_v6.dq_buffer(skew)
    assert buf.is_contiguous() and not bool(buf.any())


@pytest.mark.gpu
@sm90
def test_gpu_backward_v6_refuses_other_tiles_and_takes_empty_calls():
    q = torch.randn(1, 1, 256, 128, device="cuda", dtype=torch.float16)
    o, lse = torch.zeros_like(q), torch.zeros(1, 1, 256, device="cuda")
    g = [torch.full_like(q, 7.0) for _ in range(3)]
    with pytest.raises(ValueError, match="64 query rows x 128 keys"):
        launch_backward(q, q, q, o, lse, q, *g, False, 0.1, version="v6", config=C(128, 128, 4, 2))
    kv = torch.empty(1, 1, 0, 128, device="cuda", dtype=torch.float16)
    dk, dv = torch.empty_like(kv), torch.empty_like(kv)
    launch_backward(q, kv, kv, o, lse, q, g[0], dk, dv, False, 0.1, version="v6")
    assert (g[0] == 0).all()


@pytest.mark.parametrize("lens", [(70, 0, 5, 130), (64,), (1, 128, 63), (3, 2, 1, 7)])
def test_padded_rows_of_a_packed_call(lens):
    """Backward v6's LSE and Delta for packed sequences (the interpreter runs their kernel): sequence b's rows from
    packed_start(q0, b) on, a multiple of 4 columns (its TMA copies' first column must be 16-byte aligned), then PAD
    rows of LSE = +inf and Delta = 0, without overlapping the next sequence's; the forward's LSE and rowsum(dO * O)
    where the rows are; rows of a multiple of 4 floats."""
    H, D = 3, 128 if DEV.type == "cuda" else 32
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    total = int(cu[-1])
    o, do = (torch.randn(total, H, D, device=DEV) for _ in range(2))
    do = do.transpose(0, 1).contiguous().transpose(0, 1)                  # strides of its own
    lse = torch.randn(H, total, device=DEV) * 30
    plan = P.plan(len(lens), H, max(lens), max(lens), D, torch.float32, True, variant=P.Variant(varlen=True))
    delta, lse_p = backward_v6.padded_rows(plan, o, do, lse, cu)
    pad = backward_v6.PAD
    assert delta.shape == lse_p.shape and delta.stride() == lse_p.stride() and delta.stride(0) % 4 == 0
    ends = []
    for b, n in enumerate(lens):
        q0, c = int(cu[b]), backward_v6.packed_start(int(cu[b]), b)
        assert c % 4 == 0 and all(c >= e for e in ends) and c + n + pad <= delta.shape[1]
        ends.append(c + n + pad)
        torch.testing.assert_close(delta[:, c:c + n], (o[q0:q0 + n] * do[q0:q0 + n]).sum(-1).T, rtol=1e-5, atol=1e-4)
        assert torch.equal(lse_p[:, c:c + n], lse[:, q0:q0 + n])
        assert (delta[:, c + n:c + n + pad] == 0).all() and (lse_p[:, c + n:c + n + pad] == float("inf")).all()
