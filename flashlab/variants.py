"""The attention variants behind ``flash_attention``'s SDPA-shaped arguments, and ``flash_attention_varlen``.

    o = flash_attention(q, k, v, is_causal=True, window=(1023, 0))            # sliding window 1024
    o = flash_attention(q, k, v, enable_gqa=True)                             # k, v with H / 4 heads
    o = flash_attention(q, k, v, attn_mask=pad[:, None, None, :])             # bool (B, 1, 1, Nk)
    o = flash_attention(q, k, v, softcap=30.0, alibi_slopes=slopes, dropout_p=0.1)
    o = flash_attention_varlen(q, k, v, cu, cu, max_len, max_len, is_causal=True)   # packed (total, H, D)

What the host side does (the kernels are forward v4 and backward v5, one constexpr branch per variant):
  * checks every argument; bad input is a ValueError/TypeError naming the argument and the fix;
  * GQA / MQA: k, v with H_kv heads, H % H_kv == 0; query head h reads K/V head h // (H / H_kv),
    and the backward sums dK, dV over a group in one program (no atomics, deterministic);
  * ``window=(left, right)``, -1 unbounded, top-left aligned like ``is_causal``: query i sees keys
    i - left ... i + right; ``is_causal`` with a window keeps right <= 0.  Tiles outside the band
    are never visited (forward and backward);
  * scores, in this order: scale, soft-cap ``c tanh(s / c)``, ALiBi ``s -= slope |i - j|``, additive
    mask; then the bool mask (True = attend), the band, and causal hide scores;
  * ``attn_mask`` broadcastable to (B, H, Nq, Nk), bool or float, read tile by tile through strides
    (0 on broadcast dims): never copied to an N x N buffer; it gets no gradient (an error if it asks);
  * ``dropout_p``: Philox in the kernels, keyed on (seed, batch, head, row, column), one byte per score
    (16 scores a Philox call), so p is applied in 1/256ths (``reference.dropout_rate(p)``, at least 1/256
    when p > 0; p = 0.1 drops 26/256) and kept values are scaled by 1 / (1 - that rate); ``seed=None``
    draws one from torch's default generator (``torch.manual_seed`` governs it, as in SDPA);
    the backward regenerates the mask;
  * a query row that sees no key gives O = 0, LSE = -inf and zero gradients, never NaN;
  * under ``torch.autocast``, as SDPA: query, key, value are cast to the autocast dtype, and so is O;
  * autograd: an ``autograd.Function`` in eager mode; while compiling, the custom operators
    ``torch.ops.flashlab.variant_forward`` / ``variant_backward`` (opaque nodes, so
    ``torch.compile(fullgraph=True)`` works; the seed is drawn inside the operator).
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import device

__all__ = ["attention", "flash_attention_varlen", "uses_variants", "dropout_mask"]

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------- checks

def _check_qkv(q, k, v, dims: int, layout: str) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must have {dims} dimensions {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use torch.float16, torch.bfloat16 or torch.float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key, value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
                        "convert with .to(query.dtype)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key, value must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "cpu" and not device.INTERPRET:
        raise ValueError("the inputs are on the CPU but Triton is compiling for the GPU; move them with .cuda() "
                         "(or set TRITON_INTERPRET=1 before importing flashlab to use the interpreter)")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {q.device}; use a CUDA GPU or the CPU (interpreter)")
    if q.dtype == torch.bfloat16 and q.device.type == "cuda" and not device.bf16_supported():
        raise TypeError(f"bf16 kernels need compute capability 8.0 or newer; this GPU, "
                        f"{torch.cuda.get_device_name(q.device)}, has fp16: use torch.float16")
    D = q.shape[-1]
    if k.shape[-1] != D or v.shape[-1] != D:
        raise ValueError(f"query, key, value must have the same head dim (last dim): query {tuple(q.shape)}, "
                         f"key {tuple(k.shape)}, value {tuple(v.shape)}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} is not supported; use 1 <= D <= {MAX_HEAD_DIM}")


def _check_heads(H: int, Hk: int, enable_gqa: bool) -> int:
    if Hk != H:
        if Hk == 0 or H % Hk:
            raise ValueError(f"query has {H} heads and key/value {Hk}: for grouped-query attention the "
                             f"query heads must be a multiple of the key/value heads (H % H_kv == 0)")
        if not enable_gqa:
            raise ValueError(f"query has {H} heads and key/value {Hk}: pass enable_gqa=True for grouped-query "
                             "(or multi-query) attention, as in F.scaled_dot_product_attention")
    return H // Hk


def check_seed(seed) -> None:
    """Dropout's seed as every entry point takes it (the plain path too, which has no dropout to use it)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"seed must be an int in [0, 2**63) or None (drawn from torch's generator), got {seed!r}")


def _check_scalars(dropout_p, scale, window, softcap, seed, is_causal):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a positive finite number or None (1/sqrt(D)), got {scale!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be a positive finite number (e.g. 30.0) or None, got {softcap!r}")
    check_seed(seed)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if window is None:
        left, right = -1, -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be a pair (left, right) of ints, -1 for unbounded, e.g. (1023, 0); "
                             f"got {window!r}")
        if not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
            raise TypeError(f"window must hold two ints (left, right), got {window!r}")
        left, right = int(window[0]), int(window[1])
        if left < -1 or right < -1:
            raise ValueError(f"window=(left, right) takes ints >= 0, or -1 for unbounded; got {window!r}")
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _check_slopes(alibi_slopes, B: int, H: int, dev) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a tensor of shape ({H},) or ({B}, {H}), got "
                        f"{type(alibi_slopes).__name__}")
    if tuple(alibi_slopes.shape) not in ((H,), (B, H)):
        raise ValueError(f"alibi_slopes must have shape ({H},) (one slope per query head) or ({B}, {H}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if not alibi_slopes.is_floating_point():
        raise TypeError(f"alibi_slopes must be a float tensor, got {alibi_slopes.dtype}; use .float()")
    if alibi_slopes.device != dev:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} and the inputs on {dev}; move it with .to()")
    if alibi_slopes.requires_grad:
        raise ValueError("alibi_slopes requires grad, but flash_attention gives slopes no gradient; "
                         "pass alibi_slopes.detach()")


def _check_mask(attn_mask, shape: tuple, q) -> None:
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor (bool, True = attend, or float, added to the scores), "
                        f"got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in _DTYPES:
        raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; use torch.bool (True = attend) or a float "
                        "dtype (float16, bfloat16, float32) added to the scores")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} and query on {q.device}; move it with .to()")
    if attn_mask.requires_grad:
        raise ValueError("attn_mask requires grad, but flash_attention gives masks no gradient; pass "
                         "attn_mask.detach() (for a learned bias, use the reference or SDPA)")
    try:
        ok = torch.broadcast_shapes(tuple(attn_mask.shape), shape) == torch.Size(shape)
    except RuntimeError:
        ok = False
    if not ok or attn_mask.dim() > 4:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Nq, Nk) = "
                         f"{shape}; use e.g. (Nq, Nk), (B, 1, 1, Nk) or (B, H, Nq, Nk)")


def uses_variants(attn_mask=None, dropout_p=0.0, enable_gqa=False, window=None, softcap=None,
                  alibi_slopes=None, q=None, k=None) -> bool:
    """True when a call needs the variants' kernels (forward v4 / backward v5, or v6 where the plan runs it; the plain
    path stays the op's own)."""
    heads_differ = (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4
                    and q.shape[1] != k.shape[1] and (enable_gqa or k.shape[1] and q.shape[1] % k.shape[1] == 0))
    return (attn_mask is not None or (dropout_p != 0.0) or window is not None or softcap is not None
            or alibi_slopes is not None or heads_differ)


def dropout_mask(B: int, H: int, Nq: int, Nk: int, p: float, seed: int, device=None):
    """The keep mask (B, H, Nq, Nk), bool, that the kernels draw for ``seed`` (a debug view, tiny sizes only)."""
    from .kernels.forward_v4 import dropout_mask as _mask
    return _mask(B, H, Nq, Nk, p, seed, device=device)


# ----------------------------------------------------------------------------------------- tile maps

def band_tile_ranges(r0: int, r_block: int, c_block: int, n_cols: int, before: int, after: int):
    """forward_v4.band_tiles in Python: (lo, full_lo, full_hi, hi) for rows r0 .. r0 + r_block - 1.

    Row i sees columns i - before ... i + after (< n_cols); ``before``/``after`` < 0: unbounded.
    [lo, full_lo) and [full_hi, hi) are the masked stages, [full_lo, full_hi) the unmasked one.
    """
    big = 1 << 40
    before, after = (big if before < 0 else before), (big if after < 0 else after)
    first = max(r0 - before, 0)
    hi = min(r0 + r_block + after, n_cols)
    hi = hi if first < hi else 0
    lo = min(first // c_block * c_block, hi)
    full_lo = min(max(-(-max(r0 + r_block - 1 - before, 0) // c_block) * c_block, lo), hi)
    full_hi = min(max(min(r0 + after + 1, n_cols) // c_block * c_block, full_lo), hi)
    return lo, full_lo, full_hi, hi


def visited_tiles(nq: int, nk: int, block_m: int, block_n: int, window=None, is_causal: bool = False,
                  cu_seqlens_q=None, cu_seqlens_k=None):
    """The (Q tile, K tile) pairs forward v4 visits, as rectangles (row0, row1, col0, col1, masked).

    ``window``/``is_causal`` as in flash_attention.  With ``cu_seqlens_q``/``_k`` (lists) the rows
    and columns are packed documents, each tiled from its own first row, as the varlen kernel does.
    ``masked``: the tile is in a masked stage (it crosses the band's edge or a ragged end).
    """
    left, right = (-1, -1) if window is None else window
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    cq = [0, nq] if cu_seqlens_q is None else list(cu_seqlens_q)
    ck = [0, nk] if cu_seqlens_k is None else list(cu_seqlens_k)
    out = []
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        for r0 in range(0, q1 - q0, block_m):
            lo, flo, fhi, hi = band_tile_ranges(r0, block_m, block_n, k1 - k0, left, right)
            for c0 in range(lo, hi, block_n):
                out.append((q0 + r0, min(q0 + r0 + block_m, q1), k0 + c0, min(k0 + c0 + block_n, k1),
                            not flo <= c0 < fhi))
    return out


def varlen_program(pid: int, cu_seqlens, max_seqlen: int, block_m: int, H: int):
    """What program ``pid`` of the varlen forward computes: (sequence, head, first packed row, rows).

    The grid is cdiv(max_seqlen, block_m) * S * H programs, tile index fastest (common.program_tile);
    ``rows`` is how many of the tile's block_m rows lie in the sequence (0: the program stores nothing).
    """
    n_tiles = -(-max_seqlen // block_m)
    tile, bh = pid % n_tiles, pid // n_tiles
    b, h = bh // H, bh % H
    start, length = cu_seqlens[b], cu_seqlens[b + 1] - cu_seqlens[b]
    return b, h, start + tile * block_m, max(0, min(block_m, length - tile * block_m))


# ----------------------------------------------------------------------------------------- host code

def _kernel_head_dim(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _compute_dtype(dtype):
    return torch.float32 if (dtype == torch.bfloat16 and device.INTERPRET) else dtype   # interpreter's bf16 dot


def _prep(t, d_kernel: int, cdt):
    if t.dtype != cdt:
        t = t.to(cdt)
    if t.shape[-1] != d_kernel:
        t = F.pad(t, (0, d_kernel - t.shape[-1]))
    return t


def _band(left: int, right: int):
    return None if (left < 0 and right < 0) else (left, right)


def _variant_args(mask, slopes, cu_q, cu_k, softcap: float, dropout_p: float, seed: int) -> dict:
    """What forward v4 / backward v5 take besides the plan (the kernels' ``variant_args``)."""
    return dict(mask=mask, slopes=slopes, cu_q=cu_q, cu_k=cu_k, softcap=softcap if softcap > 0 else None,
                dropout_p=dropout_p, seed=seed)


def _plan(qp, kp, vp, mask, args, varlen: bool, B: int, H: int, Hk: int, max_q: int, max_k: int, left: int,
          right: int, softcap: float, dropout_p: float, allow_tf32: bool):
    """The launch plan of a variant call (flashlab.kernels.plan): which kernels, tiles and grids run, and why.

    The band (left, right) is told to the plan as causal (right = 0, left unbounded) and / or a window; a
    call with no feature at all (window=(-1, -1)) runs forward v4 / backward v5."""
    from .kernels import plan as P
    causal = right == 0
    window = None if (causal and left < 0) else _band(left, right)
    variant = P.Variant(kv_groups=H // Hk, window=window, softcap=args["softcap"] is not None,
                        alibi=args["slopes"] is not None,
                        mask=None if mask is None else ("bool" if mask.dtype == torch.bool else "additive"),
                        dropout=dropout_p > 0, varlen=varlen)
    force = dict(forward_version="v4", backward_version="v5") if not variant.features() else {}
    if varlen:
        return P.plan(B, H, max_q, max_k, qp.shape[-1], qp.dtype, causal, allow_tf32=allow_tf32, variant=variant,
                      layout=P.layout_of(qp, kp, vp), **force)
    return P.plan_for(qp, kp, vp, causal, allow_tf32=allow_tf32, variant=variant, **force)


def _draw_seed(dropout_p: float, seed: int) -> int:
    if dropout_p > 0 and seed < 0:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())   # torch.manual_seed governs it
    return max(seed, 0)


def _expand_mask(mask, B, H, Nq, Nk):
    if mask is None:
        return None
    if mask.dtype == torch.bfloat16 and device.INTERPRET:
        mask = mask.float()
    while mask.dim() < 4:
        mask = mask[None]
    return mask.expand(B, H, Nq, Nk)


def _slopes_view(slopes, B, H):
    if slopes is None:
        return None
    slopes = slopes.float()
    return slopes.expand(B, H) if slopes.dim() == 1 else slopes


def _forward(q, k, v, mask, slopes, cu_q, cu_k, max_q: int, max_k: int, left: int, right: int,
             softcap: float, dropout_p: float, seed: int, scale: float, allow_tf32: bool):
    """(o in q's dtype, lse float32, the seed used).  Dense (B, H, N, D) or packed (total, H, D) when cu_q."""
    varlen = cu_q is not None
    D = q.shape[-1]
    dk_ = _kernel_head_dim(D)
    cdt = _compute_dtype(q.dtype)
    qp, kp, vp = (_prep(t, dk_, cdt) for t in (q, k, v))
    H, Hk = (q.shape[1], k.shape[1])
    if varlen:
        _check_cu(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
        B = cu_q.shape[0] - 1
        o = torch.empty((q.shape[0], H, dk_), device=q.device, dtype=cdt)
        lse = torch.empty((H, q.shape[0]), device=q.device, dtype=torch.float32)
    else:
        B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
        o = torch.empty((B, H, Nq, dk_), device=q.device, dtype=cdt)
        lse = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    seed = _draw_seed(dropout_p, seed)
    m = None if varlen else _expand_mask(mask, B, H, Nq, Nk)
    from . import kernels
    args = _variant_args(m, _slopes_view(slopes, B, H), cu_q, cu_k, softcap, dropout_p, seed)
    # The plan and the kernels' runners of this exact kind of call, made on its first call: planning (the Variant,
    # the stride classes, the plan's key) and the runners' key cost the host more than the rest of a call together
    # (a window's forward on a GPU machine took about 0.3 ms of host time a call, close to the kernel's 0.33 ms).
    # The key holds what the plan and kernels._runners' key are made from: q, k, v's shapes, strides and
    # alignment, the variant tensors' (o and lse are new, contiguous, shaped by these), the band, which features
    # are on, the seed's width (the kernels' integer argument types), TF32, determinism.
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device,
           (q.data_ptr() & 15) | (k.data_ptr() & 15) << 4 | (v.data_ptr() & 15) << 8, _meta(mask), _meta(slopes),
           _meta(cu_q), _meta(cu_k), max_q, max_k, left, right, softcap > 0, dropout_p > 0,
           not -2**31 <= seed < 2**31, allow_tf32, torch.are_deterministic_algorithms_enabled())
    call = _FWD_CALLS.get(key)
    if call is None:
        p = _plan(qp, kp, vp, m, args, varlen, B, H, Hk, max_q, max_k, left, right, softcap, dropout_p, allow_tf32)
        if len(_FWD_CALLS) >= MAX_CALLS:   # many kinds of call (ragged lengths): start over, not grow without bound
            _FWD_CALLS.clear()
        if _forget_calls not in kernels.plan.FORGET_HOOKS:   # plan.forget() (a forced version, a changed GPU)
            kernels.plan.FORGET_HOOKS.append(_forget_calls)
        call = _FWD_CALLS[key] = (p, kernels._runners(p, (qp, kp, vp, o, lse), args))
    p, runners = call
    kernels.launch_forward(qp, kp, vp, o, lse, p.causal, scale, plan_=p, runners=runners, **args)
    if dk_ != D or cdt != q.dtype:
        o = o[..., :D].to(q.dtype)
    return o, lse, seed


MAX_CALLS = 4096
_FWD_CALLS: dict = {}   # exact kind of forward call (_forward's key) -> (plan, the kernels' runners)


def _meta(t):
    """What of an optional tensor argument decides the plan and the compiled kernels."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)


def _forget_calls() -> None:
    _FWD_CALLS.clear()


def _backward(q, k, v, o, lse, do, mask, slopes, cu_q, cu_k, max_q: int, max_k: int, left: int, right: int,
              softcap: float, dropout_p: float, seed: int, scale: float, allow_tf32: bool):
    varlen = cu_q is not None
    D = q.shape[-1]
    dk_ = _kernel_head_dim(D)
    cdt = _compute_dtype(q.dtype)
    qp, kp, vp, op, dop = (_prep(t, dk_, cdt) for t in (q, k, v, o, do))
    H, Hk = q.shape[1], k.shape[1]
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    if varlen:
        B = cu_q.shape[0] - 1
        m = None
    else:
        B = q.shape[0]
        m = _expand_mask(mask, B, H, q.shape[2], k.shape[2])
    from . import kernels
    args = _variant_args(m, _slopes_view(slopes, B, H), cu_q, cu_k, softcap, dropout_p, seed)
    p = _plan(qp, kp, vp, m, args, varlen, B, H, Hk, max_q, max_k, left, right, softcap, dropout_p, allow_tf32)
    kernels.launch_backward(qp, kp, vp, op, lse, dop, dq, dk, dv, p.causal, scale, plan_=p, **args)
    return dq[..., :D].to(q.dtype), dk[..., :D].to(q.dtype), dv[..., :D].to(q.dtype)


# cu_seqlens tensors whose values were checked: (id, total, max) -> (a weak reference, its version counter).  Reading
# the values is a host sync; after it the host's work for the call (the plan, descriptors, the launch) no longer
# overlaps the GPU's previous kernels, which cost packed calls a third of their time on an H200 (docs/BENCHMARKS.md,
# 2026-12-03).  A tensor is read once, and again only when written through PyTorch (its version counter moves) or
# replaced; a tensor made under torch.inference_mode() has no version counter and is read on every call.
_CHECKED: dict = {}


def _checked_before(cu, key) -> bool:
    if cu.is_inference():
        return False
    seen = _CHECKED.get((id(cu), *key))
    return seen is not None and seen[0]() is cu and seen[1] == cu._version


def _check_cu(cu_q, cu_k, total_q: int, total_k: int, max_q: int, max_k: int) -> None:
    """The values of cu_seqlens (a host sync, once per tensor and version; inside the operator, so the compiler
    never traces it)."""
    for name, cu, total, mx in (("cu_seqlens_q", cu_q, total_q, max_q), ("cu_seqlens_k", cu_k, total_k, max_k)):
        if _checked_before(cu, (total, mx)):
            continue
        version = None if cu.is_inference() else cu._version     # before the read: a write after it reads again
        c = cu.tolist()
        if c[0] != 0:
            raise ValueError(f"{name} must start at 0, got {c[0]}")
        lens = [b - a for a, b in zip(c[:-1], c[1:])]
        if any(n < 0 for n in lens):
            raise ValueError(f"{name} must not decrease (cumulative lengths), got {c}")
        if c[-1] != total:
            raise ValueError(f"{name} must end at the packed length {total} (dim 0 of the tensor), got {c[-1]}")
        if max(lens) > mx:
            raise ValueError(f"max_seqlen_{'q' if name.endswith('q') else 'k'} = {mx} is less than the longest "
                             f"sequence in {name} ({max(lens)}); pass at least {max(lens)}")
        if version is not None:
            if len(_CHECKED) > 256:
                _CHECKED.clear()
            _CHECKED[(id(cu), total, mx)] = (weakref.ref(cu), version)


class _VariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, slopes, cu_q, cu_k, max_q, max_k, left, right, softcap, dropout_p, seed,
                scale, allow_tf32):
        o, lse, seed = _forward(q, k, v, mask, slopes, cu_q, cu_k, max_q, max_k, left, right, softcap, dropout_p,
                                seed, scale, allow_tf32)
        ctx.save_for_backward(q, k, v, o, lse, mask, slopes, cu_q, cu_k)
        ctx.args = (max_q, max_k, left, right, softcap, dropout_p, seed, scale, allow_tf32)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)   # no zero-filled gradient made for lse on every backward
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if torch.is_grad_enabled():        # create_graph=True
            refuse_double_backward()
        if do is None:
            return (None,) * 16
        q, k, v, o, lse, mask, slopes, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, o, lse, do.contiguous() if do.stride(-1) != 1 else do, mask, slopes,
                               cu_q, cu_k, *ctx.args)
        return (dq, dk, dv) + (None,) * 13


# ----------------------------------------------------------------------------------------- custom operators
# (return annotations spelled ``tuple[...]``: torch before 2.7 evaluates them in its own namespace, which has
# ``tuple``, ``Optional`` and ``Tensor`` but not ``Tuple``)

@torch.library.custom_op("flashlab::variant_forward", mutates_args=())
def variant_forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], slopes: Optional[Tensor],
                    cu_q: Optional[Tensor], cu_k: Optional[Tensor], max_q: int, max_k: int, left: int, right: int,
                    softcap: float, dropout_p: float, seed: int, scale: float,
                    allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(O, LSE, seed as a 1-element int64 CPU tensor).  seed < 0 with dropout: drawn here."""
    o, lse, used = _forward(q, k, v, mask, slopes, cu_q, cu_k, max_q, max_k, left, right, softcap, dropout_p,
                            seed, scale, allow_tf32)
    return o.contiguous(), lse, torch.tensor([used], dtype=torch.int64)


@variant_forward.register_fake
def _(q, k, v, mask, slopes, cu_q, cu_k, max_q, max_k, left, right, softcap, dropout_p, seed, scale, allow_tf32):
    if cu_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return q.new_empty(q.shape), lse, torch.empty((1,), dtype=torch.int64, device="cpu")


@torch.library.custom_op("flashlab::variant_backward", mutates_args=())
def variant_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, mask: Optional[Tensor],
                     slopes: Optional[Tensor], cu_q: Optional[Tensor], cu_k: Optional[Tensor], max_q: int, max_k: int,
                     left: int, right: int, softcap: float, dropout_p: float, seed: Tensor, scale: float,
                     allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _backward(q, k, v, o, lse, do, mask, slopes, cu_q, cu_k, max_q, max_k, left, right, softcap,
                           dropout_p, int(seed.item()), scale, allow_tf32)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@variant_backward.register_fake
def _(q, k, v, o, lse, do, mask, slopes, cu_q, cu_k, max_q, max_k, left, right, softcap, dropout_p, seed, scale,
      allow_tf32):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, slopes, cu_q, cu_k, max_q, max_k, left, right, softcap, dropout_p, _seed, scale, tf32 = inputs
    o, lse, seed_t = output
    ctx.save_for_backward(q, k, v, o, lse, mask, slopes, cu_q, cu_k, seed_t)
    ctx.args = (max_q, max_k, left, right, softcap, dropout_p, scale, tf32)
    ctx.mark_non_differentiable(lse, seed_t)


def _op_backward(ctx, do, _dlse, _dseed):
    q, k, v, o, lse, mask, slopes, cu_q, cu_k, seed_t = ctx.saved_tensors
    max_q, max_k, left, right, softcap, dropout_p, scale, tf32 = ctx.args
    dq, dk, dv = variant_backward(q, k, v, o, lse, do.contiguous(), mask, slopes, cu_q, cu_k, max_q, max_k, left,
                                  right, softcap, dropout_p, seed_t, scale, tf32)
    return (dq, dk, dv) + (None,) * 13


variant_forward.register_autograd(_op_backward, setup_context=_setup_context)


def _autocast_rule(device_type: str):
    """As SDPA (and flashlab's plain op) under torch.autocast: q, k, v in the autocast dtype, O returned in it."""
    key = getattr(torch._C.DispatchKey, "Autocast" + ("CPU" if device_type == "cpu" else "CUDA"))

    def rule(_keyset, q, k, v, *rest):
        dt = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            q, k, v = (t.to(dt) if t.dtype in _DTYPES else t for t in (q, k, v))
            return variant_forward(q, k, v, *rest)
    return rule


_lib = torch.library.Library("flashlab", "FRAGMENT")
for _dev in ("cpu", "cuda"):
    _lib.impl("variant_forward", _autocast_rule(_dev), "Autocast" + ("CPU" if _dev == "cpu" else "CUDA"),
              with_keyset=True)


def _autocast(q, k, v):
    """Eager mode's autocast: the inputs in the autocast dtype of their device type, if autocast is on there."""
    if not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dt = torch.get_autocast_dtype(q.device.type)
    if q.dtype == k.dtype == v.dtype == dt:
        return q, k, v
    q, k, v = (t.to(dt) for t in (q, k, v))
    _check_qkv(q, k, v, q.dim(), "")           # bf16 where the GPU has none says so
    return q, k, v


def _run(q, k, v, mask, slopes, cu_q, cu_k, max_q, max_k, left, right, softcap, dropout_p, seed, scale, allow_tf32):
    if torch._C._are_functorch_transforms_active():
        refuse_functorch(q, k, v, mask, slopes)
    if not torch.compiler.is_compiling():      # compiled: the operator's autocast rule above
        q, k, v = _autocast(q, k, v)
    args = (q, k, v, mask, slopes, cu_q, cu_k, int(max_q), int(max_k), left, right, float(softcap or 0.0),
            float(dropout_p), -1 if seed is None else int(seed), float(scale), bool(allow_tf32))
    if torch.compiler.is_compiling():
        o, lse, _ = torch.ops.flashlab.variant_forward(*args)
    else:
        o, lse = _VariantAttention.apply(*args)
    return o, lse


class _Empty(torch.autograd.Function):
    """A call with nothing to compute (a batch, the heads, the queries or the keys of length 0), as SDPA takes it:
    O is zeros (with no key a row's O is 0, the kernels' rule), the LSE -inf, the gradients zeros."""

    @staticmethod
    def forward(ctx, q, k, v, lse_shape):
        ctx.save_for_backward(q, k, v)
        lse = torch.full(lse_shape, -math.inf, device=q.device, dtype=torch.float32)
        ctx.mark_non_differentiable(lse)
        return q.new_zeros(q.shape), lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


def empty_call(q, k, v, lse_shape) -> Optional[tuple]:
    """(O, LSE) of a call with no query-key pair, or None when there is work (the inputs checked already)."""
    if q.numel() and k.numel():
        return None
    q, k, v = _autocast(q, k, v)       # O in autocast's dtype, as SDPA's
    return _Empty.apply(q, k, v, tuple(lse_shape))


def refuse_functorch(*tensors) -> None:
    """A clear error under torch.func's transforms (grad, vmap, jacrev, ...) of these tensors: the kernels take
    real tensors and autograd.Function's eager path, which those transforms do not give them."""
    if any(isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        raise NotImplementedError(
            "flashlab's attention does not run under torch.func transforms (grad, vmap, jacrev, functional_call's "
            "grads): use torch.autograd.grad / .backward() for gradients, and a loop or a batch dimension for vmap")


def refuse_double_backward() -> None:
    """The backward under create_graph=True: the kernels' gradients carry no graph, so a second derivative through
    them would be silently wrong (treated as a constant); SDPA's flash and efficient kernels refuse it too."""
    raise RuntimeError("flashlab's attention has no second derivative: its backward runs kernels autograd cannot "
                       "differentiate (create_graph=True, e.g. a gradient penalty); use torch.nn.functional."
                       "scaled_dot_product_attention's math backend (sdpa_kernel(SDPBackend.MATH)) there")


# ----------------------------------------------------------------------------------------- public entry points

def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
              window=None, softcap=None, alibi_slopes=None, seed=None, return_lse=False, allow_tf32=False):
    """``flash_attention`` with variants (see :func:`flashlab.flash_attention`): dense (B, H, N, D)."""
    _check_qkv(query, key, value, 4, "(B, H, N, D)")
    B, H, Nq, D = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise ValueError(f"query, key, value must agree on the batch (dim 0): query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}")
    if key.shape[1:3] != value.shape[1:3]:
        raise ValueError(f"key and value must agree on batch and heads (dims 0, 1) and length (dim 2): "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}")
    Nk = key.shape[2]
    _check_heads(H, key.shape[1], bool(enable_gqa))
    left, right = _check_scalars(dropout_p, scale, window, softcap, seed, is_causal)
    _check_slopes(alibi_slopes, B, H, query.device)
    _check_mask(attn_mask, (B, H, Nq, Nk), query)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o, lse = empty_call(query, key, value, (B, H, Nq)) or _run(
        query, key, value, attn_mask, alibi_slopes, None, None, Nq, Nk, left, right, softcap, dropout_p, seed, scale,
        allow_tf32)
    return (o, lse) if return_lse else o


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False, *,
                           dropout_p=0.0, scale=None, enable_gqa=False, window=None, softcap=None, alibi_slopes=None,
                           seed=None, return_lse=False, causal=None, allow_tf32=False, attn_mask=None):
    """Attention over packed sequences (flash-attn's layout): no padding, no tile spans two documents.

    Args:
        q: (total_q, H, D); k, v: (total_k, H_kv, D) (H_kv < H with ``enable_gqa=True``).
        cu_seqlens_q, cu_seqlens_k: int32 (S + 1,), cumulative lengths starting at 0 and ending at
            total_q / total_k; sequence b is rows cu[b] ... cu[b + 1] - 1.  Their values are checked (a
            host sync) on a tensor's first call only, and again after a write through PyTorch (which moves
            its version counter): change them in place through ``.data``, DLPack or another library and the
            check is skipped, so pass a new tensor instead.
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence (the grid is sized by them).
        is_causal (alias ``causal``), window, softcap, alibi_slopes ((H,) or (S, H)), dropout_p, seed,
            scale, return_lse, allow_tf32: as in :func:`flashlab.flash_attention`, positions counted
            from each sequence's start.

    Returns:
        o (total_q, H, D), or (o, lse) with lse (H, total_q) float32.
    """
    is_causal = _causal_alias(is_causal, causal)
    _check_qkv(q, k, v, 3, "(total, H, D)")
    if attn_mask is not None:
        raise ValueError("flash_attention_varlen takes no attn_mask: sequences are separated by cu_seqlens; "
                         "use window/is_causal inside them, or flash_attention on padded (B, H, N, D) with a mask")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same length and heads: k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of dtype int32, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32 (flash-attn's layout), got {cu.dtype}; "
                            "use .to(torch.int32)")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with S + 1 >= 2 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} and q on {q.device}; move it with .to(q.device)")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences: "
                         f"{tuple(cu_seqlens_q.shape)} vs {tuple(cu_seqlens_k.shape)}")
    for name, mx in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(mx, bool) or not isinstance(mx, int) or mx < 1:
            raise ValueError(f"{name} must be a positive int (the longest sequence), got {mx!r}")
    # the kernels read cu_seqlens[b] at b (a strided view such as cu[::2] read the wrong entries)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    H = q.shape[1]
    _check_heads(H, k.shape[1], bool(enable_gqa))
    left, right = _check_scalars(dropout_p, scale, window, softcap, seed, is_causal)
    _check_slopes(alibi_slopes, cu_seqlens_q.shape[0] - 1, H, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not (q.numel() and k.numel()):
        _check_cu(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    o, lse = empty_call(q, k, v, (H, q.shape[0])) or _run(
        q, k, v, None, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, softcap,
        dropout_p, seed, scale, allow_tf32)
    return (o, lse) if return_lse else o


def _causal_alias(is_causal, causal):
    if causal is None:
        return is_causal
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if is_causal and not causal:
        raise ValueError("is_causal=True and causal=False disagree; causal= is an alias of is_causal: pass one")
    return causal or is_causal
