"""Dropout in forward / backward v6 against forward v4 / backward v5 and against the same call without dropout
(an sm_90 GPU; docs/BENCHMARKS.md has what it measured).

    python scripts/dropout_v6_probe.py [out.json]

The issue's shape (B 2, H 16, N 4096, D 128, bf16, causal, p = 0.1), then non-causal and GQA 32 / 8 at N 8192.
Each row runs flashlab.flash_attention with the versions forced, checks the output and the gradients against the
first row of its shape with the same seed (the masks are the same bits, so only rounding differs), then times the
forward and the backward (triton.testing.do_bench, median).  "x without" is the call without dropout (the plan's
own kernels) divided by the row's forward + backward.
"""
from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, ".")
import flashlab  # noqa: E402
from flashlab.kernels import plan as P  # noqa: E402
from v6_variant_probe import DT, D, FORCE, _bench  # noqa: E402  (its FORCE reaches every plan made here)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "dropout_v6_probe.json"
    rows = []
    torch.manual_seed(0)
    for label, B, H, Hk, N, causal in (("causal", 2, 16, 16, 4096, True), ("non-causal", 2, 16, 16, 4096, False),
                                       ("gqa 32/8 causal", 2, 32, 8, 8192, True)):
        q = torch.randn(B, H, N, D, device="cuda", dtype=DT).requires_grad_()
        k, v = (torch.randn(B, Hk, N, D, device="cuda", dtype=DT).requires_grad_() for _ in range(2))
        do = torch.randn(B, H, N, D, device="cuda", dtype=DT)
        base = None
        ref = None
        for p, fv, bv in ((0.0, None, None), (0.1, "v4", "v5"), (0.1, "v6", "v6"), (0.1, "v6", "v5"),
                          (0.1, "v4", "v6")):
            FORCE.clear()
            if fv:
                FORCE.update(forward_version=fv, backward_version=bv)
            P.forget()

            def call():
                return flashlab.flash_attention(q, k, v, is_causal=causal, dropout_p=p, seed=1234, enable_gqa=True)
            o = call()
            grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            t_f = _bench(call)
            t_b = _bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
            ran = [(x.fwd_version, x.bwd_version) for x in P._PLANS.values()]
            err = 0.0
            if p > 0 and ref is None:
                ref = (o.detach(),) + grads
            elif p > 0:
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip((o,) + grads, ref))
            if p == 0:
                base = t_f + t_b
            r = dict(case=label, B=B, H=H, Hk=Hk, N=N, p=p, versions=ran, fwd_ms=t_f, bwd_ms=t_b,
                     x_without=base / (t_f + t_b), max_diff_vs_v4_v5=err)
            rows.append(r)
            print(f"  {label:16s} p {p:.1f} {str(ran):24s} fwd {t_f:.3f} ms  bwd {t_b:.3f} ms  "
                  f"x without {r['x_without']:.3f}  diff {err:.1e}", flush=True)
            assert err < 0.1, f"{label}: {ran} disagrees with v4 / v5 ({err})"
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
