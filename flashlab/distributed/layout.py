"""Which rows of the sequence each rank holds, and which tiles a ring step computes.

Two layouts of a sequence of N rows over W ranks (the ring's shards):

* ``"contiguous"``: rank r holds rows [r·N/W, (r+1)·N/W).  With a causal mask, rank W-1 does W
  times the work of rank 0 (its queries see every key; rank 0's only its own).
* ``"zigzag"``: the sequence is cut into 2W equal chunks; rank r holds chunk r, then chunk
  2W-1-r.  Every rank holds one early and one late chunk, so causal work is the same on every rank.

``step_plan`` says, for one rank and one ring step, which (query rows, key rows) pairs of the two
local shards are computed, and whether a pair needs the causal mask.  With equal chunks a pair of
chunks is always full (every query sees every key), diagonal (the same chunk: causal=True on equal
lengths, top-left aligned) or skipped, so the plan is a short list of whole blocks, decided by the
chunks' global positions.  Pure Python: nothing here needs torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LAYOUTS", "num_chunks", "chunk_ids", "positions", "shard", "gather", "Tile",
           "step_source", "step_plan", "step_work"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_rank(rank, world) -> None:
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"world must be an int >= 1 (the number of ranks), got {world!r}")
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank must be an int in [0, world={world}), got {rank!r}")


def num_chunks(world: int, layout: str = "zigzag") -> int:
    """How many equal chunks the sequence is cut into: W (contiguous) or 2W (zigzag)."""
    _check_layout(layout)
    return world if layout == "contiguous" else 2 * world


def chunk_ids(rank: int, world: int, layout: str = "zigzag") -> tuple:
    """The chunks rank ``rank`` holds, in the order it stores them: (r,) or (r, 2W-1-r)."""
    _check_layout(layout)
    _check_rank(rank, world)
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def _chunk_len(n: int, world: int, layout: str) -> int:
    c = num_chunks(world, layout)
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"the sequence length must be an int >= 1, got {n!r}")
    if n % c:
        what = f"2·world = {c}" if layout == "zigzag" else f"world = {c}"
        raise ValueError(f"sequence length N = {n} is not divisible by {what} ({layout} layout cuts it into "
                         f"{c} equal chunks); with a causal mask, pad the sequence at its end to a multiple of {c} and "
                         f"drop the padded rows of the output (no real row sees a later key); without one, padded "
                         f"keys would be attended, so choose a length that divides")
    return n // c


def positions(rank: int, world: int, n: int, layout: str = "zigzag") -> list:
    """Global row indices (0..n-1) of the rows rank ``rank`` holds, in its local order."""
    c = _chunk_len(n, world, layout)
    return [i for ch in chunk_ids(rank, world, layout) for i in range(ch * c, (ch + 1) * c)]


def shard(x, rank: int, world: int, layout: str = "zigzag", dim: int = 2):
    """The rows of ``x`` (a torch tensor, the whole sequence along ``dim``) that ``rank`` holds.

    ``dim=2`` fits (B, H, N, D).  Returns a new contiguous tensor (a zigzag shard is two pieces)."""
    import torch
    n = x.shape[dim]
    c = _chunk_len(n, world, layout)
    parts = [x.narrow(dim, ch * c, c) for ch in chunk_ids(rank, world, layout)]
    return torch.cat(parts, dim=dim).contiguous()


def gather(parts, layout: str = "zigzag", dim: int = 2):
    """The inverse of ``shard``: ``parts`` is the list of every rank's shard, in rank order."""
    import torch
    _check_layout(layout)
    world = len(parts)
    if world == 0:
        raise ValueError("parts is empty; pass the list of every rank's shard, in rank order")
    n_local = parts[0].shape[dim]
    if any(p.shape[dim] != n_local for p in parts):
        raise ValueError(f"every shard must have the same length along dim {dim}, got "
                         f"{[p.shape[dim] for p in parts]}")
    per = len(chunk_ids(0, world, layout))
    if n_local % per:
        raise ValueError(f"a {layout} shard holds {per} equal chunks, so its length along dim {dim} must be "
                         f"divisible by {per}; got {n_local}")
    c = n_local // per
    chunks = [None] * (world * per)
    for r, p in enumerate(parts):
        for i, ch in enumerate(chunk_ids(r, world, layout)):
            chunks[ch] = p.narrow(dim, i * c, c)
    return torch.cat(chunks, dim=dim)


@dataclass(frozen=True)
class Tile:
    """One block a ring step computes: local query rows ``q``, local key rows ``kv`` (slices of the
    two shards) and whether it needs the causal mask (only on a chunk against itself)."""
    q: slice
    kv: slice
    causal: bool


def step_source(rank: int, world: int, step: int) -> int:
    """The rank whose K/V block rank ``rank`` holds at ring step ``step`` (blocks move r -> r+1)."""
    _check_rank(rank, world)
    return (rank - step) % world


def step_plan(rank: int, world: int, step: int, n_local: int, layout: str = "zigzag",
              causal: bool = True) -> list:
    """The tiles rank ``rank`` computes at ring step ``step``, when it holds the K/V shard of
    ``step_source(rank, world, step)``; ``n_local`` = rows per shard.

    Non-causal: the whole block.  Causal, by the chunks' global order:

    * contiguous: source < rank full, source == rank diagonal, source > rank nothing;
    * zigzag (chunks r < 2W-1-r): step 0 is the local block with the causal mask (its early chunk's
      queries do not see its late chunk's keys, the mask says so); source < rank: every query
      against the source's early chunk, full; source > rank: the late query chunk against both of
      the source's chunks, full.  Every step but the first costs half a block on every rank.
    """
    _check_layout(layout)
    src = step_source(rank, world, step)
    everything = slice(0, n_local)
    if not causal:
        return [Tile(everything, everything, False)]
    if layout == "contiguous":
        if src < rank:
            return [Tile(everything, everything, False)]
        return [Tile(everything, everything, True)] if src == rank else []
    if n_local % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks, so its length must be even; got {n_local}")
    h = n_local // 2
    if src == rank:
        return [Tile(everything, everything, True)]
    if src < rank:
        return [Tile(everything, slice(0, h), False)]
    return [Tile(slice(h, n_local), everything, False)]


def step_work(rank: int, world: int, step: int, layout: str = "zigzag", causal: bool = True) -> float:
    """Score-matrix entries computed at one step, as a fraction of a full local block (n_local²);
    a diagonal tile counts half (what block skipping computes)."""
    n = 2 * num_chunks(world, layout)      # any even n_local: fractions do not depend on it
    tiles = step_plan(rank, world, step, n, layout, causal)
    return sum((t.q.stop - t.q.start) * (t.kv.stop - t.kv.start) * (0.5 if t.causal else 1.0)
               for t in tiles) / (n * n)
