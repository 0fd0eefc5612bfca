"""The causal loop bounds of the forward kernels v2 / v3, in plain Python (no Triton).

For the Q tile ``start_m`` (rows start_m * block_m ... (start_m + 1) * block_m - 1), the
key loop runs in two stages:

    keys [0, unmasked_end)          full K tiles every row of the Q tile sees: no mask
    keys [unmasked_end, end)        tiles the diagonal crosses, and a ragged last tile: masked
    keys [end, Nk)                  never loaded (block skipping)

    end          = min((start_m + 1) * block_m, Nk)                       causal
    unmasked_end = min(floor(start_m * block_m / block_n) * block_n,       a whole number of K tiles
                       floor(Nk / block_n) * block_n)                      that are full

Non-causal: end = Nk, unmasked_end = floor(Nk / block_n) * block_n.  The kernels compute
exactly this (forward_v2.py, forward_v3.py); notebook 06 asks for it as an exercise.
"""
from __future__ import annotations


def causal_tile_ranges(start_m: int, block_m: int, block_n: int, nq: int, nk: int, causal: bool = True):
    """(unmasked_end, end) for the Q tile ``start_m``; see the module docstring."""
    full = nk // block_n * block_n
    if not causal:
        return full, nk
    end = min((start_m + 1) * block_m, nk)
    unmasked_end = min(start_m * block_m // block_n * block_n, full)
    return unmasked_end, end


def tile_kinds(nq: int, nk: int, block_m: int, block_n: int, causal: bool = True):
    """Matrix (Q tiles x K tiles) of 0 = skipped, 1 = unmasked, 2 = masked, from causal_tile_ranges."""
    n_m, n_n = -(-nq // block_m), -(-nk // block_n)
    kinds = [[0] * n_n for _ in range(n_m)]
    for i in range(n_m):
        unmasked_end, end = causal_tile_ranges(i, block_m, block_n, nq, nk, causal)
        for j in range(n_n):
            start = j * block_n
            kinds[i][j] = 1 if start < unmasked_end else (2 if start < end else 0)
    return kinds
