"""Registers and spills of each kernel version, compiled for sm_90 without a GPU.

    TRITON_INTERPRET=0 HD=64 python scripts/sass_stats.py fwd_v1 fwd_v2 fwd_v3 dkdv_v1 dkdv_v2 dq_v1 dq_v2 bwd_v3 bwd_v4
    TRITON_INTERPRET=0 HD=128 python scripts/sass_stats.py fwd_v2 dkdv_v2 dq_v2 bwd_v3 bwd_v4

Compiles with the installed Triton for GPUTarget("cuda", 90, 32) and reads the cubin with the
cuobjdump Triton ships: registers per thread, local-memory stores/loads (STL/LDL: spills) and
SASS lines, causal and not, fp16, at the H200's hand-picked tile shapes.
"""
import os, sys, subprocess, re, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashlab.kernels import forward, forward_v2, forward_v3, backward, backward_v2, backward_v3, backward_v4
CU = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
FP32 = {"LSE", "Delta", "DQ_ACC"}
CUBIN = os.path.join(tempfile.gettempdir(), "flashlab_sass_stats.cubin")
def stats(fn, causal, D, BM, BN, w, s):
    names = fn.arg_names
    sig, consts = {}, {}
    vals = dict(CAUSAL=causal, BLOCK_M=BM, BLOCK_N=BN, HEAD_DIM=D, DOT_PRECISION="ieee", HEAD_FASTEST=False,
                TMA_REDUCE=True, SPREAD=D > 64)
    for n in names:
        if n in vals: sig[n] = "constexpr"; consts[(names.index(n),)] = vals[n]
        elif n.endswith("_desc"):   # backward v4: a descriptor made on the host, in tiles of (1, 1, rows, D)
            rows = BM if n in ("q_desc", "o_desc", "do_desc", "dq_desc") else BN
            sig[n] = f"tensordesc<{'fp32' if n == 'dq_desc' else 'fp16'}[1, 1, {rows}, {D}]>"
        elif n[0].isupper() and n not in ("H", "Nq", "Nk", "N_KEY"): sig[n] = "*fp32" if n in FP32 else "*fp16"
        elif n in ("qk_scale", "sm_scale"): sig[n] = "fp32"
        else: sig[n] = "i32"
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": w, "num_stages": s})
    open(CUBIN, "wb").write(ck.asm["cubin"])
    res = subprocess.run([CU, "-res-usage", CUBIN], capture_output=True, text=True).stdout
    sass = subprocess.run([CU, "-sass", CUBIN], capture_output=True, text=True).stdout
    return (re.search(r"REG:(\d+)", res).group(1), len(re.findall(r"\bSTL", sass)), len(re.findall(r"\bLDL", sass)),
            len(sass.splitlines()), ck.metadata.shared // 1024)
which = sys.argv[1:]
K = {"fwd_v1": (forward.flash_fwd_kernel, 128, 64, 4, 3), "fwd_v2": (forward_v2.flash_fwd_kernel_v2, 128, 64, 4, 3),
     "fwd_v3": (forward_v3.flash_fwd_kernel_v3, 128, 64, 4, 3),
     "dkdv_v1": (backward.flash_bwd_dkdv_kernel, 32, 64, 4, 3), "dkdv_v2": (backward_v2.flash_bwd_dkdv_kernel_v2, 32, 64, 4, 3),
     "dq_v1": (backward.flash_bwd_dq_kernel, 64, 32, 4, 3), "dq_v2": (backward_v2.flash_bwd_dq_kernel_v2, 64, 32, 4, 3),
     "bwd_v3": (backward_v3.flash_bwd_kernel_v3, 64, 64, 4, 3), "bwd_v4": (backward_v4.flash_bwd_kernel_v4, 64, 64, 4, 3)}
K128 = {"dkdv_v2": (backward_v2.flash_bwd_dkdv_kernel_v2, 64, 128, 8, 3), "dq_v2": (backward_v2.flash_bwd_dq_kernel_v2, 128, 64, 8, 3),
        "fwd_v2": (forward_v2.flash_fwd_kernel_v2, 128, 128, 8, 3),
        "bwd_v3": (backward_v3.flash_bwd_kernel_v3, 64, 128, 8, 3), "bwd_v4": (backward_v4.flash_bwd_kernel_v4, 64, 128, 8, 3)}
D = int(os.environ.get("HD", "64"))
for name in which:
    fn, bm, bn, w, s = (K128 if D == 128 else K)[name]
    for causal in (False, True):
        print(name, f"D={D}", "causal" if causal else "non-causal", "regs/STL/LDL/sass-lines/shared-KiB", stats(fn, causal, D, bm, bn, w, s), flush=True)
