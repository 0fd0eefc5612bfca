"""Backward v6 on an sm_90 GPU: check it against float64, then time it beside backward v4, v2 and SDPA cuDNN.

    python scripts/bwd_v6_probe.py check [N_CASES]          # ragged, Nq != Nk, fp16/bf16, causal both
    python scripts/bwd_v6_probe.py time 4096,16384 OUT.json  # 16k tokens, H = 16, D = 128, backward only
    python scripts/bwd_v6_probe.py lpt 4096,16384 OUT.json   # causal: the longest-first order checked, then timed

The timed providers: v6 as the plan forces it (2 stages), v6 with 3 stages, backward v4 and v2 forced, and cuDNN; the forward is the op's own in every case.
"""
import json
import sys
import time

import torch

from flashlab import bench
from flashlab.accuracy import check_attention
from flashlab.kernels import version_op
from flashlab.kernels.tiles import C


def check_case(op, B, H, nq, nk, dtype, causal, label="") -> bool:
    """op's forward and backward against float64 on fresh data (logits x 4, D = 128); prints a line, and the
    checks when one fails."""
    q, k, v = (torch.randn(B, H, n, 128, device="cuda") for n in (nq, nk, nk))
    q, k = 4 * q, 2 * k
    t = time.time()
    checks = check_attention(op, q.to(dtype), k.to(dtype), v.to(dtype), causal, backward=True)
    torch.cuda.synchronize()
    ok = all(c.ok for c in checks)
    print(f"{label}{B},{H},{nq},{nk} {str(dtype)[6:]} causal={causal} {'ok' if ok else 'FAIL'} {time.time() - t:.1f}s",
          flush=True)
    if not ok:
        print("\n".join(map(str, checks)), flush=True)
    return ok


mode = sys.argv[1]
if mode == "check":
    torch.manual_seed(0)
    fails = 0
    cases = [(1, 1, 256, 256), (2, 3, 4096, 4096), (2, 3, 1000, 1000), (2, 3, 2050, 2050), (2, 3, 700, 1900),
             (2, 3, 1900, 700), (2, 3, 130, 64), (1, 2, 64, 130)]
    if len(sys.argv) > 2:
        cases = cases[:int(sys.argv[2])]
    for (B, H, nq, nk) in cases:
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                fails += not check_case(version_op(None, "v6"), B, H, nq, nk, dtype, causal)
    print("FAILS", fails)
elif mode == "lpt":
    # causal grids longest first over sections of heads: check forward and backward v6 with sections that do not
    # divide B * H; then time the section sizes (1 is the launch order before), the non-causal backward, the forward
    from flashlab.kernels import tiles
    torch.manual_seed(0)
    fails = 0
    for group, causal in ((4, True), (None, True), (None, False)):
        tiles.HEAD_GROUP = group
        op = version_op("v6", "v6")
        for (B, H, nq, nk) in ((2, 3, 4096, 4096), (2, 3, 2050, 2050), (2, 3, 700, 1900), (2, 3, 1900, 700),
                               (1, 5, 130, 64)):
            for dtype in (torch.float16, torch.bfloat16):
                fails += not check_case(op, B, H, nq, nk, dtype, causal, f"group={group} ")
    print("FAILS", fails, flush=True)
    rows = []
    seqs = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 16384]

    def grouped(f, g, i=0):
        def fn(q, k, v, c):
            tiles.HEAD_GROUP = g
            return f(q, k, v, c)[i]
        return fn
    cases = [("bwd", True, (1, 2, 4, None)), ("bwd", False, (None,)), ("fwd", True, (None,))]
    for dtype in (torch.float16, torch.bfloat16):
        for N in seqs:
            for mode_, causal, groups in cases:
                provs = [(f"v6-g{g or 'rule'}", grouped(version_op("v6", "v6"), g)) for g in groups]
                rr = bench.run_case(provs + ["sdpa-cudnn"], N, 128, dtype, causal, mode_)
                for r in rr:
                    print(f"{r.mode} {r.dtype} causal={r.causal} N={r.N} {r.provider:<12} {r.ms:8.3f} ms "
                          f"{r.tflops:6.1f} {r.status}", flush=True)
                rows += bench.as_dicts(rr)
                json.dump(rows, open(sys.argv[3] if len(sys.argv) > 3 else "/tmp/lpt.json", "w"), indent=1)
elif mode == "time":
    rows = []
    seqs = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 4096, 16384]
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            for N in seqs:
                wrap = lambda f: (lambda q, k, v, c: f(q, k, v, c)[0])
                provs = [("v6", wrap(version_op(None, "v6"))), ("v6-s3", wrap(version_op(None, "v6", None, C(64, 128, 4, 3)))),
                         ("v4", wrap(version_op(None, "v4"))), ("v2", wrap(version_op(None, "v2"))), "sdpa-cudnn"]
                rr = bench.run_case(provs, N, 128, dtype, causal, "bwd")
                for r in rr:
                    print(f"{r.dtype} causal={r.causal} N={r.N} {r.provider:<12} {r.ms:8.3f} ms {r.tflops:6.1f} {r.status}", flush=True)
                rows += bench.as_dicts(rr)
    json.dump(rows, open(sys.argv[3] if len(sys.argv) > 3 else "/tmp/bwd6.json", "w"), indent=1)
