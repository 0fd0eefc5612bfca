"""FlashAttention-2 forward, v4: forward v2 with the attention variants as constexpr branches.

Diff this file against forward_v2.py (its parent: plain pointers, so it runs everywhere, in the
interpreter, on a T4, an L4 and an H200).  The online softmax is v2's; what changed:

1. **One score function for every variant** (``variant_scores``, shared with backward v5).  The raw
   tile S = Q K^T goes through, in this order and only where the constexpr flag is on:
   scale; soft-cap ``c * tanh(s / c)``; ALiBi ``s -= slope * |i - j|``; an additive mask tile;
   and the keep-test (keys past Nk, the band i - left <= j <= i + right, a boolean mask tile).
   With every flag off it is v2's single multiply by ``scale * log2 e``: zero cost when off.
   Masks are read tile by tile through four strides (0 on a broadcast dimension): no N x N copy.
2. **The band decides which tiles are visited.**  ``is_causal`` and ``window`` are one band,
   top-left aligned: query i sees keys i - left ... i + right (causal is right = 0, unbounded is
   a number larger than any sequence).  The key loop runs over the tiles that meet the band only,
   in three stages: masked tiles at the left edge, unmasked tiles wholly inside, masked tiles at
   the right edge (the diagonal, the ragged tail).  Cost follows the band, not N^2.
3. **Rows that see no key.**  The running max may stay -inf (a window past the keys, a row the
   mask hides): exponents use 0 in its place, so P = 0, O = 0 and the LSE is -inf, never NaN.
4. **GQA / MQA.**  Query head h reads K/V head h // GROUP: only the address changes.
5. **Packed sequences (varlen).**  With VARLEN the "batch" index is a sequence: its rows start
   at CU_Q[b] / CU_K[b] of a packed (total, H, D) tensor and its lengths are the differences;
   programs past a short sequence's last tile visit no tile and store nothing.  Document
   boundaries therefore cost nothing: no tile ever spans two documents.
6. **Dropout.**  P is dropped after the row sum (the softmax is that of the undropped scores)
   with Philox keyed on (seed, batch * H + head, row, column): ``dropout_keep`` is the one place
   the bits are drawn; backward v5 calls it again instead of storing a mask.  One Philox call
   (four 32-bit words) serves 16 scores of a row, one byte each, compared with 256 p: p is applied
   in 1/256ths (``flashlab.reference.dropout_rate``), and kept values are scaled by
   1 / (1 - that rate) once, on the final O.  ``flashlab.reference.dropout_keep`` is the same
   bits in NumPy.
7. **Tensor descriptors on Hopper** (``TMA``, forward v3's loads): where K and V have a unit last
   stride and 16-byte aligned strides (``use_descriptors``), each program describes its (sequence,
   K/V head) K and V as (rows, HEAD_DIM) matrices and the loop loads whole tiles by their first row
   (zeros past the end, so no load mask; the scores of edge tiles are still masked).  Q (once per
   program), the masks and O stay on pointers.  Elsewhere, and in the interpreter unless a test asks,
   v2's pointer loads run.

Launch: ``launch`` at the end of the file runs the launch plan's step (grid (cdiv(Nq, BLOCK_M) * B * H,));
:func:`flashlab.kernels.launch_forward` with a ``variant`` reaches it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..reference import dropout_rate
from . import tiles
from .common import LN2_K, LOG2E_K, head_base, program_tile, tile_ptrs
from .tiles import C

MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2


@triton.jit
def _tanh(x):
    """tanh from exp2, stable at both ends (the interpreter and old Triton lack tl.math.tanh).  The division is
    the approximate one (2 ulp, a reciprocal and a multiply), not IEEE's Newton steps and special cases."""
    return 1.0 - tl.fdiv(tl.full(x.shape, 2.0, tl.float32), tl.math.exp2(x * (2.0 * LOG2E_K)) + 1.0)


@triton.jit
def dropout_words(seed, bh, rows, col0, G: tl.constexpr, ROUNDS: tl.constexpr = 10):
    """The four Philox words of each (row, group of 16 columns from col0): (len(rows), G) each, counter
    (column // 16, row, bh, 0), key the seed; Philox-4x32 with ``ROUNDS`` rounds (10, as cuRAND and PyTorch)."""
    grp = col0 // 16 + tl.arange(0, G)
    c0 = (grp[None, :] + rows[:, None] * 0).to(tl.uint32)              # (R, G): one counter a group
    c1 = (rows[:, None] + grp[None, :] * 0).to(tl.uint32)
    c2 = (c0 * 0 + bh).to(tl.uint32)
    return tl.philox(seed, c0, c1, c2, c2 * 0, ROUNDS)


@triton.jit
def dropout_top_threshold(p_drop):
    """256 p in the top byte of a uint32: byte b of a word w is >= 256 p exactly when (w << (24 - 8 b)) >= this
    (unsigned), so a byte is tested with a shift and a compare: no mask, no narrowing."""
    return (tl.cast(p_drop * 256.0 + 0.5, tl.int32) << 24).to(tl.uint32)


@triton.jit
def dropout_keep(seed, bh, rows, col0, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 ROUNDS: tl.constexpr = 10):
    """Keep mask (BLOCK_R, BLOCK_C) of the scores (rows, col0 + 0 ... BLOCK_C - 1) of (batch * H + head) ``bh``.

    One Philox call per 16 scores of a row (four 32-bit words, one byte a score): counter
    (column // 16, row, bh, 0), key the seed; column j takes byte j % 4 of word (j // 4) % 4 and is
    kept when the byte is >= 256 p (p_drop is a whole number of 1/256ths, see
    ``flashlab.reference.dropout_threshold``; ``flashlab.reference.dropout_keep`` is this in NumPy).
    ``col0``: a multiple of 16 (a tile's first column); BLOCK_C a multiple of 16.

    How the bits reach the score tile matters more than Philox itself.  Picking each column's word and byte
    in a (R, G, 16) tensor and reshaping it to (R, C) lets Triton recompute the whole Philox chain in the
    score tile's MMA layout, where the four threads of a quad hold the same rows: every call runs 4 times
    (8 in the dK/dV kernel's transposed tile; seen in the sm_90 compile, ``scripts/dropout_probe.py --sass``).  Built by joins instead (below), each call runs once and the
    bits move to the tile's layout through shared memory: on the H200 forward + backward with p = 0.1 went
    from 0.52x to 0.63x the call without dropout (``scripts/dropout_probe.py``, docs/BENCHMARKS.md).
    """
    w0, w1, w2, w3 = dropout_words(seed, bh, rows, col0, BLOCK_C // 16, ROUNDS)
    thr = dropout_top_threshold(p_drop)
    words = tl.join(tl.join(w0, w2), tl.join(w1, w3))                  # (R, G, 2, 2): [a, b] = word 2a + b
    b0 = (words << 24) >= thr
    b1 = (words << 16) >= thr
    b2 = (words << 8) >= thr
    b3 = words >= thr
    # (R, G, 2, 2, 2, 2): [a, b, c, d] = byte 2c + d of word 2a + b = column 16 g + 8a + 4b + 2c + d
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_R, BLOCK_C))


@triton.jit
def variant_scores(s, rows, cols, Nq, Nk, sm_scale, softcap, left, right, slope,
                   mask_base, stride_mm, stride_mn,
                   CHECK: tl.constexpr, BAND: tl.constexpr, MASK_KIND: tl.constexpr,
                   SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Scores in base 2 (-inf where not visible) and tanh(s / c) (soft-cap's derivative; else s).

    ``rows``, ``cols``: positions, broadcastable to s (rows[:, None], cols[None, :] in the
    forward; transposed in the dK/dV kernel).  CHECK: the tile may cross the band's edge or the
    ragged end, so test every score; without it only a boolean mask can hide a score.
    """
    if SOFTCAP or ALIBI or MASK_KIND == 2:
        x = s * sm_scale
        t = x
        if SOFTCAP:
            t = _tanh(x * (1.0 / softcap))                          # one multiply a score, not a division
            x = softcap * t
        if ALIBI:
            x = x - slope * tl.abs(rows - cols).to(tl.float32)
        if MASK_KIND != 0:
            inb = (rows < Nq) & (cols < Nk)
            m_ptrs = mask_base + rows.to(tl.int64) * stride_mm + cols.to(tl.int64) * stride_mn
        if MASK_KIND == 2:   # a finite mask below -1e37 (finfo.min, HF's "masked") as -1e37: finite through x log2(e)
            m = tl.load(m_ptrs, mask=inb, other=0.0).to(tl.float32)
            x = x + tl.where(m == float("-inf"), m, tl.maximum(m, -1e37))
        x = x * LOG2E_K
    else:
        x = s * (sm_scale * LOG2E_K)                                   # v2's one multiply
        t = x
    if MASK_KIND == 1:
        inb = (rows < Nq) & (cols < Nk)
        m_ptrs = mask_base + rows.to(tl.int64) * stride_mm + cols.to(tl.int64) * stride_mn
        keep = tl.load(m_ptrs, mask=inb, other=0) != 0
        if CHECK:
            keep = keep & (cols < Nk) & (rows < Nq)
            if BAND:
                keep = keep & (cols >= rows - left) & (cols <= rows + right)
        x = tl.where(keep, x, float("-inf"))
    elif CHECK:
        keep = (cols < Nk) & (rows < Nq)
        if BAND:
            keep = keep & (cols >= rows - left) & (cols <= rows + right)
        x = tl.where(keep, x, float("-inf"))
    return x, t


@triton.jit
def band_tiles(r0, R_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, n_cols, before, after, active):
    """Tiles of C_BLOCK columns that rows r0 .. r0 + R_BLOCK - 1 can see, if row i sees columns
    i - before ... i + after (and < n_cols): (lo, full_lo, full_hi, hi), tile aligned except hi.

    [lo, full_lo) and [full_hi, hi) cross an edge (masked stages); [full_lo, full_hi) is wholly
    visible to every row (unmasked).  ``active`` False (a program past its sequence): all empty.
    """
    first = tl.maximum(r0 - before, 0)                                # the first column row r0 sees
    hi = tl.minimum(r0 + R_BLOCK + after, n_cols)
    hi = tl.where(active & (first < hi), hi, 0)                      # the band may miss the columns
    lo = tl.minimum(first // C_BLOCK * C_BLOCK, hi)
    full_lo = tl.cdiv(tl.maximum(r0 + R_BLOCK - 1 - before, 0), C_BLOCK) * C_BLOCK
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(r0 + after + 1, n_cols) // C_BLOCK * C_BLOCK
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _fwd_inner_v4(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn,
                  offs_m, offs_n, Nq, Nk, sm_scale, softcap, left, right, slope,
                  mask_base, stride_mm, stride_mn, seed, bh, p_drop, lo, hi,
                  MASKED: tl.constexpr, BAND: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
                  ALIBI: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Stream K/V tiles lo, lo + BLOCK_N, ... < hi (v2's loop; the scores through variant_scores).
    TMA: k_base, v_base are tensor descriptors (rows past Nk load as zeros)."""
    for start_n in range(lo, hi, BLOCK_N):
        row0 = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        if TMA:
            k = k_base.load([start_n, 0])
            v = v_base.load([start_n, 0])
        elif MASKED:
            k = tl.load(k_base + row0 * stride_kn + k_offs, mask=cols[:, None] < Nk, other=0.0)
            v = tl.load(v_base + row0 * stride_vn + v_offs, mask=cols[:, None] < Nk, other=0.0)
        else:
            k = tl.load(k_base + row0 * stride_kn + k_offs)
            v = tl.load(v_base + row0 * stride_vn + v_offs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        x, _t = variant_scores(s, offs_m[:, None], cols[None, :], Nq, Nk, sm_scale, softcap, left, right, slope,
                               mask_base, stride_mm, stride_mn, MASKED, BAND, MASK_KIND, SOFTCAP, ALIBI)
        m_new = tl.maximum(m_i, tl.max(x, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)           # a row that has seen no key yet
        p = tl.math.exp2(x - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)                                # the softmax of the undropped scores
        acc = acc * alpha[:, None]
        if DROPOUT:
            p = tl.where(dropout_keep(seed, bh, offs_m, start_n, p_drop, BLOCK_M, BLOCK_N), p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seed"])
def flash_fwd_kernel_v4(
    Q, K, V, O, LSE, MASK, SLOPES, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_sb, stride_sh,
    H, GROUP, Nq, Nk, sm_scale, softcap, left, right, p_drop, seed,
    BAND: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """v2's contract plus the variants.  Nq, Nk: the lengths (VARLEN: the longest sequence's).
    left, right: the band (numbers past any length when unbounded).  GROUP = H // H_kv.
    TMA: the K/V tiles through tensor descriptors made here (forward v3's loads; last strides 1, 16-byte
    aligned; the launcher checks)."""
    n_tiles = tl.cdiv(Nq, BLOCK_M)
    start_m, off_b, off_h = program_tile(n_tiles, H)
    if BAND:
        start_m = n_tiles - 1 - start_m                                 # longest causal tiles first
    off_hk = off_h // GROUP
    if VARLEN:
        q_start = tl.load(CU_Q + off_b)
        k_start = tl.load(CU_K + off_b)
        Nq = tl.load(CU_Q + off_b + 1) - q_start
        Nk = tl.load(CU_K + off_b + 1) - k_start
    else:
        q_start = 0
        k_start = 0

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = head_base(Q, off_b, off_h, stride_qb, stride_qh) + tl.cast(q_start, tl.int64) * stride_qm
    k_base = head_base(K, off_b, off_hk, stride_kb, stride_kh) + tl.cast(k_start, tl.int64) * stride_kn
    v_base = head_base(V, off_b, off_hk, stride_vb, stride_vh) + tl.cast(k_start, tl.int64) * stride_vn
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    row_ok = offs_m < Nq
    active = start_m * BLOCK_M < Nq                                     # varlen: past a short sequence's end
    q = tl.load(tile_ptrs(q_base, start_m * BLOCK_M, offs_r, offs_d, stride_qm, stride_qd),
                mask=row_ok[:, None], other=0.0)                       # once per program: pointers will do
    if TMA:   # the K/V tiles of the loop through descriptors of this (sequence, head); >= 1 row (0 keys: no load)
        k_src = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(Nk, 1), HEAD_DIM], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(Nk, 1), HEAD_DIM], strides=[stride_vn, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
    else:
        k_src = k_base
        v_src = v_base
    mask_base = head_base(MASK, off_b, off_h, stride_mb, stride_mh)
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + off_b * stride_sb + off_h * stride_sh).to(tl.float32)
    bh = off_b * H + off_h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    lo, full_lo, full_hi, hi = band_tiles(start_m * BLOCK_M, BLOCK_M, BLOCK_N, Nk, left, right, active)
    acc, l_i, m_i = _fwd_inner_v4(acc, l_i, m_i, q, k_src, v_src, k_offs, v_offs, stride_kn, stride_vn,
                                  offs_m, offs_n, Nq, Nk, sm_scale, softcap, left, right, slope,
                                  mask_base, stride_mm, stride_mn, seed, bh, p_drop, lo, full_lo,
                                  True, BAND, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_inner_v4(acc, l_i, m_i, q, k_src, v_src, k_offs, v_offs, stride_kn, stride_vn,
                                  offs_m, offs_n, Nq, Nk, sm_scale, softcap, left, right, slope,
                                  mask_base, stride_mm, stride_mn, seed, bh, p_drop, full_lo, full_hi,
                                  False, BAND, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_inner_v4(acc, l_i, m_i, q, k_src, v_src, k_offs, v_offs, stride_kn, stride_vn,
                                  offs_m, offs_n, Nq, Nk, sm_scale, softcap, left, right, slope,
                                  mask_base, stride_mm, stride_mn, seed, bh, p_drop, full_hi, hi,
                                  True, BAND, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA)

    seen = l_i > 0.0
    out_scale = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)   # a row that saw no key: O = 0
    if DROPOUT:
        out_scale = out_scale / (1.0 - p_drop)
    acc = acc * out_scale[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2_K, float("-inf"))
    l_base = head_base(LSE, off_b, off_h, stride_lb, stride_lh) + tl.cast(q_start, tl.int64) * stride_lm
    tl.store(l_base + offs_m * stride_lm, lse, mask=row_ok)
    o_base = head_base(O, off_b, off_h, stride_ob, stride_oh) + tl.cast(q_start, tl.int64) * stride_om
    tl.store(tile_ptrs(o_base, start_m * BLOCK_M, offs_r, offs_d, stride_om, stride_od),
             acc.to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["seed"])
def dropout_mask_kernel(OUT, stride_b, stride_h, stride_m, H, Nq, Nk, p_drop, seed,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Debug: write the keep mask (B, H, Nq, Nk) the kernels draw; for tests at tiny sizes only."""
    start_m, off_b, off_h = program_tile(tl.cdiv(Nq, BLOCK_M), H)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    for start_n in range(0, Nk, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, off_b * H + off_h, rows, start_n, p_drop, BLOCK_M, BLOCK_N)
        ptrs = head_base(OUT, off_b, off_h, stride_b, stride_h) + rows[:, None] * stride_m + cols[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < Nq) & (cols[None, :] < Nk))


# ------------------------------------------------------------------------------------- configs and launcher

SUPPORTS = frozenset({"gqa", "window", "softcap", "alibi", "mask", "dropout", "varlen"})


def forward_v4_configs(head_dim: int, dtype, cc=None) -> list:
    """Hand-picked configs, best first (v4 does not autotune).  Forward v2's hand-picked list; on Hopper at
    D = 128 first the tiles autotuning picked for forward v3 (descriptor loads) at long sequences, 128 x 128
    with 8 warps and 3 stages (docs/BENCHMARKS.md, 2026-11-30: 507-526 TFLOP/s causal at N = 16384, against
    474-510 for the 128 x 64 configs; at N = 4096 within 1 % of the best)."""
    import torch
    if dtype == torch.float32 or head_dim > 128:
        return [C(64, 32, 4, 2), C(32, 32, 4, 2), C(32, 16, 4, 1), C(16, 16, 4, 1)]
    if head_dim <= 64:
        return [C(128, 64, 4, 3), C(64, 64, 4, 2), C(64, 32, 4, 2), C(32, 32, 4, 1)]
    hopper = [C(128, 128, 8, 3)] if cc is not None and tuple(cc) >= (9, 0) else []
    return hopper + [C(128, 64, 8, 3), C(128, 64, 8, 2), C(64, 64, 4, 2), C(64, 32, 4, 2), C(32, 32, 4, 1)]


def config_lists(head_dim, dtype, limit, cc) -> dict:
    """{"fwd": (the hand-picked configs that fit ``limit``, no autotuning candidates)}."""
    return {"fwd": (tiles.fitting(forward_v4_configs(head_dim, dtype, cc), "fwd", head_dim, dtype, limit, cc), [])}


def dense_strides(t, varlen: bool):
    """(batch, head, row, dim) strides: (B, H, N, D) as is; packed (total, H, D) with batch stride 0."""
    if varlen:
        return (0, t.stride(1), t.stride(0), t.stride(2))
    return tuple(t.stride())


def variant_arguments(plan, q, lse, mask=None, slopes=None, cu_q=None, cu_k=None, softcap=None,
                      dropout_p: float = 0.0, seed: int = 0):
    """What forward v4 and backward v5 take besides Q, K, V and their outputs, from the plan's
    :class:`~flashlab.kernels.plan.Variant` and the call's ``variant_args``:
    (mask, slopes, cu_q, cu_k pointers; their strides; the scalars H ... seed; the constexprs)."""
    import torch
    var = plan.variant
    varlen = var.varlen
    band = var.band(plan.causal)
    big = plan.Nq + plan.Nk + 256
    # -1 and anything past every key are ``big``: a bound near 2**31 would wrap the kernels' int32 tile arithmetic
    left, right = (big, big) if band is None else tuple(big if x < 0 else min(x, big) for x in band)
    if mask is None:
        kind, mptr, mstr = MASK_NONE, q, (0, 0, 0, 0)
    else:
        kind = MASK_BOOL if mask.dtype == torch.bool else MASK_ADD
        mptr = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        mstr = tuple(mask.stride())
    sptr, sstr = (q, (0, 0)) if slopes is None else (slopes, tuple(slopes.stride()))
    dummy = cu_q if varlen else lse
    ptrs = (mptr, sptr, cu_q if varlen else dummy, cu_k if varlen else dummy)
    scalars = (plan.H, var.kv_groups, plan.Nq, plan.Nk, float(softcap or 1.0), left, right, dropout_rate(dropout_p),
               int(seed))
    consts = dict(BAND=band is not None, MASK_KIND=kind, SOFTCAP=softcap is not None, ALIBI=slopes is not None,
                  DROPOUT=dropout_p > 0, VARLEN=varlen, HEAD_DIM=plan.D, DOT_PRECISION=plan.dot_precision)
    return ptrs, (*mstr, *sstr), scalars, consts


DESCRIPTORS_IN_INTERPRETER = False   # tests set it to run the descriptor path in the interpreter
DESCRIPTOR_ERRORS: list = []         # the descriptor path failed to compile here: said once, then pointers run


def use_descriptors(plan, *tensors) -> bool:
    """Whether forward v4 (and backward v5) load their streamed tiles through tensor descriptors: on Hopper (TMA),
    when every tensor has a unit last stride and 16-byte aligned base and strides (packed tensors too: a
    sequence's rows start at a multiple of the row stride), and this Triton has ``tl.make_tensor_descriptor``
    (3.4 on; the plan says so otherwise).  Elsewhere the pointer loads (v2's) run."""
    from .plan import tma_ok
    on = DESCRIPTORS_IN_INTERPRETER if plan.facts.interpret else plan.facts.hopper
    return bool(on) and plan.facts.device_descriptors and not DESCRIPTOR_ERRORS and tma_ok(*tensors)


def run_step(step, kern, args, consts, runners, key):
    """tiles.run the step; should the descriptor path fail to compile with this Triton, say so (a warning, and
    DESCRIPTOR_ERRORS) and run the pointer loads, here and from then on.  Any other failure is raised."""
    try:
        return tiles.run(step, kern, args, consts, step.grid_for, runners, key)
    except Exception as e:   # noqa: BLE001 - compile errors come as several types; the retry re-raises the rest
        from .. import device
        if not consts.get("TMA") or device.INTERPRET:    # the interpreter: the tests want to see it fail
            raise
        import warnings
        DESCRIPTOR_ERRORS.append(f"{kern.fn.__name__}: {type(e).__name__}: {str(e)[:400]}")
        warnings.warn(f"flashlab: the descriptor loads of {kern.fn.__name__} did not compile here; pointer loads "
                      f"run instead ({type(e).__name__}: {str(e)[:200]})", RuntimeWarning, stacklevel=2)
        return tiles.run(step, kern, args, dict(consts, TMA=False), step.grid_for, runners, key)


def launch(plan, q, k, v, o, lse, scale: float, runners=None, *, mask=None, slopes=None, cu_q=None, cu_k=None,
           softcap=None, dropout_p: float = 0.0, seed: int = 0):
    """Run the plan's forward step: O and the natural-log LSE (-inf for a row that sees no key).

    Dense: q (B, H, Nq, D), k, v (B, H // kv_groups, Nk, D), o like q, lse (B, H, Nq).  Packed
    (``plan.variant.varlen``): q (total_q, H, D), k, v (total_k, H // kv_groups, D), lse (H, total_q),
    cu_q / cu_k int32 (B + 1,), the plan's Nq / Nk the longest lengths.  The band is the plan's
    (``Variant.band``).  ``mask``: None, or a bool / float tensor of shape (B, H, Nq, Nk) with any
    strides (0 on broadcast dims).  ``slopes``: (B, H) float32 view (stride 0 where broadcast) or None.
    The checks are the caller's (flashlab.variants); this only launches.
    """
    varlen = plan.variant.varlen
    lse_strides = (0, lse.stride(0), lse.stride(1)) if varlen else tuple(lse.stride())
    ptrs, strides, (H, group, Nq, Nk, cap, left, right, p_drop, seed_), consts = variant_arguments(
        plan, q, lse, mask, slopes, cu_q, cu_k, softcap, dropout_p, seed)
    args = (q, k, v, o, lse, *ptrs,
            *dense_strides(q, varlen), *dense_strides(k, varlen), *dense_strides(v, varlen),
            *dense_strides(o, varlen), *lse_strides, *strides,
            H, group, Nq, Nk, float(scale), cap, left, right, p_drop, seed_)
    consts["TMA"] = use_descriptors(plan, k, v)
    if consts["TMA"]:
        tiles.ensure_allocator()
    run_step(plan.forward[0], flash_fwd_kernel_v4, args, consts, runners, "fwd")


def dropout_mask(B: int, H: int, Nq: int, Nk: int, p: float, seed: int, device=None):
    """The keep mask (B, H, Nq, Nk, bool) the kernels draw for this seed: a debug view at tiny sizes."""
    import torch
    out = torch.empty((B, H, Nq, Nk), dtype=torch.int8, device=device)
    dropout_mask_kernel[(triton.cdiv(Nq, 32) * B * H,)](out, out.stride(0), out.stride(1), out.stride(2),
                                                        H, Nq, Nk, dropout_rate(p), int(seed), BLOCK_M=32, BLOCK_N=32)
    return out.bool()
