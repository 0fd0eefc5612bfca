"""flashlab.flash_attention as a torch.library custom op: opcheck, and torch.compile(fullgraph=True).

On the CPU the kernels run in Triton's interpreter and the compiled graph calls them as opaque
operators; sizes are tiny.  The inductor test compiles C++ on the CPU: about 25 s on a cold
compiler cache with two busy cores, a few seconds once cached.
"""
import pytest
import torch

import flashlab
from flashlab import device
from flashlab.accuracy import check_attention

DEV = device.DEVICE


def _rand(*shape, dtype=torch.float32):
    return torch.randn(shape, device=DEV, dtype=torch.float32).to(dtype)


def _assert_checks(checks, label):
    assert all(c.ok for c in checks), f"{label}:\n" + "\n".join(str(c) for c in checks)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck_forward(rng, causal, dtype):
    # D = 24 is padded to 32 inside the op; k and v are non-contiguous views.
    q = _rand(1, 2, 19, 24, dtype=dtype).requires_grad_()
    k = _rand(1, 23, 2, 24, dtype=dtype).transpose(1, 2).requires_grad_()
    v = _rand(1, 2, 23, 24, dtype=dtype).requires_grad_()
    torch.library.opcheck(torch.ops.flashlab.attention_forward.default, (q, k, v, causal, 0.3, False))


def test_custom_op_follows_autocast(rng):
    """The forward op has an autocast rule (as SDPA): fp32 inputs under autocast run in, and return, its dtype."""
    q, k, v = (_rand(1, 2, 19, 32) for _ in range(3))
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        o, lse = torch.ops.flashlab.attention_forward(q, k, v, True, 0.25, False)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.to(torch.bfloat16).double() for t in (q, k, v)),
                                                         is_causal=True, scale=0.25)
    assert (o.double() - ref).abs().max() < 2e-2
    o32, _ = torch.ops.flashlab.attention_forward(q, k, v, True, 0.25, False)    # outside autocast: fp32 again
    assert o32.dtype == torch.float32


def test_opcheck_backward(rng):
    q, k, v = (_rand(1, 2, 21, 16) for _ in range(3))
    o, lse = torch.ops.flashlab.attention_forward(q, k, v, True, 0.25, False)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.flashlab.attention_backward.default,
                          (q, k, v, o, lse, do, True, 0.25, False))


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_fullgraph_is_accurate(rng, causal):
    """Forward, LSE and gradients of the compiled call pass the accuracy rule (ragged Nq != Nk)."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fa(q, k, v, causal, scale):
        return flashlab.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)

    q, k, v = _rand(2, 1, 37, 32), _rand(2, 1, 29, 32), _rand(2, 1, 29, 32)
    _assert_checks(check_attention(fa, q, k, v, causal), f"compiled causal={causal}")


def test_compiled_dynamic_shapes(rng):
    """A second sequence length reuses the graph with symbolic sizes: the fake implementations hold."""
    torch._dynamo.reset()
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    f = torch.compile(lambda q, k, v: flashlab.flash_attention(q, k, v, causal=True), fullgraph=True,
                      backend=backend, dynamic=True)
    for n in (20, 45):
        q, k, v = (_rand(1, 2, n, 16) for _ in range(3))
        torch.testing.assert_close(f(q, k, v), flashlab.flash_attention(q, k, v, causal=True))
    assert len(calls) == 1, f"recompiled for a new sequence length: {len(calls)} graphs"
    ops = [str(n.target) for n in calls[0].graph.nodes if n.op == "call_function"]
    assert any("flashlab.attention_forward" in t for t in ops), ops   # the custom op, not a traced launcher


class TinyAttention(torch.nn.Module):
    """One causal self-attention block: qkv projection, flashlab attention, output projection."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        o = flashlab.flash_attention(q, k, v, causal=True)            # (B, H, N, D)
        return self.out(o.transpose(1, 2).reshape(B, N, C))


def test_compiled_model_inductor_forward_and_backward(rng):
    """The default backend (inductor) compiles a model around the op; outputs and grads match eager."""
    torch._dynamo.reset()
    model = TinyAttention().to(DEV)
    x = _rand(2, 33, 32)

    y = model(x)
    y.square().mean().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    # One compile thread: a pool of compile workers costs more than it saves on a small CPU machine.
    # No graph caches: they are keyed on the forward graph, so a cached backward would hide a change
    # to flashlab/op.py's autograd formula (seen).  Compiled C++ is still reused, keyed on its source.
    functorch_cfg = {"enable_autograd_cache": False} if hasattr(torch._functorch.config, "enable_autograd_cache") else {}
    with torch._inductor.config.patch(compile_threads=1, fx_graph_cache=False), \
            torch._functorch.config.patch(**functorch_cfg):
        yc = torch.compile(model, fullgraph=True)(x)
        yc.square().mean().backward()
    # Same kernels; only the compiled code around them (fusions, matmul choice) differs: fp32 rounding.
    torch.testing.assert_close(yc, y, rtol=1e-4, atol=1e-5)
    for (name, p), g in zip(model.named_parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad of {name}: {m}")
