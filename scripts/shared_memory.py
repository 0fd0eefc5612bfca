"""Shared memory each tile config needs on each GPU the course names, by compiling for it.

    TRITON_INTERPRET=0 [KERNELS=fwd,dkdv,dq,bwd] python scripts/shared_memory.py [--quick] [--targets 75 89]

No GPU is needed: Triton compiles for a target (GPUTarget("cuda", 75, 32) is a T4) and
reports the shared memory of the compiled kernel.  For every kernel, head dim and target
it prints the first hand-picked config (the H200's choice), the config the launcher picks
for that target's limit by ``kernels.estimate_shared_memory``, and what each really needs.
"""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")   # compile, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashlab import kernels  # noqa: E402
from flashlab.kernels import backward_v2, backward_v3, forward_v2  # noqa: E402

TARGETS = {"sm_75 (T4)": (75, 64 * 1024), "sm_80 (A100)": (80, 163 * 1024),
           "sm_89 (L4, RTX 4090)": (89, 99 * 1024), "sm_90 (H100, H200)": (90, 227 * 1024)}
KERNELS = {"fwd": forward_v2.flash_fwd_kernel_v2, "dkdv": backward_v2.flash_bwd_dkdv_kernel_v2,
           "dq": backward_v2.flash_bwd_dq_kernel_v2, "bwd": backward_v3.flash_bwd_kernel_v3}
FP32_PTRS = {"LSE", "Delta", "DQ_ACC"}
CONSTS = {"CAUSAL", "BLOCK_M", "BLOCK_N", "HEAD_DIM", "DOT_PRECISION", "TMA_REDUCE", "SPREAD"}
FLOATS = {"qk_scale", "sm_scale"}


def compiled_shared(fn, cfg, head_dim, cc):
    names = fn.arg_names
    sig, consts = {}, {}
    values = dict(CAUSAL=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, DOT_PRECISION="ieee",
                  TMA_REDUCE=cc >= 90, SPREAD=head_dim > 64)   # backward v3 as its launcher compiles it
    for n in names:
        if n in CONSTS:
            sig[n] = "constexpr"
            consts[(names.index(n),)] = values[n]
        elif n[0].isupper() and n not in ("H", "Nq", "Nk", "N_KEY"):
            sig[n] = "*fp32" if n in FP32_PTRS else "*fp16"
        elif n in FLOATS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    ck = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return ck.metadata.shared


def main(quick=False, only=None):
    e = 2
    rows = []
    print(f"{'target':<22}{'kernel':<6}{'D':>4}  {'config':<22}{'estimate':>9}{'compiled':>10}  fits", flush=True)
    for tname, (cc, limit) in TARGETS.items():
        if only and cc not in only:
            continue
        for D in (64, 128):
            fw = kernels.forward_configs(D, torch.float16)
            bw = kernels.backward_configs(D, torch.float16)
            lists = {"fwd": fw, "dkdv": [p[0] for p in bw], "dq": [p[1] for p in bw],
                     "bwd": kernels.backward_v3_configs(D, torch.float16)}
            if os.environ.get("KERNELS"):
                lists = {k: v for k, v in lists.items() if k in os.environ["KERNELS"].split(",")}
            for kname, cands in lists.items():
                cap = divmod(cc, 10)
                fit = [c for c in cands if kernels.estimate_shared_memory(kname, c, D, e, cap) <= limit]
                picks = [("first", cands[0])]
                if fit and fit[0] != cands[0]:
                    picks.append(("picked", fit[0]))
                if quick:
                    picks = picks[-1:]
                for label, cfg in picks:
                    est = kernels.estimate_shared_memory(kname, cfg, D, e, cap)
                    try:
                        sh = compiled_shared(KERNELS[kname], cfg, D, cc)
                    except Exception as ex:  # a target this Triton cannot build for
                        sh = f"error {type(ex).__name__}"
                    ok = "yes" if isinstance(sh, int) and sh <= limit else "NO"
                    c = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} ({label})"
                    print(f"{tname:<22}{kname:<6}{D:>4}  {c:<22}{est // 1024:>7}KB"
                          f"{(sh // 1024 if isinstance(sh, int) else sh):>8}KB  {ok} (limit {limit // 1024} KB)",
                          flush=True)
                    rows.append((tname, kname, D, c, est, sh, ok))
    return rows


if __name__ == "__main__":
    only = [int(a) for a in sys.argv[sys.argv.index("--targets") + 1:]] if "--targets" in sys.argv else None
    main("--quick" in sys.argv, only)
