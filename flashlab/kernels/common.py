"""Pieces every kernel shares: the log constants and 64-bit addressing, said once.

Addressing.  Element (b, h, i, d) of a (B, H, N, D) tensor with strides
(sb, sh, sn, sd) lives at  ptr + b*sb + h*sh + i*sn + d*sd.  Triton does integer
arithmetic in 32 bits when both operands are 32-bit (program ids, most strides), so
b*sb overflows as soon as a tensor holds more than 2^31 elements (B = 34, H = 32,
N = 16384, D = 128 in fp16 is 2.3e9 elements: an illegal memory access).  The two
helpers below compute every *base* (the (batch, head) start, and a tile's first row)
in 64 bits; only the small in-tile offsets (< BLOCK rows times a stride) stay 32-bit.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634            # log2(e), host side: e^x = 2^(x log2 e)
LN2 = 0.6931471805599453              # ln(2), host side: log2 -> natural log
LOG2E_K = tl.constexpr(LOG2E)         # the same constants for use inside kernels
LN2_K = tl.constexpr(LN2)


@triton.jit
def head_base(ptr, off_b, off_h, stride_b, stride_h):
    """Address of element (off_b, off_h, 0, 0): the (batch, head) base, in 64 bits."""
    return ptr + off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h


@triton.jit
def tile_ptrs(base, row0, offs_r, offs_d, stride_r, stride_d):
    """Pointers (len(offs_r), len(offs_d)) to rows row0 + offs_r of the matrix at ``base``.

    ``row0`` (a tile's first row) is widened to 64 bits; ``offs_r`` are the rows inside the tile.
    """
    return base + tl.cast(row0, tl.int64) * stride_r + offs_r[:, None] * stride_r + offs_d[None, :] * stride_d


@triton.jit
def head_desc(ptr, off_b, off_h, stride_b, stride_h, n_rows, stride_r, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Tensor descriptor of the (n_rows, HEAD_DIM) matrix of one (batch, head), in tiles of (BLOCK, HEAD_DIM).

    The base is head_base's 64-bit address; the last stride must be 1 (the launchers check).  Loads
    of rows past n_rows return zeros; stores there are dropped.
    """
    return tl.make_tensor_descriptor(head_base(ptr, off_b, off_h, stride_b, stride_h), shape=[n_rows, HEAD_DIM],
                                     strides=[stride_r, 1], block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def program_tile(n_tiles, H, HEAD_FASTEST: tl.constexpr = False):
    """(tile, batch, head) of this program on a 1-D grid of n_tiles * B * H programs.

    One grid axis, tile index fastest: programs launched together share a (batch, head),
    so its K and V stay in L2, as with a (n_tiles, B*H) grid, but without grid axis 1's
    limit of 65535 (B*H may be anything; axis 0 allows 2^31 - 1 programs).
    HEAD_FASTEST puts the (batch, head) index fastest instead: programs launched together
    then belong to different heads (notebook 06's L2 experiment; no kernel uses it by default).
    """
    pid = tl.program_id(0)
    if HEAD_FASTEST:
        bh = tl.num_programs(0) // n_tiles
        tile = pid // bh
        off_bh = pid % bh
    else:
        tile = pid % n_tiles
        off_bh = pid // n_tiles
    return tile, off_bh // H, off_bh % H
