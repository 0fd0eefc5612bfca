"""``flashlab.flash_attention`` as PyTorch operators, so ``torch.compile`` sees one opaque node.

Two custom operators (``torch.library.custom_op``) wrap the host code in :mod:`flashlab.attention`:

    torch.ops.flashlab.attention_forward(q, k, v, causal, scale, allow_tf32) -> (o, lse)
    torch.ops.flashlab.attention_backward(q, k, v, o, lse, do, causal, scale, allow_tf32) -> (dq, dk, dv)

Each has a fake (meta) implementation, which tells the compiler the shapes and dtypes of the
outputs without running a kernel, and the forward has an autograd formula that calls the backward
operator.  So a model calling ``flashlab.flash_attention`` compiles with
``torch.compile(model, fullgraph=True)``, forward and backward, without a graph break: the
compiler traces around the Triton kernels instead of into them.

``flash_attention`` calls them only while compiling (``torch.compiler.is_compiling()``); in eager
mode it runs the same host code through a plain ``autograd.Function``, which costs less per call
than the operator dispatch.  Outputs are always contiguous (the fake implementations promise it).
``lse`` is not differentiable: a gradient flowing into it is ignored.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import attention as _host

__all__ = ["attention_forward", "attention_backward"]

# The operators' annotations are strings here (``from __future__ import annotations``); torch before 2.7
# evaluates them in its own namespace, which has ``tuple`` and ``Tensor`` but not ``typing.Tuple``.


@torch.library.custom_op("flashlab::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                      allow_tf32: bool) -> tuple[Tensor, Tensor]:
    """O (B, H, Nq, D) in q's dtype and LSE (B, H, Nq) float32.  Inputs are checked by the caller."""
    o, lse = _host._forward(q, k, v, causal, scale, allow_tf32)
    return o.contiguous(), lse


@attention_forward.register_fake
def _(q, k, v, causal, scale, allow_tf32):
    B, H, Nq, D = q.shape
    return q.new_empty((B, H, Nq, D)), q.new_empty((B, H, Nq), dtype=torch.float32)


@torch.library.custom_op("flashlab::attention_backward", mutates_args=())
def attention_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                       causal: bool, scale: float, allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV (shaped like q, k, v, contiguous) from the forward's inputs, outputs and dO."""
    dq, dk, dv = _host._backward(q, k, v, o, lse, do, causal, scale, allow_tf32)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_backward.register_fake
def _(q, k, v, o, lse, do, causal, scale, allow_tf32):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, allow_tf32 = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale, ctx.allow_tf32 = causal, scale, allow_tf32
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.allow_tf32)
    return dq, dk, dv, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------ autocast
# As SDPA under torch.autocast: the forward runs in the autocast dtype (floating inputs cast to it) and
# returns it.  One rule per device type, reading autocast's dtype at the call (torch.library.register_autocast
# takes one fixed dtype).  The backward needs none: it receives the forward's (cast) tensors and their grads.

def _autocast_rule(device_type: str):
    key = getattr(torch._C.DispatchKey, "Autocast" + ("CPU" if device_type == "cpu" else "CUDA"))

    def rule(_keyset, q, k, v, causal, scale, allow_tf32):
        dt = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            q, k, v = (t.to(dt) if t.dtype in (torch.float16, torch.bfloat16, torch.float32) else t for t in (q, k, v))
            return attention_forward(q, k, v, causal, scale, allow_tf32)
    return rule


_lib = torch.library.Library("flashlab", "FRAGMENT")
for _dev in ("cpu", "cuda"):
    _lib.impl("attention_forward", _autocast_rule(_dev), "Autocast" + ("CPU" if _dev == "cpu" else "CUDA"),
              with_keyset=True)
