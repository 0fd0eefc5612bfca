"""Decoding against a KV cache: ``flashlab.flash_decode``, split-KV (flash-decoding) in Triton.

    o = flash_decode(q, k_cache, v_cache, cache_seqlens)                       # contiguous cache
    o = flash_decode(q, k_pages, v_pages, cache_seqlens, block_table=table)    # paged cache (vLLM)
    o, lse = flash_decode(q, k_cache, v_cache, lens, is_causal=True, return_lse=True)

Shapes:
  * q (B, H, Nq, D): the Nq >= 1 newest query rows of each sequence (Nq > 1: speculative decoding);
  * a contiguous cache k_cache, v_cache (B, H_kv, N_max, D), or a paged one (num_blocks, H_kv,
    block_size, D) with ``block_table`` (B, max_blocks) int32: logical block m of sequence b is
    physical block block_table[b, m];
  * ``cache_seqlens`` (B,) int32: valid keys per sequence (None: the whole capacity, N_max or
    max_blocks * block_size).

Positions are bottom-right, as flash-attn's ``flash_attn_with_kvcache``: query row t of sequence b
sits at position cache_seqlens[b] - Nq + t; ``is_causal`` and ``window=(left, right)`` (-1:
unbounded) are relative to it.  GQA/MQA follow the cache's head count (H % H_kv == 0).

What is checked where (nothing here synchronises with the GPU, so a call can be captured in a
CUDA graph):
  * on the host: types, dtypes, ranks, shapes, devices, head counts, block_table's dtype and
    shape, scale / softcap / window / num_splits values (once per combination of shapes, dtypes and
    options, whose launch plan is then looked up: a decode step is short enough that the host's
    work shows), and requires_grad on every call;
  * on the host, only when the tensors are on the CPU (reading them costs no sync there): that
    0 <= cache_seqlens <= capacity and that the block-table entries a sequence uses lie in
    [0, num_blocks);
  * on the GPU the kernel clamps instead: a length is clamped into [0, capacity] and a table entry
    into [0, num_blocks - 1], so a bad value gives a wrong answer for that sequence, never a read
    outside the cache.
"""
from __future__ import annotations

import functools
import math

import torch

from . import device
from .kernels.decode import decode_merge_kernel, decode_split_kernel
from .kernels.tiles import launch_cached

__all__ = ["flash_decode", "choose_num_splits", "decode_config", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 128          # beyond this the merge reads more partial state than it saves
MIN_TILES_PER_SPLIT = 4   # a split of fewer tiles spends more on its start and its partial state than on keys


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ------------------------------------------------------------------------------------------------ checks

def _check(q, k_cache, v_cache, cache_seqlens, block_table, scale, softcap, window, num_splits, is_causal=False):
    """Raise a ValueError/TypeError naming the argument and the fix; return the problem's sizes."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "(B, H, Nq, D)" if name == "q" else "(B, H_kv, N_max, D) or, paged, (num_blocks, H_kv, block_size, D)"
            raise ValueError(f"{name} must have 4 dimensions {want}, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use torch.float16, torch.bfloat16 or torch.float32")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache, v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}; "
                        f"convert with .to(q.dtype)")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache, v_cache must be on one device, got {q.device}, {k_cache.device}, {v_cache.device}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {q.device}; use a CUDA GPU or the CPU (interpreter)")
    if q.device.type == "cpu" and not device.INTERPRET:
        raise ValueError("q is on the CPU but Triton is compiling for the GPU; move the inputs with .cuda() "
                         "(or set TRITON_INTERPRET=1 before importing flashlab to use the interpreter)")
    if q.device.type == "cuda" and device.INTERPRET:
        raise ValueError("the inputs are on the GPU but Triton runs in the interpreter (TRITON_INTERPRET=1); "
                         "move them with .cpu() or unset TRITON_INTERPRET")
    if q.dtype == torch.bfloat16 and q.device.type == "cuda" and not device.bf16_supported():
        raise TypeError(f"bf16 kernels need compute capability 8.0 or newer; this GPU, "
                        f"{torch.cuda.get_device_name(q.device)}, has fp16: use torch.float16")
    B, H, Nq, D = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if min(q.shape) == 0 or min(k_cache.shape) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}; every dimension must be >= 1")
    n0, H_kv, n2, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"q and the cache must have the same head dim (dim 3): q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} is not supported; use D <= {MAX_HEAD_DIM} (64 and 128 are the fast paths)")
    if H % H_kv:
        raise ValueError(f"the query heads (q.shape[1] = {H}) must be a multiple of the cache's heads "
                         f"(k_cache.shape[1] = {H_kv}) for GQA/MQA; repeat or regroup the heads so H % H_kv == 0")

    if block_table is None:
        if n0 != B:
            raise ValueError(f"a contiguous cache must be (B, H_kv, N_max, D) with B = q.shape[0] = {B}, got "
                             f"k_cache {tuple(k_cache.shape)}; for a paged cache pass block_table=")
        capacity, page = n2, 0
    else:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor (B, max_blocks) int32, got {type(block_table).__name__}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table has dtype {block_table.dtype}; it must be torch.int32: "
                            f"pass block_table.to(torch.int32)")
        if block_table.dim() != 2 or block_table.shape[0] != B or block_table.shape[1] == 0:
            raise ValueError(f"block_table must be (B, max_blocks) = ({B}, >= 1), got shape {tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q on {q.device}; move it with .to(q.device)")
        capacity, page = block_table.shape[1] * n2, n2

    if cache_seqlens is not None:
        if not isinstance(cache_seqlens, torch.Tensor):
            raise TypeError(f"cache_seqlens must be a torch.Tensor (B,) int32 or None, got {type(cache_seqlens).__name__}")
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens has dtype {cache_seqlens.dtype}; it must be torch.int32: "
                            f"pass cache_seqlens.to(torch.int32)")
        if cache_seqlens.shape != (B,):
            raise ValueError(f"cache_seqlens must have shape (B,) = ({B},), got {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q on {q.device}; "
                             f"move it with .to(q.device)")
    if scale is not None and (isinstance(scale, bool) or not (isinstance(scale, (int, float)) and math.isfinite(scale)
                                                               and scale > 0)):
        raise ValueError(f"scale must be a positive finite number or None (1/sqrt(D)), got {scale!r}")
    if softcap is not None and (isinstance(softcap, bool) or not (isinstance(softcap, (int, float))
                                                                  and math.isfinite(softcap) and softcap > 0)):
        raise ValueError(f"softcap must be a positive finite number or None (no capping), got {softcap!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if window is not None:
        ok = (isinstance(window, (tuple, list)) and len(window) == 2
              and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window))
        if not ok:
            raise ValueError(f"window must be None or (left, right), two ints >= -1 (-1: unbounded), got {window!r}")
    if num_splits is not None and not (isinstance(num_splits, int) and not isinstance(num_splits, bool)
                                       and num_splits >= 1):
        raise ValueError(f"num_splits must be None (automatic) or an int >= 1, got {num_splits!r}")
    return B, H, Nq, D, H_kv, capacity, page


def _check_grad(q, k_cache, v_cache):
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        raise RuntimeError("flash_decode is for inference and has no autograd (no backward): call it under "
                           "torch.no_grad() or torch.inference_mode(), or pass tensors detached with .detach(); "
                           "for training use flashlab.flash_attention")


def _check_values_on_cpu(cache_seqlens, block_table, capacity, page, n_blocks, B):
    """The checks that read tensor values: done only for CPU tensors, where reading costs no sync."""
    if cache_seqlens is not None:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi > capacity:
            what = "N_max = k_cache.shape[2]" if block_table is None else "max_blocks * block_size"
            raise ValueError(f"cache_seqlens must lie in [0, {capacity}] ({what}), got values in [{lo}, {hi}]")
    if block_table is not None:
        lens = cache_seqlens.long() if cache_seqlens is not None else torch.full((B,), capacity, dtype=torch.long)
        used = torch.arange(block_table.shape[1])[None, :] < ((lens + page - 1) // page)[:, None]
        vals = block_table[used]
        if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= n_blocks):
            raise ValueError(f"block_table holds physical block numbers outside [0, num_blocks = {n_blocks}) in the "
                             f"blocks the sequences use (got [{int(vals.min())}, {int(vals.max())}])")


# ------------------------------------------------------------------------------------------------ configs

@functools.lru_cache(maxsize=None)
def _sm_count(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def decode_config(head_dim: int, dtype: torch.dtype, rows: int) -> dict:
    """Tile sizes and launch parameters of the split kernel: BLOCK_N (keys per tile), num_warps, num_stages.

    The split kernel moves K/V bytes and does almost no arithmetic, so what matters is many bytes in
    flight.  At D = 128 in bf16, 64-key tiles and num_stages=3 (compiled for sm_90 with Triton 3.6):
    the contiguous kernel double-buffers K and V through asynchronous copies (70 KB of shared memory,
    ~90-100 registers: 3 programs per multiprocessor); the paged kernel's K/V loads wait on its
    block-table load, and the pipeliner gives them one buffer (38 KB, ~115-128 registers: 4 programs).
    On the H200 (2026-12-01, B 8, H_kv 8, 32k keys) 128-key tiles or 4 stages timed the same as this
    (within 1 %), 32-key tiles 9 % slower.
    """
    if device.INTERPRET:
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    d = _next_pow2(max(16, head_dim))
    if dtype == torch.float32 or d > 128:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=64, num_warps=4 if rows <= 64 else 8, num_stages=3)


def choose_num_splits(programs: int, n_tiles: int, sms: int, occupancy: int = 2) -> int:
    """How many splits of the keys: enough programs to fill every multiprocessor, in full waves.

    ``programs``: programs per split (B * H_kv * row blocks); ``n_tiles``: key tiles of the longest
    possible sequence; ``sms``: multiprocessors; ``occupancy``: programs one multiprocessor runs at once.
    Each candidate s gives waves = programs * s / (sms * occupancy); its efficiency is waves / ceil(waves)
    (the last wave's idle share).  Among the splits that leave each at least MIN_TILES_PER_SPLIT tiles,
    take the smallest whose efficiency is within 10 % of the best (fewer splits: less partial state to
    merge).  A batch that already fills the GPU gets one split (no merge at all).

    flash_decode passes occupancy 2 for a contiguous cache and 4 for a paged one, whose programs each
    keep one K/V tile in flight instead of two.  Both were chosen on the H200 by timing split counts at 128k
    keys (B 8, H_kv 8, D 128, bf16); that sweep's numbers are not in docs/BENCHMARKS.md, so re-time with
    ``flash_decode(..., num_splits=s)`` (scripts/bench_decode.py) before changing them.
    """
    slots = sms * occupancy
    if programs >= slots:
        return 1
    s_max = max(1, min(MAX_SPLITS, n_tiles // MIN_TILES_PER_SPLIT))
    effs = []
    for s in range(1, s_max + 1):
        waves = programs * s / slots
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    for s, e in enumerate(effs, start=1):
        if e >= 0.9 * best:
            return s
    return 1  # pragma: no cover


# ------------------------------------------------------------------------------------------------ the op

def flash_decode(q, k_cache, v_cache, cache_seqlens=None, *, block_table=None, is_causal: bool = False,
                 scale: float | None = None, softcap: float | None = None, window=None,
                 num_splits: int | None = None, return_lse: bool = False):
    """Attention of a few new query rows against a KV cache, split over the keys (flash-decoding).

    Args:
        q: (B, H, Nq, D), Nq >= 1.  fp16, bf16 or fp32; any strides.
        k_cache, v_cache: contiguous (B, H_kv, N_max, D), or paged (num_blocks, H_kv, block_size, D)
            with ``block_table``.  H % H_kv == 0 (GQA, MQA).  Any strides.
        cache_seqlens: (B,) int32, valid keys per sequence; None: the whole capacity.
        block_table: (B, max_blocks) int32; logical block m of sequence b is physical block
            block_table[b, m] (vLLM's page table).  Entries past a sequence's length are not read.
        is_causal: query row t (at position cache_seqlens[b] - Nq + t) sees keys j <= its position.
        scale: softmax scale, default 1/sqrt(D).
        softcap: scores s become softcap * tanh(s / softcap) after scaling (Gemma 2's soft capping).
        window: (left, right): row at position p sees keys p - left <= j <= p + right; -1 is unbounded.
        num_splits: how many stretches the keys of each sequence are cut into; None chooses by
            B * H_kv, the cache length and the multiprocessor count.  Any value gives the same result
            within rounding; values above the number of key tiles leave splits empty (harmless).
        return_lse: also return the log-sum-exp (B, H, Nq), float32, natural log.

    Returns:
        o (B, H, Nq, D) in q's dtype, or (o, lse).  A row that sees no key gets o = 0 and lse = -inf.

    Inference only: no autograd; an input that requires grad while grad mode is on is refused
    (RuntimeError), so run it under torch.no_grad() or torch.inference_mode().  No host
    synchronisation and no allocation whose size depends on tensor *values*, so a call can be
    captured in a CUDA graph (after one warm-up call compiles it).  With is_causal and a window,
    the window's right bound becomes min(right, 0).
    """
    return _decode(q, k_cache, v_cache, cache_seqlens, block_table, is_causal, scale, softcap, window,
                   num_splits, return_lse)


_PLANS: dict = {}   # launch plans by everything the checks and the tiling depend on (shapes, dtypes, options)


def _typed(x):
    return type(x), x


def _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, is_causal, scale, softcap, window, num_splits,
              return_lse, config):
    """The cache key of a call, or None when an argument is not what a plan can describe (the checks say why)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        return None
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        return None
    if block_table is not None and not isinstance(block_table, torch.Tensor):
        return None
    try:
        return (q.shape, q.dtype, q.device, k_cache.shape, k_cache.dtype, k_cache.device, v_cache.shape, v_cache.dtype,
                v_cache.device,
                None if cache_seqlens is None else (cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device),
                None if block_table is None else (block_table.shape, block_table.dtype, block_table.device),
                # each option with its type: True == 1 == 1.0 hash alike, and a plan made for 1 would skip the
                # checks that refuse True
                _typed(is_causal), _typed(scale), _typed(softcap),
                None if window is None else (type(window), *map(_typed, window)), _typed(num_splits),
                bool(return_lse), None if config is None else tuple(sorted(config.items())))
    except TypeError:   # an unhashable option (a list window, say): no cache, the checks still run
        return None


def _make_plan(q, k_cache, v_cache, cache_seqlens, block_table, is_causal, scale, softcap, window, num_splits,
               return_lse, config):
    """Check the call's shapes and options, then work out everything the launches need but the tensors' addresses."""
    B, H, Nq, D, H_kv, capacity, page = _check(q, k_cache, v_cache, cache_seqlens, block_table,
                                               scale, softcap, window, num_splits, is_causal)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # bounds past 2**30 (positions never reach them) as 2**30: near 2**31 they would wrap the kernel's int32 sums
    left, right = (-1, -1) if window is None else (min(int(window[0]), 1 << 30), min(int(window[1]), 1 << 30))
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    upcast = q.dtype == torch.bfloat16 and device.INTERPRET     # the interpreter's bf16 tl.dot is wrong
    cdt = torch.float32 if upcast else q.dtype

    G = H // H_kv
    rows = G * Nq
    block_d = _next_pow2(max(16, D))
    max_rows = 128 if block_d <= 128 else 64
    block_m = min(max(16, _next_pow2(rows)), max_rows)
    n_row_blocks = -(-rows // block_m)
    cfg = dict(config or decode_config(D, cdt, block_m))
    block_n = cfg.pop("BLOCK_N")
    paged = block_table is not None

    span = capacity if left < 0 else min(capacity, left + Nq + block_n)   # keys one sequence can need
    n_tiles = -(-span // block_n)
    programs = B * H_kv * n_row_blocks
    if num_splits is None:
        sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
            if q.device.type == "cuda" else 4
        # the paged kernel keeps one K/V tile in flight per program (its loads wait on the block table), the
        # contiguous one two: the paged one needs twice the programs for as many bytes in flight
        num_splits = choose_num_splits(programs, n_tiles, sms, occupancy=4 if paged else 2)
    S = int(num_splits)
    if programs * S >= 2**31:
        raise ValueError(f"{programs * S} programs exceed the grid limit 2^31 - 1; use fewer num_splits or split the batch")
    n_rows = B * H * Nq
    consts = dict(PAGED=paged, PAGE=max(page, 1), HAS_SEQLENS=cache_seqlens is not None,
                  HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap is not None,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HEAD_DIM=D, DOT_PRECISION="ieee", **cfg)
    ints = (H_kv, G, Nq, capacity, k_cache.shape[0], S, n_row_blocks, n_rows * S * D if S > 1 else 0,
            scale, float(softcap) if softcap is not None else 1.0, left, right)
    merge = dict(BLOCK_S=_next_pow2(S), BLOCK_D=block_d, HEAD_DIM=D, num_warps=4 if S * block_d <= 8192 else 8)
    return dict(B=B, H=H, Nq=Nq, D=D, S=S, capacity=capacity, page=page, upcast=upcast, grid=(programs * S,),
                n_rows=n_rows, ints=ints, consts=consts, merge=merge, n_blocks=k_cache.shape[0],
                runners={}, merge_runners={})


def _decode(q, k_cache, v_cache, cache_seqlens, block_table, is_causal, scale, softcap, window, num_splits,
            return_lse, config=None):
    """flash_decode's body; ``config`` (a decode_config dict) forces the tile sizes (scripts/bench_decode.py).

    A decode step takes tens of microseconds on a GPU, so the host's work per call is kept small: the
    checks and the tiling are worked out once per combination of shapes, dtypes and options (a plan) and
    looked up after that; each call then only allocates the outputs and launches.
    """
    key = _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, is_causal, scale, softcap, window,
                    num_splits, return_lse, config)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _make_plan(q, k_cache, v_cache, cache_seqlens, block_table, is_causal, scale, softcap, window,
                          num_splits, return_lse, config)
        if key is not None:
            if len(_PLANS) > 512:
                _PLANS.clear()
            _PLANS[key] = plan
    _check_grad(q, k_cache, v_cache)
    if q.device.type == "cpu":
        _check_values_on_cpu(cache_seqlens, block_table, plan["capacity"], plan["page"], plan["n_blocks"], plan["B"])

    out_dtype = q.dtype
    if plan["upcast"]:
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    B, H, Nq, D, S = plan["B"], plan["H"], plan["Nq"], plan["D"], plan["S"]
    dev = q.device
    o = torch.empty((B, H, Nq, D), device=dev, dtype=q.dtype)
    lse = torch.empty((B, H, Nq), device=dev, dtype=torch.float32) if return_lse else o
    ws = torch.empty(plan["n_rows"] * S * (D + 1), device=dev, dtype=torch.float32) if S > 1 else None

    paged = block_table is not None
    bt = block_table if paged else o                  # any tensor: not read when not paged
    # the kernel reads entry b at offset b: a strided view (lens[:, 0]) is copied (contiguous() is free otherwise)
    seq = cache_seqlens.contiguous() if cache_seqlens is not None else o
    bts = block_table.stride() if paged else (0, 0)
    ptrs = (q, k_cache, v_cache, bt, seq, o if S == 1 else ws, lse if S == 1 else ws)
    strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *bts)
    # after the first call of a layout, the compiled kernels' runners (a decode step is tens of microseconds:
    # JITFunction's per-call binding would be a third of it); the key is what Triton specialises on here
    key = (strides, tuple(t.data_ptr() & 15 for t in ptrs))
    launch_cached(decode_split_kernel, plan["grid"], (*ptrs, *strides, *plan["ints"]),
                  dict(plan["consts"], STORE_LSE=return_lse or S > 1), plan["runners"], key)
    if S > 1:
        launch_cached(decode_merge_kernel, (plan["n_rows"],), (ws, o, lse, plan["ints"][7], S),
                      dict(plan["merge"], STORE_LSE=return_lse), plan["merge_runners"],
                      tuple(t.data_ptr() & 15 for t in (ws, o, lse)))
    if o.dtype != out_dtype:   # bf16 computed in fp32 by the interpreter
        o = o.to(out_dtype)
    return (o, lse) if return_lse else o
