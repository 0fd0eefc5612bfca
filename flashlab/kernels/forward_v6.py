"""FlashAttention-2 forward, v6: FlashAttention-3's warp specialisation, written in Gluon (Hopper, D = 128).

Forward v3 leaves the schedule to Triton: every warp loads, multiplies and exponentiates in turn, and the
softmax of a tile waits for its product.  v6 writes the schedule out in Gluon
(``triton.experimental.gluon``, Triton's lower-level dialect: explicit layouts, shared memory,
``mbarrier``s, TMA copies and asynchronous ``warpgroup_mma``), as FlashAttention-3 does on Hopper:

1. **A producer warp** issues every TMA copy: Q's tile once, then K_j and V_j into a ring of STAGES
   shared-memory stages.  Each stage has a "ready" barrier per operand (the copy signals it) and an
   "empty" barrier that both consumers arrive on once they are done with it; the producer waits on
   "empty" before refilling.  ``gl.warp_specialize`` runs it as a partition of its own, with 24
   registers a thread (``setmaxnreg``): the registers go to the consumers.
2. **Two consumer warpgroups** (4 warps each, partitions of their own) each own 64 of the tile's 128
   query rows and keep the online softmax of v1 for them.  Being separate partitions, the warp
   scheduler runs one's softmax while the other's products occupy the tensor cores.
3. **Inside a consumer, the two products overlap** (FlashAttention-3's intra-warpgroup overlap):
   S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued together as asynchronous wgmmas; the softmax of
   S_j runs while P_{j-1} V_{j-1} is still on the tensor cores; then O is rescaled.

Everything else is v3's: rows past N load as zeros (4-D TMA over (B, H, N, D), so any strides with a unit
last stride and 16-byte alignment), only tiles that need it are masked (the last key tile if Nk is ragged,
the diagonal if causal), causal programs start with the longest rows, O and the LSE are stored per row.

Prediction (scripts/gluon_probe.py, its warp-specialised form, non-causal, N = 4k-16k): 1.19-1.21x v3 at
the same 128 x 128 tiles, which would put the forward at cuDNN's level.  Measured: docs/BENCHMARKS.md.

Hopper only (sm_90: ``warpgroup_mma`` and ``setmaxnreg``), fp16/bf16, D = 128; no interpreter (Gluon has
none), so the plan runs it only on such a GPU and the tests that run it need one.

**The variants** (``SUPPORTS``: GQA, sliding windows, soft-cap, packed sequences, dropout), constexpr branches that
cost nothing when off.  The plan runs v6 for GQA, soft-cap, dropout, packed sequences (plan.V6_PLANNED; packed
documents of 2048 rows 1.06-1.32x v4 from run to run, the host's time for such a call close to v6's GPU time) and
windows (plan.V6_PLANNED_FORWARD), these on a persistent grid (below):
GQA reads K/V head h // KV_GROUP; BAND visits only the key tiles that rows row - left ... row + right reach,
masks only the tiles that cross the band's edges, and gives a row that sees no key O = 0 and LSE = -inf (its
running maximum taken as 0 while it is -inf); SOFTCAP turns S into c tanh(S scale / c) before the mask (tanh
from exp2, as forward v4), in base 2 by passing c log2(e) as the scale; VARLEN reads packed (total, H, D) tensors
as (1, H, total, D), each program's sequence from cu_seqlens (its first row added to every TMA coordinate, its
lengths as Nq and Nk: the next sequence's rows, which a tile may load, are masked like keys past Nk); DROPOUT zeroes
P's dropped scores after its row sums with forward v4's mask, bit for bit (Philox keyed on (seed, batch * H + head,
row, column // 16), one byte a score), each Philox call run once by one thread and its 16 bits sent to the threads
that hold them (_dropout_masks), and scales O by 1 / (1 - p).

**A persistent grid** (the constexpr PERSIST, for the calls in PERSIST_FOR: windows).  A window's programs are short
(9 key tiles at a window of 1024), and a program's start (barriers, Q's copy, the first product alone) and end (the
last product, the stores) cost about as much as a few of them.  With PERSIST the grid has one program per
multiprocessor, and each takes work items (Q tile, batch, head) pid, pid + nprog, ... (_tile gives an item's
coordinates, the same order as the one-item grid's): the ring's stage and phase counters run on across items, the
consumers arrive on ``q_empty`` once the item's last S is done, and the producer, waiting on it, copies the next
item's Q and first K / V tiles while the consumers finish the last product and store O.  The work items are
computed in every partition (the one-item kernel too: its SASS grew from 3,968 to 4,032 instructions in triton
3.9's sm_90 build, the same 44 local stores and 50 loads; its causal forward measured 437-444 TFLOP/s at N = 2048
and 506 at 4096, against 443 and 497 before, docs/BENCHMARKS.md 2026-12-04).

FP8 (``launch_fp8``, the constexpr FP8; scripts call it, the plan does not): e4m3 Q, K and V^T with one scale
per (batch, head), GQA, the FP8 `tl` kernel's algorithm (forward_fp8.py) on this schedule.  An e4m3 product's
operands must have their K dimension contiguous (hence V^T), and an 8-bit register operand cannot be kept
alive through a wgmma wait in this Triton, so P8 goes through a 64 x 128 shared tile per consumer.
Predicted: 1.3x the bf16 v6 forward.  Measured (H200, N 4k-16k): 1.17-1.22x it, within 1 % of the `tl` FP8
kernel non-causal and causal at 16k (+7 % causal at 4k): P's trip through shared memory costs what the schedule
gains; not adopted (docs/BENCHMARKS.md, 2026-12-03).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import tiles
from .tiles import C
from ..reference import dropout_rate

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    AVAILABLE = hasattr(gl, "warp_specialize")
except Exception:  # noqa: BLE001  # pragma: no cover - Triton before Gluon, or an early Gluon without these names
    AVAILABLE = False

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAXNREG = 168          # 12 warps (4 + 4 + the producer's, rounded up to a warpgroup) x 32 threads x 168 <= 65,536
CONSUMER_REGS = 240    # per consumer thread after the producer gives its registers back (24 each)

SUPPORTS = frozenset({"gqa", "window", "softcap", "varlen", "dropout"})
HEAD_DIMS = (128,)
ONLY_ON = "sm_90"      # not among the versions every machine runs (plan.FORWARD_VERSIONS)


if AVAILABLE:
    LN2_K = gl.constexpr(LN2)

    if hasattr(tma, "async_load"):       # Triton >= 3.7 names the TMA copy async_load
        @gluon.jit
        def _tma_load(desc, coord, bar, dst):
            tma.async_load(desc, coord, bar, dst)
    else:
        @gluon.jit
        def _tma_load(desc, coord, bar, dst):
            tma.async_copy_global_to_shared(desc, coord, bar, dst)

    if hasattr(gl, "barrier"):                   # Triton >= 3.7 names the partition's barrier gl.barrier
        @gluon.jit
        def _sync():
            gl.barrier()
    else:
        @gluon.jit
        def _sync():
            gl.thread_barrier()

    @gluon.jit
    def _tile(t, work, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, BAND: gl.constexpr,
              VARLEN: gl.constexpr):
        """Work item t (a program's, or a persistent program's t-th): (coords, Nq, Nk, bh), coords = (off_b, off_h,
        off_kv, row0, j0, n_tiles, q0, k0): the tile's batch and heads, its first row, its first key tile and how
        many it visits, a packed sequence's first row and key (0 otherwise); Nq and Nk the sequence's lengths."""
        _, _, BH, H, KV_GROUP, Nq, Nk, GROUP, left, right, CU_Q, CU_K = work
        n_m = gl.cdiv(Nq, BLOCK_M)
        if CAUSAL:
            rank, bh = _longest_first(t, n_m, BH, GROUP)
            start_m = n_m - 1 - rank                                     # the last Q tile sees the most keys
        else:
            start_m = t % n_m
            bh = t // n_m
        off_b = bh // H
        off_h = bh % H
        off_kv = off_h // KV_GROUP
        row0 = start_m * BLOCK_M
        q0 = 0
        k0 = 0
        if VARLEN:   # this sequence's rows of the packed tensors, and its lengths
            q0 = gl.load(CU_Q + off_b)
            Nq = gl.load(CU_Q + off_b + 1) - q0
            k0 = gl.load(CU_K + off_b)
            Nk = gl.load(CU_K + off_b + 1) - k0
        hi = Nk
        if CAUSAL:
            hi = gl.minimum(row0 + BLOCK_M, Nk)
        j0 = t * 0                                                       # the first key tile (a tensor, as hi)
        if BAND:   # the band of rows row0 ... row0 + BLOCK_M - 1: keys row0 - left ... row0 + BLOCK_M - 1 + right
            hi = gl.minimum(row0 + BLOCK_M + right, Nk)
            j0 = gl.maximum(gl.minimum(gl.maximum(row0 - left, 0) // BLOCK_N, gl.cdiv(Nk, BLOCK_N) - 1), 0)
        n_tiles = gl.cdiv(hi, BLOCK_N) - j0
        if VARLEN:   # past the sequence's end (no row to store): one tile, not all of them
            n_tiles = gl.where(row0 < Nq, n_tiles, 1)
        if BAND or VARLEN:   # rows that see no key still run one tile, all masked: O = 0, LSE = -inf
            n_tiles = gl.maximum(n_tiles, 1)
        if VARLEN:
            coords = (0, off_h, off_kv, row0, j0, n_tiles, q0, k0)   # the packed tensors' one "batch"
        else:
            coords = (off_b, off_h, off_kv, row0, j0, n_tiles, q0, k0)
        return coords, Nq, Nk, bh

    @gluon.jit
    def _n_work(work, BLOCK_M: gl.constexpr):
        """A persistent grid's work items: Q tiles x B * H."""
        return gl.cdiv(work[5], BLOCK_M) * work[2]

    @gluon.jit
    def _load_tile(q_desc, k_desc, v_desc, bufs, bars, coords, it, tc, FP8: gl.constexpr, PERSIST: gl.constexpr):
        """One work item's copies: Q's two halves (PERSIST: once both consumers are done with the previous item's Q;
        tc items came before), then K_j, V_j (FP8: V_j^T) into stage (it + j) % STAGES when it is empty (it: the key
        tiles of the items before, so the ring's stages and phases run on across items)."""
        q_smem, k_smem, v_smem, p_all = bufs
        q_bar, k_ready, v_ready, kv_empty, q_empty = bars
        off_b, off_h, off_kv, row0, j0, n_tiles, q0, k0 = coords
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[3]
        HALF: gl.constexpr = q_smem.type.shape[3]
        if PERSIST:
            mbarrier.wait(q_empty, (tc & 1) ^ 1)                         # a fresh barrier passes phase 1
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [off_b, off_h, q0 + row0, 0], q_bar, q_smem.index(0))
        _tma_load(q_desc, [off_b, off_h, q0 + row0 + HALF, 0], q_bar, q_smem.index(1))
        for j in range(n_tiles):
            st = (it + j) % STAGES
            mbarrier.wait(kv_empty.index(st), (((it + j) // STAGES) & 1) ^ 1)   # a fresh barrier passes phase 1
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            col = k0 + (j0 + j) * BLOCK_N
            _tma_load(k_desc, [off_b, off_kv, col, 0], k_ready.index(st), k_smem.index(st))
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            if FP8:     # V^T (B, H_kv, D, Nk): an e4m3 product's B operand must have its K dimension contiguous
                _tma_load(v_desc, [off_b, off_kv, 0, col], v_ready.index(st), v_smem.index(st))
            else:
                _tma_load(v_desc, [off_b, off_kv, col, 0], v_ready.index(st), v_smem.index(st))

    @gluon.jit
    def _load_partition(q_desc, k_desc, v_desc, O, LSE, bufs, bars, work, strides, qk_scale, descale, drop_in,
                        CAUSAL: gl.constexpr, FP8: gl.constexpr, BAND: gl.constexpr, SOFTCAP: gl.constexpr,
                        VARLEN: gl.constexpr, DROPOUT: gl.constexpr, PERSIST: gl.constexpr, WG: gl.constexpr):
        """The producer (1 warp): each work item's copies (_load_tile); PERSIST: items pid, pid + nprog, ..."""
        BLOCK_M: gl.constexpr = 2 * bufs[0].type.shape[3]
        BLOCK_N: gl.constexpr = bufs[1].type.shape[3]
        pid = work[0]
        if PERSIST:
            it = pid * 0
            tc = pid * 0
            for t in range(pid, _n_work(work, BLOCK_M), work[1]):
                coords, _, _, _ = _tile(t, work, BLOCK_M, BLOCK_N, CAUSAL, BAND, VARLEN)
                _load_tile(q_desc, k_desc, v_desc, bufs, bars, coords, it, tc, FP8, PERSIST)
                it += coords[5]
                tc += 1
        else:
            coords, _, _, _ = _tile(pid, work, BLOCK_M, BLOCK_N, CAUSAL, BAND, VARLEN)
            _load_tile(q_desc, k_desc, v_desc, bufs, bars, coords, 0, 0, FP8, PERSIST)

    @gluon.jit
    def _masked(s, j, first_row, Nk, band, BLOCK_N: gl.constexpr, HALF: gl.constexpr, CAUSAL: gl.constexpr,
                BAND: gl.constexpr, layout: gl.constexpr):
        """S_j with the keys a row must not see at -inf: past Nk, (causal) right of the diagonal, (BAND) outside
        row - left ... row + right."""
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        if CAUSAL or BAND:
            rows = first_row + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
        if CAUSAL:
            s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
        if BAND:
            left, right = band
            s = gl.where((cols[None, :] >= rows[:, None] - left) & (cols[None, :] <= rows[:, None] + right), s,
                         float("-inf"))
        return gl.where(cols[None, :] < Nk, s, float("-inf"))

    @gluon.jit
    def _needs_mask(j, lo_full, full, BAND: gl.constexpr):
        """Key tile j crosses an edge for some of the warpgroup's rows (Nk, the diagonal, the band's two edges)."""
        if BAND:
            need = (j < lo_full) | (j >= full)
        else:
            need = j >= full
        return need

    @gluon.jit
    def _tanh(x):
        """tanh from exp2, stable at both ends, with the approximate division (forward v4's soft-cap)."""
        return 1.0 - gl.fdiv(gl.full(x.shape, 2.0, gl.float32, x.type.layout), gl.exp2(x * 2.8853900817779268) + 1.0)

    # Dropout's bits, made where each thread computes distinct Philox calls and moved to the wgmma layout as one word
    # of 16 keep bits a call (forward v4's mask, bit for bit: flashlab.reference.dropout_keep).  A consumer's S tile is 64 rows x 128
    # columns, 8 groups of 16 columns a row: 512 Philox calls, 4 a thread in _DROP_CALLS (lane bits 0-1 and register
    # bit 1 pick the group; the rows are the wgmma layout's: lane bits 2-4, register bit 0 (+8), the warp (+16)).
    # Each call's 16 keep bits (column 16 g + k: byte k % 4 of word k // 4 >= 256 p) go, one word a (row, group),
    # to the four lanes of the quad that hold the row (_DROP_MASKS, replicated over lane bits 0-1); there
    # (row, group, k) -> (row, 16 g + k) is exactly the wgmma accumulator's layout (_DROP_BITS reshaped).
    # In the wgmma layout itself each call would run four times, once per lane of a quad (forward v4's lesson).
    _DROP_CALLS = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [0, 4]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 8]))
    _DROP_BITS = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [8, 0, 0], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        lane_bases=[[0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 8, 16]))
    _DROP_MASKS = gl.constexpr(gl.SliceLayout(2, _DROP_BITS))

    @gluon.jit
    def _philox(seed_lo, seed_hi, c0, c1, c2, ROUNDS: gl.constexpr = 10):
        """Philox-4x32 (key: the seed's two halves; counter (c0, c1, c2, 0), uint32 tensors): tl.philox's
        rounds, which Gluon does not name."""
        k0 = seed_lo
        k1 = seed_hi
        c3 = c2 * 0
        for _ in gl.static_range(ROUNDS):
            a0 = c0
            a2 = c2
            c0 = gl.umulhi(0xCD9E8D57, a2) ^ c1 ^ k0
            c2 = gl.umulhi(0xD2511F53, a0) ^ c3 ^ k1
            c1 = a2 * 0xCD9E8D57
            c3 = a0 * 0xD2511F53
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        return c0, c1, c2, c3

    @gluon.jit
    def _bytes_kept(w, thr):
        """The top bit of each byte of w: that byte >= thr's byte (thr: 256 p in every byte), four compares in one
        word: with x = w | 0x80 and y = thr & 0x7f a byte's x - y borrows from no other byte, its top bit is
        (w & 0x7f) >= (thr & 0x7f), and w >= thr is the majority of w's top bit, thr's inverted top bit and that."""
        d = (w | 0x80808080) - (thr & 0x7F7F7F7F)
        return ((w & ~thr) | (w & d) | (~thr & d)) & 0x80808080

    @gluon.jit
    def _keep_words(seed_lo, seed_hi, bh, rows, groups, thr):
        """One keep mask per (row, group of 16 columns) (rows and groups broadcastable 2-D, any layout): counter
        (g, row, bh, 0), column 16 g + k kept when byte k % 4 of word k // 4 >= 256 p (thr: 256 p in each byte);
        its bit is 8 (k % 4) + k // 4 of the mask (_dropped reads it there)."""
        c0 = (groups + rows * 0).to(gl.uint32)
        c1 = (rows + groups * 0).to(gl.uint32)
        w0, w1, w2, w3 = _philox(seed_lo, seed_hi, c0, c1, c0 * 0 + bh)
        return ((_bytes_kept(w0, thr) >> 7) | (_bytes_kept(w1, thr) >> 6) | (_bytes_kept(w2, thr) >> 5)
                | (_bytes_kept(w3, thr) >> 4))

    @gluon.jit
    def _dropout_masks(drop, first_row, col0):
        """Keep masks of a consumer's S tile (rows first_row ... + 63, columns col0 ... + 127): (64, 8) words in
        _DROP_MASKS, bit 8 (k % 4) + k // 4 of [r, g] the score (r, 16 g + k)'s.  drop: (seed_lo, seed_hi, thr,
        1 / (1 - p), bh)."""
        seed_lo, seed_hi, thr, _, bh = drop
        rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, _DROP_CALLS))
        groups = col0 // 16 + gl.arange(0, 8, layout=gl.SliceLayout(0, _DROP_CALLS))
        return gl.convert_layout(_keep_words(seed_lo, seed_hi, bh, rows[:, None], groups[None, :], thr), _DROP_MASKS)

    @gluon.jit
    def _dropout_scalars(seed_lo, seed_hi, p_drop, bh, DROPOUT: gl.constexpr):
        """(seed_lo, seed_hi, thr, 1 / (1 - p), bh) as _dropout_masks takes them (unused without DROPOUT): the seed's
        halves as uint32, thr = 256 p in each byte (p a whole number of 1/256ths: reference.dropout_rate)."""
        if DROPOUT:
            lo = seed_lo.to(gl.uint32)
            hi = seed_hi.to(gl.uint32)
            thr = (p_drop * 256.0 + 0.5).to(gl.int32).to(gl.uint32) * 0x01010101
            inv = 1.0 / (1.0 - p_drop)
            b = bh.to(gl.uint32)
        else:
            lo = 0
            hi = 0
            thr = 0
            inv = 1.0
            b = 0
        return lo, hi, thr, inv, b

    @gluon.jit
    def _dropped(p, masks, layout: gl.constexpr):
        """P with the dropped scores at 0 (masks from _dropout_masks; p in the consumer's wgmma layout)."""
        k = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(0, _DROP_BITS)))
        # column k's bit, 8 (k % 4) + k // 4, as the part that depends on the lane (k's bits 1 and 2: the same for
        # all of a thread's columns, so one shift a mask) and the part that a register fixes (bits 0 and 3)
        by_lane = gl.expand_dims(gl.expand_dims(16 * ((k >> 1) & 1) + ((k >> 2) & 1), 0), 0)
        by_reg = gl.expand_dims(gl.expand_dims(8 * (k & 1) + 2 * ((k >> 3) & 1), 0), 0)
        keep = (((gl.expand_dims(masks, 2) >> by_lane) >> by_reg) & 1) != 0
        keep = gl.convert_layout(keep.reshape([64, 128]), layout, assert_trivial=True)
        return gl.where(keep, p, 0.0)

    @gluon.jit
    def _safe(m, SAFE: gl.constexpr):
        """The running maximum to subtract: BAND and VARLEN rows may have seen no key yet (m = -inf), and -inf - -inf
        is NaN."""
        if SAFE:
            m = gl.where(m == float("-inf"), 0.0, m)
        return m

    @gluon.jit
    def _v_operand(v_smem, st, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, FP8: gl.constexpr):
        """V_j as P V_j's B operand (BLOCK_N x D): the tile itself, or FP8's V_j^T tile read transposed."""
        if FP8:
            return v_smem.index(st).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
        else:
            return v_smem.index(st).reshape([BLOCK_N, HEAD_DIM])

    @gluon.jit
    def _consume_tile(q_desc, k_desc, v_desc, O, LSE, bufs, bars, coords, sizes, qk_scale, descale, drop, it, tc,
                      CAUSAL: gl.constexpr, FP8: gl.constexpr, BAND: gl.constexpr, SOFTCAP: gl.constexpr,
                      SAFE: gl.constexpr, DROPOUT: gl.constexpr, PERSIST: gl.constexpr, WG: gl.constexpr):
        """A consumer warpgroup on one work item: rows row0 + WG * 64 ... + 63 of the tile, online softmax with
        overlapped wgmmas.  Its key tiles are the ring's it, it + 1, ... (the items before used it); tc items came
        before (Q's barrier phase); PERSIST: Q's buffer given back once the last S is done.
        DROPOUT: P's dropped scores set to 0 after its row sums (the softmax is the undropped one), the kept ones
        scaled by 1 / (1 - p) once, on O; the keep masks of tile j made while S_j is on the tensor cores.
        FP8: Q, K, V^T in e4m3 with one float32 scale per (batch, head); P rounded to e4m3 for P V (its row sums
        taken before) through this warpgroup's P tile in shared memory; the scales applied to the scores' exponent
        and to O."""
        q_smem, k_smem, v_smem, p_all = bufs
        p_smem = p_all.index(WG)
        q_bar, k_ready, v_ready, kv_empty, q_empty = bars
        off_b, off_h, off_kv, row0, j0, n_tiles, q0, k0 = coords
        Nq, Nk, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm, band, cap_in = sizes
        dtype: gl.constexpr = q_desc.dtype
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[3]
        HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
        HALF: gl.constexpr = q_smem.type.shape[3]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEAD_DIM, 16 + 16 * FP8])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        v_scale = 1.0
        if FP8:   # S = (Q8 K8^T) s_q s_k: the descale joins the exponent's scale; O's joins 1 / l
            QS, KS, VS, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh = descale
            qk_scale = qk_scale * gl.load(QS + off_b * stride_qsb + off_h * stride_qsh) \
                * gl.load(KS + off_b * stride_ksb + off_kv * stride_ksh)
            v_scale = gl.load(VS + off_b * stride_vsb + off_kv * stride_vsh)
        if DROPOUT:
            v_scale = v_scale * drop[3]
        first_row = row0 + WG * HALF
        # key tiles 0 ... full - 1 need no mask for any of this warpgroup's rows
        full = Nk // BLOCK_N
        if CAUSAL:
            full = gl.minimum(full, (first_row + 1) // BLOCK_N)
        lo_full = full * 0
        if BAND:   # key tiles lo_full ... full - 1 lie inside every row's band (and below Nk)
            left, right = band
            lo_full = gl.cdiv(gl.maximum(first_row + HALF - 1 - left, 0), BLOCK_N)
            full = gl.minimum(first_row + right + 1, Nk) // BLOCK_N
        q_s = q_smem.index(WG).reshape([HALF, HEAD_DIM])
        zero = gl.zeros([HALF, BLOCK_N], dtype=gl.float32, layout=mma)
        acc = gl.zeros([HALF, HEAD_DIM], dtype=gl.float32, layout=mma)

        mbarrier.wait(q_bar, tc & 1)
        mbarrier.wait(k_ready.index(it % STAGES), (it // STAGES) & 1)
        s_tok = warpgroup_mma(q_s, k_smem.index(it % STAGES).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero,
                              use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        if SOFTCAP:                 # c tanh(s scale / c) in base 2: qk_scale is c log2(e), cap_in scale / c
            s = _tanh(s * cap_in)
        if _needs_mask(j0, lo_full, full, BAND):
            s = _masked(s, j0, first_row, Nk, band, BLOCK_N, HALF, CAUSAL, BAND, mma)
        m_i = gl.max(s, axis=1) * qk_scale
        p = gl.exp2(s * qk_scale - _safe(m_i, SAFE)[:, None])
        l_i = gl.sum(p, axis=1)
        if DROPOUT:
            p = _dropped(p, _dropout_masks(drop, first_row, j0 * BLOCK_N), mma)
        for j in range(1, n_tiles):
            st = (it + j) % STAGES
            prev = (it + j - 1) % STAGES
            mbarrier.wait(k_ready.index(st), ((it + j) // STAGES) & 1)
            s_tok = warpgroup_mma(q_s, k_smem.index(st).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
            if FP8:   # an 8-bit register operand cannot be kept alive through the wait: P8 goes through shared memory
                p_smem.store(p.to(dtype))
                fence_async_shared()
                _sync()
                acc_tok = warpgroup_mma(p_smem, _v_operand(v_smem, prev, BLOCK_N, HEAD_DIM, FP8), acc, is_async=True)
            else:
                p16 = gl.convert_layout(p.to(dtype), p_op)
                acc_tok = warpgroup_mma(p16, _v_operand(v_smem, prev, BLOCK_N, HEAD_DIM, FP8), acc, is_async=True)
            if DROPOUT:   # tile j's keep masks while S_j and P_{j-1} V_{j-1} are on the tensor cores
                masks = _dropout_masks(drop, first_row, (j0 + j) * BLOCK_N)
            s = warpgroup_mma_wait(1, deps=(s_tok,))                   # S_j done; P_{j-1} V_{j-1} in flight
            if SOFTCAP:
                s = _tanh(s * cap_in)
            if _needs_mask(j0 + j, lo_full, full, BAND):
                s = _masked(s, j0 + j, first_row, Nk, band, BLOCK_N, HALF, CAUSAL, BAND, mma)
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            m_use = _safe(m_new, SAFE)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s * qk_scale - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            if DROPOUT:
                p = _dropped(p, masks, mma)
            if FP8:
                acc = warpgroup_mma_wait(0, deps=(acc_tok,))
            else:
                acc, p16 = warpgroup_mma_wait(0, deps=(acc_tok, p16))
            mbarrier.arrive(kv_empty.index(prev), count=1)              # done with stage prev
            acc = acc * alpha[:, None]
        if PERSIST:   # every S of this item is done: the producer may load the next item's Q
            mbarrier.arrive(q_empty, count=1)
        last = (it + n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((it + n_tiles - 1) // STAGES) & 1)
        if FP8:
            p_smem.store(p.to(dtype))
            fence_async_shared()
            _sync()
            acc_tok = warpgroup_mma(p_smem, _v_operand(v_smem, last, BLOCK_N, HEAD_DIM, FP8), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        else:
            p16 = gl.convert_layout(p.to(dtype), p_op)
            acc_tok = warpgroup_mma(p16, _v_operand(v_smem, last, BLOCK_N, HEAD_DIM, FP8), acc, is_async=True)
            acc, p16 = warpgroup_mma_wait(0, deps=(acc_tok, p16))
        mbarrier.arrive(kv_empty.index(last), count=1)

        if SAFE:   # a row that saw no key: O = 0 (acc is 0; 0 / 0 would be NaN), LSE = -inf below
            acc = acc * (v_scale / gl.where(l_i == 0.0, 1.0, l_i))[:, None]
        else:
            acc = acc * (v_scale / l_i)[:, None]
        # O's values and the LSE before their indices, which are the masks' own aranges: made after them, the
        # loops above reloaded spilled registers every tile (sm_90, triton 3.6: 26 local loads a tile in a causal
        # consumer's loop, none in this order; docs/BENCHMARKS.md, 2026-12-06)
        o = acc.to(O.dtype.element_ty)
        lse = (m_i + gl.log2(l_i)) * LN2_K                                 # natural-log LSE of the scaled scores
        rows = first_row + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
        row_ok = rows < Nq
        o_ptrs = (O + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
                  + (q0 + rows)[:, None].to(gl.int64) * stride_om + offs_d[None, :])
        gl.store(o_ptrs, o, mask=row_ok[:, None])
        gl.store(LSE + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + (q0 + rows) * stride_lm,
                 lse, mask=row_ok)

    @gluon.jit
    def _consumer_partition(q_desc, k_desc, v_desc, O, LSE, bufs, bars, work, strides, qk_scale, descale, drop_in,
                            CAUSAL: gl.constexpr, FP8: gl.constexpr, BAND: gl.constexpr, SOFTCAP: gl.constexpr,
                            VARLEN: gl.constexpr, DROPOUT: gl.constexpr, PERSIST: gl.constexpr, WG: gl.constexpr):
        """A consumer warpgroup: its rows of each work item (_consume_tile); PERSIST: items pid, pid + nprog, ...,
        the ring's position carried from one to the next."""
        BLOCK_M: gl.constexpr = 2 * bufs[0].type.shape[3]
        BLOCK_N: gl.constexpr = bufs[1].type.shape[3]
        seed_lo, seed_hi, p_drop = drop_in
        s_ob, s_oh, s_om, s_lb, s_lh, s_lm, cap_in = strides
        left = work[8]
        right = work[9]
        pid = work[0]
        if PERSIST:
            it = pid * 0
            tc = pid * 0
            for t in range(pid, _n_work(work, BLOCK_M), work[1]):
                coords, Nq, Nk, bh = _tile(t, work, BLOCK_M, BLOCK_N, CAUSAL, BAND, VARLEN)
                sizes = (Nq, Nk, s_ob, s_oh, s_om, s_lb, s_lh, s_lm, (left, right), cap_in)
                drop = _dropout_scalars(seed_lo, seed_hi, p_drop, bh, DROPOUT)
                _consume_tile(q_desc, k_desc, v_desc, O, LSE, bufs, bars, coords, sizes, qk_scale, descale, drop,
                              it, tc, CAUSAL, FP8, BAND, SOFTCAP, BAND or VARLEN, DROPOUT, PERSIST, WG)
                it += coords[5]
                tc += 1
        else:
            coords, Nq, Nk, bh = _tile(pid, work, BLOCK_M, BLOCK_N, CAUSAL, BAND, VARLEN)
            sizes = (Nq, Nk, s_ob, s_oh, s_om, s_lb, s_lh, s_lm, (left, right), cap_in)
            drop = _dropout_scalars(seed_lo, seed_hi, p_drop, bh, DROPOUT)
            _consume_tile(q_desc, k_desc, v_desc, O, LSE, bufs, bars, coords, sizes, qk_scale, descale, drop,
                          0, 0, CAUSAL, FP8, BAND, SOFTCAP, BAND or VARLEN, DROPOUT, PERSIST, WG)

    @gluon.jit
    def _longest_first(pid, n_tiles, BH, GROUP):
        """A causal grid's program -> (rank, bh), rank 0 the tile with the most work.  The heads go in sections of
        GROUP; a section runs every head's rank-0 tile, then every rank 1, and so on: the longest-processing-time
        order, so the last programs of a section (and of the grid) are short ones and no multiprocessor is left with
        a long tile while the others idle; and the programs running together read at most about GROUP heads'
        tensors, which stay in L2 (tiles.head_group picks GROUP)."""
        per = GROUP * n_tiles
        sec = pid // per
        heads = gl.minimum(GROUP, BH - sec * GROUP)
        r = pid - sec * per
        return r // heads, sec * GROUP + r % heads

    @gluon.jit(do_not_specialize=["seed_lo", "seed_hi"])
    def flash_fwd_kernel_v6(q_desc, k_desc, v_desc, O, LSE, QS, KS, VS,
                            stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
                            stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
                            H, KV_GROUP, Nq, Nk, qk_scale, GROUP, left, right, cap_in, CU_Q, CU_K,
                            seed_lo, seed_hi, p_drop, BH,
                            CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            FP8: gl.constexpr = False, BAND: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
                            VARLEN: gl.constexpr = False, DROPOUT: gl.constexpr = False,
                            PERSIST: gl.constexpr = False):
        """One program: BLOCK_M query rows of one (batch, head); a 1-D grid of Q tiles x B * H, the tile index
        fastest (common.program_tile's order: programs launched together share K and V in L2); causal, the
        longest rows first over sections of GROUP heads (_longest_first).  K and V have H / KV_GROUP heads.
        FP8: e4m3 Q, K and V^T (B, H_kv, D, Nk) with scales QS (per batch and query head), KS, VS (per batch and
        K/V head); O in its own dtype (the bf16 / fp16 kernel ignores QS, KS, VS).
        The variants (flashlab.variants, through the plan): GQA is KV_GROUP; BAND visits only the key tiles that
        rows row - left ... row + right reach (left, right >= 0; a row that sees no key gets O = 0, LSE = -inf);
        SOFTCAP takes qk_scale = c log2(e) and cap_in = scale / c: S -> c tanh(S scale / c), in base 2.
        VARLEN: packed sequences, Q, K, V seen as (1, H, total, D) (and O, LSE as (H, total)); sequence off_b's rows
        are CU_Q[off_b] ... CU_Q[off_b + 1] - 1 (keys: CU_K), Nq and Nk the longest lengths (the grid's); a program
        past its sequence's end runs one tile and stores nothing."""
        pid = gl.program_id(0)
        if PERSIST:   # a grid of at most one program a multiprocessor, each running items pid, pid + nprog, ...
            nprog = gl.num_programs(0)
        else:         # one item a program
            nprog = 1
            BH = gl.num_programs(0) // gl.cdiv(Nq, BLOCK_M)
        work = (pid, nprog, BH, H, KV_GROUP, Nq, Nk, GROUP, left, right, CU_Q, CU_K)

        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        if PERSIST:   # both consumers done with an item's Q (the producer waits on it before the next item's)
            q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(q_empty, count=2)
        else:
            q_empty = q_bar
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(kv_empty.index(s), count=2)                   # both consumer warpgroups arrive
        fence_async_shared()

        if FP8:     # each consumer's P8 tile (64 x 128 e4m3, 8 KiB)
            p_all = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, BLOCK_N],
                                              gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, BLOCK_N], dtype))
        else:
            p_all = q_smem
        bufs = (q_smem, k_smem, v_smem, p_all)
        bars = (q_bar, k_ready, v_ready, kv_empty, q_empty)
        strides = (stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm, cap_in)
        descale = (QS, KS, VS, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh)
        drop_in = (seed_lo, seed_hi, p_drop)
        gl.warp_specialize([
            (_consumer_partition, (q_desc, k_desc, v_desc, O, LSE, bufs, bars, work, strides, qk_scale, descale,
                                   drop_in, CAUSAL, FP8, BAND, SOFTCAP, VARLEN, DROPOUT, PERSIST, 0)),
            (_consumer_partition, (q_desc, k_desc, v_desc, O, LSE, bufs, bars, work, strides, qk_scale, descale,
                                   drop_in, CAUSAL, FP8, BAND, SOFTCAP, VARLEN, DROPOUT, PERSIST, 1)),
            (_load_partition, (q_desc, k_desc, v_desc, O, LSE, bufs, bars, work, strides, qk_scale, descale, drop_in,
                               CAUSAL, FP8, BAND, SOFTCAP, VARLEN, DROPOUT, PERSIST, 1)),
        ], [4, 1], [CONSUMER_REGS, 24])


# ------------------------------------------------------------------------------------- configs and launcher

def config_lists(head_dim, dtype, limit, cc) -> dict:
    """One config (its tiles are the kernel's design: 128 x 128, 4 warps per partition); 3 stages, then 2.
    Shared memory: Q 32 KiB + 2 x STAGES x 32 KiB (K, V): 224 KiB at 3 stages, 160 at 2."""
    cands = [C(128, 128, 4, 3), C(128, 128, 4, 2)]
    if limit is not None:
        cands = [c for c in cands if 32 * 1024 * (1 + 2 * c.num_stages) + 1024 <= limit]
    return {"fwd": (cands, [])}


def compile_sm90(causal: bool = False, dtype: str = "bf16", stages: int = 3, band: bool = False,
                 softcap: bool = False, varlen: bool = False, dropout: bool = False, persist: bool = False):
    """Compile the kernel for sm_90 without a GPU (Triton's compiler and ptxas only): what a machine without a
    Hopper GPU can check of v6.  Needs compiled mode (``TRITON_INTERPRET=0``): Gluon has no interpreter.
    dtype "fp8e4nv": the FP8 kernel (e4m3 Q, K, V^T; O in bf16); band, softcap, varlen, dropout: the variants'
    kernels; persist: on a persistent grid."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    gdt = {"fp16": gl.float16, "bf16": gl.bfloat16, "fp8e4nv": gl.float8e4nv}[dtype]
    fp8 = dtype == "fp8e4nv"
    fn = flash_fwd_kernel_v6
    sig = {n: "i32" for n in fn.arg_names}
    for name, rows in (("q_desc", 64), ("k_desc", 128), ("v_desc", 128)):
        layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, 128], gdt)
        sig[name] = f"tensordesc<{dtype}[1, 1, {rows}, 128],{layout!r}>"
    sig.update(O="*bf16" if fp8 else f"*{dtype}", LSE="*fp32", QS="*fp32", KS="*fp32", VS="*fp32", qk_scale="fp32",
               cap_in="fp32", CU_Q="*i32", CU_K="*i32", p_drop="fp32")
    consts = dict(CAUSAL=causal, BLOCK_M=128, BLOCK_N=128, HEAD_DIM=128, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS,
                  FP8=fp8, BAND=band, SOFTCAP=softcap, VARLEN=varlen, DROPOUT=dropout, PERSIST=persist)
    sig.update({k: "constexpr" for k in consts})
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4, "maxnreg": MAXNREG})


@functools.lru_cache(maxsize=64)
def _shared_layout(block: tuple, dtype):
    """The swizzled shared-memory layout of a TMA block, made once: making it took 57 of the 62 us a descriptor cost
    the host (one CPU, docs/BENCHMARKS.md), and a launch makes three to five descriptors."""
    gdt = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
           torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gdt)


def _descriptor(t, rows: int, cols: int | None = None):
    """A TMA descriptor over the whole (B, H, N, D) tensor, blocks of rows x cols (default: all of D)."""
    block = [1, 1, rows, cols or t.shape[-1]]
    return GluonDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(tuple(block), t.dtype))


class VariantCall(NamedTuple):
    causal: bool      # the causal kernel (plain causal attention, GQA or soft-capped)
    band: bool        # the BAND kernel: a window (left, right), causal or not
    softcap: bool
    left: int
    right: int
    qk_scale: float
    cap_in: float
    dropout: bool = False
    p_drop: float = 0.0   # the rate applied, a whole number of 1/256ths (reference.dropout_rate)
    seed_lo: int = 0      # the seed's low and high 32 bits (Philox's key), each as a signed 32-bit int (_int32)
    seed_hi: int = 0


def variant_scalars(plan, scale: float, softcap=None, dropout_p: float = 0.0, seed: int = 0,
                    **others) -> VariantCall:
    """What v6 (forward and backward) takes of a variant call.
    The band is the window's (Variant.band, -1 unbounded given as past every key); plain causal attention keeps
    the causal kernel (its longest-first order and one masked diagonal).  Soft-cap: qk_scale = c log2(e) and
    cap_in = scale / c (the scores become c tanh(s scale / c) in base 2); else qk_scale = scale log2(e).  Dropout:
    forward v4's mask (reference.dropout_keep), its rate rounded to 1/256ths, the seed split into Philox's key."""
    extra = sorted(k for k, v in others.items()
                   if not (v is None or v is False or (isinstance(v, (int, float)) and v == 0)))
    if extra:   # the plan runs v6 only for the features in SUPPORTS; anything else here is a caller's mistake
        raise ValueError(f"v6 implements {sorted(SUPPORTS)} only, not {extra}")
    var = plan.variant
    band = var.band(plan.causal) if var.window is not None else None
    big = plan.Nq + plan.Nk + 256
    left, right = (0, 0) if band is None else tuple(big if x < 0 else min(x, big) for x in band)   # int32-safe
    qk, cap_in = (scale * LOG2E, 1.0) if softcap is None else (float(softcap) * LOG2E, scale / float(softcap))
    drop = dropout_p > 0
    seed = int(seed) if drop else 0
    return VariantCall(plan.causal and band is None, band is not None, softcap is not None, left, right, qk, cap_in,
                       drop, dropout_rate(dropout_p) if drop else 0.0, _int32(seed), _int32(seed >> 32))


def _int32(x: int) -> int:
    """x's low 32 bits as a signed 32-bit int (the kernels read them back as uint32, the same bits).  Triton types an
    int argument by its value (i32 below 2**31, i64 above), so halves up to 2**32 - 1 would give the kernel one
    signature or the other from call to call: a second compilation, and a launch through a kept runner
    (tiles.launch_cached) with the other type, an error.  Signed, every seed's halves are i32."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= (1 << 31) else x


# Which calls run on a persistent grid (PERSIST: one program a multiprocessor, each taking work items pid, pid + nprog,
# ...): "band" (windows), "varlen" (packed sequences), "causal", "dense" (neither causal nor a band).  A persistent
# program's producer loads the next item's Q and first K / V tiles while the consumers finish the last one, which
# pays where items are short.
# Measured (H200, bf16, D = 128, causal; docs/BENCHMARKS.md 2026-12-04): windows of 256 and 1024 keys 1.05-2.5x the
# grid of one program a Q tile, 4096 as fast; causal attention 0.76-0.87x (a static share of the tiles loses the
# hardware's longest-first hand-out) and packed documents 0.76-0.83x; non-causal 1.0-1.05x.  So windows only.
PERSIST_FOR = frozenset({"band"})


def persistent(plan, call) -> bool:
    """Whether this call runs on a persistent grid (PERSIST_FOR)."""
    return persistent_for(call.band, plan.variant.varlen, call.causal)


def persistent_for(band: bool, varlen: bool, causal: bool) -> bool:
    """The same from the call's kind: a band (window), packed sequences, causal (no band)."""
    kind = {"band"} if band else set()
    if varlen:
        kind.add("varlen")
    if not kind:
        kind.add("causal" if causal else "dense")
    return bool(kind & PERSIST_FOR)


def launch(plan, q, k, v, o, lse, scale: float, runners=None, **variant_args):
    """Three TMA descriptors over the whole (B, H, N, D) tensors (K, V: B, H / kv_groups, N, D), then one launch on
    a 1-D grid of Q tiles x B * H.  ``variant_args``: the soft-cap value, and a packed call's cu_q, cu_k (int32,
    B + 1; q, k, v, o then (total, H, D), lse (H, total_q), as forward v4's); the window and GQA are the plan's."""
    step = plan.forward[0]
    cfg = step.config
    if (cfg.block_m, cfg.block_n, cfg.num_warps) != (128, 128, 4) or cfg.num_stages < 2:
        raise ValueError(f"forward v6's tiles are its design, 128 x 128, 4 warps per consumer warpgroup (64 query "
                         f"rows each), and at least 2 stages (one would deadlock its ring), not {cfg}")
    varlen = plan.variant.varlen
    cu_q, cu_k = variant_args.pop("cu_q", None), variant_args.pop("cu_k", None)
    call = variant_scalars(plan, scale, **variant_args)
    if plan.Nk == 0 or (varlen and k.shape[0] == 0):   # no key tile: the consumers would wait for one for ever
        o.zero_()
        lse.fill_(float("-inf"))
        return
    if varlen:   # (total, H, D) seen as (1, H, total, D): sequence b's rows start at cu_q[b] (the kernel adds it)
        if q.shape[0] == 0:
            return
        q, k, v, o = (t.permute(1, 0, 2)[None] for t in (q, k, v, o))
        lse_strides = (0, *lse.stride())
    else:
        cu_q = cu_k = lse
        lse_strides = tuple(lse.stride())
    # causal: longest first, by sections of heads (1 otherwise: unused, and one value keeps one compiled kernel)
    group = tiles.head_group(plan.B * plan.H, -(-plan.Nq // cfg.block_m), plan.facts.sms) if call.causal else 1
    persist = persistent(plan, call)
    errors = []
    for cand in (cfg,) + tuple(step.fallbacks):     # 3 stages, then 2 if a GPU's shared memory is short
        try:
            n_work = -(-plan.Nq // cand.block_m) * plan.B * plan.H
            grid = (min(n_work, plan.facts.sms),) if persist else tiles.grid_1d(-(-plan.Nq // cand.block_m),
                                                                                 plan.B * plan.H)
            args = (_descriptor(q, cand.block_m // 2), _descriptor(k, cand.block_n), _descriptor(v, cand.block_n),
                    o, lse, lse, lse, lse, *o.stride()[:3], *lse_strides, 0, 0, 0, 0, 0, 0,
                    plan.H, plan.variant.kv_groups, plan.Nq, plan.Nk, call.qk_scale, group, call.left, call.right,
                    call.cap_in, cu_q, cu_k, call.seed_lo, call.seed_hi, call.p_drop, plan.B * plan.H)
            consts = dict(CAUSAL=call.causal, BLOCK_M=cand.block_m, BLOCK_N=cand.block_n, HEAD_DIM=plan.D,
                          STAGES=cand.num_stages, CONSUMER_REGS=CONSUMER_REGS, BAND=call.band, SOFTCAP=call.softcap,
                          VARLEN=varlen, DROPOUT=call.dropout, PERSIST=persist, num_warps=cand.num_warps,
                          maxnreg=MAXNREG)
            # after the first launch, the compiled kernel's runner (runners: this plan's and these tensors' exact
            # specialisation): Triton's argument binding skipped, the host's time a call shorter
            tiles.launch_cached(flash_fwd_kernel_v6, grid, args, consts, runners if cand is cfg else None,
                                "fwd v6 persistent" if persist else "fwd v6")
            if cand != cfg or not step.verified:
                step.fell_back(cand, errors)
            return
        except Exception as e:  # noqa: BLE001 - out of resources on this GPU: the next config
            if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e).lower():
                raise
            errors.append(e)
    raise errors[-1]


def launch_fp8(q8, k8, vt8, o, lse, scale: float, q_scale, k_scale, v_scale, causal: bool, stages: int = 3):
    """The FP8 forward on v6's schedule (not yet in the plan: scripts call it).  q8 (B, H, Nq, 128), k8 (B, H_kv,
    Nk, 128) and vt8 (B, H_kv, 128, Nk) e4m3 with TMA-able strides (Nk a multiple of 16 for V^T's rows);
    q_scale (B, H), k_scale and v_scale (B, H_kv) float32; o (B, H, Nq, 128) bf16 / fp16; lse (B, H, Nq)."""
    B, H, Nq, D = q8.shape
    Hkv, Nk = k8.shape[1], k8.shape[2]
    e4m3 = torch.float8_e4m3fn
    if (q8.dtype, k8.dtype, vt8.dtype) != (e4m3, e4m3, e4m3):
        raise TypeError(f"q8, k8, vt8 must be {e4m3}, got {q8.dtype}, {k8.dtype}, {vt8.dtype}")
    if D != 128 or Hkv == 0 or H % Hkv or tuple(k8.shape) != (B, Hkv, Nk, D) or tuple(vt8.shape) != (B, Hkv, D, Nk):
        raise ValueError(f"the FP8 v6 forward takes q8 (B, H, Nq, 128), k8 (B, H_kv, Nk, 128) and vt8 (B, H_kv, 128, "
                         f"Nk) with H a multiple of H_kv, not {tuple(q8.shape)}, {tuple(k8.shape)}, {tuple(vt8.shape)}")
    for name, t, shape in (("q_scale", q_scale, (B, H)), ("k_scale", k_scale, (B, Hkv)),
                           ("v_scale", v_scale, (B, Hkv))):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be a float32 tensor of shape {shape}")
    if Nk % 16:
        raise ValueError(f"Nk = {Nk}: V^T's rows must be a multiple of 16 bytes for its TMA copies (pad the keys)")
    if B * H * Nq == 0:
        return
    if Nk == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return
    sms = torch.cuda.get_device_properties(q8.device).multi_processor_count
    group = tiles.head_group(B * H, -(-Nq // 128), sms) if causal else 1
    grid = tiles.grid_1d(-(-Nq // 128), B * H)
    flash_fwd_kernel_v6[grid](
        _descriptor(q8, 64), _descriptor(k8, 128), _descriptor(vt8, 128, 128), o, lse, q_scale, k_scale, v_scale,
        *o.stride()[:3], *lse.stride(), *q_scale.stride(), *k_scale.stride(), *v_scale.stride(),
        H, H // k8.shape[1], Nq, Nk, scale * LOG2E, group, 0, 0, 1.0, lse, lse, 0, 0, 0.0, B * H,
        CAUSAL=causal, BLOCK_M=128, BLOCK_N=128, HEAD_DIM=128, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS,
        FP8=True, num_warps=4, maxnreg=MAXNREG)
