"""The accuracy rule the tests hold the kernels to.

Who uses what (three different needs, so three checks, said plainly):

* the tests (``tests/test_attention.py``, ``tests/test_gpu.py``) and
  ``scripts/accuracy_report.py`` judge ``flashlab``'s kernels by the rule below;
* the grader (``flashlab/grader/exercises/``) does not run PyTorch's same-dtype
  attention on every case; it uses fixed tolerances per dtype instead (1e-8
  relative for the float64 NumPy exercises; for kernels 1e-4 fp32 in the
  interpreter, 5e-3 fp32 on a GPU where TF32 is allowed, 1e-2 fp16 and 4e-2 bf16
  for O), set so that a right kernel passes without a second reference run;
* the benchmark (``flashlab/bench.py``) only refuses to time a provider whose
  output is grossly wrong (its own per-dtype table); it is a gate, not a test.

FlashAttention's own tests judge a kernel against PyTorch, not against a fixed
number: the kernel's error against a float64 reference may be at most twice
the error of PyTorch's own attention in the same dtype, plus a small floor.

    err(ours)  = max |ours  - ref64|
    err(torch) = max |torch_same_dtype - ref64|
    pass  <=>  err(ours) <= 2 * err(torch) + floor * max(1, max |ref64|)

One addition for gradients.  A FlashAttention backward recomputes P = e^(S - L)
from the float32 LSE it saved, so every P_ij of row i carries L_i's rounding
error, |L_i| * 2^-24, the same sign along the row.  PyTorch's autograd keeps P
itself and has no such term.  With ordinary data |L| ~ 5 and it is invisible; with
scores in the hundreds it dominates an fp32 backward.  So the gradient bound adds
    4 * max|L| * 2^-24 * max(1, max |ref64|).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import attention_naive_torch

# relative floor per dtype (times max(1, |reference|)): a few ulps of the dtype
FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}


@dataclass
class Check:
    name: str
    err: float        # max |ours - ref64|
    torch_err: float  # max |torch same-dtype - ref64|
    bound: float      # 2 * torch_err + floor
    ok: bool

    def __str__(self):
        mark = "ok " if self.ok else "BAD"
        return f"{mark} {self.name:<4} err {self.err:.2e}  torch {self.torch_err:.2e}  bound {self.bound:.2e}"


def judge(name: str, ours: torch.Tensor, torch_same: torch.Tensor, ref64: torch.Tensor, dtype,
          lse_max: float = 0.0) -> Check:
    """Judge one output; ``lse_max`` (max |L|) adds the recomputed-P term for gradients."""
    ref64 = ref64.double()
    err = (ours.double() - ref64).abs().max().item()
    terr = (torch_same.double() - ref64).abs().max().item()
    floor = (FLOOR[dtype] + 4 * lse_max * 2.0**-24) * max(1.0, ref64.abs().max().item())
    bound = 2 * terr + floor
    ok = bool(err <= bound)  # NaN compares False: NaN never passes
    return Check(name, err, terr, bound, ok)


def reference_outputs(q, k, v, do, causal: bool, scale=None, dtype=None):
    """(o, lse, dq, dk, dv) of naive attention computed in ``dtype`` (default: float64) by autograd.

    The same-dtype run is "PyTorch's own error" in the accuracy rule.  bf16/fp16
    runs on the CPU work too (PyTorch computes them, slowly).
    """
    dtype = dtype or torch.float64
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, lse = attention_naive_torch(qq, kk, vv, causal, scale)
    o.backward(do.to(dtype))
    return o.detach(), lse.detach(), qq.grad, kk.grad, vv.grad


def check_attention(fn, q, k, v, causal: bool, scale=None, backward: bool = True, do=None):
    """Run ``fn(q, k, v, causal, scale) -> (o, lse)`` and judge o, lse (and dq, dk, dv) by the rule.

    Returns a list of :class:`Check`.
    """
    dtype = q.dtype
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    o, lse = fn(q, k, v, causal, scale)
    if do is None:
        do = torch.randn_like(o)
    ref = reference_outputs(q, k, v, do, causal, scale, torch.float64)
    same = reference_outputs(q, k, v, do, causal, scale, dtype)
    checks = [judge("o", o, same[0], ref[0], dtype), judge("lse", lse, same[1], ref[1], torch.float32)]
    if backward:
        o.backward(do)
        lse_max = ref[1].abs().max().item()
        for name, g, s_, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), same[2:], ref[2:]):
            checks.append(judge(name, g, s_, r, dtype, lse_max))
    return checks


# ------------------------------------------------------------------------------------------------ FP8 beside bf16

@dataclass
class Error:
    name: str
    max_err: float    # max |out - ref64|
    mean_err: float   # mean |out - ref64|

    def __str__(self):
        return f"{self.name:<34} max {self.max_err:.2e}  mean {self.mean_err:.2e}"


def fp8_errors(q, k, v, causal: bool = False, scale=None) -> list:
    """The bf16 forward and the FP8 forward on the same inputs, each against float64 attention of those inputs.

    ``q``, ``k``, ``v``: (B, H, N, D) bf16 (what both forwards start from).  Returns :class:`Error` rows:
    ``bf16 forward`` (``flash_attention``), ``fp8 forward`` (``flash_attention(..., fp8=True)``: Q, K, V
    quantised to e4m3, P rounded to e4m3) and, to show where the FP8 error enters, ``fp8 inputs only`` (float64
    attention of the dequantised e4m3 inputs: the quantisation alone) and ``fp8 kernel vs its own inputs`` (the
    kernel against that: P's rounding and float32 arithmetic).  The FP8 forward runs on GPUs of compute
    capability >= 8.9 and in the interpreter."""
    from . import flash_attention
    from .fp8 import dequantize_fp8, flash_attention_fp8, quantize_fp8
    q, k, v = (t.detach().to(torch.bfloat16) for t in (q, k, v))
    ref = attention_naive_torch(q.double(), k.double(), v.double(), causal, scale)[0]
    with torch.no_grad():
        o16 = flash_attention(q, k, v, is_causal=causal, scale=scale)
        o8 = flash_attention(q, k, v, is_causal=causal, scale=scale, fp8=True)
        (q8, qs), (k8, ks), (vt8, vs) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v, transpose=True)
        deq = attention_naive_torch(dequantize_fp8(q8, qs), dequantize_fp8(k8, ks),
                                    dequantize_fp8(vt8, vs, transposed=True), causal, scale)[0]
        o8k = flash_attention_fp8(q8, k8, vt8, qs, ks, vs, causal, scale, out_dtype=torch.float32)

    def row(name, out, against):
        d = (out.double() - against).abs()
        return Error(name, d.max().item(), d.mean().item())
    return [row("bf16 forward", o16, ref), row("fp8 forward", o8, ref), row("fp8 inputs only (float64)", deq, ref),
            row("fp8 kernel vs its own inputs", o8k, deq)]
