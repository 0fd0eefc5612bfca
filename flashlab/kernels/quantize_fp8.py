"""Quantisation to e4m3 in two Triton kernels: what ``flashlab.quantize_fp8`` runs on a GPU.

    t8, scale = quantize(t, transpose=False)   # t (B, H, N, D) fp16 / bf16 / fp32, any strides

``scale[b, h] = amax(|t[b, h]|) / 448`` (1 for an all-zero head) and ``t8 = e4m3(clamp(t / scale, +-448))``,
rounded to nearest even: the same numbers as the plain-torch reference ``flashlab.fp8._quantize_torch``, bit
for bit.  A scale needs the whole (batch, head) before its first element can be written, so two passes:

1. ``amax_kernel``: each program loads one (BLOCK_N, D) tile, takes max |x| and folds it into its head's
   maximum with ``tl.atomic_max``.  The maximum is kept as the int32 bit pattern of the float32 |x|: for
   non-negative floats the bit patterns order like the numbers (the exponent sits above the mantissa), and
   integer atomics exist everywhere.  NaN's patterns lie above +inf's, so a NaN anywhere wins, as torch's
   ``amax`` propagates it.
2. ``quantize_kernel``: each program loads its tile again, reads its head's maximum, makes the scale (the
   head's first tile also stores it), divides, clamps, casts to ``tl.float8e4nv`` and stores.  For V^T the
   output's strides are those of a (B, H, D, N) tensor seen as (B, H, N, D): the kernel is unchanged, only
   the store's addresses differ.  A stride of 1 is a compile-time constant to Triton, so its compiler can
   lay the stores out along N (the tile goes through shared memory) and keep them contiguous;
   scripts/bench_fp8.py times the two layouts apart.

Why a grid of tiles with atomics, not one program per (batch, head) looping over N.  FP8 attention pays at
long sequences, N = 4k-16k, with B * H = 16-512 heads.  One program per head would launch 16 programs on an
H200's 132 streaming multiprocessors at 16 heads: a streaming kernel needs several programs per SM in flight
to reach HBM's bandwidth, so most of the chip would idle.  Tiles of 8192 elements give N * D / 8192 programs
per head (256 at N = 16k, D = 128) whatever B * H is; the price is one atomic per tile, 4 bytes against the
tile's 16 KB.  Nor can one program hold a whole head and read it once: at N = 4k-16k, D = 128 a head is
0.5-2 M elements, far beyond a program's registers and shared memory.

Bytes per element (bf16 input, 2 bytes): the amax pass reads 2; the quantising pass reads 2 and writes 1
(e4m3): 5 in all (fp16 the same, fp32 9).  The quantising pass walks the tiles in the reverse order of the
amax pass, so its first tiles are the ones the amax pass read last, which may still be in the L2 (50 MB on
an H200): part of its read may not reach HBM.  The plain-torch reference moves 39 bytes per element (41 for
V^T): a float32 copy (read 2, write 4), |x| (read 4, write 4), the max (read 4), the divide (read 4,
write 4), the clamp in place (read 4, write 4), the cast (read 4, write 1), and V's transpose (read 1,
write 1).

Prediction (not a measurement) for ``flash_attention(q, k, v, fp8=True)`` on an H200, bf16, N = 16384,
D = 128, 16 heads (33.5 M elements per tensor, 101 M for Q, K and V): the torch passes move 4.0 GB, 0.83 ms
at 4.8 TB/s; these kernels 0.50 GB, 0.10 ms, 8x less.  Recorded there (docs/BENCHMARKS.md, notebook 06's
run): the FP8 kernel 3.24 / 1.64 ms (non-causal / causal), the bf16 forward 4.15 / 2.13 ms, ``fp8=True``
4.75 / 3.13 ms, so the torch passes cost about 1.5 ms, below HBM's peak.  With 0.1-0.2 ms instead,
``fp8=True`` should take about 3.4 / 1.8 ms: about 1.2x the bf16 forward where it was 0.87x / 0.68x.
(What the H200 then measured, quantisation and ``fp8=True``: docs/BENCHMARKS.md, 2026-12-02.)
Two things could make it slower: each element is divided (IEEE ``div_rn``, several instructions where a
multiply is one: torch divides, and the bytes must match), which brings the quantising pass's arithmetic
near what an H200 issues per byte of HBM; and each op makes nine launches (per tensor: the maxima zeroed,
the two kernels), host time that matters at small sizes only.

Rounding.  Triton's compiled cast to ``tl.float8e4nv`` is the hardware's round-to-nearest-even conversion,
saturating, as torch's (after the clamp, saturation never acts).  The interpreter's cast does not round
correctly (forward_fp8.py says how), so in the interpreter ``ROUND`` first rounds to the e4m3 grid in
float32 with forward_fp8's ``round_to_e4m3``, the sign kept, and the cast that follows is exact.

NaN and inf, as torch's reference: a head with a NaN gets scale 1 (amax is NaN, and NaN > 0 is false),
its NaN elements the e4m3 NaN and its other elements ``clamp(x, +-448)`` rounded; a head with an inf (and
no NaN) gets scale inf, its finite elements +-0 and its infinities NaN (inf / inf).  A NaN's sign bit may
differ from torch's (on a GPU, whose arithmetic makes every NaN 0x7FFFFFFF, both should write 0x7F); every
other byte is equal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import head_base, tile_ptrs
from .forward_fp8 import FP8_DTYPE, FP8_MAX, round_to_e4m3

FP8_MAX_K = tl.constexpr(FP8_MAX)
INV_FP8_MAX_K = tl.constexpr(1.0 / FP8_MAX)   # scale = amax * (1 / 448): what torch computes for amax / 448 on CUDA
TILE = 8192          # elements per program: BLOCK_N = TILE / BLOCK_D rows of the head (64 at D = 128); not tuned
NUM_WARPS = 8        # 32 elements per thread
MAX_HEAD_DIM = 256   # one tile spans all of D; larger D (which the FP8 forward refuses) stays on the torch path


@triton.jit
def _tile_of(pid, n_tiles, H):
    """(tile, batch, head) of program ``pid`` on a 1-D grid, tile index fastest (no 65535 limit on B * H)."""
    tile = pid % n_tiles
    off_bh = pid // n_tiles
    return tile, off_bh // H, off_bh % H


@triton.jit
def _load_tile(X, tile, off_b, off_h, stride_xb, stride_xh, stride_xn, stride_xd, N, D,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows tile * BLOCK_N + [0, BLOCK_N) of X[b, h] (N, D), as float32 (exact from fp16 / bf16); zeros outside."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    inside = ((tile * BLOCK_N + offs_n)[:, None] < N) & (offs_d[None, :] < D)
    ptrs = tile_ptrs(head_base(X, off_b, off_h, stride_xb, stride_xh), tile * BLOCK_N, offs_n, offs_d,
                     stride_xn, stride_xd)
    return tl.load(ptrs, mask=inside, other=0.0).to(tl.float32), inside


@triton.jit
def amax_kernel(X, AMAX, stride_xb, stride_xh, stride_xn, stride_xd, H, N, D,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """AMAX[b * H + h] (int32, zeroed by the caller) = max over X[b, h] of the bits of |x| (float32)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    tile, off_b, off_h = _tile_of(tl.program_id(0), n_tiles, H)
    x, _ = _load_tile(X, tile, off_b, off_h, stride_xb, stride_xh, stride_xn, stride_xd, N, D, BLOCK_N, BLOCK_D)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF        # |x|'s bits: the sign bit cleared (NaN stays NaN)
    tl.atomic_max(AMAX + off_b * H + off_h, tl.max(bits))  # integer max: orders |x| like floats, NaN on top


@triton.jit
def round_signed_to_e4m3(y):
    """y in [-448, 448] or NaN, rounded to the e4m3 grid in float32 (nearest even), its sign kept (-0.0 too).
    NaN becomes +-480: the interpreter's conversion (it slices the bits) turns 480 into 0x7F, e4m3's NaN."""
    mag = tl.abs(y)
    r = tl.where(mag != mag, 480.0, round_to_e4m3(mag))
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)


@triton.jit
def quantize_kernel(X, AMAX, OUT, SCALE,
                    stride_xb, stride_xh, stride_xn, stride_xd,
                    stride_ob, stride_oh, stride_on, stride_od,
                    H, N, D,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROUND: tl.constexpr):
    """OUT[b, h, n, d] = e4m3(clamp(X[b, h, n, d] / scale[b, h], +-448)) and SCALE[b, h] (float32, (B, H)
    contiguous), from AMAX (amax_kernel's bits).  OUT's strides address element (n, d): for V^T they are a
    (B, H, D, N) tensor's, with unit stride along n.  ROUND: the interpreter's rounding (module docstring)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    # Reverse order: the first tiles quantised are the last ones amax_kernel read, likeliest still in the L2.
    tile, off_b, off_h = _tile_of(tl.num_programs(0) - 1 - tl.program_id(0), n_tiles, H)
    amax = tl.load(AMAX + off_b * H + off_h).to(tl.float32, bitcast=True)
    scale = tl.where(amax > 0, amax * INV_FP8_MAX_K, 1.0)  # an all-zero head: 1 (and NaN > 0 is false: 1)
    if tile == 0:
        tl.store(SCALE + off_b * H + off_h, scale)
    x, inside = _load_tile(X, tile, off_b, off_h, stride_xb, stride_xh, stride_xn, stride_xd, N, D,
                           BLOCK_N, BLOCK_D)
    # A division rounded as IEEE says (div_rn), as torch's x / scale: x * (1 / scale) would differ in the
    # last bit of float32 now and then, and so, rarely, in the e4m3 byte.
    y = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_K, FP8_MAX_K, propagate_nan=tl.PropagateNan.ALL)
    if ROUND:
        y = round_signed_to_e4m3(y)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = tile_ptrs(head_base(OUT, off_b, off_h, stride_ob, stride_oh), tile * BLOCK_N, offs_n, offs_d,
                     stride_on, stride_od)
    tl.store(ptrs, y.to(tl.float8e4nv), mask=inside)


# ------------------------------------------------------------------------------------------------ launcher

def quantize(t: torch.Tensor, transpose: bool = False):
    """(t8, scale) for t (B, H, N, D) fp16 / bf16 / fp32 with any strides, N * D >= 1 and D <= MAX_HEAD_DIM:
    t8 e4m3, (B, H, N, D) contiguous or, ``transpose``, (B, H, D, N) contiguous; scale float32 (B, H).
    The checks are the caller's (flashlab.fp8.quantize_fp8); this only launches."""
    from .. import device
    B, H, N, D = t.shape
    t8 = torch.empty((B, H, D, N) if transpose else (B, H, N, D), device=t.device, dtype=FP8_DTYPE)
    out = t8.transpose(2, 3) if transpose else t8          # element (b, h, n, d) either way
    scale = torch.empty((B, H), device=t.device, dtype=torch.float32)
    amax = torch.zeros(B * H, device=t.device, dtype=torch.int32)   # +0.0's bits: below every |x|
    block_d = triton.next_power_of_2(D)
    block_n = max(16, min(triton.next_power_of_2(N), TILE // block_d))
    grid = (triton.cdiv(N, block_n) * B * H,)
    amax_kernel[grid](t, amax, *t.stride(), H, N, D, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=NUM_WARPS)
    quantize_kernel[grid](t, amax, out, scale, *t.stride(), *out.stride(), H, N, D,
                          BLOCK_N=block_n, BLOCK_D=block_d, ROUND=device.INTERPRET, num_warps=NUM_WARPS)
    return t8, scale
