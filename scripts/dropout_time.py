"""Dropout's cost in one process, quickly: the call without dropout (v6 / v6 forced), forward v4 / backward v5 with
dropout and v6 / v6 with dropout, each output and gradient of v6 checked against v4 / v5's (the same mask bits), at
B 2, H 16, N 4096, D 128, bf16, causal and not, p = 0.1 (an sm_90 GPU).  For comparing two checkouts of the kernels
(PYTHONPATH=checkout python scripts/dropout_time.py TAG OUT.json, one process each); scripts/dropout_v6_probe.py is
the fuller table.
"""
import json
import sys

import torch
from triton.testing import do_bench

import flashlab
from flashlab.kernels import plan as P

tag = sys.argv[1]
_plan = P.plan
FORCE = {}
P.plan = lambda *a, **kw: _plan(*a, **dict(kw, **FORCE))
torch.manual_seed(0)
res = {}
for label, B, H, Hk, N, causal in (("causal", 2, 16, 16, 4096, True), ("non-causal", 2, 16, 16, 4096, False)):
    q = torch.randn(B, H, N, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(B, Hk, N, 128, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    do = torch.randn(B, H, N, 128, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for p, fv, bv in ((0.0, "v6", "v6"), (0.1, "v4", "v5"), (0.1, "v6", "v6")):
        FORCE.clear()
        FORCE.update(forward_version=fv, backward_version=bv)
        P.forget()
        f = lambda: flashlab.flash_attention(q, k, v, is_causal=causal, dropout_p=p, seed=7)   # noqa: E731
        o = f()
        g = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        outs[(p, fv)] = (o.detach(),) + g
        tf = do_bench(f, warmup=25, rep=100, return_mode="median")
        tb = do_bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), warmup=25, rep=100,
                      return_mode="median")
        res[f"{label} p={p} {fv}/{bv}"] = (tf, tb)
        print(f"{tag} {label:10s} p={p} {fv}/{bv}: fwd {tf:.3f} bwd {tb:.3f} ms", flush=True)
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs[(0.1, "v6")], outs[(0.1, "v4")]))
    print(f"{tag} {label} v6 vs v4/v5 max diff {err:.2e}", flush=True)
    assert err < 0.1, f"{label}: v6 with dropout disagrees with v4 / v5 ({err})"
with open(sys.argv[2], "w") as fh:
    json.dump(res, fh, indent=1)
