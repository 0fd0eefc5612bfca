"""Attention over several GPUs through torch.distributed (gloo on CPUs, NCCL on GPUs).

* :func:`ring_attention` (:mod:`.ring`): each rank keeps its queries, K/V blocks go around a ring
  of ranks, partial results are merged by log-sum-exp; differentiable.
* :mod:`.layout`: which rows each rank holds ("contiguous" or "zigzag"), :func:`shard` /
  :func:`gather`, and :func:`step_plan`, the tiles one ring step computes.
* :mod:`.cost`: the overlap condition and the ring vs all-to-all cost model (no GPU needed);
  :mod:`.figures`: notebook 09's pictures; :mod:`.local`: run a function on W local processes of
  one process group (tests, demos); :func:`simulate_ring`: the ring's forward played by one process.
* :mod:`.timeline`: an optional per-step recorder of the ring (compute, and the wait the compute
  did not hide), for ``scripts/ring_scaling.py``'s overlap measurement.
"""
from .layout import LAYOUTS, Tile, chunk_ids, gather, num_chunks, positions, shard, step_plan, step_source, step_work
from .ring import all_gather_sequence, merge_attention, ring_attention, simulate_ring

__all__ = ["ring_attention", "simulate_ring", "merge_attention", "all_gather_sequence", "shard", "gather", "positions",
           "chunk_ids", "num_chunks", "step_plan", "step_source", "step_work", "Tile", "LAYOUTS"]
