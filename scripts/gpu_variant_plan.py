"""GPU check: the variants launched through the launch plan (forward v4 / backward v5).

For each variant: print its plan, run forward + backward twice (the first call launches through
JITFunction.run, the second through the compiled kernels' runners), require the two to give the same
bits, and compare the first against the float64 reference; dropout runs with a seed that fits 32 bits
and one that needs 64 (the runner key tells them apart).  Prints one table row per case.

    python scripts/gpu_variant_plan.py
"""
import torch

import flashlab
from flashlab import kernels
from flashlab.kernels import tiles
from flashlab.reference import attention_variants_torch


def run(case, B, H, Hk, N, D, dtype, **kw):
    torch.manual_seed(0)
    q = torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hk, N, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    outs = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        o = flashlab.flash_attention(q, k, v, enable_gqa=Hk != H, **kw)
        o.backward(do)
        outs.append([o.detach().clone()] + [t.grad.clone() for t in (q, k, v)])
    same = all(torch.equal(a, b) for a, b in zip(*outs))
    err = float("nan")
    if "dropout_p" not in kw:
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref_kw = {n: kw[n] for n in ("is_causal", "window", "softcap", "alibi_slopes", "attn_mask") if n in kw}
        ref, _ = attention_variants_torch(qd, kd, vd, **ref_kw)
        ref.backward(do.double())
        err = max((a.double() - b).abs().max().item()
                  for a, b in zip(outs[0], (ref, qd.grad, kd.grad, vd.grad)))
    return case, same, err


def main():
    assert torch.cuda.is_available(), "a GPU check"
    print(kernels.plan.plan(2, 32, 8192, 8192, 128, torch.float16, True,
                            variant=kernels.plan.Variant(window=(1023, 0))))
    slopes = torch.rand(8, device="cuda")
    mask = torch.rand(1024, 1024, device="cuda") > 0.2
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        dt = str(dtype)[6:]
        rows.append(run(f"gqa 4:1 + window (255, 0) causal {dt}", 2, 8, 2, 2048, 64, dtype, is_causal=True,
                        window=(255, 0)))
        rows.append(run(f"softcap 30 + alibi, D 128 {dt}", 1, 8, 8, 1024, 128, dtype, softcap=30.0, alibi_slopes=slopes))
        rows.append(run(f"bool mask {dt}", 1, 8, 8, 1024, 64, dtype, attn_mask=mask))
        rows.append(run(f"dropout 0.1, seed 7 {dt}", 1, 8, 8, 1024, 64, dtype, dropout_p=0.1, seed=7))
        rows.append(run(f"dropout 0.1, seed 2^40 {dt}", 1, 8, 8, 1024, 64, dtype, dropout_p=0.1, seed=2**40))
    print(f"\nlaunches: {tiles.STATS}")
    print(f"{'case':<44} {'2nd call same bits':>18} {'max |err| vs f64':>17}")
    for case, same, err in rows:
        print(f"{case:<44} {str(same):>18} {err:>17.3g}")
    assert all(same for _, same, _ in rows), "the runner path changed the result"


if __name__ == "__main__":
    main()
