"""Dropout's keep bits: other forms of ``forward_v4.dropout_keep`` (the same bits), checked and timed.

    python scripts/dropout_probe.py                     # the forms, each in a fresh process: check, time (GPU)
    python scripts/dropout_probe.py --impl gather       # one form (and the call without dropout)
    python scripts/dropout_probe.py --quick             # CPU: the interpreter at tiny sizes (checks only)
    TRITON_INTERPRET=0 python scripts/dropout_probe.py --sass   # compiled for sm_90 without a GPU: SASS counts

Each form replaces ``flashlab.kernels.forward_v4.dropout_keep`` and ``backward_v5.dropout_keep`` before a kernel
compiles, in a process of its own (so Triton's cache sees one form), then

1. checks the bits: the debug mask kernel against ``flashlab.reference.dropout_keep`` (NumPy Philox), and a
   small causal dropout call (O, LSE, dQ, dK, dV) against the float64 reference given the kernel's mask, by
   the accuracy rule the tests use (at the H200's tiles for D = 128 when on a GPU);
2. times ``flashlab.flash_attention(q, k, v, dropout_p=0.1, is_causal=True, seed=...)`` at B 2, H 16, N 4096,
   D 128, bf16: forward, and forward + backward (``triton.testing.do_bench``, median), against the same
   call with dropout_p = 0 (timed once, in the first process).  The ratio is time without / time with:
   1.0 means dropout is free.

Why the forms (compiled for sm_90 with Triton 3.9, tiles 128 x 128 forward, 64 x 128 dK/dV, 128 x 64 dQ):
"select" (one Philox call per 16 scores of a row, each column's word and byte picked in a (R, G, 16) tensor
reshaped to (R, C)) costs no layout conversion at all: Triton recomputes the whole Philox chain in the score
tile's MMA layout.  But there each thread holds 2 rows x all G groups of the tile while the four threads of a
quad hold the same rows (they differ in columns 2t, 2t + 1 of every 8): every Philox call runs 4 times
(forward, dQ; 8 times in dK/dV, whose transposed tile puts one 16-key group per warp).  IMAD goes
171 -> 1707 in the forward, LOP3 60 -> 1148, SASS instructions 3808 -> 7360; no shared memory is added.
The other forms evaluate Philox once per (row, group) and move words or bits to the MMA layout: fewer
integer instructions, but a shared-memory round trip (convert_layout, STS/LDS, barriers), register spills
at 255 registers, and 16 KiB more shared memory, which at 128 x 128 with 3 stages passes the H200's
227 KiB, so the launcher falls back to the next hand-picked tile (printed with the timings).  "current" is
forward v4's own form, the 16 bits of a group built by joins (on the H200 the fastest of the three tried:
docs/BENCHMARKS.md, 2026-12-02); "gather" fetches each column pair's word with tl.gather; "mixed" keeps the
current form in the forward and gathers in the backward.
``--sass`` prints these counts for each form with the Triton at hand.

Forms that move fewer bytes to the tile (docs/BENCHMARKS.md, the entry "dropout's cost taken apart"): "bits"
packs a group's 16 tests into one word and lets each score take its bit; nothing stops Triton from
recomputing Philox in the MMA layout again (IMAD 171 -> 2441 in the forward).  "nibble" and "byte" keep a join
on a dimension the quad's lanes split, so Philox runs once, and cross 1 byte per 4 or per 8 scores (the byte
form's forward fits 128 x 128 tiles in the H200's 227 KiB, 232448 bytes exactly).  "rounds7" and "rounds0" are
the current form with Philox-4x32-7 and with no rounds at all (other bits, checked against the NumPy
reference with the same rounds): what Philox's rounds cost, and what everything else costs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if "--sass" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"                    # compile for the GPU target, no GPU needed

import flashlab  # noqa: E402  (sets TRITON_INTERPRET before triton.jit runs: the forms below follow it)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from flashlab.kernels.forward_v4 import dropout_keep as keep_join  # noqa: E402  (before install() replaces it)
from flashlab.kernels.forward_v4 import dropout_top_threshold, dropout_words  # noqa: E402  (shared by every form)

# ------------------------------------------------------------------------------------------------ the forms
# Every form has forward_v4.dropout_keep's contract: keep mask (BLOCK_R, BLOCK_C) of the scores
# (rows, col0 + 0 ... BLOCK_C - 1) of (batch * H + head) bh; Philox counter (column // 16, row, bh, 0), key the
# seed; column j takes byte j % 4 of word (j // 4) % 4 and is kept when that byte is >= 256 p.


@triton.jit
def keep_shift(seed, bh, rows, col0, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The current layout (word picked per slot of a (R, G, 16) tensor, reshaped); the byte is tested by
    shifting it to the top of the word and comparing with 256 p << 24 (no mask, no narrowing)."""
    G: tl.constexpr = BLOCK_C // 16
    w0, w1, w2, w3 = dropout_words(seed, bh, rows, col0, G)
    slot = tl.arange(0, 16)[None, None, :]
    word = tl.where(slot < 8, tl.where(slot < 4, w0[:, :, None], w1[:, :, None]),
                    tl.where(slot < 12, w2[:, :, None], w3[:, :, None]))
    keep = (word << ((3 - slot % 4) * 8).to(tl.uint32)) >= dropout_top_threshold(p_drop)
    return tl.reshape(keep, (BLOCK_R, BLOCK_C))


@triton.jit
def keep_gather(seed, bh, rows, col0, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Philox once per (row, group); the row's words in column order, (R, 4 G) (word of column j: j // 4);
    each pair of columns (2m, 2m + 1) gathers its word, tests its two bytes; the pairs joined to (R, C)."""
    G: tl.constexpr = BLOCK_C // 16
    w0, w1, w2, w3 = dropout_words(seed, bh, rows, col0, G)
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_R, 4 * G))   # [g, 2a + b] = w(2a + b)
    m = tl.arange(0, BLOCK_C // 2)
    word = tl.gather(words, (m // 2)[None, :] + rows[:, None] * 0, 1)                  # (R, C / 2)
    thr = dropout_top_threshold(p_drop)
    sh = ((1 - m % 2) * 16).to(tl.uint32)[None, :]                                      # bytes 2 (m % 2), + 1
    even = (word << (sh + 8)) >= thr
    odd = (word << sh) >= thr
    return tl.reshape(tl.join(even, odd), (BLOCK_R, BLOCK_C))


@triton.jit
def _word_tests(w, thr):
    """A word's four byte tests as bits 0-3 (bit b: byte b >= 256 p), uint32."""
    return (((w << 24) >= thr).to(tl.uint32) | (((w << 16) >= thr).to(tl.uint32) << 1)
            | (((w << 8) >= thr).to(tl.uint32) << 2) | ((w >= thr).to(tl.uint32) << 3))


@triton.jit
def keep_bits(seed, bh, rows, col0, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Philox once per (row, group); the group's 16 tests packed into one word's bits 0-15 (bit j: column
    16 g + j), then each score takes its bit: (R, G) words move to the tile's layout, not (R, C) bytes."""
    G: tl.constexpr = BLOCK_C // 16
    w0, w1, w2, w3 = dropout_words(seed, bh, rows, col0, G)
    thr = dropout_top_threshold(p_drop)
    m = _word_tests(w0, thr) | (_word_tests(w1, thr) << 4) | (_word_tests(w2, thr) << 8) | (_word_tests(w3, thr) << 12)
    j = tl.arange(0, 16).to(tl.uint32)[None, None, :]
    return tl.reshape((m[:, :, None] >> j) & 1, (BLOCK_R, BLOCK_C)) != 0


@triton.jit
def _nibble(wlo, whi, c: tl.constexpr, thr):
    """Bits (2a + d) = the tests of byte 2c + d of word wlo (a = 0) and of whi (a = 1)."""
    k0 = ((wlo << (24 - 16 * c)) >= thr).to(tl.uint8)
    k1 = ((wlo << (16 - 16 * c)) >= thr).to(tl.uint8)
    k2 = ((whi << (24 - 16 * c)) >= thr).to(tl.uint8)
    k3 = ((whi << (16 - 16 * c)) >= thr).to(tl.uint8)
    return k0 | (k1 << 1) | (k2 << 2) | (k3 << 3)


@triton.jit
def keep_nibble(seed, bh, rows, col0, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Philox once per (row, group); column 16 g + 8a + 4b + 2c + d is byte 2c + d of word 2a + b.  The four
    columns a thread of an MMA quad holds for (b, c) (a and d vary) go in one byte's 4 bits, the (R, G, c, b)
    bytes built by joins (1 byte per 4 scores crosses to the tile's layout), the bits taken out there."""
    w0, w1, w2, w3 = dropout_words(seed, bh, rows, col0, BLOCK_C // 16)
    thr = dropout_top_threshold(p_drop)
    nib = tl.join(tl.join(_nibble(w0, w2, 0, thr), _nibble(w0, w2, 1, thr)),
                  tl.join(_nibble(w1, w3, 0, thr), _nibble(w1, w3, 1, thr)))          # (R, G, c, b)
    ad = tl.arange(0, 4).to(tl.uint8)
    bits = (nib[:, :, :, :, None] >> ad[None, None, None, None, :]) & 1              # (R, G, c, b, 2a + d)
    bits = tl.reshape(bits, (BLOCK_R, BLOCK_C // 16, 2, 2, 2, 2))                      # (R, G, c, b, a, d)
    return tl.reshape(tl.permute(bits, (0, 1, 4, 3, 2, 5)), (BLOCK_R, BLOCK_C)) != 0


@triton.jit
def keep_byte(seed, bh, rows, col0, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """As "nibble", with c in the bits too: one byte per (row, group, b), bit 4c + 2a + d; the (R, G, b) bytes
    built by one join (1 byte per 8 scores crosses to the tile's layout)."""
    w0, w1, w2, w3 = dropout_words(seed, bh, rows, col0, BLOCK_C // 16)
    thr = dropout_top_threshold(p_drop)
    by = tl.join(_nibble(w0, w2, 0, thr) | (_nibble(w0, w2, 1, thr) << 4),
                 _nibble(w1, w3, 0, thr) | (_nibble(w1, w3, 1, thr) << 4))             # (R, G, b)
    cad = tl.arange(0, 8).to(tl.uint8)
    bits = (by[:, :, :, None] >> cad[None, None, None, :]) & 1                       # (R, G, b, 4c + 2a + d)
    bits = tl.reshape(bits, (BLOCK_R, BLOCK_C // 16, 2, 2, 2, 2))                      # (R, G, b, c, a, d)
    return tl.reshape(tl.permute(bits, (0, 1, 4, 2, 3, 5)), (BLOCK_R, BLOCK_C)) != 0


@triton.jit
def keep_rounds7(seed, bh, rows, col0, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The current form with Philox-4x32-7 (the fewest rounds its authors found to pass BigCrush): other bits."""
    return keep_join(seed, bh, rows, col0, p_drop, BLOCK_R, BLOCK_C, 7)


@triton.jit
def keep_rounds0(seed, bh, rows, col0, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The current form with no Philox rounds (the counters as words; not random): what all but Philox costs."""
    return keep_join(seed, bh, rows, col0, p_drop, BLOCK_R, BLOCK_C, 0)


@triton.jit
def keep_select(seed, bh, rows, col0, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The form forward v4 had before the joins: each column's word picked per slot of a (R, G, 16) tensor, its
    byte shifted out and narrowed, the tensor reshaped to (R, C) (Philox recomputed per thread of a quad)."""
    G: tl.constexpr = BLOCK_C // 16
    w0, w1, w2, w3 = dropout_words(seed, bh, rows, col0, G)
    slot = tl.arange(0, 16)[None, None, :]
    word = tl.where(slot < 8, tl.where(slot < 4, w0[:, :, None], w1[:, :, None]),
                    tl.where(slot < 12, w2[:, :, None], w3[:, :, None]))
    byte = ((word >> ((slot % 4) * 8).to(tl.uint32)) & 0xFF).to(tl.uint8)
    threshold = tl.cast(p_drop * 256.0 + 0.5, tl.int32)
    return tl.reshape(byte, (BLOCK_R, BLOCK_C)).to(tl.int32) >= threshold


# name -> (forward v4's form, backward v5's form); None: the one in flashlab/kernels/forward_v4.py.  The bits are
# the same, so the forward and the backward may use different forms ("mixed": the forward keeps its form, the
# backward gathers).
FORMS = {"current": (None, None), "gather": (keep_gather, keep_gather), "select": (keep_select, keep_select),
         "mixed": (None, keep_gather), "shift": (keep_shift, keep_shift),
         "bits": (keep_bits, keep_bits), "nibble": (keep_nibble, keep_nibble),
         "byte": (keep_byte, keep_byte), "rounds7": (keep_rounds7, keep_rounds7),
         "rounds0": (keep_rounds0, keep_rounds0)}
ROUNDS = {"rounds7": 7, "rounds0": 0}   # the forms whose bits are Philox with fewer rounds (10 otherwise)
DEFAULT = ("current", "select", "gather", "mixed")   # "shift" saves ~2 % of the SASS only: on request


def install(name: str):
    """Put form ``name`` in place of dropout_keep (before anything compiles)."""
    from flashlab.kernels import backward_v5, forward_v4
    fwd, bwd = FORMS[name]
    if fwd is not None:
        forward_v4.dropout_keep = fwd            # the forward and the debug mask kernel
    if bwd is not None:
        backward_v5.dropout_keep = bwd           # imported by name: its own binding


# ------------------------------------------------------------------------------------------------ checks

def check_bits(gpu: bool, rounds: int = 10) -> tuple[bool, str]:
    import numpy as np
    from flashlab import device
    from flashlab.kernels import forward_v4
    from flashlab.reference import dropout_keep
    sizes = [(0.1, 7, 2, 2, 33, 50), (0.5, 2**40 + 3, 1, 3, 40, 70)]
    if gpu:
        sizes.append((0.1, 12345, 2, 2, 300, 260))
    for p, seed, B, H, Nq, Nk in sizes:
        m = forward_v4.dropout_mask(B, H, Nq, Nk, p, seed, device=device.DEVICE).cpu().numpy()
        for b in range(B):
            for h in range(H):
                ref = dropout_keep(seed, b * H + h, np.arange(Nq), np.arange(Nk), p, rounds)
                if not (m[b, h] == ref).all():
                    return False, f"mask differs: p {p}, seed {seed}, (b, h) ({b}, {h}), {(m[b, h] != ref).sum()} bits"
    return True, "mask kernel = NumPy reference"


def check_attention(gpu: bool) -> tuple[bool, str]:
    """A causal dropout call against float64 given the kernel's mask (tests/test_variants.py's rule)."""
    import torch
    from flashlab import device, variants
    from flashlab.accuracy import judge
    from flashlab.reference import attention_variants_torch, dropout_rate
    dev = device.DEVICE
    # H 16, N a multiple of 16: the specialisation the timing below runs (no second compile)
    B, H, N, D, dtype = (1, 16, 384, 128, torch.bfloat16) if gpu else (1, 2, 40, 16, torch.float32)
    p, seed = 0.1, 4242
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=dev).to(dtype) for _ in range(3))
    keep = variants.dropout_mask(B, H, N, N, p, seed, device=dev)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flashlab.flash_attention(qq, kk, vv, dropout_p=p, is_causal=True, seed=seed, return_lse=True)
    do = torch.randn_like(o)
    o.backward(do)
    ours = (o, lse, qq.grad, kk.grad, vv.grad)

    def ref(dt):
        x = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        ro, rl = attention_variants_torch(*x, is_causal=True, dropout_mask=keep, dropout_p=dropout_rate(p))
        ro.backward(do.to(dt))
        return ro.detach(), rl.detach(), x[0].grad, x[1].grad, x[2].grad

    r64 = ref(torch.float64)
    same = ref(dtype if (gpu or dtype != torch.bfloat16) else torch.float32)
    lse_max = r64[1].abs().max().item()
    checks = [judge(n, a, s, r, torch.float32 if n == "lse" else dtype, lse_max if n.startswith("d") else 0.0)
              for n, a, s, r in zip(("o", "lse", "dq", "dk", "dv"), ours, same, r64)]
    bad = [str(c) for c in checks if not c.ok]
    return not bad, ("O, LSE, dQ, dK, dV within the rule" if not bad else "; ".join(bad))


# ------------------------------------------------------------------------------------------------ timing

def timings(quick: bool, base: bool) -> dict:
    import torch
    from flashlab import device
    gpu = not device.INTERPRET
    B, H, N, D, dtype = (1, 2, 64, 16, torch.float32) if quick else (2, 16, 4096, 128, torch.bfloat16)
    dev = device.DEVICE
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, N, D, device=dev, dtype=dtype)

    def fwd(p):
        with torch.no_grad():
            flashlab.flash_attention(q, k, v, dropout_p=p, is_causal=True, seed=1234)

    def fwd_bwd(p):
        flashlab.flash_attention(q, k, v, dropout_p=p, is_causal=True, seed=1234).backward(do)

    def bench(fn):
        fn()                                                       # compile (and pick the tiles) first
        if gpu:
            torch.cuda.synchronize()
            return triton.testing.do_bench(fn, warmup=100, rep=400, grad_to_none=[q, k, v], return_mode="median")
        t = time.perf_counter()                                    # the interpreter: a smoke test, not a timing
        fn()
        return 1e3 * (time.perf_counter() - t)

    out = {"fwd_ms": bench(lambda: fwd(0.1)), "fwd_bwd_ms": bench(lambda: fwd_bwd(0.1))}
    if base:
        out["base_fwd_ms"] = bench(lambda: fwd(0.0))
        out["base_fwd_bwd_ms"] = bench(lambda: fwd_bwd(0.0))
    from flashlab.kernels import tiles
    out["tiles"] = sorted({f"{key[0]} v{key[1]}: {cfg}" for key, cfg in tiles.CHOSEN.items()})
    return out


# ------------------------------------------------------------------------------------------------ SASS counts

def sass_counts() -> dict:
    """Compile forward v4 and backward v5's two kernels (causal, DROPOUT on) for sm_90 with the installed
    Triton; counts from the TTGIR and the SASS (Triton's cuobjdump).  Strides of 1 as Triton specialises them."""
    import collections
    import re
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from flashlab.kernels import backward_v5, forward_v4
    cu = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    unit = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_dod", "stride_dkd", "stride_dvd",
            "stride_dqd", "stride_lm", "stride_dlm"}
    bf16 = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ", "MASK", "SLOPES"}
    base = dict(BAND=True, MASK_KIND=0, SOFTCAP=False, ALIBI=False, VARLEN=False, HEAD_DIM=128,
                DOT_PRECISION="ieee", TMA=True)
    kernels = {"fwd": (forward_v4.flash_fwd_kernel_v4, 128, 128, 8, 3),
               "dkdv": (backward_v5.flash_bwd_dkdv_kernel_v5, 64, 128, 8, 3),
               "dq": (backward_v5.flash_bwd_dq_kernel_v5, 128, 64, 8, 3)}
    res = {}
    for name, (fn, bm, bn, w, s) in kernels.items():
        for drop in (False, True):
            consts = dict(base, DROPOUT=drop, BLOCK_M=bm, BLOCK_N=bn)
            sig, cx, attrs = {}, {}, {}
            for i, n in enumerate(fn.arg_names):
                if n in consts:
                    sig[n], cx[n] = "constexpr", consts[n]
                elif n in unit:
                    sig[n], cx[n] = "constexpr", 1
                elif n[0].isupper() and n not in ("H", "GROUP", "Nq", "Nk"):
                    sig[n], attrs[(i,)] = ("*bf16" if n in bf16 else "*fp32"), [["tt.divisibility", 16]]
                elif n in ("sm_scale", "softcap", "p_drop"):
                    sig[n] = "fp32"
                else:
                    sig[n] = "i32"
                    if n.startswith("stride_"):
                        attrs[(i,)] = [["tt.divisibility", 16]]
            ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": w, "num_stages": s})
            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(ck.asm["cubin"])
            usage = subprocess.run([cu, "-res-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([cu, "-sass", f.name], capture_output=True, text=True).stdout
            os.unlink(f.name)
            ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(
                r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
            ttgir = ck.asm["ttgir"]
            row = dict(regs=int(re.search(r"REG:(\d+)", usage).group(1)), smem=ck.metadata.shared,
                       sass=sum(ops.values()), cvt=ttgir.count("ttg.convert_layout"))
            row.update({op: ops.get(op, 0) for op in ("IMAD", "LOP3", "SHF", "SEL", "STS", "LDS", "BAR", "SHFL",
                                                      "STL", "LDL")})
            res[f"{name}{'' if drop else ' (no dropout)'}"] = row
    return res


# ------------------------------------------------------------------------------------------------ driver

def child(name: str, quick: bool, base: bool, sass: bool) -> dict:
    install(name)
    if sass:
        return {"impl": name, "sass": sass_counts()}
    from flashlab import device
    gpu = not device.INTERPRET
    out = {"impl": name}
    out["bits_ok"], out["bits"] = check_bits(gpu, ROUNDS.get(name, 10))
    out["acc_ok"], out["acc"] = check_attention(gpu)
    out.update(timings(quick, base))
    return out


def table(results: list, sass: bool) -> None:
    if sass:
        for r in results:
            if "error" in r:
                print(f"{r['impl']}: failed: {r['error']}")
                continue
            for kern, row in r["sass"].items():
                if "no dropout" in kern and r["impl"] != results[0]["impl"]:
                    continue
                print(f"{r['impl']:8s} {kern:18s} " + " ".join(f"{k} {v:g}" for k, v in row.items()))
        return
    base = next((r for r in results if "base_fwd_ms" in r), None)
    print()
    for r in results:
        if "error" not in r:
            print(f"{r['impl']}: bits {'ok' if r['bits_ok'] else 'WRONG'} ({r['bits']}); "
                  f"accuracy {'ok' if r['acc_ok'] else 'FAILED'} ({r['acc']}); tiles {', '.join(r['tiles'])}")
    print()
    print(f"{'impl':10s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'fwd ratio':>10s} {'fwd+bwd ratio':>14s}  (ratio: time "
          f"without dropout / time with)")
    if base:
        print(f"{'no drop':10s} {base['base_fwd_ms']:8.3f} {base['base_fwd_bwd_ms']:11.3f} {1:10.2f} {1:14.2f}")
    for r in results:
        if "error" in r:
            print(f"{r['impl']:10s} failed: {r['error']}")
            continue
        rf = base["base_fwd_ms"] / r["fwd_ms"] if base else float("nan")
        rb = base["base_fwd_bwd_ms"] / r["fwd_bwd_ms"] if base else float("nan")
        flag = "" if r["bits_ok"] and r["acc_ok"] else "  (wrong bits: do not use)"
        print(f"{r['impl']:10s} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} {rf:10.2f} {rb:14.2f}{flag}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="all",
                    help=f"one of {', '.join(FORMS)} (comma-separated), or all: {', '.join(DEFAULT)} (default)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the interpreter on a CPU): checks only")
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 and count instructions instead")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds for one form's process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--base", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.quick, a.base, a.sass)), flush=True)
        return
    names = list(DEFAULT) if a.impl == "all" else a.impl.split(",")
    for n in names:
        if n not in FORMS:
            ap.error(f"unknown form {n!r}: {', '.join(FORMS)}")
    results = []
    for i, n in enumerate(names):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", n] + (["--base"] if i == 0 else []) \
            + (["--quick"] if a.quick else []) + (["--sass"] if a.sass else [])
        t = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=ROOT)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            r = json.loads(line[7:]) if line else {"impl": n, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
        except subprocess.TimeoutExpired:
            r = {"impl": n, "error": f"timed out after {a.timeout:.0f} s"}
        print(f"{n}: {time.time() - t:.0f} s" + (f", {r['error']}" if "error" in r else ""), flush=True)
        results.append(r)
    table(results, a.sass)


if __name__ == "__main__":
    main()
