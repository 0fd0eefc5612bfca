"""The public op: ``flashlab.flash_attention``, a drop-in for SDPA with a Triton forward and backward.

    o = flash_attention(q, k, v, causal=True)             # like F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o, lse = flash_attention(q, k, v, return_lse=True)    # LSE: (B, H, Nq) float32, natural log
    o.sum().backward()                                    # runs the Triton backward

What happens around the kernels:
  * inputs are checked, and bad ones get a ValueError/TypeError that says what to fix;
  * a head dim that is not a power of two (>= 16) is zero-padded up to one (zeros do
    not change Q K^T, and the padded columns of O are cut off);
  * bf16 in the interpreter is upcast to fp32 (the interpreter's bf16 ``tl.dot`` is wrong);
  * fp32 is true fp32 (IEEE dot products) unless ``allow_tf32=True``;
  * under ``torch.autocast``, as SDPA: the inputs are cast to the autocast dtype and so is the output;
  * autograd: an ``autograd.Function`` in eager mode (none when nothing needs a gradient); under
    ``torch.compile`` the same host code runs as the custom operators of :mod:`flashlab.op`, which
    the compiler treats as opaque nodes;
  * the host cost per call is kept near SDPA's: inputs are checked once per kind (shapes, dtypes,
    devices), each kind of call keeps its launch plan and its compiled kernels' runners
    (``_FWD`` / ``_BWD``, keyed by shapes, strides and alignment), and no no-op pad or cast runs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import device
from . import variants
from .kernels.plan import BACKWARD, FORWARD, kernel_head_dim, plan_for

__all__ = ["flash_attention", "check_inputs", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q, k, v, scale=None) -> None:
    """Raise a ValueError/TypeError naming the argument and the fix; return None if q, k, v are usable."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, N, D), got shape {tuple(t.shape)}; "
                             f"for a single head use {name}[None, None]")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use torch.float16, torch.bfloat16 or torch.float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; convert with .to(q.dtype)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "cpu" and not device.INTERPRET:
        raise ValueError("q is on the CPU but Triton is compiling for the GPU; move the inputs with "
                         ".cuda() (or set TRITON_INTERPRET=1 before importing flashlab to use the interpreter)")
    if q.dtype == torch.bfloat16 and q.device.type == "cuda" and not device.bf16_supported():
        raise TypeError(f"bf16 kernels need compute capability 8.0 or newer (A100, L4, H100); this GPU, "
                        f"{torch.cuda.get_device_name(q.device)}, has fp16: use torch.float16")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {q.device}; use a CUDA GPU or the CPU (interpreter)")
    B, H, Nq, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise ValueError(f"q, k, v must agree on batch and heads (dims 0, 1): q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same sequence length (dim 2): k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != D or v.shape[3] != D:
        raise ValueError(f"q, k, v must have the same head dim (dim 3): q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} is not supported; use 1 <= D <= {MAX_HEAD_DIM} "
                         f"(16, 32, 64, 128 are the fast paths)")
    if scale is not None and (isinstance(scale, bool) or not (isinstance(scale, (int, float)) and math.isfinite(scale)
                                                               and scale > 0)):
        raise ValueError(f"scale must be a positive finite number or None (1/sqrt(D)), got {scale!r}")


def _kernel_head_dim(d: int) -> int:
    return kernel_head_dim(d)


def _prepare(t: torch.Tensor, d_kernel: int, compute_dtype: torch.dtype) -> torch.Tensor:
    """Pad the head dim with zeros up to what the kernel needs, and cast if we must."""
    if t.dtype != compute_dtype:
        t = t.to(compute_dtype)
    if t.shape[-1] != d_kernel:
        t = F.pad(t, (0, d_kernel - t.shape[-1]))
    return t


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # The interpreter's bf16 tl.dot returns garbage: compute in fp32, return bf16.
    if dtype == torch.bfloat16 and device.INTERPRET:
        return torch.float32
    return dtype


class _Call:
    """One kind of call made ready: its plan, whether inputs need padding or a cast, the output shapes, and the
    compiled kernels' runners (kept per exact shapes, strides and alignment: the call cache's key).  A forward
    call keeps the backward calls of its outputs (``bwd``, keyed by dO's strides and alignment)."""
    __slots__ = ("plan", "prep", "d", "dk", "cdt", "dtype", "launch", "runners", "o_shape", "lse_shape", "device",
                 "causal", "allow_tf32", "bwd")

    def __init__(self, q, k, v, causal, allow_tf32, backward, extra=()):
        self.d, self.dtype, self.device = q.shape[-1], q.dtype, q.device
        self.dk, self.cdt = kernel_head_dim(self.d), _compute_dtype(q.dtype)
        self.prep = self.dk != self.d or self.cdt != self.dtype
        self.causal, self.allow_tf32 = causal, allow_tf32
        qp, kp, vp, *xp = (_prepare(t, self.dk, self.cdt) for t in (q, k, v, *extra))
        self.plan = plan_for(qp, kp, vp, causal, allow_tf32=allow_tf32, extra=tuple(xp))
        mods = BACKWARD if backward else FORWARD
        self.launch = mods[self.plan.bwd_version if backward else self.plan.fwd_version].launch
        self.runners = {}
        B, H, Nq = q.shape[:3]
        self.o_shape, self.lse_shape = (B, H, Nq, self.dk), (B, H, Nq)
        self.bwd = {}

    def forward(self, q, k, v, scale):
        if self.prep:
            q, k, v = (_prepare(t, self.dk, self.cdt) for t in (q, k, v))
        o = torch.empty(self.o_shape, device=self.device, dtype=self.cdt)
        lse = torch.empty(self.lse_shape, device=self.device, dtype=torch.float32)
        self.launch(self.plan, q, k, v, o, lse, scale, self.runners)
        if self.prep:
            o = o[..., :self.d].to(self.dtype)
        return o, lse

    def backward(self, q, k, v, o, lse, do, scale):
        if self.prep:
            q, k, v, o, do = (_prepare(t, self.dk, self.cdt) for t in (q, k, v, o, do))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.launch(self.plan, q, k, v, o, lse, do, dq, dk, dv, scale, self.runners)
        if self.prep:
            return dq[..., :self.d].to(self.dtype), dk[..., :self.d].to(self.dtype), dv[..., :self.d].to(self.dtype)
        return dq, dk, dv

    def backward_of(self, q, k, v, o, lse, do):
        """The backward call for this forward's outputs and this dO (o and lse are the forward's own)."""
        key = (do.stride(), do.data_ptr() & 15, torch.are_deterministic_algorithms_enabled())
        c = self.bwd.get(key)
        if c is None:
            c = self.bwd[key] = _Call(q, k, v, self.causal, self.allow_tf32, True, (do,))
        return c


MAX_CALLS = 4096   # kinds of call kept ready (each holds a plan and its runners: a few kB)
_FWD: dict = {}   # exact key (shapes, strides, dtypes, devices, flags, alignment) -> forward _Call
_BWD: dict = {}   # the same for _backward called on its own (torch.ops.flashlab.attention_backward)


def _fwd_call(q, k, v, causal: bool, allow_tf32: bool) -> _Call:
    """The forward call for these inputs; inputs of a kind not seen before are checked first (check_inputs)."""
    try:
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
               k.device, v.device, causal, allow_tf32,
               (q.data_ptr() & 15) | (k.data_ptr() & 15) << 4 | (v.data_ptr() & 15) << 8)
    except AttributeError:   # not tensors: check_inputs says so
        check_inputs(q, k, v)
        raise
    c = _FWD.get(key)
    if c is None:
        check_inputs(q, k, v)
        if len(_FWD) >= MAX_CALLS:   # many shapes (ragged lengths): start over rather than grow without bound
            _FWD.clear()
        c = _FWD[key] = _Call(q, k, v, causal, allow_tf32, False)
    return c


def _forward(q, k, v, causal: bool, scale: float, allow_tf32: bool):
    """Run the forward kernel: (o in q's dtype, lse float32)."""
    return _fwd_call(q, k, v, causal, allow_tf32).forward(q, k, v, scale)


def _backward(q, k, v, o, lse, do, causal: bool, scale: float, allow_tf32: bool):
    """Run the backward kernels: (dq, dk, dv) in q's dtype.  ``o`` and ``lse`` are the forward's outputs."""
    key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), o.stride(), do.stride(), lse.stride(), q.dtype,
           q.device, causal, allow_tf32, torch.are_deterministic_algorithms_enabled(),
           tuple(t.data_ptr() & 15 for t in (q, k, v, o, do, lse)))
    c = _BWD.get(key)
    if c is None:
        if len(_BWD) >= MAX_CALLS:
            _BWD.clear()
        c = _BWD[key] = _Call(q, k, v, causal, allow_tf32, True, (do,))
    return c.backward(q, k, v, o, lse, do, scale)


class _FlashAttention(torch.autograd.Function):
    """Eager mode's path: the same host code as the custom operators, without their dispatch
    (measured: tens of microseconds less per call, which matters when a kernel takes as little)."""

    @staticmethod
    def forward(ctx, q, k, v, call, scale):
        o, lse = call.forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.call, ctx.scale = call, scale
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)   # no zero-filled gradient made for lse on every backward (a kernel)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if torch.is_grad_enabled():        # create_graph=True: an error, not a silently wrong second derivative
            variants.refuse_double_backward()
        if do is None:                     # no gradient reached o (only possible without materialized grads)
            return None, None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.call.backward_of(q, k, v, o, lse, do).backward(q, k, v, o, lse, do, ctx.scale)
        return dq, dk, dv, None, None


# Function.apply's Python wrapper unwraps functorch's dead wrappers with a pytree walk on every call (microseconds);
# outside functorch transforms the C implementation underneath is what it calls.
_apply_c = super(torch.autograd.Function, _FlashAttention).apply
_functorch_active = torch._C._are_functorch_transforms_active

try:
    _any_autocast = torch._C._is_any_autocast_enabled
except AttributeError:  # pragma: no cover - older torch
    def _any_autocast():
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def autocast_dtype(device_type: str):
    """The dtype autocast runs SDPA in on this device type now, or None when autocast is off there."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast(q, k, v):
    """Under torch.autocast, what SDPA does: floating inputs in the autocast dtype (their grads flow back)."""
    dt = autocast_dtype(q.device.type)
    if dt is None or (q.dtype == getattr(k, "dtype", None) == getattr(v, "dtype", None) == dt):
        return q, k, v
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype in _DTYPES else t for t in (q, k, v))


def _attention(q, k, v, causal, scale, allow_tf32):
    """flash_attention's work between its arguments and the kernels: validation (once per kind of input),
    autocast, the default scale, autograd.  Returns (o, lse)."""
    if _functorch_active():
        variants.refuse_functorch(q, k, v)
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and not (q.numel() and k.numel()):
        check_inputs(q, k, v, scale)   # a call with no query-key pair (a dimension of 0): zeros, as SDPA gives
        return variants.empty_call(q, k, v, q.shape[:3])
    if torch.compiler.is_compiling():  # one opaque custom op for the compiler (flashlab/op.py): no graph break
        check_inputs(q, k, v, scale)   # (autocast: the op's own autocast rule, flashlab/op.py)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return torch.ops.flashlab.attention_forward(q, k, v, bool(causal), scale, bool(allow_tf32))
    if _any_autocast() and isinstance(q, torch.Tensor):
        q, k, v = _autocast(q, k, v)       # checked below, once per kind, as the tensors the kernels get
    call = _fwd_call(q, k, v, causal is True or bool(causal), allow_tf32 is True or bool(allow_tf32))
    if scale is None:
        scale = 1.0 / math.sqrt(call.d)
    elif isinstance(scale, float) and 0.0 < scale < math.inf:
        pass
    else:
        check_inputs(q, k, v, scale)
        scale = float(scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if _functorch_active():
            return _FlashAttention.apply(q, k, v, call, scale)
        return _apply_c(q, k, v, call, scale)
    return call.forward(q, k, v, scale)   # nothing to differentiate: no autograd node


def flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, *, window=None, softcap=None, alibi_slopes=None, seed=None,
                    return_lse=False, causal=None, allow_tf32=False, fp8=False):
    """FlashAttention-2: softmax(scale * q k^T) v without ever storing an N x N matrix.

    Shaped like ``F.scaled_dot_product_attention`` (the same positional order), so it drops
    into an SDPA call site (nanoGPT's ``flash_attention(q, k, v, attn_mask=None,
    dropout_p=0.0, is_causal=True)`` runs unchanged).

    Args:
        query: (B, H, Nq, D); key, value: (B, H_kv, Nk, D).  fp16, bf16 or fp32, on CUDA
            (compiled Triton) or on the CPU (Triton interpreter).  Any strides.
        attn_mask: bool (True = attend, SDPA's meaning) or float (added to the scaled scores; values below
            -1e37, such as torch.finfo(float32).min, count as -1e37, so a row masked by them alone averages V as
            in SDPA, while -inf hides a key), broadcastable to (B, H, Nq, Nk); read tile by tile, never copied;
            no gradient.
        dropout_p: probability of dropping an attention weight (Philox in the kernel, one random
            byte per weight, so p is applied rounded to 1/256ths: ``flashlab.reference.dropout_rate``;
            the backward regenerates the mask; kept weights scaled by 1 / (1 - that rate)).
        is_causal: top-left causal mask, query i sees keys j <= i.  ``causal=`` is an alias.
        scale: softmax scale, default 1/sqrt(D).
        enable_gqa: allow H_kv < H (grouped-query / multi-query), H % H_kv == 0.
        window: (left, right): query i sees keys i - left ... i + right; -1 unbounded (so is a bound past
            every key, e.g. 2**31 - 1).
        softcap: s -> softcap * tanh(s / softcap), after scaling (Gemma 2: 50.0 / 30.0).
        alibi_slopes: (H,) or (B, H): s -= slope * |i - j|.
        seed: dropout's seed; None draws one from torch's generator (``torch.manual_seed``).
        return_lse: also return the log-sum-exp (B, H, Nq), float32, natural log (-inf for a
            row that sees no key; its O is 0).
        allow_tf32: let fp32 inputs use TF32 tensor cores (faster, ~1e-3 relative error).
        fp8: quantise q, k, v to e4m3 with one scale per (batch, head) and run the FP8 forward
            (``flashlab/kernels/forward_fp8.py``; compute capability >= 8.9 on a GPU): forward only
            (a ValueError if a gradient is needed), plain or causal attention and GQA only; O in
            query's dtype.  :func:`flashlab.flash_attention_fp8` takes tensors already in e4m3.

    Returns:
        o (B, H, Nq, D) in the dtype of query (under ``torch.autocast``: the autocast dtype), or
        (o, lse).  ``o`` is differentiable with respect to query, key and value (once: a second derivative,
        ``create_graph=True``, raises, as SDPA's flash kernels do); lse is not.  torch.func's transforms (grad,
        vmap) raise a NotImplementedError; torch.autograd and torch.compile are the ways in.

    A Python bool in ``attn_mask``'s place is read as the course's first positional order,
    ``flash_attention(q, k, v, causal, scale, return_lse)`` (masks are tensors, so it is unambiguous).

    Packed sequences of different lengths: :func:`flashlab.flash_attention_varlen`.  The
    variants run forward v4 / backward v5, or v6 on an H100 / H200 at D = 128 for the ones it runs
    (flashlab/variants.py, ``python -m flashlab plan``); a plain call runs the kernels tuned for it.
    """
    if isinstance(attn_mask, bool):   # the course's first order, flash_attention(q, k, v, causal, scale, return_lse)
        attn_mask, is_causal, return_lse = None, attn_mask, bool(return_lse or is_causal)
        if dropout_p is None or dropout_p != 0.0:
            scale, dropout_p = (dropout_p if scale is None else scale), 0.0
    if causal is not None:
        is_causal = variants._causal_alias(is_causal, causal)
    if fp8 is not False:
        if fp8 is not True:
            raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
        if is_causal is not True and is_causal is not False:
            raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
        from . import fp8 as _fp8
        return _fp8.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window=window,
                              softcap=softcap, alibi_slopes=alibi_slopes, seed=seed, return_lse=return_lse)
    if variants.uses_variants(attn_mask, dropout_p, enable_gqa, window, softcap, alibi_slopes, query, key):
        return variants.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                  window=window, softcap=softcap, alibi_slopes=alibi_slopes, seed=seed,
                                  return_lse=return_lse, allow_tf32=allow_tf32)
    if is_causal is not True and is_causal is not False:
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    variants.check_seed(seed)
    o, lse = _attention(query, key, value, is_causal, scale, allow_tf32)
    return (o, lse) if return_lse else o
