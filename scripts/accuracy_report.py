"""Max errors of flashlab.flash_attention against float64, per dtype, next to PyTorch's own.

    python scripts/accuracy_report.py            # small sizes in the interpreter, larger on a GPU
    python scripts/accuracy_report.py --fp8      # the FP8 forward beside the bf16 forward

Prints, per dtype and output (o, lse, dq, dk, dv), the worst error over ragged shapes, both
causal modes and large-magnitude logits, PyTorch's same-dtype error on the same case, and the
accuracy rule's bound (flashlab.accuracy).  With ``--fp8``: max and mean |O - float64| of the bf16
forward and of the FP8 forward on the same bf16 inputs, and the FP8 error split into its input
quantisation and the kernel's own (flashlab.accuracy.fp8_errors).
"""
import sys

import torch

import flashlab
from flashlab import device
from flashlab.accuracy import check_attention

SHAPES = device.pick(gpu=[(2, 4, 1000, 1000, 64), (1, 4, 1537, 777, 128)],
                     cpu=[(2, 2, 100, 129, 32), (1, 2, 129, 100, 64)])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def fa(q, k, v, causal, scale):
    return flashlab.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)



def fp8_report():
    from flashlab.accuracy import fp8_errors
    shapes = device.pick(gpu=[(1, 8, 4096, 4096, 128), (2, 4, 1537, 1000, 64)], cpu=[(1, 2, 256, 256, 64)])
    torch.manual_seed(0)
    print(f"device: {device.DEVICE}, interpreter: {device.INTERPRET}; inputs bf16, randn * magnitude for q and k")
    for (B, H, nq, nk, D) in shapes:
        for causal in (False, True):
            for mag in (1.0, 4.0):
                q = (mag * torch.randn(B, H, nq, D, device=device.DEVICE)).bfloat16()
                k = (mag * torch.randn(B, H, nk, D, device=device.DEVICE)).bfloat16()
                v = torch.randn(B, H, nk, D, device=device.DEVICE).bfloat16()
                print(f"{(B, H, nq, nk, D)} causal={causal} |q|,|k|~{mag}:")
                for e in fp8_errors(q, k, v, causal):
                    print("   ", e, flush=True)


if "--fp8" in sys.argv[1:]:
    fp8_report()
    sys.exit(0)

torch.manual_seed(0)
worst = {}
for dtype in DTYPES:
    for (B, H, nq, nk, D) in SHAPES:
        for causal in (False, True):
            for mag in (1.0, 8.0):
                q = (mag * torch.randn(B, H, nq, D, device=device.DEVICE)).to(dtype)
                k = (mag * torch.randn(B, H, nk, D, device=device.DEVICE)).to(dtype)
                v = torch.randn(B, H, nk, D, device=device.DEVICE).to(dtype)
                checks = check_attention(fa, q, k, v, causal)
                print(f"{str(dtype):<15}{str((B, H, nq, nk, D)):<26}causal={causal!s:<6}|q|,|k|~{mag}: "
                      + "  ".join(f"{c.name} {c.err:.1e}/{c.bound:.1e}" for c in checks), flush=True)
                for c in checks:
                    key = (str(dtype).split(".")[1], c.name)
                    if key not in worst or c.err / c.bound > worst[key][0].err / worst[key][0].bound:
                        worst[key] = (c, f"{(B, H, nq, nk, D)} causal={causal} |q|,|k|~{mag}")
print(f"device: {device.DEVICE}, interpreter: {device.INTERPRET}")
print(f"{'dtype':<9}{'out':<5}{'err':>10}{'torch err':>11}{'bound':>10}  ok   case with the largest err/bound")
for (dt, name), (c, case) in worst.items():
    print(f"{dt:<9}{name:<5}{c.err:>10.2e}{c.torch_err:>11.2e}{c.bound:>10.2e}  {'yes' if c.ok else 'NO '}  {case}")
