"""FP8 attention, forward only: quantisation to e4m3 and the host side of the FP8 forward kernel.

    q8, q_scale = quantize_fp8(q)                     # e4m3 (B, H, N, D) and float32 (B, H): q ~ q8 * q_scale
    vt8, v_scale = quantize_fp8(v, transpose=True)    # V^T (B, H, D, N): the layout the FP8 P V product wants
    o = flash_attention_fp8(q8, k8, vt8, q_scale, k_scale, v_scale, is_causal=True)   # bf16 by default
    o = flashlab.flash_attention(q, k, v, is_causal=True, fp8=True)                   # the same, from fp16/bf16

e4m3 (``torch.float8_e4m3fn``): 1 sign bit, 4 exponent bits, 3 mantissa bits, largest finite value 448,
smallest normal 2^-6, subnormals down to 2^-9.  Rounding to it costs at most 2^-4 relatively (half the
spacing 2^-3 between neighbouring significands) for numbers in the normal range.  So every (batch, head)
is scaled first, ``scale = amax / 448``: its largest element lands on 448 and the rest keep as much of the
exponent range as they can.  The kernels are ``flashlab/kernels/forward_fp8.py`` (attention) and
``flashlab/kernels/quantize_fp8.py`` (the quantisation); they need compute capability 8.9 or newer on a GPU
(L4, H100, H200), or Triton's interpreter on a CPU.

No backward: ``flash_attention(..., fp8=True)`` raises on inputs that need gradients; ``flash_attention_fp8``
(e4m3 tensors in) returns an output without a gradient.  Plain and causal attention, and grouped K/V heads (GQA); no masks, windows, dropout.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import device
from .kernels import quantize_fp8 as quantize_kernels
from .kernels.forward_fp8 import FP8_DTYPE, FP8_MAX, MIN_CC, MIN_HEAD_DIM
from .kernels.plan import kernel_head_dim

__all__ = ["quantize_fp8", "dequantize_fp8", "flash_attention_fp8", "FP8_DTYPE", "FP8_MAX"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_fp8(t: torch.Tensor, *, transpose: bool = False):
    """(t8, scale): t (B, H, N, D) fp16 / bf16 / fp32 as e4m3 with one float32 scale per (batch, head).

    ``scale[b, h] = max |t[b, h]| / 448`` (1 where that head is all zeros), ``t8 = round(t / scale)``, clamped to
    +-448, so ``t ~ t8.float() * scale[..., None, None]`` with a relative error of at most 2^-4 per element in
    e4m3's normal range (|t / scale| >= 2^-6; smaller elements are off by at most 2^-10 * scale).
    ``transpose=True`` returns t8 as (B, H, D, N), contiguous: V^T for the FP8 forward.  Any strides.

    Two Triton kernels (``flashlab/kernels/quantize_fp8.py``: the maxima, then scale, cast and store, V^T
    written transposed directly), on a GPU of compute capability 8.9 or newer and in the interpreter on a
    CPU; elsewhere, and for D > 256, the plain-torch passes of ``_quantize_torch``.  Both give the same bytes
    (a NaN's sign bit aside).  No gradient flows through it.  A head with an infinite element gets scale inf
    (its finite elements become 0, the infinities NaN); a head with a NaN gets scale 1 (NaN stays NaN, the
    rest is clamped to +-448 unscaled): check your inputs."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"quantize_fp8 takes a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"quantize_fp8 takes a (B, H, N, D) tensor, got shape {tuple(t.shape)}")
    if t.dtype not in _OUT_DTYPES:
        raise TypeError(f"quantize_fp8 takes fp16, bf16 or fp32, got {t.dtype}")
    if _triton_quantises(t):
        return quantize_kernels.quantize(t.detach(), transpose)
    return _quantize_torch(t, transpose)


def _triton_quantises(t: torch.Tensor) -> bool:
    """Whether quantize_fp8 runs the Triton kernels on t: a GPU with e4m3 conversions (cc >= 8.9, as the FP8
    forward), or a CPU tensor in the interpreter; a non-empty t with D <= 256 (one tile spans D)."""
    if t.numel() == 0 or t.shape[3] > quantize_kernels.MAX_HEAD_DIM:
        return False
    if t.device.type == "cuda":
        return device._capability_of(t.device.index) >= MIN_CC
    return t.device.type == "cpu" and device.INTERPRET


def _quantize_torch(t: torch.Tensor, transpose: bool = False):
    """quantize_fp8 in plain torch, several passes: a float32 copy, amax, a divide, a clamp, the cast, and a copy
    for transpose=True (39 bytes moved per bf16 element, 41 for V^T, where the kernels move 5).  The reference the kernels
    are tested against.  ``amax * (1 / 448)``: what torch computes for ``amax / 448`` on CUDA (a Python number
    divides as a multiply by its reciprocal there), said so that a CPU rounds the same."""
    x = t.detach().float()
    amax = x.abs().amax(dim=(2, 3))
    scale = torch.where(amax > 0, amax * (1 / FP8_MAX), torch.ones_like(amax))
    t8 = (x / scale[:, :, None, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if transpose:
        t8 = t8.transpose(2, 3).contiguous()
    return t8, scale


def dequantize_fp8(t8: torch.Tensor, scale, *, transposed: bool = False, dtype=torch.float64) -> torch.Tensor:
    """``t8 * scale`` in ``dtype`` (default float64, for references), as (B, H, N, D); ``transposed``: t8 is V^T."""
    s = torch.as_tensor(scale, dtype=dtype, device=t8.device)
    while s.dim() < 2:
        s = s[None]
    x = t8.to(dtype) * s[:, :, None, None]
    return x.transpose(2, 3) if transposed else x


# ------------------------------------------------------------------------------------------------- checks

def _scale_tensor(name: str, s, B: int, H: int, dev, check: bool = True) -> torch.Tensor:
    """A scale as a float32 (B, H) view: a number, a 0-d tensor or one broadcastable to (B, H) (stride 0)."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        s = torch.tensor(float(s), dtype=torch.float32, device=dev)
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor of shape ({B}, {H}) (or a number), got {type(s).__name__}")
    if s.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {s.dtype}; quantize_fp8 returns float32 scales")
    if s.device != dev:
        raise ValueError(f"{name} is on {s.device}, the tensors on {dev}: move it with .to({str(dev)!r})")
    try:
        s = s.expand(B, H)
    except RuntimeError:
        raise ValueError(f"{name} must have shape ({B}, {H}) (one scale per batch and head) or broadcast to it, "
                         f"got {tuple(s.shape)}") from None
    # The kernel folds the scales into one positive multiplier of the scores (its masking relies on the sign):
    # a zero, negative, infinite or NaN scale would give a wrong O or NaN, silently.  One check (a host sync on a
    # GPU); flash_attention(..., fp8=True) makes its scales with quantize_fp8 and skips it.
    if check and not bool(((s > 0) & s.isfinite()).all()):
        raise ValueError(f"{name} must be positive and finite everywhere (x = x8 * scale); "
                         f"got min {s.min().item():g}, max {s.max().item():g}")
    return s


def _pad_head_dim(t8: torch.Tensor, d_kernel: int, dim: int) -> torch.Tensor:
    """Zero-pad dimension ``dim`` of an e4m3 tensor to d_kernel (through uint8: the byte 0 is +0.0 in e4m3)."""
    n = t8.shape[dim]
    if n == d_kernel:
        return t8
    pad = [0, 0] * (t8.dim() - 1 - dim) + [0, d_kernel - n]
    return F.pad(t8.view(torch.uint8), pad).view(FP8_DTYPE)


def _check_fp8(q8, k8, vt8):
    for name, t in (("q8", q8), ("k8", k8), ("vt8", vt8)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} has dtype {t.dtype}; flash_attention_fp8 takes torch.float8_e4m3fn: make it "
                            f"with flashlab.quantize_fp8 (or call flash_attention(..., fp8=True) on fp16/bf16)")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(t.shape)}")
    if not (q8.device == k8.device == vt8.device):
        raise ValueError(f"q8, k8, vt8 must be on one device, got {q8.device}, {k8.device}, {vt8.device}")
    if q8.device.type == "cpu" and not device.INTERPRET:
        raise ValueError("q8 is on the CPU but Triton is compiling for the GPU; move the inputs with .cuda()")
    if q8.device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {q8.device}; use a CUDA GPU or the CPU (interpreter)")
    B, H, Nq, D = q8.shape
    Bk, Hk, Nk, Dk = k8.shape
    if Bk != B or Hk < 1 or H % Hk:
        raise ValueError(f"k8 must be (B, H_kv, Nk, D) with B = {B} and H_kv dividing H = {H}, got {tuple(k8.shape)}")
    if Dk != D:
        raise ValueError(f"q8 and k8 must have the same head dim: q8 {tuple(q8.shape)}, k8 {tuple(k8.shape)}")
    if tuple(vt8.shape) != (B, Hk, D, Nk):
        hint = (" it looks like V itself: pass V transposed, quantize_fp8(v, transpose=True)"
                if tuple(vt8.shape) == (B, Hk, Nk, D) else "")
        raise ValueError(f"vt8 must be V transposed, (B, H_kv, D, Nk) = {(B, Hk, D, Nk)}, got {tuple(vt8.shape)};"
                         + (hint or " make it with quantize_fp8(v, transpose=True)"))
    if min(B, H, Nq, Nk) == 0:
        raise ValueError(f"empty input: q8 {tuple(q8.shape)}, k8 {tuple(k8.shape)}; every dimension must be >= 1")
    if not 1 <= D <= 256:
        raise ValueError(f"head dim D={D} is not supported; use 1 <= D <= 256")


# ----------------------------------------------------------------------------------------------- the calls

def flash_attention_fp8(q8, k8, vt8, q_scale, k_scale, v_scale, is_causal: bool = False, scale=None,
                        out_dtype: torch.dtype = torch.bfloat16, return_lse: bool = False, *, causal=None,
                        check_scales: bool = True):
    """softmax(scale * Q K^T) V from e4m3 inputs, forward only (the FP8 forward kernel).

    Args:
        q8: (B, H, Nq, D) e4m3; k8: (B, H_kv, Nk, D) e4m3; vt8: V **transposed**, (B, H_kv, D, Nk) e4m3
            (``quantize_fp8(v, transpose=True)``); H_kv divides H (grouped-query attention when smaller).
        q_scale: (B, H) float32, so that Q = q8 * q_scale[b, h]; k_scale, v_scale: (B, H_kv) float32.
            A number or any tensor broadcastable to that shape is taken too (one scale per tensor).
        is_causal: top-left causal mask, query i sees keys j <= i.  ``causal=`` is an alias.
        scale: softmax scale, default 1 / sqrt(D).
        out_dtype: O's dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        return_lse: also return the log-sum-exp (B, H, Nq), float32, natural log.
        check_scales: check that every scale is positive and finite (a ValueError otherwise).  On a GPU each
            check reads a result back to the host, which stalls the GPU between calls (docs/BENCHMARKS.md has
            what the H200 measured with and without them): pass False for scales quantize_fp8 made from
            finite inputs.

    Returns o (B, H, Nq, D) in ``out_dtype``, or (o, lse).  No gradient flows through it.
    """
    from . import variants
    if causal is not None:
        is_causal = variants._causal_alias(is_causal, causal)
    if is_causal is not True and is_causal is not False:
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    return _forward(q8, k8, vt8, q_scale, k_scale, v_scale, is_causal, scale, out_dtype, return_lse,
                    bool(check_scales))


def _forward(q8, k8, vt8, q_scale, k_scale, v_scale, is_causal, scale, out_dtype, return_lse, check_scales):
    """flash_attention_fp8's work; ``check_scales=False`` for scales quantize_fp8 made (positive and finite)."""
    from . import kernels
    from .kernels import plan as P
    _check_fp8(q8, k8, vt8)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number or None (1/sqrt(D)), got {scale!r}")
    B, H, Nq, D = q8.shape
    Hk, Nk = k8.shape[1], k8.shape[2]
    dev = q8.device
    qs = _scale_tensor("q_scale", q_scale, B, H, dev, check_scales)
    ks = _scale_tensor("k_scale", k_scale, B, Hk, dev, check_scales)
    vs = _scale_tensor("v_scale", v_scale, B, Hk, dev, check_scales)
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dk = max(MIN_HEAD_DIM, kernel_head_dim(D))
    q8, k8, vt8 = _pad_head_dim(q8, dk, 3), _pad_head_dim(k8, dk, 3), _pad_head_dim(vt8, dk, 2)
    # The interpreter's float32 -> bf16 cast truncates: there O is written in float32 and rounded here.
    kdt = torch.float32 if (device.INTERPRET and out_dtype == torch.bfloat16) else out_dtype
    o = torch.empty((B, H, Nq, dk), device=dev, dtype=kdt)
    lse = torch.empty((B, H, Nq), device=dev, dtype=torch.float32)
    variant = P.PLAIN if Hk == H else P.Variant(kv_groups=H // Hk)
    kernels.launch_forward(q8, k8, vt8, o, lse, is_causal, sm_scale, variant=variant,
                           q_scale=qs, k_scale=ks, v_scale=vs)
    if dk != D:
        o = o[..., :D]
    if o.dtype != out_dtype:
        o = o.to(out_dtype)
    return (o, lse) if return_lse else o


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
              window=None, softcap=None, alibi_slopes=None, seed=None, return_lse=False):
    """``flash_attention(..., fp8=True)``: quantise q, k, v (V transposed) per (batch, head) and run the FP8 forward;
    O in q's dtype.  Forward only; plain or causal attention, grouped K/V heads allowed."""
    from . import attention as _op
    given = [name for name, bad in (("attn_mask", attn_mask is not None), ("dropout_p", dropout_p != 0.0),
                                    ("window", window is not None), ("softcap", softcap is not None),
                                    ("alibi_slopes", alibi_slopes is not None), ("seed", seed is not None)) if bad]
    if given:
        raise ValueError(f"fp8=True runs plain or causal attention (and GQA) only, not {', '.join(given)}; "
                         "drop fp8=True for the variants (fp16/bf16 kernels)")
    if torch.compiler.is_compiling():
        raise NotImplementedError("fp8=True is not a custom operator yet: call it outside torch.compile "
                                  "(or use fp16/bf16 there)")
    if _op._any_autocast() and isinstance(q, torch.Tensor):
        q, k, v = _op._autocast(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("fp8=True is forward-only (inference): q, k or v requires a gradient; run it under "
                         "torch.no_grad() or torch.inference_mode(), pass detached tensors, or drop fp8=True to "
                         "train (the fp16/bf16/fp32 kernels have a backward)")
    if q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and k.shape[1] != q.shape[1]:
        if k.shape[1] < 1 or q.shape[1] % k.shape[1] or k.shape[:2] != v.shape[:2]:
            raise ValueError(f"grouped K/V heads: k and v need H_kv heads dividing H = {q.shape[1]}, got "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
        if not enable_gqa:
            raise ValueError(f"query has {q.shape[1]} heads and key/value {k.shape[1]}: pass enable_gqa=True for "
                             "grouped-query (or multi-query) attention, as in F.scaled_dot_product_attention")
        like = (k[:, :1].expand(-1, q.shape[1], -1, -1), v[:, :1].expand(-1, q.shape[1], -1, -1))
    else:
        like = (k, v)
    _op.check_inputs(q, *like, scale)
    q8, qs = quantize_fp8(q)
    k8, ks = quantize_fp8(k)
    vt8, vs = quantize_fp8(v, transpose=True)
    return _forward(q8, k8, vt8, qs, ks, vs, is_causal, scale, q.dtype, return_lse, False)
