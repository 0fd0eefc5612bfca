"""The SASS of forward or backward v6's loops over tiles: instructions, local-memory stores and loads (spills) a step.

    TRITON_INTERPRET=0 python scripts/sass_loops.py bwd --causal --softcap
    TRITON_INTERPRET=0 python scripts/sass_loops.py bwd --band --kv-group 4
    TRITON_INTERPRET=0 python scripts/sass_loops.py fwd --causal --varlen
    TRITON_INTERPRET=0 python scripts/sass_loops.py fwd --band --persist

Compiles the kernel for sm_90 without a GPU (Triton's compiler and ptxas; the cuobjdump Triton ships reads the cubin),
finds its loops (a branch back to an earlier address) that hold tensor-core instructions (HGMMA) and no such loop
inside them, and prints each: its address, instructions, STL and LDL.  The compiler may give each consumer warpgroup
its own copy of a loop (backward v6 with a masked and an unmasked loop prints four); the epilogue's and the producer's
loops are not printed (they have no HGMMA).  docs/BENCHMARKS.md quotes these counts with the Triton version they came from.
"""
import argparse
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


def tile_loops(cubin: bytes) -> list:
    """[(address, instructions, STL, LDL, HGMMA)] of the innermost loops holding HGMMA, in address order."""
    path = os.path.join(tempfile.gettempdir(), "flashlab_sass_loops.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    sass = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True, check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    out = []
    for lo, hi in loops:
        if any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in loops):
            continue                                           # not innermost
        body = [t for a, t in ins if lo <= a <= hi]
        hg = sum("HGMMA" in t for t in body)
        if hg:
            out.append((hex(lo), len(body), sum(bool(re.search(r"\bSTL", t)) for t in body),
                        sum(bool(re.search(r"\bLDL", t)) for t in body), hg))
    return sorted(out, key=lambda r: int(r[0], 16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=("fwd", "bwd"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--band", action="store_true", help="a window")
    ap.add_argument("--softcap", action="store_true")
    ap.add_argument("--dropout", action="store_true")
    ap.add_argument("--varlen", action="store_true", help="packed sequences")
    ap.add_argument("--kv-group", type=int, default=1, help="GQA: query heads per K/V head (backward)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--persist", action="store_true", help="the forward on a persistent grid")
    a = ap.parse_args()
    kw = dict(causal=a.causal, dtype=a.dtype, band=a.band, softcap=a.softcap, dropout=a.dropout, varlen=a.varlen)
    if a.kernel == "bwd":
        from flashlab.kernels import backward_v6
        ck = backward_v6.compile_sm90(kv_group=a.kv_group, **kw)
    else:
        from flashlab.kernels import forward_v6
        ck = forward_v6.compile_sm90(persist=a.persist, **kw)
    print(f"{a.kernel} v6 {kw}, kv_group {a.kv_group}{', persistent' if a.persist else ''}; triton {triton.__version__}, "
          "sm_90")
    for addr, n, stl, ldl, hg in tile_loops(ck.asm["cubin"]):
        print(f"  loop at {addr:>8s}: {n:5d} instructions, {stl:3d} STL, {ldl:3d} LDL ({hg} HGMMA)")


if __name__ == "__main__":
    main()
