"""flashlab.flash_decode (split-KV decoding, contiguous and paged caches) against a float64 reference.

The reference is flashlab.reference.decode_reference (torch, one sequence at a time, paged caches
gathered block by block); the accuracy rule is flashlab.accuracy's: our error against float64 at
most twice PyTorch's own error in the same dtype, plus a floor.  Runs in the interpreter on the
CPU (small sizes) and compiled on a GPU; the CUDA-graph test needs a GPU.
"""
import pytest
import torch

from flashlab import device, flash_decode
from flashlab.accuracy import judge
from flashlab.decode import choose_num_splits
from flashlab.reference import decode_reference

DEV = device.DEVICE


def _rand(shape, dtype, mag=1.0):
    return (mag * torch.randn(shape, device=DEV, dtype=torch.float32)).to(dtype)


def _paged(k, v, block_size, extra_blocks=3):
    """Scatter contiguous (B, H_kv, N, D) caches into a shuffled pool of blocks; return (k_pool, v_pool, table)."""
    B, H_kv, N, D = k.shape
    nb = -(-N // block_size)
    pad = nb * block_size - N
    if pad:
        k = torch.cat([k, torch.randn(B, H_kv, pad, D, device=k.device).to(k.dtype)], dim=2)
        v = torch.cat([v, torch.randn(B, H_kv, pad, D, device=v.device).to(v.dtype)], dim=2)
    n_pool = B * nb + extra_blocks
    perm = torch.randperm(n_pool)[:B * nb].view(B, nb)                   # shuffled physical blocks
    k_pool = torch.randn(n_pool, H_kv, block_size, D, device=k.device).to(k.dtype)   # garbage elsewhere
    v_pool = torch.randn(n_pool, H_kv, block_size, D, device=k.device).to(k.dtype)
    kb = k.view(B, H_kv, nb, block_size, D).permute(0, 2, 1, 3, 4)        # (B, nb, H_kv, bs, D)
    vb = v.view(B, H_kv, nb, block_size, D).permute(0, 2, 1, 3, 4)
    k_pool[perm.reshape(-1)] = kb.reshape(-1, H_kv, block_size, D)
    v_pool[perm.reshape(-1)] = vb.reshape(-1, H_kv, block_size, D)
    return k_pool, v_pool, perm.to(torch.int32).to(k.device)


def _check(q, k, v, lens, *, block_table=None, label="", **kw):
    """Run flash_decode and judge o and lse against float64 by the accuracy rule."""
    o, lse = flash_decode(q, k, v, lens, block_table=block_table, return_lse=True, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype, (o.shape, o.dtype)
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    ref_kw = {key: val for key, val in kw.items() if key != "num_splits"}
    ro, rl = decode_reference(q, k, v, lens, block_table=block_table, **ref_kw)
    so, sl = decode_reference(q, k, v, lens, block_table=block_table, dtype=q.dtype, **ref_kw)
    o, lse = o.cpu(), lse.cpu()
    assert torch.isfinite(o).all(), f"{label}: non-finite output"
    c_o = judge("o", o, so, ro, q.dtype)
    empty = torch.isneginf(rl)
    assert torch.equal(torch.isneginf(lse), empty), f"{label}: -inf LSE where the reference has none, or the reverse"
    assert (o[empty] == 0).all(), f"{label}: a row that sees no key must give O = 0"
    keep = ~empty
    if keep.any():
        c_l = judge("lse", lse[keep], sl[keep], rl[keep], torch.float32)
    else:
        c_l = c_o
    assert c_o.ok and c_l.ok, f"{label}:\n{c_o}\n{c_l}"
    return o, lse


def _lens(B, N, gen):
    """Ragged lengths with 1 and the full capacity among them."""
    lens = torch.randint(1, N + 1, (B,), generator=gen)
    lens[0] = N
    if B > 1:
        lens[1] = 1
    return lens.to(torch.int32).to(DEV)


def _gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**31)))


# ------------------------------------------------------------------------------------------ contiguous

CONTIG = [
    # B, H, H_kv, Nq, N, D, dtype
    (3, 4, 1, 1, 70, 32, torch.float32),       # MQA, ragged
    (3, 8, 2, 2, 53, 64, torch.float16),       # GQA 4:1
    (2, 2, 2, 3, 40, 16, torch.float32),       # MHA, Nq 3
    (2, 4, 1, 4, 33, 40, torch.float16),       # MQA, Nq 4, D not a power of two
    (2, 4, 1, 1, 24, 128, torch.bfloat16),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,H_kv,Nq,N,D,dtype", CONTIG)
def test_contiguous(rng, B, H, H_kv, Nq, N, D, dtype, causal):
    gen = _gen(rng)
    q, k, v = _rand((B, H, Nq, D), dtype), _rand((B, H_kv, N, D), dtype), _rand((B, H_kv, N, D), dtype)
    lens = _lens(B, N, gen)
    _check(q, k, v, lens, is_causal=causal, num_splits=3, label=f"contiguous {B, H, H_kv, Nq, N, D} {dtype} {causal}")


def test_contiguous_no_seqlens_is_the_whole_cache(rng):
    q, k, v = _rand((2, 4, 2, 32), torch.float32), _rand((2, 2, 37, 32), torch.float32), _rand((2, 2, 37, 32), torch.float32)
    o = _check(q, k, v, None, is_causal=True, label="no cache_seqlens")[0]
    full = torch.full((2,), 37, dtype=torch.int32, device=DEV)
    assert torch.allclose(o, flash_decode(q, k, v, full, is_causal=True).cpu(), atol=1e-6)


# ------------------------------------------------------------------------------------------ paged

PAGED = [
    # B, H, H_kv, Nq, N, D, block_size, dtype
    (3, 8, 2, 1, 75, 32, 16, torch.float32),
    (3, 4, 1, 2, 70, 64, 32, torch.float16),
    (2, 4, 4, 4, 50, 16, 16, torch.float32),
    (2, 8, 2, 1, 64, 128, 32, torch.bfloat16),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,H_kv,Nq,N,D,bs,dtype", PAGED)
def test_paged(rng, B, H, H_kv, Nq, N, D, bs, dtype, causal):
    gen = _gen(rng)
    q, k, v = _rand((B, H, Nq, D), dtype), _rand((B, H_kv, N, D), dtype), _rand((B, H_kv, N, D), dtype)
    k_pool, v_pool, table = _paged(k, v, bs)
    lens = _lens(B, N, gen)
    o, lse = _check(q, k_pool, v_pool, lens, block_table=table, is_causal=causal, num_splits=2,
                    label=f"paged {B, H, H_kv, Nq, N, D, bs} {dtype} {causal}")
    # the same keys as a contiguous cache give the same answer
    o2, lse2 = flash_decode(q, k, v, lens, is_causal=causal, num_splits=2, return_lse=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(o.float(), o2.cpu().float(), atol=tol) and torch.allclose(lse, lse2.cpu(), atol=1e-4)


def test_paged_table_entries_past_the_length_are_not_read(rng):
    q, k, v = _rand((2, 4, 1, 32), torch.float32), _rand((2, 2, 64, 32), torch.float32), _rand((2, 2, 64, 32), torch.float32)
    k_pool, v_pool, table = _paged(k, v, 16)
    lens = torch.tensor([20, 33], dtype=torch.int32, device=DEV)
    table = table.clone()
    table[0, 2:] = -1        # vLLM pads unused entries; they must never be read
    table[1, 3:] = 10**6
    _check(q, k_pool, v_pool, lens, block_table=table, label="padded block table")


# ------------------------------------------------------------------------------------------ options

@pytest.mark.parametrize("window,causal", [((8, -1), False), ((-1, 2), False), ((5, 0), False), ((0, 0), False),
                                           ((6, 3), True), ((-1, -1), True)])
@pytest.mark.parametrize("paged", [False, True])
def test_windows(rng, window, causal, paged):
    gen = _gen(rng)
    B, H, H_kv, Nq, N, D = 3, 4, 2, 3, 60, 32
    q, k, v = _rand((B, H, Nq, D), torch.float32), _rand((B, H_kv, N, D), torch.float32), _rand((B, H_kv, N, D), torch.float32)
    lens = _lens(B, N, gen)
    kw = dict(is_causal=causal, window=window, num_splits=3, label=f"window {window} causal {causal} paged {paged}")
    if paged:
        k, v, table = _paged(k, v, 16)
        _check(q, k, v, lens, block_table=table, **kw)
    else:
        _check(q, k, v, lens, **kw)


def test_strided_cache_seqlens():
    """cache_seqlens as a strided view (lens[:, 0]) is read entry by entry, not at the kernel's offsets (it read
    entry 1 of the storage, 99, for sequence 1)."""
    q, k, v = _rand((2, 2, 1, 16), torch.float32), _rand((2, 1, 40, 16), torch.float32), _rand((2, 1, 40, 16), torch.float32)
    lens = torch.tensor([[5, 99], [20, 99]], dtype=torch.int32, device=DEV)[:, 0]
    _check(q, k, v, lens, num_splits=1, label="strided cache_seqlens")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (4.4 GB of cache; the interpreter too slow)")
def test_gpu_cache_rows_past_int32_offsets():
    """A cache whose rows lie 2**22 elements apart (a (B, N, H_kv, D) cache seen transposed, at scale): row 520 x
    2**22 passes 2**31, so the rows are addressed in int64 (int32 offsets read outside the cache)."""
    N, step = 530, 2**22
    store = torch.zeros(N * step, device=DEV, dtype=torch.float16)
    store.view(N, step)[:, :16] = _rand((N, 16), torch.float16)
    kv = store.as_strided((1, 1, N, 16), (0, 0, step, 1))
    _check(_rand((1, 2, 1, 16), torch.float16), kv, kv, None, num_splits=1, label="rows 2**22 apart")
    del store, kv
    torch.cuda.empty_cache()


@pytest.mark.parametrize("call,words", [
    (dict(scale=True), "scale"), (dict(softcap=True), "softcap"), (dict(is_causal="no"), "bool")])
def test_options_refused_whatever_was_cached(call, words):
    """A plan is kept per kind of call; True == 1 == 1.0 hash alike, so the key holds each option's type too: a
    call with num_splits=1 or window=(1, 0) cached does not let True or 1.0 past the checks."""
    q, k = torch.randn(1, 1, 1, 16, device=DEV), torch.randn(1, 1, 16, 16, device=DEV)
    flash_decode(q, k, k, num_splits=1)
    flash_decode(q, k, k, window=(1, 0))
    for bad in (dict(num_splits=True), dict(window=(True, 0)), dict(window=(1.0, 0)), call):
        with pytest.raises((ValueError, TypeError), match=words if bad is call else "num_splits|window"):
            flash_decode(q, k, k, **bad)


@pytest.mark.parametrize("window", [(2**31 - 1, -1), (5, 2**31 - 1), (2**31 - 1, 2**31 - 1)])
def test_window_bounds_near_int32_max(rng, window):
    """A bound near 2**31 (INT32_MAX as "unbounded") is one past every key, not a wrap of the kernel's int32 sums."""
    gen = _gen(rng)
    B, H, H_kv, Nq, N, D = 2, 2, 1, 3, 40, 16
    q, k, v = _rand((B, H, Nq, D), torch.float32), _rand((B, H_kv, N, D), torch.float32), _rand((B, H_kv, N, D), torch.float32)
    _check(q, k, v, _lens(B, N, gen), window=window, num_splits=2, label=f"window {window}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap_and_large_logits(rng, dtype):
    gen = _gen(rng)
    B, H, H_kv, Nq, N, D = 2, 4, 1, 2, 45, 64
    q, k, v = _rand((B, H, Nq, D), dtype, 4.0), _rand((B, H_kv, N, D), dtype, 4.0), _rand((B, H_kv, N, D), dtype)
    lens = _lens(B, N, gen)
    _check(q, k, v, lens, softcap=10.0, is_causal=True, num_splits=2, label=f"softcap {dtype}")
    _check(q, k, v, lens, softcap=0.5, scale=0.3, label=f"softcap 0.5 {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_magnitude_logits(rng, dtype):
    """Scores in the hundreds: the online softmax must subtract the running max before exponentiating."""
    gen = _gen(rng)
    B, H, H_kv, Nq, N, D = 2, 4, 2, 2, 50, 32
    q, k, v = _rand((B, H, Nq, D), dtype, 10.0), _rand((B, H_kv, N, D), dtype, 10.0), _rand((B, H_kv, N, D), dtype)
    _check(q, k, v, _lens(B, N, gen), is_causal=True, num_splits=4, label=f"large logits {dtype}")


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40])
def test_any_num_splits_same_result(rng, num_splits):
    """1 split (no merge), a few, and more splits than key tiles (empty splits) agree with the reference."""
    gen = _gen(rng)
    B, H, H_kv, Nq, N, D = 2, 4, 1, 2, 70, 32
    q, k, v = _rand((B, H, Nq, D), torch.float32), _rand((B, H_kv, N, D), torch.float32), _rand((B, H_kv, N, D), torch.float32)
    lens = _lens(B, N, gen)
    o, lse = _check(q, k, v, lens, is_causal=True, num_splits=num_splits, label=f"num_splits {num_splits}")
    o1, lse1 = flash_decode(q, k, v, lens, is_causal=True, num_splits=1, return_lse=True)
    assert torch.allclose(o, o1.cpu(), atol=1e-5) and torch.allclose(lse, lse1.cpu(), atol=1e-5)


def test_automatic_num_splits(rng):
    q, k, v = _rand((1, 4, 1, 32), torch.float32), _rand((1, 1, 200, 32), torch.float32), _rand((1, 1, 200, 32), torch.float32)
    _check(q, k, v, torch.tensor([190], dtype=torch.int32, device=DEV), label="automatic splits")


def test_num_splits_heuristic():
    # a batch that fills the GPU gets no split; a single sequence gets many, each of several tiles
    assert choose_num_splits(programs=2000, n_tiles=2048, sms=132) == 1
    s = choose_num_splits(programs=8, n_tiles=2048, sms=132)
    assert 8 * s >= 0.8 * 132 and 2048 // s >= 4
    assert choose_num_splits(programs=8, n_tiles=3, sms=132) == 1      # too short to split
    assert choose_num_splits(programs=64, n_tiles=128, sms=132) * 64 <= 2 * 132 * 2
    # the H200 benchmark shape (B 8 x H_kv 8 programs, 128k keys in 64-key tiles): the splits measured best
    assert choose_num_splits(programs=64, n_tiles=2048, sms=132, occupancy=2) == 4     # contiguous
    assert choose_num_splits(programs=64, n_tiles=2048, sms=132, occupancy=4) == 8     # paged


def test_rows_that_see_no_key(rng):
    """Length 0, and causal rows before the first key: O = 0 and LSE = -inf, never NaN."""
    B, H, H_kv, Nq, N, D = 3, 2, 1, 4, 20, 16
    q, k, v = _rand((B, H, Nq, D), torch.float32), _rand((B, H_kv, N, D), torch.float32), _rand((B, H_kv, N, D), torch.float32)
    lens = torch.tensor([0, 2, 20], dtype=torch.int32, device=DEV)   # len 2 with Nq 4: rows 0 and 1 sit before key 0
    for s in (1, 3):
        o, lse = _check(q, k, v, lens, is_causal=True, num_splits=s, label=f"empty rows, {s} splits")
        assert torch.isneginf(lse[0]).all() and (o[0] == 0).all()
        assert torch.isneginf(lse[1, :, :2]).all() and torch.isfinite(lse[1, :, 2:]).all()


def test_strided_inputs(rng):
    """Views, not copies: q as (B, Nq, H, D).transpose(1, 2), the cache a slice of a larger buffer."""
    B, H, H_kv, Nq, N, D = 2, 4, 2, 2, 30, 32
    q = _rand((B, Nq, H, D), torch.float32).transpose(1, 2)
    big_k, big_v = _rand((B, N + 7, H_kv, D), torch.float32), _rand((B, N + 7, H_kv, D), torch.float32)
    k, v = big_k[:, :N].transpose(1, 2), big_v[:, :N].transpose(1, 2)
    lens = torch.tensor([30, 11], dtype=torch.int32, device=DEV)
    _check(q, k, v, lens, is_causal=True, num_splits=2, label="strided")


def test_no_grad_and_no_autograd():
    q, k, v = _rand((1, 2, 1, 16), torch.float32), _rand((1, 1, 8, 16), torch.float32), _rand((1, 1, 8, 16), torch.float32)
    with pytest.raises(RuntimeError, match="no autograd"):
        flash_decode(q.requires_grad_(), k, v)
    with torch.no_grad():
        o = flash_decode(q, k, v)
    assert not o.requires_grad


# ------------------------------------------------------------------------------------------ bad input

def test_bad_inputs():
    f32, i32 = torch.float32, torch.int32
    q, k, v = _rand((2, 4, 1, 16), f32), _rand((2, 2, 32, 16), f32), _rand((2, 2, 32, 16), f32)
    pool, table = _rand((6, 2, 16, 16), f32), torch.zeros((2, 2), dtype=i32, device=DEV)
    cases = [
        (TypeError, "torch.Tensor", lambda: flash_decode(q.tolist(), k, v)),
        (ValueError, "4 dimensions", lambda: flash_decode(q[0], k, v)),
        (ValueError, "4 dimensions", lambda: flash_decode(q, k[0], v[0])),
        (TypeError, "dtype", lambda: flash_decode(q.double(), k.double(), v.double())),
        (TypeError, "share one dtype", lambda: flash_decode(q.half(), k, v)),
        (ValueError, "multiple of the cache's heads", lambda: flash_decode(_rand((2, 3, 1, 16), f32), k, v)),
        (ValueError, "same shape", lambda: flash_decode(q, k, v[:, :, :16])),
        (ValueError, "head dim", lambda: flash_decode(q, k[..., :8], v[..., :8])),
        (ValueError, "contiguous cache", lambda: flash_decode(q, k[:1], v[:1])),
        (TypeError, "int32", lambda: flash_decode(q, k, v, torch.tensor([3, 4], device=DEV))),
        (ValueError, r"shape \(B,\)", lambda: flash_decode(q, k, v, torch.tensor([3], dtype=i32, device=DEV))),
        (ValueError, "cache_seqlens must lie", lambda: flash_decode(q, k, v, torch.tensor([3, 33], dtype=i32, device=DEV))),
        (ValueError, "cache_seqlens must lie", lambda: flash_decode(q, k, v, torch.tensor([-1, 3], dtype=i32, device=DEV))),
        (TypeError, "block_table has dtype", lambda: flash_decode(q, pool, pool, block_table=table.long())),
        (ValueError, "block_table must be", lambda: flash_decode(q, pool, pool, block_table=table[:1])),
        (ValueError, "cache_seqlens must lie",
         lambda: flash_decode(q, pool, pool, torch.tensor([3, 33], dtype=i32, device=DEV), block_table=table)),
        (ValueError, "outside", lambda: flash_decode(q, pool, pool, block_table=table + 6)),
        (ValueError, "window", lambda: flash_decode(q, k, v, window=(3,))),
        (ValueError, "window", lambda: flash_decode(q, k, v, window=(-2, 0))),
        (ValueError, "num_splits", lambda: flash_decode(q, k, v, num_splits=0)),
        (ValueError, "scale", lambda: flash_decode(q, k, v, scale=-1.0)),
        (ValueError, "softcap", lambda: flash_decode(q, k, v, softcap=0.0)),
        (ValueError, "empty", lambda: flash_decode(q[:, :, :0], k, v)),
    ]
    reads_values = ("cache_seqlens must lie", "outside")   # checked on the host only for CPU tensors (no sync)
    for exc, msg, call in cases:
        if DEV.type == "cuda" and msg in reads_values:
            call()             # on a GPU the kernel clamps instead (decode.py's docstring): no error, no bad read
            continue
        with pytest.raises(exc, match=msg):
            call()


# ------------------------------------------------------------------------------------------ GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_long_cache_accuracy(rng, paged):
    gen = _gen(rng)
    B, H, H_kv, Nq, N, D = 4, 16, 4, 2, 5000, 128
    dtype = torch.bfloat16
    q, k, v = _rand((B, H, Nq, D), dtype), _rand((B, H_kv, N, D), dtype), _rand((B, H_kv, N, D), dtype)
    lens = _lens(B, N, gen)
    if paged:
        k, v, table = _paged(k, v, 64)
        _check(q, k, v, lens, block_table=table, is_causal=True, label="gpu paged")
    else:
        _check(q, k, v, lens, is_causal=True, label="gpu contiguous")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(rng):
    """No host sync inside: the call captures in a CUDA graph, and replays follow new lengths and queries."""
    B, H, H_kv, Nq, N, D = 3, 8, 2, 1, 3000, 128
    dtype = torch.bfloat16
    q, k, v = _rand((B, H, Nq, D), dtype), _rand((B, H_kv, N, D), dtype), _rand((B, H_kv, N, D), dtype)
    k_pool, v_pool, table = _paged(k, v, 16)
    lens = torch.tensor([N, 1, 1234], dtype=torch.int32, device=DEV)
    for paged in (False, True):
        args = (q, k_pool, v_pool) if paged else (q, k, v)
        kw = dict(block_table=table) if paged else {}
        flash_decode(*args, lens, is_causal=True, **kw)             # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_static = flash_decode(*args, lens, is_causal=True, **kw)
        for new in ([17, N, 2999], [N, N, 5]):
            lens.copy_(torch.tensor(new, dtype=torch.int32))
            q.copy_(torch.randn_like(q))
            graph.replay()
            torch.cuda.synchronize()
            want = flash_decode(*args, lens, is_causal=True, **kw)
            assert torch.allclose(o_static.float(), want.float(), atol=2e-2), (paged, new)


@pytest.mark.gpu
def test_gpu_later_calls_launch_through_runners(rng):
    """After the first call of a layout, both kernels launch through their compiled runners (no
    JITFunction.run per call), on new tensors each time, and stay right; a new layout compiles again."""
    from flashlab.kernels import tiles
    gen = _gen(rng)
    B, H, H_kv, Nq, N, D = 2, 8, 2, 1, 4000, 128
    dtype = torch.bfloat16
    for i in range(3):
        q, k, v = _rand((B, H, Nq, D), dtype), _rand((B, H_kv, N, D), dtype), _rand((B, H_kv, N, D), dtype)
        lens = _lens(B, N, gen)
        before = dict(tiles.STATS)
        _check(q, k, v, lens, num_splits=4, label=f"call {i}")
        fast = tiles.STATS["fast"] - before["fast"]
        jit = tiles.STATS["jit"] - before["jit"]
        if i > 0:
            assert (fast, jit) == (2, 0), (i, fast, jit)     # split kernel and merge kernel
    kt = _rand((B, N, H_kv, D), dtype).transpose(1, 2)         # another layout: other strides
    before = dict(tiles.STATS)
    _check(q, kt, kt, lens, num_splits=4, label="transposed cache")
    assert tiles.STATS["jit"] - before["jit"] >= 1


def test_without_triton_says_so(tmp_path):
    """Where Triton is not installed (macOS, Windows), flash_decode raises TritonMissing, offering Colab."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["triton"] = None\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]))
    env.pop("TRITON_INTERPRET", None)
    code = ("import torch, flashlab\nfrom flashlab import device\nq = torch.randn(1, 1, 1, 16)\n"
            "try:\n    flashlab.flash_decode(q, q, q)\nexcept device.TritonMissing as e:\n    print('MISSING', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "MISSING" in r.stdout and "flashlab.flash_decode" in r.stdout and "Colab" in r.stdout, r.stdout
