"""Split-KV decoding (flash-decoding): a split kernel and a merge kernel.

Decoding asks for one (or a few) new query rows against a long KV cache.  A FlashAttention
grid over query tiles has B·H programs at most, far too few for a GPU of 132 multiprocessors
to read the cache at full bandwidth.  So the keys are split: each program takes one KV head
of one sequence and one stretch of its keys, and

  * holds ALL the query rows that read this KV head (the G = H / H_kv heads of a GQA group,
    times the Nq new rows) as the rows of one tile, so every K/V byte is read once;
  * streams its stretch of keys in tiles of BLOCK_N rows through the online softmax;
  * writes a partial state: O_s = acc / l (normalised) and L_s = m + log l (natural log).

The merge kernel then combines the splits of each query row with notebook 02's log-sum-exp
merge (flashlab.reference.merge_states), written for normalised parts:

    L = log sum_s e^(L_s),        O = sum_s e^(L_s - L) O_s.

A split that saw no key has L_s = -inf and weight 0; a row that saw no key at all gets
O = 0 and L = -inf, never NaN.  With one split the split kernel writes O and L directly.

Positions are bottom-right (flash-attn's kv-cache call): query row t of sequence b sits at
position len_b - Nq + t, and key j is visible to it when j < len_b and, with a window
(left, right), pos - left <= j <= pos + right (causal is right = 0; -1 means unbounded).

Each sequence's stretch of keys [lo, hi) (lo > 0 only with a left window) is cut into
equal whole tiles per split *on the device*, from its own length: no length is read on the host.

Paged cache (vLLM's layout): K is (num_blocks, H_kv, PAGE, D) and logical block m of sequence
b is physical block block_table[b, m], so key n of sequence b lives in physical block
block_table[b, n // PAGE] at row n % PAGE.  The kernel gathers key rows through the table
(one table entry per key row: the PAGE rows of a block share it), so a tile of BLOCK_N keys may
span several blocks.  A contiguous cache is the same code with "physical block" = b.

Head dims that are not a power of two: loads and stores are masked along D (BLOCK_D is the
next power of two); the cache is never copied or padded.
"""
import triton
import triton.language as tl

from .common import LN2_K, LOG2E_K


@triton.jit
def _tanh(x):
    # tanh(x) = sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|)): the exponent is never positive, so no overflow
    e = tl.math.exp2(tl.abs(x) * -2.8853900817779268)     # -2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def decode_split_kernel(
    Q, K, V, BT, SEQ, O, L,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_btb, stride_btm,
    H_KV, G, Nq, N_CAP, NUM_BLOCKS, NUM_SPLITS, N_ROW_BLOCKS, L_OFFSET,
    scale, softcap, win_left, win_right,
    PAGED: tl.constexpr, PAGE: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, STORE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: (split, row block, KV head, sequence) on a 1-D grid, split fastest.

    Rows of the tile: r = g * Nq + t for query head kvh * G + g and new row t (r < G * Nq).
    O, L + L_OFFSET: contiguous partial states (B, H, Nq, NUM_SPLITS, HEAD_DIM) and (B, H, Nq, NUM_SPLITS)
    float32 (one workspace), or with one split the outputs themselves, (B, H, Nq, HEAD_DIM) and (B, H, Nq):
    the same addresses with NUM_SPLITS = 1.  Fewer arguments than strides for each: a decode step is
    short enough that the launch's cost on the host shows.
    """
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    rest = pid // NUM_SPLITS
    rblk = rest % N_ROW_BLOCKS
    bh = rest // N_ROW_BLOCKS
    off_b = bh // H_KV
    kvh = bh % H_KV

    # ---- this sequence's length and key range (on the device: no host sync)
    if HAS_SEQLENS:
        n_len = tl.load(SEQ + off_b)
        n_len = tl.minimum(tl.maximum(n_len, 0), N_CAP)   # the host checks what it can; never read past the cache
    else:
        n_len = N_CAP
    lo = 0
    if HAS_LEFT:
        lo = tl.maximum(n_len - Nq - win_left, 0)          # row t = 0 sees no key before pos_0 - left
    hi = n_len                                              # the last row sits at len - 1: right >= 0 adds nothing
    lo_tile = lo // BLOCK_N * BLOCK_N
    n_tiles = tl.cdiv(tl.maximum(hi - lo_tile, 0), BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    start = lo_tile + split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, hi)

    # ---- the query rows: all heads of this KV head's group, times the Nq new rows
    offs_r = rblk * BLOCK_M + tl.arange(0, BLOCK_M)
    g = offs_r // Nq
    t = offs_r % Nq
    row_ok = offs_r < G * Nq
    head = kvh * G + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + head[:, None].to(tl.int64) * stride_qh
              + t[:, None] * stride_qt + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = n_len - Nq + t                                    # bottom-right position of each row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh
    if not PAGED:
        k_head += off_b.to(tl.int64) * stride_kb
        v_head += off_b.to(tl.int64) * stride_vb
    bt_row = BT + off_b.to(tl.int64) * stride_btb

    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        n_ok = cols < end
        if PAGED:
            phys = tl.load(bt_row + (cols // PAGE) * stride_btm, mask=n_ok, other=0)
            phys = tl.minimum(tl.maximum(phys, 0), NUM_BLOCKS - 1).to(tl.int64)   # never read outside the pool
            k_rows = phys * stride_kb + (cols % PAGE).to(tl.int64) * stride_kn
            v_rows = phys * stride_vb + (cols % PAGE).to(tl.int64) * stride_vn
        else:   # in int64: a (B, N, H_kv, D) cache seen transposed has rows H_kv D apart, past 2**31 from 2**21 keys
            k_rows = cols.to(tl.int64) * stride_kn
            v_rows = cols.to(tl.int64) * stride_vn
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale   # natural-log units
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        keep = n_ok[None, :]
        if HAS_LEFT:
            keep = keep & (cols[None, :] >= pos[:, None] - win_left)
        if HAS_RIGHT:
            keep = keep & (cols[None, :] <= pos[:, None] + win_right)
        s = tl.where(keep, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)             # a row that has seen nothing yet
        p = tl.math.exp2((s - m_ref[:, None]) * LOG2E_K)                 # subtract first: exact at large |s|
        alpha = tl.math.exp2((m_i - m_ref) * LOG2E_K)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]                          # no key: acc = 0, O = 0
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) * LN2_K, float("-inf"))

    slot = ((off_b.to(tl.int64) * (H_KV * G) + head) * Nq + t) * NUM_SPLITS + split     # (b, h, t, split)
    o_ptrs = O + slot[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if STORE_LSE:
        tl.store(L + L_OFFSET + slot, lse, mask=row_ok)


@triton.jit
def decode_merge_kernel(
    WS, O, L, L_OFFSET, NUM_SPLITS,
    STORE_LSE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """One program per query row (b, h, t), its index ``row``: merge its NUM_SPLITS partial states.

    WS holds the parts O_s (rows, NUM_SPLITS, HEAD_DIM) and, from L_OFFSET on, L_s (rows, NUM_SPLITS);
    O (rows, HEAD_DIM) and L (rows,) are contiguous.  Normalised parts:
        L = max_s L_s + log sum_s e^(L_s - max),    O = sum_s e^(L_s - L) O_s.
    """
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    lse_s = tl.load(WS + L_OFFSET + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2((lse_s - m_ref) * LOG2E_K)                           # 0 for empty splits
    total = tl.sum(w, 0)
    seen = total > 0.0
    w = w / tl.where(seen, total, 1.0)
    parts = tl.load(WS + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], 0)
    tl.store(O + row * HEAD_DIM + offs_d, o.to(O.dtype.element_ty), mask=d_ok)
    if STORE_LSE:
        lse = tl.where(seen, m_ref + tl.math.log2(tl.where(seen, total, 1.0)) * LN2_K, float("-inf"))
        tl.store(L + row, lse)
