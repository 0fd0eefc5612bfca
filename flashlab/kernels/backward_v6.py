"""FlashAttention-2 backward, v6: forward v6's warp specialisation applied to backward v4 (Gluon, Hopper, D = 128).

Backward v4 leaves the schedule to Triton: each program loads Q_i and dO_i, then runs five products and
the exponentials in turn, and the tensor cores wait for every load and every softmax.  v6 writes the
same one-pass algorithm (K_j, V_j stationary; dV_j, dK_j on chip; dQ_i's share added to a float32
buffer by the TMA unit) as FlashAttention-3 does on Hopper:

1. **A producer warp** issues every TMA copy: K_j and V_j once, then Q_i and dO_i into a ring of
   STAGES stages, with a "ready" barrier per operand and an "empty" barrier both consumers arrive on.
2. **Two consumer warpgroups** (partitions of their own, 240 registers a thread) each own 64 of the
   tile's 128 keys: dV and dK for them are 64 x 128 float32 accumulators, 64 registers each.
   Per Q tile of 64 rows, warpgroup w computes, with asynchronous ``warpgroup_mma``s:

       S^T = K_w Q_i^T,  dP^T = V_w dO_i^T             (issued together, 64 x 64 each)
       P^T = exp2(S^T log2(e) s - L_i),  dV_w += P^T dO_i   (P^T from registers)
       dS^T = P^T o (dP^T - D_i),         dK_w += dS^T Q_i

3. **dQ_i = dS K_j is split by columns, not by keys.**  Each warpgroup writes its half of dS^T
   (64 keys x 64 rows) to shared memory; once both halves are there (a barrier both arrive on),
   warpgroup w computes dQ_i's columns 64w ... 64w + 63 from all 128 keys,
   dS (64 x 128, the shared tile read transposed) times K_j's columns (128 x 64): 32 registers, not
   the 64 a key split would need beside dK and dV, and one float32 add per element of dQ_i, not two.
   The warpgroup stages its 64 x 64 block in shared memory and the TMA unit adds it into the buffer
   (``cp.reduce.async.bulk.tensor``), as v4 does; the dS^T tiles are double-buffered so a warpgroup
   may run one Q tile ahead of the other.

Rows past N load as zeros and their adds are dropped (4-D TMA over (B, H, N, D)); P^T's exponent is
clamped at 0 as in v3 (keys past Nk); causal programs start at the first Q tile that sees their keys
and mask only the two tiles on the diagonal, in a loop of their own: with the mask in the one loop,
ptxas spilled its indices to local memory on every Q tile (cuobjdump of the sm_90 build, triton 3.6, what the
H200 ran: 828 instructions a tile with 30 local stores and 34 loads; the loop without the mask, 665 with 9 and
13, as the non-causal loop; a consumer's 240 registers hold dK and dV, 128 of them, beside S^T and dP^T).
Triton 3.9's build spills otherwise (its loop without the mask: 0-16 stores and 43-54 loads a tile, the
non-causal loop 3-4 and 12-31) and has not been timed.
Causal grids run longest first by sections of heads (tiles.head_group).  A step's Q tile, (first + i) mod n_iter
from the program's first, is first + i less n_iter once past the wrap (first < n_iter, i < n_iter): a remainder by
a runtime value cost each step about 30 instructions of both consumers' loops (sm_90, triton 3.6: causal 665 / 637
-> 636 / 615 a step; ptxas then spills differently, 13 / 12 local loads a step -> 29 / 30).  The backward kernel
alone on the H200, bf16, D 128 (docs/BENCHMARKS.md, 2026-12-05, second entry): causal B 8 x 2048, 865 -> 830 us;
8 packed documents of 2048, 960 -> 885; GQA 32 / 8 causal B 2 x 8192, 6,075 -> 5,792; non-causal B 4 x 4096,
2,833 -> 2,757; a window of 1024 (forced), 1,173 -> 1,144.  Walking a window's two edges first, then its inside
(two loops, as causal's, not three) compiled to fewer local stores but ran slower (1,290-1,296 us).

**LSE and Delta through shared memory.**  The producer copies each step's 64 rows of LSE with Q_i and of Delta with
dO_i (TMA, on the same barriers: 16,640 bytes a stage each; (B * H, Nq) float32, a copy with rows padded to 16 bytes
where Nq is not a multiple of 4, _rows), and a consumer reads LSE once S^T is done and Delta once dP^T is.  Loaded
from global memory at the step's start, they held 32 registers a thread through both products' waits beside dK and
dV's 128, and ptxas spilled.  A step of each consumer's loop without the mask, instructions (local stores, loads),
sm_90, triton 3.6, before -> after: causal 636 / 615 (7 / 5, 29 / 30) -> 458 / 456 (0 / 0, 1 / 1); non-causal
610 / 607 (10 / 7, 17 / 11) -> 441 / 442 (none); GQA 4 639 / 629 -> 470 / 463 (0 / 0, 1 / 4); packed, causal
582 / 564 (11 / 6, 33 / 32) -> 460 / 455 (0 / 0, 4 / 2); soft-cap 1,030 / 1,011 (29 / 27, 51 / 52) -> 816 / 811
(0 / 0, 1 / 2); dropout 834 / 800 (14 / 9, 41 / 39) -> 639 / 632 (0 / 0, 2 / 3); a window's inside 668 / 686
(15 / 22, 48 / 58) -> 500 / 504 (6 / 7, 10 / 11).  The kernel alone on an H100 (docs/BENCHMARKS.md, 2026-12-05,
fifth entry): causal B 8 x 2048, 855 -> 753 us; non-causal B 4 x 4096, 2,795 -> 2,353; 8 packed documents of 2048,
916 -> 760; a window of 1024, 1,196 -> 839; GQA 32 / 8 causal B 2 x 8192, 5,834 -> 4,943.

**The variants** (``SUPPORTS``, forward v6's: GQA, sliding windows, soft-cap, dropout, packed sequences), constexpr
branches that leave the plain kernel's loops as they were (their SASS: the same instructions, local loads and stores a
tile).  The plan runs all of them here (plan.V6_PLANNED); a window since LSE and Delta come through shared memory
(1.25-1.30x backward v5 at a window of 1024, docs/BENCHMARKS.md 2026-12-05, fifth entry; before, as fast as v5, which
is deterministic, and the plan kept v5):
- GQA: a program owns a K/V head's 128 keys and walks the Q tiles of each of the KV_GROUP query heads that read
  them in turn (the ring's steps continue across heads), summing dK and dV in registers: no atomics for them.
  KV_GROUP is a constexpr (one loop more only when it is above 1: a runtime group spilled the causal loop).
- BAND: only the Q tiles whose rows reach these keys (n0 - right ... n0 + 127 + left); the tiles that cross the
  band's two edges run in loops of their own with the mask, the inside without (three loops, as causal's two);
  a row that saw no key (LSE = -inf) is taken as LSE = +inf there, so its P = 0.
- SOFTCAP: P from c tanh(S scale / c), and dS^T = P^T o (1 - tanh^2) o (dP^T - D_i), the first product made while
  dP^T is still on the tensor cores: it replaces P^T, so tanh (32 registers a thread) is not kept through dP^T's
  wait beside it.  Kept there, the loop spilled (sm_90, triton 3.6: 1,114 instructions a tile, 58 local stores and
  64 loads; now 1,058, 31 and 36) and the backward took 4.73 ms at B 2, H 16, N 8192, causal (now 3.79 ms;
  docs/BENCHMARKS.md, 2026-12-04).
- DROPOUT: forward v6's mask regenerated once (backward v5 draws it in both its kernels).  The producer, a warpgroup
  with dropout (its three more warps were the padding of the 12 warps the registers are counted for), makes both
  consumers' keep masks of a step once its copies are issued, into the stage's shared memory (1 KiB a consumer),
  and arrives a second time on dO's barrier; so Philox runs off the consumers' path, where the tensor cores waited
  for it.  A consumer reads its masks once, into P^T's sign (a dropped score's P negative): max(P^T, 0) is
  P^T o keep for dV, and dS^T = P^T o (dP^T - D_i) where kept, -|P^T| D_i where dropped.  Z's factor 1 / (1 - p)
  is applied to dK, dV and dQ once, at the end.  The loop's SASS (sm_90, triton 3.6, causal, the unmasked loop of
  each consumer): 1,063 / 1,055 instructions a step with 28 / 25 local stores and 48 / 38 loads when each consumer
  made its own masks (before the products; made while they were in flight, 1,186, 48, 71) and read them twice;
  866 / 823 with 12 / 7 and 21 / 19 now (665 / 637, 9 / 4, 13 / 12 without dropout).  The backward with
  dropout at B 2, H 16, N 4096, causal: 1.28 ms with the consumers' masks, 0.97 now (0.85 without dropout;
  docs/BENCHMARKS.md, 2026-12-05).
- VARLEN (packed sequences, forward v6's layout): a program's sequence from cu_seqlens, its first row and key added
  to every TMA coordinate.  A tile may load the next sequence's rows, which are not zeros as past a dense tensor's
  end; rather than a mask on every tile (masking the ragged ones in loops of their own spilled the loop without the
  mask: 770 instructions, 41 local stores, 59 loads a tile), keys past the sequence's end are set to zero in shared
  memory once (_zero_keys: then they are what TMA gives past a dense tensor), and rows past it read LSE = +inf, so
  their P and dS are 0.  The loops are then causal's or the plain ones (674, 17, 22 causal; 671, 10, 18 plain).
  LSE and Delta come in padded rows (padded_rows: each sequence's rows, from a 16-byte boundary, followed by 64 of
  LSE = +inf, Delta = 0), so a step's 64 rows are copied without a mask and the sequence's length, a loaded value, is
  not live in the loops (ncu, when they were loaded from global memory: the packed kernel made 13.3 million
  local-memory requests against the dense kernel's 7.5): 643 / 637, 14 / 11, 19 / 19 causal; the packed kernel on an
  H100 (8 documents of 2048, H 16), 1,103 -> 982 us (docs/BENCHMARKS.md, 2026-12-05, second entry).

Prediction: forward v6 measured 1.19-1.21x v3 at the same tiles with this split of work; the
backward has the same kind of idle tensor cores, so 1.15-1.25x backward v4 at D = 128, N >= 4096 (0.85-0.9x
cuDNN).  Measured: docs/BENCHMARKS.md.

Hopper only (sm_90), fp16/bf16, D = 128; no interpreter (Gluon has none).  The plan runs it there from the 2048
bucket on (plan.choose_versions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backward, forward_v6, tiles
from .common import program_tile
from .tiles import C

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton._C.libtriton import ir as _ir
    AVAILABLE = hasattr(gl, "warp_specialize")
except Exception:  # noqa: BLE001  # pragma: no cover - Triton before Gluon
    AVAILABLE = False

LOG2E = 1.4426950408889634
MAXNREG = 168          # as forward v6: 12 warps x 32 threads x 168 <= 65,536
CONSUMER_REGS = 240

SUPPORTS = forward_v6.SUPPORTS   # GQA, windows, soft-cap, dropout, packed sequences: forward v6's constexpr branches
HEAD_DIMS = (128,)
ONLY_ON = "sm_90"


if AVAILABLE:
    from .forward_v6 import (GluonDescriptor, _descriptor, _dropout_scalars, _keep_words, _longest_first, _sync, _tanh,
                             _tma_load)

    # Dropout's bits for S^T (64 keys x 64 rows a consumer; forward v6's mask, bit for bit).  In the wgmma layout a
    # warp holds 16 keys, one group of 16 columns of the forward's mask: 4 groups x 64 rows = 256 Philox calls, two a
    # thread in _DROP_CALLS_T (the warp picks the group, lanes and a register the row), their masks stored to shared
    # memory and read back by the lanes that hold each row (_DROP_MASKS_T); (group, k, row) -> (16 group + k, row) is
    # then S^T's wgmma layout.
    _DROP_CALLS_T = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 32]], lane_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]],
        warp_bases=[[1, 0], [2, 0]], block_bases=[], shape=[4, 64]))
    _DROP_BITS_T = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 8, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, 64]))
    _DROP_MASKS_T = gl.constexpr(gl.SliceLayout(1, _DROP_BITS_T))

    @gluon.jit
    def _dropout_words_t(drop, bh, row0, group0):
        """Keep masks of a consumer's S^T tile (key groups group0 ... + 3, rows row0 ... + 63): (4, 64) words in
        _DROP_CALLS_T (two a thread, as computed), bit 8 (k % 4) + k // 4 of [g, r] the score (row r, key
        16 (group0 + g) + k)'s."""
        seed_lo, seed_hi, thr, _, _ = drop
        groups = group0 + gl.arange(0, 4, layout=gl.SliceLayout(1, _DROP_CALLS_T))
        rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(0, _DROP_CALLS_T))
        return _keep_words(seed_lo, seed_hi, bh.to(gl.uint32), rows[None, :], groups[:, None], thr)

    @gluon.jit
    def _kept_t(x, masks, layout: gl.constexpr):
        """x (S^T's wgmma layout, x >= 0) with the dropped scores negated (masks: _dropout_words_t's, read in
        _DROP_MASKS_T): max(., 0) is then x o keep and |.| x, so the keep bits are read once a step."""
        k = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _DROP_BITS_T)))
        # key k's bit, 8 (k % 4) + k // 4: k's bits 0-2 are the lane's (one shift a mask), bit 3 a register's
        by_lane = gl.expand_dims(gl.expand_dims(8 * (k & 3) + ((k >> 2) & 1), 0), 2)
        by_reg = gl.expand_dims(gl.expand_dims(2 * ((k >> 3) & 1), 0), 2)
        keep = (((gl.expand_dims(masks, 1) >> by_lane) >> by_reg) & 1) != 0
        keep = gl.convert_layout(keep.reshape([64, 64]), layout, assert_trivial=True)
        return gl.where(keep, x, -x)

    if hasattr(tma, "async_atomic_add"):          # Triton >= 3.7
        @gluon.jit
        def _tma_add(desc, coord, src):
            tma.async_atomic_add(desc, coord, src)
    else:                                         # Triton 3.6: the op exists, Gluon does not name it yet
        @_builtin
        def _tma_add_op(desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)

        @gluon.jit
        def _tma_add(desc, coord, src):
            _tma_add_op(desc, coord, src)

    @gluon.jit
    def _load_partition(q_desc, k_desc, v_desc, do_desc, dq_desc, bufs, bars, coords, sizes, ptrs, scales,
                        CAUSAL: gl.constexpr, BAND: gl.constexpr, SOFTCAP: gl.constexpr, KV_GROUP: gl.constexpr,
                        DROPOUT: gl.constexpr, WG: gl.constexpr, VARLEN: gl.constexpr = False):
        """The producer (1 warp; a warpgroup with dropout, which makes the keep masks too): K_j and V_j once, then,
        for each query head of the K/V head's group, Q_i and dO_i into stage it % STAGES when it is empty."""
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dm_smem, lse_smem, dl_smem = bufs
        kv_bar, q_ready, do_ready, qdo_empty, ds_ready, ds_free, kz_bar = bars
        off_b, off_kv, n0, m_lo, n_iter, first, tb, q0, k0 = coords
        lb, lc, H = sizes[5], sizes[6], sizes[7]
        lse_desc, delta_desc = ptrs[0], ptrs[1]
        drop = scales[4]
        masks = (dm_smem, drop, off_b, H, n0)
        rows = (lse_desc, delta_desc, lse_smem, dl_smem)
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [tb, off_kv, k0 + n0, 0], kv_bar, k_smem)
        _tma_load(v_desc, [tb, off_kv, k0 + n0, 0], kv_bar, v_smem)
        if KV_GROUP > 1:
            for g in range(KV_GROUP):
                h = off_kv * KV_GROUP + g
                _produce(tb, h, g * n_iter, m_lo, n_iter, first, q0, lb + h, lc, q_desc, do_desc, q_smem, do_smem,
                         q_ready, do_ready, qdo_empty, masks, rows, DROPOUT)
        else:
            _produce(tb, off_kv, 0, m_lo, n_iter, first, q0, lb + off_kv, lc, q_desc, do_desc, q_smem, do_smem,
                     q_ready, do_ready, qdo_empty, masks, rows, DROPOUT)

    @gluon.jit
    def _produce(off_b, off_h, base, m_lo, n_iter, first, q0, lrow, lc, q_desc, do_desc, q_smem, do_smem, q_ready,
                 do_ready, qdo_empty, masks, rows, DROPOUT: gl.constexpr):
        """Query head off_h's Q_i and dO_i, the ring's steps base ... base + n_iter - 1 (off_b: the descriptors'
        batch, 0 in a packed call's (1, H, total, D) view; q0: the sequence's first row there, 0 in a dense call).
        With Q_i its rows' LSE, with dO_i their Delta, on the same barriers (rows = (lse_desc, delta_desc, lse_smem,
        dl_smem): (lrow, lc + row0) in the (rows, columns) of LSE and Delta the descriptors cover).
        DROPOUT (this partition then has 4 warps): once the copies are issued, both consumers' keep masks of the step
        (masks = (dm_smem, drop, the sequence's batch, H, n0)) into stage st's two slots of dm_smem; a second arrival
        on do_ready tells the consumers they are there (they read them after dP^T is issued, which waits for it)."""
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BLOCK_M: gl.constexpr = q_smem.type.shape[3]
        for i in range(n_iter):
            it = base + i
            st = it % STAGES
            t = first + i
            row0 = (m_lo + gl.where(t >= n_iter, t - n_iter, t)) * BLOCK_M     # (first + i) % n_iter
            mbarrier.wait(qdo_empty.index(st), ((it // STAGES) & 1) ^ 1)   # a fresh barrier passes phase 1
            lse_desc, delta_desc, lse_smem, dl_smem = rows
            mbarrier.expect(q_ready.index(st), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            _tma_load(q_desc, [off_b, off_h, q0 + row0, 0], q_ready.index(st), q_smem.index(st))
            _tma_load(lse_desc, [lrow, lc + row0], q_ready.index(st), lse_smem.index(st))
            mbarrier.expect(do_ready.index(st), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            _tma_load(do_desc, [off_b, off_h, q0 + row0, 0], do_ready.index(st), do_smem.index(st))
            _tma_load(delta_desc, [lrow, lc + row0], do_ready.index(st), dl_smem.index(st))
            if DROPOUT:   # both consumers read the stage's slots before they arrive on qdo_empty: free to write
                dm_smem, drop, seq, H, n0 = masks
                for w in gl.static_range(2):
                    dm_smem.index(st * 2 + w).store(_dropout_words_t(drop, seq * H + off_h, row0, n0 // 16 + 4 * w))
                _sync()
                mbarrier.arrive(do_ready.index(st), count=1)

    @gluon.jit
    def _consumer_steps(lo, hi, base, off_h, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes, band,
                        qk_scale, cap_in, drop, MASK: gl.constexpr, BAND: gl.constexpr, SOFTCAP: gl.constexpr,
                        DROPOUT: gl.constexpr, WG: gl.constexpr, VARLEN: gl.constexpr = False):
        """Q tiles lo ... hi - 1 of query head off_h's walk (the ring's steps base + lo ...): dK_w, dV_w updated and
        returned, dQ's share added.  MASK (the tiles on the diagonal or the band's edges only): a loop of its own,
        so that the other tiles' loop carries no mask (its indices cost registers, and registers here are short: a
        causal loop with them spilled).  BAND: the window's mask (else the causal one), and rows that see no key
        (LSE = -inf) taken as LSE = +inf, so their P = 0.  SOFTCAP: scores c tanh(s scale / c) (qk_scale = c log2 e,
        cap_in = scale / c), and dS^T gains the factor 1 - tanh^2.  DROPOUT: forward v6's keep masks, the producer's
        (dm_smem, stage st): dV_w += (P^T o Z) dO_i and dS^T = P^T o (dP^T o Z - D_i), Z the kept scores'
        1 / (1 - p), 0 elsewhere; here without Z's factor 1 / (1 - p), which the caller applies to dK and dV
        and the launcher to dQ.  VARLEN (a packed sequence; rows and keys counted from its start q0, k0): the rows
        past the sequence's end (the next one's) read LSE = +inf, so their P and dS are 0."""
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dm_smem, lse_smem, dl_smem = bufs
        kv_bar, q_ready, do_ready, qdo_empty, ds_ready, ds_free, kz_bar = bars
        off_b, off_kv, n0, m_lo, n_iter, first, tb, q0, k0 = coords
        left, right = band
        dtype: gl.constexpr = q_desc.dtype
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BLOCK_M: gl.constexpr = q_smem.type.shape[3]
        HEAD_DIM: gl.constexpr = q_smem.type.shape[4]
        HALF: gl.constexpr = 64
        BLOCK_N: gl.constexpr = 2 * HALF
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
        mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(0, mma_s)        # along S^T's columns: the Q tile's rows
        key_l: gl.constexpr = gl.SliceLayout(1, mma_s)        # along S^T's rows: this warpgroup's keys

        offs_m = gl.arange(0, BLOCK_M, layout=row_l)
        k_all = k_smem.reshape([BLOCK_N, HEAD_DIM])
        k_w = k_all.slice(WG * HALF, HALF, dim=0)              # this warpgroup's keys (64 x D)
        v_w = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(WG * HALF, HALF, dim=0)
        k_cols = k_all.slice(WG * HALF, HALF, dim=1)           # all keys, this warpgroup's dQ columns (128 x 64)
        stage = dq_smem.index(WG)
        zero_s = gl.zeros([HALF, BLOCK_M], dtype=gl.float32, layout=mma_s)

        for i in range(lo, hi):
            it = base + i
            st = it % STAGES
            ph = (it // STAGES) & 1
            b = it % 2
            phb = (it // 2) & 1
            t = first + i
            row0 = (m_lo + gl.where(t >= n_iter, t - n_iter, t)) * BLOCK_M     # (first + i) % n_iter
            rows = row0 + offs_m
            q_s = q_smem.index(st).reshape([BLOCK_M, HEAD_DIM])
            do_s = do_smem.index(st).reshape([BLOCK_M, HEAD_DIM])

            if DROPOUT:   # keys n0 + 64 WG ... (four groups of 16) x the tile's 64 rows: the producer's (_produce)
                mbuf = dm_smem.index(st * 2 + WG)
            mbarrier.wait(q_ready.index(st), ph)
            s_tok = warpgroup_mma(k_w, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(st), ph)
            dp_tok = warpgroup_mma(v_w, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(1, deps=(s_tok,))                     # S^T done; dP^T in flight
            # the rows' LSE, copied with Q_i (read here, not before the products: held through their waits, LSE and
            # Delta took 32 registers a thread beside dK and dV's 128, and the loops spilled)
            lse2 = lse_smem.index(st).reshape([BLOCK_M]).load(row_l) * 1.4426950408889634
            if BAND and MASK:
                lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
            if SOFTCAP:
                s_t = _tanh(s_t * cap_in)
                t = s_t
            if MASK:
                keys = n0 + WG * HALF + gl.arange(0, HALF, layout=key_l)
                if BAND:
                    keep = (keys[:, None] >= rows[None, :] - left) & (keys[:, None] <= rows[None, :] + right)
                else:
                    keep = keys[:, None] <= rows[None, :]
                s_t = gl.where(keep, s_t, float("-inf"))     # (soft-cap: t stays unmasked; P = 0 zeroes dS there)
            p_t = gl.exp2(gl.minimum(s_t * qk_scale - lse2[None, :], 0.0))  # P^T <= 1 (keys past Nk too)
            if DROPOUT:   # Z's 1 / (1 - p) is taken out of dV, dK and dQ and applied once, at their end; P^T's
                # dropped scores negative from here on (one reading of the keep bits a step)
                p_t = _kept_t(p_t, mbuf.load(_DROP_MASKS_T), mma_s)
                p16 = gl.convert_layout(gl.maximum(p_t, 0.0).to(dtype), a_op)
            else:
                p16 = gl.convert_layout(p_t.to(dtype), a_op)
            dv_tok = warpgroup_mma(p16, do_s, dv, is_async=True)             # dV_w += P^T dO_i
            if SOFTCAP:   # dS^T's factors but dP^T - D_i now, P^T o (1 - t^2): t is not kept through dP^T's wait
                p_t = p_t * (1.0 - t * t)
            dp_t = warpgroup_mma_wait(1, deps=(dp_tok,))                   # dP^T done; dV in flight
            delta = dl_smem.index(st).reshape([BLOCK_M]).load(row_l)       # copied with dO_i
            if DROPOUT:   # dS^T (1 - p) = P^T o (dP^T o keep - D_i (1 - p)) = (P^T o keep) o dP^T - P^T D_i (1 - p)
                dd = (delta * (1.0 / drop[3]))[None, :]
                ds16 = (p_t * gl.where(p_t > 0.0, dp_t - dd, dd)).to(dtype)
            else:
                ds16 = (p_t * (dp_t - delta[None, :])).to(dtype)             # dS^T (soft-cap: o (1 - t^2) above)

            mbarrier.wait(ds_free.index(b), phb ^ 1)                       # both read this buffer 2 tiles ago
            ds_smem.index(b).slice(WG * HALF, HALF, dim=0).store(ds16)
            fence_async_shared()
            _sync()
            mbarrier.arrive(ds_ready.index(b), count=1)

            dk_tok = warpgroup_mma(gl.convert_layout(ds16, a_op), q_s, dk, is_async=True)   # dK_w += dS^T Q_i
            mbarrier.wait(ds_ready.index(b), phb)                          # the other half of dS^T is there
            dq_tok = warpgroup_mma(ds_smem.index(b).permute((1, 0)), k_cols, zero_s, use_acc=False, is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
            mbarrier.arrive(qdo_empty.index(st), count=1)                  # done with Q_i, dO_i
            mbarrier.arrive(ds_free.index(b), count=1)                     # done reading dS^T

            tma.store_wait(0)                                              # the last add has read the stage
            _sync()
            stage.reshape([BLOCK_M, HALF]).store(dq)
            fence_async_shared()
            _sync()
            _tma_add(dq_desc, [tb, off_h, q0 + row0, WG * HALF], stage)     # dQacc_i[:, cols] += dS K_j[:, cols]
        return dk, dv

    @gluon.jit
    def _zero_keys(k_smem, v_smem, keep, kz_bar, WG: gl.constexpr):
        """Set this warpgroup's rows (keys 64 WG ... + 63 of the tile) of K and V to zero from row ``keep`` on, then
        wait for the other warpgroup's: a packed sequence's keys past its end are the next one's, and zeros make
        them what a dense tensor's TMA loads give past its end (S^T = 0, dP^T = 0: their dK, dV rows are not
        stored and their dQ terms, dS K_j, are 0)."""
        HALF: gl.constexpr = 64
        BLOCK_N: gl.constexpr = 2 * HALF
        HEAD_DIM: gl.constexpr = k_smem.type.shape[3]
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        key = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, blk))
        for t in gl.static_range(2):
            buf = (k_smem if t == 0 else v_smem).reshape([BLOCK_N, HEAD_DIM]).slice(WG * HALF, HALF, dim=0)
            x = buf.load(blk)
            buf.store(gl.where((key < keep)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
        _sync()
        mbarrier.arrive(kz_bar, count=1)
        mbarrier.wait(kz_bar, 0)

    @gluon.jit
    def _walk(off_h, base, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes, band, qk_scale, cap_in,
              drop, CAUSAL: gl.constexpr, BAND: gl.constexpr, SOFTCAP: gl.constexpr, DROPOUT: gl.constexpr,
              WG: gl.constexpr, VARLEN: gl.constexpr = False):
        """Query head off_h's Q tiles (the ring's steps from base).  Those that need the mask (the band's edges;
        causal, the two on the diagonal, where the kernel starts such a program) run in loops of their own.
        VARLEN: causal's two tiles on the diagonal masked, as without it, and every tile with a window.  The keys
        past the sequence's end were set to zero (_zero_keys) and the rows past it read LSE = +inf
        (_consumer_steps), so the other tiles need no mask."""
        off_b, off_kv, n0, m_lo, n_iter, first, tb, q0, k0 = coords
        if VARLEN:   # as without it (keys past the sequence are zeros, rows past it have P = 0); a window: all masked
            if BAND:
                n_a = n_iter
            elif CAUSAL:
                n_a = gl.minimum(n_iter, 2)
            else:
                n_a = n_iter * 0
            dk, dv = _consumer_steps(0, n_a, base, off_h, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes, band,
                                     qk_scale, cap_in, drop, True, BAND, SOFTCAP, DROPOUT, WG, True)
            dk, dv = _consumer_steps(n_a, n_iter, base, off_h, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes,
                                     band, qk_scale, cap_in, drop, False, BAND, SOFTCAP, DROPOUT, WG, True)
        elif BAND:   # tile rows r0 ... r0 + 63 see all 128 keys iff n0 + 127 - right <= r0 <= n0 - 63 + left
            left, right = band
            n_a = gl.maximum(gl.minimum(gl.cdiv(gl.maximum(n0 + 127 - right, 0), 64) - m_lo, n_iter), 0)
            t = n0 - 63 + left
            inside = gl.where(t >= 0, t // 64 + 1, 0)                    # Q tiles 0 ... t // 64 pass the left edge
            n_b = gl.minimum(gl.maximum(inside - m_lo, n_a), n_iter)
            dk, dv = _consumer_steps(0, n_a, base, off_h, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes, band,
                                     qk_scale, cap_in, drop, True, True, SOFTCAP, DROPOUT, WG)
            dk, dv = _consumer_steps(n_a, n_b, base, off_h, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes, band,
                                     qk_scale, cap_in, drop, False, True, SOFTCAP, DROPOUT, WG)
            dk, dv = _consumer_steps(n_b, n_iter, base, off_h, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes,
                                     band, qk_scale, cap_in, drop, True, True, SOFTCAP, DROPOUT, WG)
        elif CAUSAL:
            n_diag = gl.minimum(n_iter, 2)
            dk, dv = _consumer_steps(0, n_diag, base, off_h, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes,
                                     band, qk_scale, cap_in, drop, True, False, SOFTCAP, DROPOUT, WG)
            dk, dv = _consumer_steps(n_diag, n_iter, base, off_h, dk, dv, q_desc, dq_desc, bufs, bars, coords,
                                     sizes, band, qk_scale, cap_in, drop, False, False, SOFTCAP, DROPOUT,
                                     WG)
        else:
            dk, dv = _consumer_steps(0, n_iter, base, off_h, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes,
                                     band, qk_scale, cap_in, drop, False, False, SOFTCAP, DROPOUT, WG)
        return dk, dv

    @gluon.jit
    def _consumer_partition(q_desc, k_desc, v_desc, do_desc, dq_desc, bufs, bars, coords, sizes, ptrs, scales,
                            CAUSAL: gl.constexpr, BAND: gl.constexpr, SOFTCAP: gl.constexpr, KV_GROUP: gl.constexpr,
                            DROPOUT: gl.constexpr, WG: gl.constexpr, VARLEN: gl.constexpr = False):
        """A consumer warpgroup: keys n0 + 64 WG ... + 63; dK, dV for them (summed over the K/V head's group of
        query heads), dQ's columns 64 WG ... + 63."""
        kv_bar = bars[0]
        off_b, off_kv, n0, m_lo, n_iter, first, tb, q0, k0 = coords
        Nq, Nk, stride_db, stride_dh, stride_dn, lb, lc, H = sizes
        DK, DV = ptrs[2], ptrs[3]
        qk_scale, sm_scale, band, cap_in, drop = scales
        dtype: gl.constexpr = q_desc.dtype
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        HALF: gl.constexpr = 64
        mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
        dk = gl.zeros([HALF, HEAD_DIM], dtype=gl.float32, layout=mma_d)
        dv = gl.zeros([HALF, HEAD_DIM], dtype=gl.float32, layout=mma_d)

        mbarrier.wait(kv_bar, 0)
        if VARLEN:
            if n0 + 2 * HALF > Nk:   # the sequence's keys end inside this tile
                k_smem, v_smem = bufs[0], bufs[1]
                _zero_keys(k_smem, v_smem, Nk - n0, bars[6], WG)
        if KV_GROUP > 1:      # the group's query heads one after the other, dK and dV summed in registers
            for g in range(KV_GROUP):
                dk, dv = _walk(off_kv * KV_GROUP + g, g * n_iter, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes,
                               band, qk_scale, cap_in, drop, CAUSAL, BAND, SOFTCAP, DROPOUT, WG, VARLEN)
        else:
            dk, dv = _walk(off_kv, 0, dk, dv, q_desc, dq_desc, bufs, bars, coords, sizes, band, qk_scale,
                           cap_in, drop, CAUSAL, BAND, SOFTCAP, DROPOUT, WG, VARLEN)
        tma.store_wait(0)

        kd = n0 + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_d))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma_d))
        off = (off_b.to(gl.int64) * stride_db + off_kv.to(gl.int64) * stride_dh
               + kd[:, None].to(gl.int64) * stride_dn + offs_d[None, :])
        ok = (kd < Nk)[:, None]
        if DROPOUT:   # Z's factor 1 / (1 - p), left out of the steps
            gl.store(DK + off, (dk * (sm_scale * drop[3])).to(dtype), mask=ok)
            gl.store(DV + off, (dv * drop[3]).to(dtype), mask=ok)
        else:
            gl.store(DK + off, (dk * sm_scale).to(dtype), mask=ok)
            gl.store(DV + off, dv.to(dtype), mask=ok)

    @gluon.jit(do_not_specialize=["seed_lo", "seed_hi"])
    def flash_bwd_kernel_v6(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc, DK, DV,
                            stride_db, stride_dh, stride_dn,
                            H, Nq, Nk, sm_scale, qk_scale, GROUP, left, right, cap_in, seed_lo, seed_hi, p_drop,
                            CU_Q, CU_K,
                            CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            SPREAD: gl.constexpr = True, BAND: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
                            KV_GROUP: gl.constexpr = 1, DROPOUT: gl.constexpr = False, VARLEN: gl.constexpr = False,
                            SPAN: gl.constexpr = 68):
        """One program: BLOCK_N = 128 keys of one (batch, K/V head); a 1-D grid of K tiles x B * H / KV_GROUP, the
        tile index fastest.  dK and dV are written with dK's strides (the launcher makes dV's alike), summed over the
        KV_GROUP query heads that read the K/V head (GQA: one program owns each dK, dV row, no atomics).  SPREAD:
        each program walks its Q tiles from its own, wrapping (backward v3's spread: the programs of a head do not
        all add into the same dQ rows at once).  Causal, the first K tiles (the most Q tiles) first over sections of
        GROUP heads (forward v6's _longest_first).  BAND: only the Q tiles whose rows' band (row - left ... row +
        right) reaches these keys; SOFTCAP: as forward v6 (qk_scale = c log2 e, cap_in = scale / c).
        LSE and Delta: TMA descriptors (_rows_descriptor) over (B * H, Nq) float32, rows past Nq read as zeros.
        VARLEN: packed sequences, as forward v6: Q, K, V, dO seen as (1, H, total, D), LSE and Delta (H, W)
        (padded_rows), dK and dV (total_k, H_kv, D) (stride_db = 0); batch off_b is sequence off_b, its rows
        CU_Q[off_b] ... CU_Q[off_b + 1] - 1, its keys CU_K's; Nq, Nk the longest lengths (the grid's).  A program
        past its sequence's keys runs no Q tile and stores nothing; the Q tiles run in order (no SPREAD)."""
        n_n = gl.cdiv(Nk, BLOCK_N)
        pid = gl.program_id(0)
        if CAUSAL:
            start_n, bh = _longest_first(pid, n_n, gl.num_programs(0) // n_n, GROUP)
        else:
            start_n = pid % n_n
            bh = pid // n_n
        off_b = bh // (H // KV_GROUP)
        off_kv = bh % (H // KV_GROUP)
        n0 = start_n * BLOCK_N
        tb = off_b
        q0 = 0
        k0 = 0
        lb = off_b * H                                                 # LSE's and Delta's row of (off_b, head 0)
        lc = 0                                                         # and the column of the rows' first
        if VARLEN:   # this sequence's rows and keys of the packed tensors, and its lengths
            tb = 0
            q0 = gl.load(CU_Q + off_b)
            Nq = gl.load(CU_Q + off_b + 1) - q0
            k0 = gl.load(CU_K + off_b)
            Nk = gl.load(CU_K + off_b + 1) - k0
            # LSE, Delta: (H, W), each sequence's rows followed by PAD rows of LSE = +inf, Delta = 0
            # (padded_rows); dK, dV: (total_k, H_kv, D)
            lb = 0
            lc = (q0 + 3) // 4 * 4 + off_b * SPAN                       # packed_start: 16-byte aligned
            DK += k0.to(gl.int64) * stride_dn
            DV += k0.to(gl.int64) * stride_dn
        n_q = gl.cdiv(Nq, BLOCK_M)
        m_lo = pid * 0                                                  # a tensor: partitions take no ints
        if CAUSAL:
            m_lo = gl.minimum(n0 // BLOCK_M, n_q)                        # the first Q tile that sees these keys
        n_iter = n_q - m_lo
        if BAND:   # rows n0 - right ... n0 + BLOCK_N - 1 + left reach these keys
            m_lo = gl.minimum(gl.maximum(n0 - right, 0) // BLOCK_M, n_q)
            n_iter = gl.maximum(gl.minimum(gl.cdiv(n0 + BLOCK_N + left, BLOCK_M), n_q) - m_lo, 0)
        if VARLEN:   # past the sequence's keys: no Q tile
            n_iter = gl.where(n0 < Nk, n_iter, 0)
        first = pid * 0
        if SPREAD and not CAUSAL and not BAND and not VARLEN:   # causal programs start at their diagonal, already each its own
            first = start_n % gl.maximum(n_iter, 1)                      # each program starts at its own Q tile

        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        kz_bar = kv_bar                                                 # (unused)
        if VARLEN:   # both consumers zeroed their keys past the sequence's end (_zero_keys)
            kz_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(kz_bar, count=2)
        for s in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(s), count=1)
            if DROPOUT:   # dO's copy and the producer's keep masks (_produce)
                mbarrier.init(do_ready.index(s), count=2)
            else:
                mbarrier.init(do_ready.index(s), count=1)
            mbarrier.init(qdo_empty.index(s), count=2)                 # both consumer warpgroups arrive
        for s in gl.static_range(2):
            mbarrier.init(ds_ready.index(s), count=2)
            mbarrier.init(ds_free.index(s), count=2)
        fence_async_shared()

        dm_smem = dq_smem                                               # (unused)
        if DROPOUT:   # each consumer's keep words of a stage (1 KiB each), made by the producer
            dm_smem = gl.allocate_shared_memory(gl.uint32, [2 * STAGES, 4, 64],
                                                gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        # each stage's rows of LSE (with Q) and Delta (with dO): 256 bytes each
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
        dl_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
        bufs = (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dm_smem, lse_smem, dl_smem)
        bars = (kv_bar, q_ready, do_ready, qdo_empty, ds_ready, ds_free, kz_bar)
        coords = (off_b, off_kv, n0, m_lo, n_iter, first, tb, q0, k0)
        sizes = (Nq, Nk, stride_db, stride_dh, stride_dn, lb, lc, H)
        ptrs = (lse_desc, delta_desc, DK, DV)
        if BAND:      # the variants' scalars only where their constexpr is on (a partition's every capture costs)
            band = (left, right)
        else:
            band = (0, 0)
        drop = _dropout_scalars(seed_lo, seed_hi, p_drop, m_lo, DROPOUT)   # bh unused: each query head's (_consumer_steps)
        if SOFTCAP:
            scales = (qk_scale, sm_scale, band, cap_in, drop)
        else:
            scales = (qk_scale, sm_scale, band, 1.0, drop)
        if DROPOUT:   # the producer a warpgroup (the 12 warps' registers as before: its 3 more warps were padding)
            gl.warp_specialize([
                (_consumer_partition, (q_desc, k_desc, v_desc, do_desc, dq_desc, bufs, bars, coords, sizes, ptrs,
                                       scales, CAUSAL, BAND, SOFTCAP, KV_GROUP, DROPOUT, 0, VARLEN)),
                (_consumer_partition, (q_desc, k_desc, v_desc, do_desc, dq_desc, bufs, bars, coords, sizes, ptrs,
                                       scales, CAUSAL, BAND, SOFTCAP, KV_GROUP, DROPOUT, 1, VARLEN)),
                (_load_partition, (q_desc, k_desc, v_desc, do_desc, dq_desc, bufs, bars, coords, sizes, ptrs, scales,
                                   CAUSAL, BAND, SOFTCAP, KV_GROUP, DROPOUT, 1, VARLEN)),
            ], [4, 4], [CONSUMER_REGS, 24])
        else:
            gl.warp_specialize([
                (_consumer_partition, (q_desc, k_desc, v_desc, do_desc, dq_desc, bufs, bars, coords, sizes, ptrs,
                                       scales, CAUSAL, BAND, SOFTCAP, KV_GROUP, DROPOUT, 0, VARLEN)),
                (_consumer_partition, (q_desc, k_desc, v_desc, do_desc, dq_desc, bufs, bars, coords, sizes, ptrs,
                                       scales, CAUSAL, BAND, SOFTCAP, KV_GROUP, DROPOUT, 1, VARLEN)),
                (_load_partition, (q_desc, k_desc, v_desc, do_desc, dq_desc, bufs, bars, coords, sizes, ptrs, scales,
                                   CAUSAL, BAND, SOFTCAP, KV_GROUP, DROPOUT, 1, VARLEN)),
            ], [4, 1], [CONSUMER_REGS, 24])


# ------------------------------------------------------------------------------------- configs and launcher

def config_lists(head_dim, dtype, limit, cc) -> dict:
    """One config (the tiles are the kernel's design: 64 query rows x 128 keys, 4 warps per partition), 2 stages.
    Shared memory: K, V 64 KiB, Q and dO 32 KiB a stage with their rows' LSE and Delta (512 bytes), dS^T 2 x 16, the
    dQ stages 2 x 16: 193 KiB at 2 stages (4 KiB more with dropout: its keep words; the filter below does not count
    them, and 2 stages leave room)."""
    cands = [C(64, 128, 4, 2)]
    if limit is not None:
        cands = [c for c in cands if 1024 * (64 + 32 * c.num_stages + 64) + 512 * c.num_stages + 1024 <= limit]
    return {"bwd": (cands, [])}


def _sig(dtype: str, causal: bool, stages: int, band: bool = False, softcap: bool = False, kv_group: int = 1,
         dropout: bool = False, varlen: bool = False):
    gdt = {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype]
    fn = flash_bwd_kernel_v6
    sig = {n: "i32" for n in fn.arg_names}
    for name, rows, cols, dt, g in (("q_desc", 64, 128, dtype, gdt), ("do_desc", 64, 128, dtype, gdt),
                                    ("k_desc", 128, 128, dtype, gdt), ("v_desc", 128, 128, dtype, gdt),
                                    ("dq_desc", 64, 64, "fp32", gl.float32)):
        layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], g)
        sig[name] = f"tensordesc<{dt}[1, 1, {rows}, {cols}],{layout!r}>"
    rows = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sig["lse_desc"] = sig["delta_desc"] = f"tensordesc<fp32[1, 64],{rows!r}>"
    sig.update(DK=f"*{dtype}", DV=f"*{dtype}", sm_scale="fp32", qk_scale="fp32",
               cap_in="fp32", p_drop="fp32", CU_Q="*i32", CU_K="*i32")
    consts = dict(CAUSAL=causal, BLOCK_M=64, BLOCK_N=128, HEAD_DIM=128, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS,
                  BAND=band, SOFTCAP=softcap, KV_GROUP=kv_group, DROPOUT=dropout, VARLEN=varlen, SPAN=SPAN)
    sig.update({k: "constexpr" for k in consts})
    return fn, sig, consts


def compile_sm90(causal: bool = False, dtype: str = "bf16", stages: int = 2, band: bool = False,
                 softcap: bool = False, kv_group: int = 1, dropout: bool = False, varlen: bool = False):
    """Compile the kernel for sm_90 without a GPU (Triton's compiler and ptxas only); needs ``TRITON_INTERPRET=0``.
    band, softcap, kv_group, dropout, varlen: the variants' kernels."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    fn, sig, consts = _sig(dtype, causal, stages, band, softcap, kv_group, dropout, varlen)
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4, "maxnreg": MAXNREG})


_ROWS_LAYOUT = None


def _rows(t):
    """``t`` (R, W) float32 as a TMA descriptor can take it: rows 16-byte aligned (W padded to a multiple of 4 in a
    copy where they are not; a copy of LSE or Delta, B H N floats, is cheap beside the backward)."""
    W = t.shape[-1]
    if t.stride(-1) == 1 and t.stride(0) % 4 == 0 and t.data_ptr() % 16 == 0:
        return t
    out = torch.empty((t.shape[0], -(-W // 4) * 4), device=t.device, dtype=torch.float32)[:, :W]
    return out.copy_(t)


def _rows_descriptor(t):
    """A TMA descriptor over (R, W) float32 ``t`` (_rows), blocks of 1 x 64 (a Q tile's LSE or Delta): the producer
    copies them with Q and dO; past W TMA gives zeros."""
    global _ROWS_LAYOUT
    if _ROWS_LAYOUT is None:   # (no swizzle: a 256-byte row is wider than any swizzle's span)
        _ROWS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    t = _rows(t)
    return GluonDescriptor(t, list(t.shape), list(t.stride()), [1, 64], _ROWS_LAYOUT)


PAD = 64   # rows after each packed sequence in the backward's LSE and Delta (a Q tile's, BLOCK_M)
SPAN = PAD + 4   # and up to 3 more, so that the next one starts on 16 bytes (a TMA copy's first column must)


def packed_start(q0, b):
    """Where packed sequence b (its first row q0 of the packed tensors) starts in the backward's LSE and Delta
    (padded_rows): 16-byte aligned, a TMA copy's innermost coordinate must be (an unaligned one is an illegal
    instruction on sm_90); the kernels compute it alike."""
    return (q0 + 3) // 4 * 4 + b * SPAN


@triton.jit
def flash_bwd_preprocess_packed(O, DO, LSE, Delta, LSE_pad, CU_Q, stride_om, stride_oh, stride_od, stride_dom,
                                stride_doh, stride_dod, stride_lh, stride_lm, stride_ph, H, n_tiles,
                                PAD_ROWS: tl.constexpr, SPAN: tl.constexpr, BLOCK_M: tl.constexpr,
                                HEAD_DIM: tl.constexpr):
    """A packed call's Delta = rowsum(dO o O) and its LSE, in padded rows: sequence b's row r at packed_start(q0, b) +
    r of (H, W) float32, and the PAD_ROWS rows after its end Delta = 0, LSE = +inf.  Backward v6
    then reads a Q tile's LSE and Delta without a mask (its rows past the sequence's end, the next one's, get P = 0):
    the sequence's length is not live in its loops."""
    start_m, off_b, off_h = program_tile(n_tiles, H)
    q0 = tl.load(CU_Q + off_b)
    n = tl.load(CU_Q + off_b + 1) - q0
    r = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < n
    row = (q0 + r).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(O + row[:, None] * stride_om + off_h * stride_oh + offs_d[None, :] * stride_od, mask=ok[:, None],
                other=0.0).to(tl.float32)
    do = tl.load(DO + row[:, None] * stride_dom + off_h * stride_doh + offs_d[None, :] * stride_dod,
                 mask=ok[:, None], other=0.0).to(tl.float32)
    lse = tl.load(LSE + off_h.to(tl.int64) * stride_lh + row * stride_lm, mask=ok, other=float("inf"))
    dst = off_h.to(tl.int64) * stride_ph + ((q0 + 3) // 4 * 4 + off_b * SPAN + r).to(tl.int64)   # packed_start
    keep = r < n + PAD_ROWS
    tl.store(Delta + dst, tl.sum(o * do, 1), mask=keep)
    tl.store(LSE_pad + dst, lse, mask=keep)


def padded_rows(plan, o, do, lse, cu_q, runners=None):
    """(Delta, LSE) of a packed call as backward v6 reads them: (H, W) float32, each sequence's rows from
    packed_start(q0, b) on, followed by PAD rows of Delta 0 and LSE +inf (flash_bwd_preprocess_packed; the up to 7
    columns between one sequence's padding and the next one's start are not written and never read); ``lse`` is the
    forward's (H, total_q), ``plan.Nq`` the longest sequence.  W, a multiple of 4, leaves every row 16-byte aligned."""
    total, S = o.shape[0], cu_q.shape[0] - 1
    W = -(-total // 4) * 4 + S * SPAN
    delta, lse_pad = (torch.empty((plan.H, W), device=o.device, dtype=torch.float32) for _ in range(2))
    n_tiles = lambda cfg: -(-(plan.Nq + PAD) // cfg.block_m)      # noqa: E731 - rows r < Nq + PAD of each
    tiles.run(plan.backward[0], flash_bwd_preprocess_packed,
              lambda cfg: (o, do, lse, delta, lse_pad, cu_q, *o.stride(), *do.stride(), *lse.stride(),
                           delta.stride(0), plan.H, n_tiles(cfg)), dict(HEAD_DIM=plan.D, PAD_ROWS=PAD, SPAN=SPAN),
              lambda cfg: tiles.grid_1d(n_tiles(cfg), S * plan.H), runners, "pre")
    return delta, lse_pad


def dq_buffer(dq):
    """dQ's float32 buffer (zeros) for a dense call: with dQ's strides when they can be a TMA descriptor's ((B, N, H, D)
    memory seen as (B, H, N, D): a model's q_proj(x).view(B, N, H, D).transpose(1, 2)), so the last scaling reads it
    in order, as a packed call's (a strided copy took 136 us where an ordered one takes 66); else (B, H, N, D)
    contiguous."""
    buf = torch.zeros_like(dq, dtype=torch.float32)          # dQ's strides when dQ is dense, else contiguous
    if buf.stride(-1) != 1 or any(st % 4 for st in buf.stride()[:-1]):   # TMA: the other strides 16-byte multiples
        # (zeros_like keeps even a size-1 dimension's stride, which as_strided may have made odd)
        buf = torch.zeros(dq.shape, device=dq.device, dtype=torch.float32)
    return buf


def launch(plan, q, k, v, o, lse, do, dq, dk, dv, scale: float, runners=None, **variant_args):
    """Delta, then the warp-specialised pass adding dQ into a float32 buffer; dQ = scale * buffer.  K, V, dK, dV
    have H / kv_groups heads; ``variant_args``: the soft-cap value, dropout's rate and seed, and a packed call's
    cu_q, cu_k (int32, B + 1; q, k, v, o, do and the gradients then (total, H, D), lse (H, total_q), as forward
    v6's); the window and GQA are the plan's."""
    step = plan.backward[1]
    cfg = step.config
    if (cfg.block_m, cfg.block_n, cfg.num_warps) != (64, 128, 4) or cfg.num_stages < 2:
        raise ValueError(f"backward v6's tiles are its design, 64 query rows x 128 keys, 4 warps per consumer "
                         f"warpgroup, and at least 2 stages, not {cfg}")
    varlen = plan.variant.varlen
    cu_q, cu_k = variant_args.pop("cu_q", None), variant_args.pop("cu_k", None)
    call = forward_v6.variant_scalars(plan, scale, **variant_args)
    if plan.Nk == 0 or plan.Nq == 0 or (varlen and (q.shape[0] == 0 or k.shape[0] == 0)):
        dq.zero_(), dk.zero_(), dv.zero_()
        return
    if varlen:   # (total, H, D) seen as (1, H, total, D); dK, dV written through (total_k, H_kv, D)'s strides
        delta, lse = padded_rows(plan, o, do, lse, cu_q, runners)
        # dQ's float32 buffer in dQ's own layout, so that the last scaling reads it in order: (1, H, total, D)
        # made the scaling a strided copy (123 us against 66 on 8 documents of 2048, H 16; the kernel as fast)
        dq_rows = torch.zeros((q.shape[0], plan.H, plan.D), device=q.device, dtype=torch.float32)
        dq_acc = dq_rows.permute(1, 0, 2)[None]
        q, k, v, do = (t.permute(1, 0, 2)[None] for t in (q, k, v, do))
    else:
        delta = backward.preprocess(plan, o, do, runners)     # (B, H, Nq), as LSE (both seen as (B * H, Nq) below)
        dq_acc = dq_buffer(dq)
        cu_q = cu_k = lse
    # (B * H, Nq) dense, (H, W) packed
    lse, delta = (t.reshape(t.shape[0], -1) if varlen else t.reshape(-1, plan.Nq) for t in (lse, delta))
    # the kernel writes dK and dV with one set of strides, the last 1
    dk_out = dk if dk.stride(-1) == 1 else torch.empty(dk.shape, device=dk.device, dtype=dk.dtype)
    dv_out = dv if dv.stride() == dk_out.stride() else torch.empty_like(dk_out)
    d_strides = (0, dk_out.stride(1), dk_out.stride(0)) if varlen else dk_out.stride()[:3]
    n_n = -(-plan.Nk // cfg.block_n)
    bh_kv = plan.B * (plan.H // plan.variant.kv_groups)
    grid = tiles.grid_1d(n_n, bh_kv)
    # causal: longest first, by sections of heads (1 otherwise: unused, and one value keeps one compiled kernel)
    group = tiles.head_group(bh_kv, n_n, plan.facts.sms) if call.causal else 1
    args = (_descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
            _descriptor(do, cfg.block_m), _descriptor(dq_acc, cfg.block_m, 64), _rows_descriptor(lse),
            _rows_descriptor(delta), dk_out, dv_out, *d_strides, plan.H, plan.Nq, plan.Nk, float(scale),
            call.qk_scale, group, call.left, call.right, call.cap_in, call.seed_lo, call.seed_hi, call.p_drop, cu_q,
            cu_k)
    consts = dict(CAUSAL=call.causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=plan.D,
                  STAGES=cfg.num_stages, CONSUMER_REGS=CONSUMER_REGS, BAND=call.band, SOFTCAP=call.softcap,
                  KV_GROUP=plan.variant.kv_groups, DROPOUT=call.dropout, VARLEN=varlen, SPAN=SPAN,
                  num_warps=cfg.num_warps, maxnreg=MAXNREG)
    # dk_out, dv_out and dq_acc have strides of their own: the runner's key (the caller's tensors) does not hold
    # them unless they are the caller's (dk_out is dk, dv_out dv); dq_acc's follow from dq's (the caller's)
    same = dk_out is dk and dv_out is dv
    tiles.launch_cached(flash_bwd_kernel_v6, grid, args, consts, runners if same else None, "bwd v6")
    if dk_out is not dk:
        dk.copy_(dk_out)
    if dv_out is not dv:
        dv.copy_(dv_out)
    if not step.verified:
        step.fell_back(cfg, [])
    # dQ = scale * buffer (dropout: and Z's 1 / (1 - p), which the steps leave out)
    if varlen:
        torch.mul(dq_rows, scale / (1.0 - call.p_drop), out=dq)
    else:
        torch.mul(dq_acc, scale / (1.0 - call.p_drop), out=dq)
