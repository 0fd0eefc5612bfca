"""Ring attention (flashlab.distributed): the layouts and step plans by brute force over global
positions, the torch merge against the NumPy one, and the ring itself on 2 and 4 gloo processes
(the Triton interpreter on the CPU), forward and backward, against float64 attention on the whole
sequence by the accuracy rule and against the single-process op."""
import math

import numpy as np
import pytest
import torch

from flashlab import device
from flashlab import reference as R
from flashlab.distributed import (chunk_ids, gather, merge_attention, positions, shard, step_plan,
                                  step_source, step_work)

LAYOUTS = ("contiguous", "zigzag")

# The gloo processes run CPU tensors through the interpreter; on a GPU machine the kernels want CUDA
# tensors and a forked child cannot use CUDA, so there the ring runs on NCCL (test_ring_nccl_two_gpus).
on_cpu_processes = pytest.mark.skipif(not device.INTERPRET, reason="gloo ring tests run in the interpreter; "
                                      "on a GPU machine test_ring_nccl_two_gpus runs the ring")


# ----------------------------------------------------------------------------
# layouts and plans (pure Python)
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_gather_round_trip(layout, world):
    n = 2 * world * 5
    x = torch.randn(2, 3, n, 4)
    parts = [shard(x, r, world, layout) for r in range(world)]
    assert all(p.shape == (2, 3, n // world, 4) for p in parts)
    for r, p in enumerate(parts):
        assert torch.equal(p, x[:, :, positions(r, world, n, layout)])
    assert torch.equal(gather(parts, layout), x)
    assert sorted(i for r in range(world) for i in positions(r, world, n, layout)) == list(range(n))
    y = torch.randn(n, 7)                            # another dim
    assert torch.equal(gather([shard(y, r, world, layout, dim=0) for r in range(world)], layout, dim=0), y)


def test_zigzag_chunks_are_r_and_mirror():
    assert [chunk_ids(r, 4, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert positions(1, 2, 8, "zigzag") == [2, 3, 4, 5] and positions(0, 2, 8, "zigzag") == [0, 1, 6, 7]
    assert positions(1, 2, 8, "contiguous") == [4, 5, 6, 7]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_step_plan_covers_exactly_the_visible_pairs(layout, world, causal):
    """Over all steps, the tiles of a rank cover each (query, key) pair that the mask allows exactly
    once and no other; a tile without the mask is fully visible; a masked tile is a chunk against
    itself (equal lengths, the same positions), where top-left causal is the global mask."""
    n = 4 * world
    nl = n // world
    for rank in range(world):
        pq = np.array(positions(rank, world, n, layout))
        count = np.zeros((nl, n), int)
        for step in range(world):
            pk = np.array(positions(step_source(rank, world, step), world, n, layout))
            for t in step_plan(rank, world, step, nl, layout, causal):
                qs, ks = pq[t.q], pk[t.kv]
                vis = ks[None, :] <= qs[:, None] if causal else np.ones((len(qs), len(ks)), bool)
                if t.causal:
                    assert np.array_equal(qs, ks), "a masked tile must be a chunk against itself"
                    assert np.array_equal(vis, np.tril(np.ones_like(vis)))
                else:
                    assert vis.all(), f"rank {rank} step {step}: an unmasked tile holds masked pairs"
                cols = np.searchsorted(np.arange(n), ks)
                for i, row in enumerate(range(t.q.start, t.q.stop)):
                    count[row, cols[vis[i]]] += 1
        want = (np.arange(n)[None, :] <= pq[:, None]) if causal else np.ones((nl, n), bool)
        assert np.array_equal(count, want.astype(int)), f"rank {rank}: pairs missed or computed twice"


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    W = 4
    for layout in LAYOUTS:
        per_rank = [sum(step_work(r, W, s, layout) for s in range(W)) for r in range(W)]
        if layout == "zigzag":
            assert per_rank == [0.5 + 0.5 * (W - 1)] * W
            assert all(step_work(r, W, s, layout) == 0.5 for r in range(W) for s in range(1, W))
        else:
            assert per_rank == [0.5 + r for r in range(W)]


@pytest.mark.parametrize("call, words", [
    (lambda: shard(torch.zeros(1, 1, 10, 4), 0, 3, "contiguous"), "divisible by world = 3"),
    (lambda: shard(torch.zeros(1, 1, 12, 4), 0, 4, "zigzag"), "divisible by 2·world = 8"),
    (lambda: shard(torch.zeros(1, 1, 8, 4), 0, 2, "stripes"), "layout must be one of"),
    (lambda: shard(torch.zeros(1, 1, 8, 4), 2, 2, "zigzag"), "rank must be an int in [0, world=2)"),
    (lambda: gather([torch.zeros(1, 1, 3, 4)] * 2, "zigzag"), "divisible by 2"),
    (lambda: step_plan(0, 2, 1, 5, "zigzag"), "must be even"),
])
def test_layout_errors_say_what_to_fix(call, words):
    with pytest.raises(ValueError, match=None) as e:
        call()
    assert words in str(e.value), str(e.value)


# ----------------------------------------------------------------------------
# the merge
# ----------------------------------------------------------------------------

def _naive(q, k, v, mask=None):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def test_merge_matches_numpy_merge_and_whole_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q[0, 0] *= 60                                   # large logits: e^S overflows without the max
    mask = torch.ones(9, 9, dtype=torch.bool)
    mask[:3, :5] = False                            # rows 0-2 see nothing in the first part
    o1, l1 = _naive(q, k[:, :, :5], v[:, :, :5], mask[:, :5])
    o2, l2 = _naive(q, k[:, :, 5:], v[:, :, 5:], mask[:, 5:])
    o, lse = merge_attention(o1.float(), l1.float(), o2, l2.float())
    ow, lw = _naive(q, k, v, mask)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), ow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lw, atol=1e-4, rtol=1e-6)
    # the NumPy merge of notebook 02 on the unnormalised states gives the same
    st = [(lp.numpy(), np.ones(lp.shape), op.numpy()) for op, lp in ((o1, l1), (o2, l2))]
    m, ll, acc = R.merge_states(*st[0], *st[1])
    np.testing.assert_allclose(acc / ll[..., None], ow.numpy(), atol=1e-10)
    # a part that saw nothing (lse = -inf everywhere) leaves the state alone
    o3, l3 = merge_attention(o.clone(), lse.clone(), torch.full_like(o, float("nan")) * 0,
                             torch.full_like(lse, -math.inf))
    assert torch.equal(l3, lse) and torch.allclose(o3, o, equal_nan=False)


def test_merge_at_large_lse_and_an_unseen_running_state():
    """Weights against the larger LSE, divided by their sum: weighed against the merged LSE, its float32 rounding
    scaled O (two equal parts at LSE 1e8 gave 3, not 1.5).  A running state that saw nothing (LSE -inf) has its O
    ignored, NaN or not, in either argument order."""
    one, two = torch.ones(1, 2), 2 * torch.ones(1, 2)
    for big in (1e8, 5e4, -5e4):
        o, lse = merge_attention(one, torch.tensor([big]), two, torch.tensor([big]))
        torch.testing.assert_close(o, 1.5 * one, atol=1e-6, rtol=0)
        want = torch.tensor([big], dtype=torch.float64) + math.log(2)
        torch.testing.assert_close(lse.double(), want, atol=abs(big) * 1e-7 + 1e-6, rtol=0)
    nan, seen = torch.full((1, 2), float("nan")), torch.tensor([[1.0, 2.0]])
    for args in ((nan, torch.tensor([-math.inf]), seen, torch.tensor([0.3])),
                 (seen, torch.tensor([0.3]), nan, torch.tensor([-math.inf]))):
        o, lse = merge_attention(*args)
        assert torch.equal(o, seen) and torch.equal(lse, torch.tensor([0.3]))
    o, lse = merge_attention(nan, torch.tensor([-math.inf]), nan, torch.tensor([-math.inf]))
    assert torch.equal(o, torch.zeros(1, 2)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.float16])
def test_fused_merge_kernel_matches_the_elementwise_merge(part_dtype):
    """The ring's one-pass merge kernel (what it runs on a GPU) against ``merge_attention``: rows of
    a larger buffer (strided views, as the ring's tiles are), a ragged row count and head dim, large
    LSE gaps, rows where either side or both saw nothing, NaN in a part whose LSE is -inf."""
    pytest.importorskip("triton")
    from flashlab.kernels.merge import merge_into
    g = torch.Generator().manual_seed(3)
    B, H, N, D = 2, 3, 37, 24
    dev = device.DEVICE
    big_o = torch.randn(B, H, N + 11, D, generator=g).to(dev)
    big_l = (torch.randn(B, H, N + 11, generator=g) * 30).to(dev)
    o, lse = big_o[:, :, 5:5 + N], big_l[:, :, 5:5 + N]              # views: strides of the big buffer
    o_p = torch.randn(B, H, N, D, generator=g).to(part_dtype).to(dev)
    l_p = (torch.randn(B, H, N, generator=g) * 30).to(dev)
    lse[0, 0, :4] = -math.inf                                       # the running state saw nothing yet
    o[0, 0, :4] = 0.0
    l_p[1, 2, 6:9] = -math.inf                                      # the part saw nothing: its O is garbage
    o_p[1, 2, 6:9] = float("nan")
    lse[0, 1, 10] = l_p[0, 1, 10] = -math.inf                       # neither side saw a key
    o[0, 1, 10] = 0.0
    want_o, want_l = merge_attention(o.clone(), lse.clone(), o_p, l_p)
    untouched = big_o[:, :, :5].clone(), big_o[:, :, 5 + N:].clone()
    merge_into(o, lse, o_p, l_p)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_l, atol=1e-5, rtol=1e-6)
    assert lse[0, 1, 10] == -math.inf and not o[0, 1, 10].any()
    assert torch.equal(big_o[:, :, :5], untouched[0]) and torch.equal(big_o[:, :, 5 + N:], untouched[1])
    with pytest.raises(TypeError, match="float32"):
        merge_into(o.half(), lse, o_p, l_p)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_ring_simulation_is_attention_on_the_whole_sequence(layout, causal):
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((30, 8)) for _ in range(3))
    q[3] *= 300.0                                     # one row with scores in the thousands
    ro, rl = R.attention_naive(q, k, v, causal)
    for world in (1, 3, 5):
        o, lse = R.ring_attention_sim(q, k, v, world, layout, causal)
        np.testing.assert_allclose(o, ro, atol=1e-12, rtol=1e-10)
        np.testing.assert_allclose(lse, rl, atol=1e-9, rtol=1e-12)


def test_numpy_merge_partials_equals_one_softmax():
    rng = np.random.default_rng()
    q, k, v = rng.standard_normal((5, 4)) * 40, rng.standard_normal((12, 4)), rng.standard_normal((12, 4))
    parts = [R.attention_naive(q, k[a:b], v[a:b]) for a, b in ((0, 3), (3, 10), (10, 12))]
    o, lse = R.merge_partials(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    ro, rl = R.attention_naive(q, k, v)
    np.testing.assert_allclose(o, ro, atol=1e-12)
    np.testing.assert_allclose(lse, rl, atol=1e-10)
    empty = (np.full_like(o, np.nan), np.full_like(lse, -np.inf))   # a split with no keys
    o2, l2 = R.merge_partials(np.stack([o, empty[0]]), np.stack([lse, empty[1]]))
    np.testing.assert_allclose(o2, o, atol=0)
    np.testing.assert_allclose(l2, lse, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_simulated_in_one_process_with_the_kernels(layout):
    import flashlab
    from flashlab.distributed import simulate_ring
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 24, 16, generator=g).to(device.DEVICE)
    k, v = (torch.randn(1, 1, 24, 16, generator=g).to(device.DEVICE) for _ in range(2))
    for causal in (False, True):
        o, lse = simulate_ring(q, k, v, 3, causal, layout=layout)
        ro, rl = flashlab.flash_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal,
                                          return_lse=True)
        torch.testing.assert_close(o, ro, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse, rl, atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------
# the ring on gloo processes
# ----------------------------------------------------------------------------

def _ring_cases(rank, world, cases, group=None):
    """Run each case on this rank (of ``group``: rank and world in it); return a list of failure
    messages (empty: all good)."""
    import flashlab
    from flashlab.accuracy import judge, reference_outputs
    from flashlab.distributed import all_gather_sequence, ring_attention
    bad = []
    for c in cases:
        B, H, Hkv, N, D, layout, causal, dtype, big = (c[k] for k in ("B", "H", "Hkv", "N", "D", "layout",
                                                                        "causal", "dtype", "large"))
        g = torch.Generator().manual_seed(c["seed"])               # the same data on every rank
        Q, K, V, dO = (torch.randn(B, h, N, D, generator=g) for h in (H, Hkv, Hkv, H))
        if big:
            Q = Q * 20.0
        Q, K, V, dO = (t.to(dtype) for t in (Q, K, V, dO))
        q, k, v, do = (shard(t, rank, world, layout) for t in (Q, K, V, dO))
        if c.get("strided"):                                        # (B, N, H, D) storage seen as (B, H, N, D)
            q, k, v, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o, lse = ring_attention(q, k, v, is_causal=causal, layout=layout, return_lse=True, group=group)
        o.backward(do)
        got = [all_gather_sequence(t, layout, group=group)
               for t in (o.detach(), lse[..., None], q.grad, k.grad, v.grad)]
        got[1] = got[1][..., 0]
        grp = H // Hkv
        Ke, Ve = (t.repeat_interleave(grp, 1) for t in (K, V))
        ref = list(reference_outputs(Q, Ke, Ve, dO, causal))
        same = list(reference_outputs(Q, Ke, Ve, dO, causal, dtype=torch.float32 if dtype != torch.float16
                                      else torch.float16))
        for lst in (ref, same):
            lst[3], lst[4] = (t.view(B, Hkv, grp, N, D).sum(2) for t in lst[3:5])
        lse_max = ref[1].abs().max().item()
        for i, name in enumerate(("o", "lse", "dq", "dk", "dv")):
            chk = judge(name, got[i], same[i], ref[i], dtype, lse_max=lse_max if i >= 2 else 0.0)
            if not chk.ok:
                bad.append(f"{c}: {chk}")
        # the single-process op on the whole sequence (K/V expanded over heads, dK/dV summed back)
        Qo, Ko, Vo = (t.detach().clone().requires_grad_() for t in (Q, K, V))
        oo, lo = flashlab.flash_attention(Qo, Ko.repeat_interleave(grp, 1), Vo.repeat_interleave(grp, 1),
                                          causal, return_lse=True)
        oo.backward(dO)
        tol = 2e-3 if dtype == torch.float16 else 2e-5 * (20 if big else 1)
        for name, a, b in (("o", got[0], oo), ("lse", got[1], lo), ("dq", got[2], Qo.grad),
                           ("dk", got[3], Ko.grad), ("dv", got[4], Vo.grad)):
            err = (a.double() - b.double()).abs().max().item()
            scale = max(1.0, b.double().abs().max().item())
            if not err <= tol * scale:
                bad.append(f"{c}: {name} differs from the single-process op by {err:.2e} (allowed {tol * scale:.2e})")
    return bad


def _errors_on_rank(rank, world):
    """Bad input with the group initialised: the message names the fix."""
    from flashlab.distributed import ring_attention
    said = []
    x = torch.randn(1, 2, 5, 16)
    for call, words in (
            (lambda: ring_attention(x, x, x), "must be even"),
            (lambda: ring_attention(x, x[:, :1, :4], x[:, :1, :4], layout="contiguous"), "same length"),
            (lambda: ring_attention(torch.randn(1, 3, 4, 16), x[:, :, :4], x[:, :, :4]),
             "multiple of the key/value heads"),
            (lambda: ring_attention(x, x, x, layout="diagonal"), "layout must be one of")):
        try:
            call()
            said.append(f"no error for {words!r}")
        except (ValueError, TypeError) as e:
            if words not in str(e):
                said.append(f"{words!r} not in {e}")
    z = torch.randn(1, 2, 4 + 2 * rank, 16)                 # shards of different lengths on different ranks
    try:
        ring_attention(z, z, z)
        said.append("no error for shards of different shapes")
    except ValueError as e:
        if "same shape" not in str(e) or "rank 1: (B, H, n, D) = (1, 2, 6, 16)" not in str(e):
            said.append(f"'same shape' not in {e}")
    try:
        ring_attention(x[:, :, :4], x[:, :, :4], x[:, :, :4], is_causal="no")
        said.append("no error for is_causal='no'")
    except TypeError as e:
        if "bool" not in str(e):
            said.append(f"'bool' not in {e}")
    w = torch.randn(1, 2, 4, 16, requires_grad=True)        # a second derivative: refused, not silently wrong
    try:
        torch.autograd.grad(ring_attention(w, w, w, is_causal=True).pow(2).sum(), w, create_graph=True)
        said.append("no error for create_graph=True")
    except RuntimeError as e:
        if "no second derivative" not in str(e):
            said.append(f"'no second derivative' not in {e}")
    y = torch.randn(1, 2, 4, 16)
    out = ring_attention(y, y, y, causal=True)              # the alias; no LSE unless asked
    if not (isinstance(out, torch.Tensor) and out.shape == y.shape):
        said.append(f"ring_attention without return_lse returned {type(out).__name__}")
    return said


def _case(**kw):
    c = dict(B=1, H=2, Hkv=2, N=32, D=16, layout="zigzag", causal=True, dtype=torch.float32, large=False, seed=0)
    c.update(kw)
    return c


@on_cpu_processes
def test_ring_two_ranks_both_layouts_causal_and_not_fwd_bwd():
    from flashlab.distributed.local import run_local
    cases = [_case(layout=lay, causal=cau, seed=i) for i, (lay, cau) in
             enumerate([(a, b) for a in LAYOUTS for b in (False, True)])]
    cases += [_case(H=4, Hkv=2, N=44, D=24, seed=7, strided=True),   # GQA, ragged 11-row chunks, D padded, strides
              _case(B=2, layout="contiguous", N=36, large=True, seed=8),          # |S| in the hundreds
              _case(dtype=torch.float16, N=40, seed=9)]
    outs = run_local(lambda r, w: _ring_cases(r, w, cases) + _errors_on_rank(r, w), 2, timeout=240)
    bad = [m for o in outs for m in o]
    assert not bad, "\n".join(bad)


@on_cpu_processes
def test_ring_four_ranks():
    from flashlab.distributed.local import run_local
    cases = [_case(N=64, seed=11), _case(N=48, layout="contiguous", causal=True, H=2, Hkv=1, seed=12)]
    outs = run_local(lambda r, w: _ring_cases(r, w, cases) + _two_rings(r, w), 4, timeout=240)
    bad = [m for o in outs for m in o]
    assert not bad, "\n".join(bad)


def _two_rings(rank, world):
    """Ranks {0, 1} and {2, 3} as two process groups, each running its own ring (peers are named by
    their global rank in the P2P calls: this checks the translation)."""
    import torch.distributed as dist
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    return _ring_cases(dist.get_rank(mine), 2, [_case(N=24, seed=13 + rank // 2, layout="zigzag")], group=mine)


def test_ring_without_a_process_group_says_so():
    import torch.distributed as dist
    from flashlab.distributed import ring_attention
    assert not dist.is_initialized()
    x = torch.randn(1, 1, 4, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(x, x, x)


@on_cpu_processes
def test_a_hung_rank_is_stopped():
    from flashlab.distributed.local import run_local

    def hang(rank, world):
        import torch.distributed as dist
        import time
        if rank == 0:
            dist.recv(torch.zeros(1), src=1)      # rank 1 never sends
        time.sleep(60)
        return rank
    with pytest.raises(TimeoutError, match="did not finish"):
        run_local(hang, 2, timeout=4)


# ----------------------------------------------------------------------------
# notebook 09's graded exercises (flashlab/grader/exercises/beyond.py)
# ----------------------------------------------------------------------------

def _beyond():
    from flashlab.grader.exercises import beyond
    return beyond


def _right(name):
    def merge(o_parts, lse_parts):
        mx = lse_parts.max(0)
        ms = np.where(np.isneginf(mx), 0, mx)
        w = np.exp(lse_parts - ms)
        t = w.sum(0)
        safe = np.where(t > 0, t, 1.0)                      # a row no split saw: O = 0, LSE = -inf
        return ((w[..., None] * np.where(w[..., None] > 0, o_parts, 0)).sum(0) / safe[:, None],
                np.where(t > 0, ms + np.log(safe), -np.inf))

    def zz(rank, world, n):
        c = n // (2 * world)
        return np.r_[rank * c:(rank + 1) * c, (2 * world - 1 - rank) * c:(2 * world - rank) * c]

    def step(q, k, v, qp, kp, o, lse, causal):
        s = q @ k.T / math.sqrt(q.shape[1])
        if causal:
            s = np.where(kp[None] <= qp[:, None], s, -np.inf)
        mb = s.max(1)
        mbs = np.where(np.isneginf(mb), 0, mb)
        p = np.exp(s - mbs[:, None])
        l = p.sum(1)
        lb = np.where(l > 0, mbs + np.log(np.where(l > 0, l, 1)), -np.inf)
        ob = p @ v / np.where(l > 0, l, 1)[:, None]
        return merge(np.stack([o, ob]), np.stack([lse, lb]))
    return {"merge_partials": merge, "zigzag_indices": zz, "ring_step": step}[name]


def _as_candidate(name, bug):
    """A learner's function that makes exactly this mistake (the bug's outputs, case by case)."""
    from flashlab.grader.core import Case
    if name == "zigzag_indices":
        return lambda rank, world, n: bug.outputs(Case({"world": world, "N": n}, {}))["indices"][rank].astype(int)
    if name == "merge_partials":
        def merge(o, lse):
            out = bug.outputs(Case({}, {"o_parts": o, "lse_parts": lse}))
            return out["o"], out["lse"]
        return merge

    def step(q, k, v, qp, kp, o, lse, causal):
        out = bug.outputs(Case({"causal": causal}, dict(q=q, k=k, v=v, q_pos=qp, k_pos=kp, o=o, lse=lse)))
        return out["o"], out["lse"]
    return step


@pytest.mark.parametrize("name", ["merge_partials", "zigzag_indices", "ring_step"])
def test_beyond_exercises_pass_right_answers_and_name_each_mistake(name, monkeypatch):
    import contextlib
    from flashlab.grader.core import grade
    from flashlab.grader.exercises import EXERCISES
    mod = _beyond()
    ex = EXERCISES[name]
    assert ex.module.endswith("beyond") and ex.notebook == "09" and not ex.needs_triton
    with np.errstate(all="ignore"):
        r = grade(ex, _right(name))
    assert r.passed, str(r)
    assert len(r.cases) >= 6 and sum(c.label.startswith("hidden") for c in r.cases) >= 5
    stub = grade(ex, lambda *a: (_ for _ in ()).throw(NotImplementedError()))
    assert [c.status for c in stub.cases] == ["not implemented"]
    cheat = grade(ex, lambda *a: getattr(R, name, None)(*a) if hasattr(R, name) else
                  positions(a[0], a[1], a[2], "zigzag"))
    assert not cheat.passed, "calling the reference must not pass"
    monkeypatch.setattr(mod, "_watch", lambda found: contextlib.nullcontext())   # the bugs call references
    for bug in ex.bugs:
        with np.errstate(all="ignore"):
            r = grade(ex, _as_candidate(name, bug))
        text = str(r)
        assert not r.passed, f"{bug.key} passes"
        assert bug.title in text, f"{bug.key} not named:\n{text}"


# ----------------------------------------------------------------------------
# the cost model and the figures
# ----------------------------------------------------------------------------

def test_overlap_rows_is_where_transfer_equals_compute():
    from flashlab.distributed import cost as C
    for bw in (C.H200_NODE.nvlink, C.H200_NODE.ib):
        for causal in (False, True):
            for H, Hkv in ((32, 32), (32, 8)):
                n = C.overlap_rows(bw, C.H200_NODE.flops, H, Hkv, 2, causal)
                tc, tm, _, _ = C.ring_step(n, 3, H, Hkv, 64, 2, causal, bw, C.H200_NODE.flops)   # B, D cancel
                assert tc == pytest.approx(tm, rel=1e-12)
                tc2, tm2, _, _ = C.ring_step(2 * n, 3, H, Hkv, 64, 2, causal, bw, C.H200_NODE.flops)
                assert tc2 > tm2                                   # past n*, compute hides the transfer
    assert C.overlap_rows(C.H200_NODE.nvlink, causal=True) == pytest.approx(400e12 * 2 / (2 * 0.5 * 450e9))


def test_cost_model_limits():
    from flashlab.distributed import cost as C
    s = C.scaling(1 << 20)
    assert all(u is None for W, u in zip(s["W"], s["ulysses"]) if W > 32)        # W > H: no head per rank
    assert all(u is not None for W, u in zip(s["W"], s["ulysses"]) if W <= 32)
    ratio = [r / i for r, i in zip(s["ring"], s["ideal"])]
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] > 2.0                   # comm-bound at 1024 GPUs


def test_figures_are_figures():
    from matplotlib.figure import Figure
    from flashlab.distributed import figures as F
    figs = [F.fig_programs_vs_sms(), F.fig_split_merge(), F.fig_block_table([[2, 0], [1, 3]], [20, 9], 16),
            F.fig_ring_schedule(3, "zigzag"), F.fig_ring_schedule(2, "contiguous", causal=False),
            F.fig_overlap(measured={1024: 1e-4}), F.fig_cost_model(seqlens=(65536,))]
    assert all(isinstance(f, Figure) and f.axes for f in figs)


# ----------------------------------------------------------------------------
# on GPUs
# ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_simulated_on_a_gpu_bf16(layout):
    import flashlab
    from flashlab.accuracy import judge, reference_outputs
    from flashlab.distributed import simulate_ring
    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, 8, 2048, 128, generator=g).cuda()
    k, v = (torch.randn(2, 2, 2048, 128, generator=g).cuda() for _ in range(2))
    qc, kc, vc = (t.bfloat16() for t in (q, k, v))
    o, lse = simulate_ring(qc, kc, vc, 4, True, layout=layout)
    ke, ve = (t.repeat_interleave(4, 1) for t in (k, v))
    do = torch.randn_like(q)
    ref = reference_outputs(q, ke, ve, do, True)
    same = reference_outputs(q, ke, ve, do, True, dtype=torch.bfloat16)
    chk = judge("o", o, same[0], ref[0], torch.bfloat16)
    assert chk.ok, chk
    op = flashlab.flash_attention(qc, kc.repeat_interleave(4, 1), vc.repeat_interleave(4, 1), True)
    assert (o.float() - op.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a NCCL ring needs two GPUs")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_nccl_two_gpus(layout):
    from flashlab.distributed.local import ring_check, run_local
    import functools
    outs = run_local(functools.partial(ring_check, B=2, H=8, H_kv=2, N=4096, D=128, layout=layout), 2,
                     backend="nccl", timeout=300)
    for o in outs:                      # fp16 against the single-process op
        assert o["o"] < 5e-3 and o["lse"] < 5e-3, o
        assert max(o["dq"], o["dk"], o["dv"]) < 5e-2, o


def test_next_block_is_in_flight_while_a_step_computes(monkeypatch):
    """The order of events in the forward and the backward, with a recording stand-in for the ring:
    the transfer of the next block is posted before the step's kernels and waited for after them; in
    the backward the dK/dV accumulator of the step before is waited for only after this step's kernels."""
    import flashlab.attention as A
    from flashlab.distributed import ring as RG
    events = []

    class Req:
        def __init__(self, tag):
            self.tag = tag

        def wait(self):
            events.append(("wait", self.tag))

    class FakeRing:
        rank, world = 1, 3

        def pass_on(self, tensors):
            tag = "dkv" if tensors[0].dtype == torch.float32 else "kv"     # accumulators are float32
            events.append(("post", tag))
            return [t.clone() for t in tensors], [Req(tag)]

    fwd, bwd = A._forward, A._backward
    monkeypatch.setattr(A, "_forward", lambda *a: (events.append(("fwd", None)), fwd(*a))[1])
    monkeypatch.setattr(A, "_backward", lambda *a: (events.append(("bwd", None)), bwd(*a))[1])
    q, k, v = (torch.randn(1, 1, 8, 16, dtype=torch.float16, device=device.DEVICE) for _ in range(3))
    o, lse = RG._ring_forward(q, k, v, False, 0.25, False, FakeRing(), "zigzag")
    assert events == [("post", "kv"), ("fwd", None), ("wait", "kv")] * 2 + [("fwd", None)], events
    events.clear()
    RG._ring_backward(q, k, v, o, lse, torch.randn_like(q), False, 0.25, False, FakeRing(), "zigzag")
    kinds = [e[0] + (":" + e[1] if e[1] else "") for e in events]
    assert kinds == ["post:kv", "bwd", "post:dkv", "wait:kv",
                     "post:kv", "bwd", "wait:dkv", "post:dkv", "wait:kv",
                     "bwd", "wait:dkv", "post:dkv", "wait:dkv"], kinds
