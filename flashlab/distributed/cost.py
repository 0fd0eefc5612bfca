"""On paper: when a ring step's transfer hides under its compute, and ring vs all-to-all to 1024 GPUs.

Symbols (one attention layer, forward): B batch, H query heads, H_kv key/value heads, D head dim,
N the whole sequence, W ranks, n = N/W rows per rank, e bytes per element (2: bf16), F the FLOP/s
one GPU's attention kernel reaches, BW the link's bandwidth per direction.

Ring, one step: compute one block of n query rows against n keys, f·4·B·H·n²·D FLOPs (f = 1, or
1/2 for causal with the zigzag layout, where every step computes half a block); meanwhile send the
next K/V block, 2·B·H_kv·n·D·e bytes.  The transfer hides when

    2·B·H_kv·n·D·e / BW  <=  f·4·B·H·n²·D / F     <=>     n >= n* = H_kv·e·F / (2·f·H·BW)

B and D cancel: the block size that hides the transfer depends on the ratio F/BW of the machine
and on the GQA ratio only.  The backward computes 2.5x the FLOPs and sends K/V plus the dK/dV
accumulators (float32 here: 4 bytes each), 3x the bytes: n* grows by 3/2.5.

All-to-all (DeepSpeed-Ulysses): each rank trades its n rows of all heads for all N rows of H/W
heads (Q, K, V in, O back: four all-to-alls, each sending (W-1)/W of a rank's n rows), computes
attention of its heads on the whole sequence, and trades back.  Its bytes per rank fall as 1/W, as
its compute does, but only while W <= H: a rank needs at least one head (and each K/V head is
copied to the W/H_kv ranks that read it once W > H_kv).  No overlap of transfer and compute is
assumed for it (the four all-to-alls stand between the layer's projections and its attention).

Machines: 8 GPUs of an HGX H200 share NVLink (~450 GB/s per direction per GPU); past 8, the ring
and the all-to-all cross nodes over InfiniBand (~50 GB/s per GPU: one 400 Gb/s NIC each).  These
are datasheet numbers for a model, not measurements: `scripts/ring_bench.py` times the pieces that
one GPU can time (the per-step kernels and the merge).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Machine", "H200_NODE", "overlap_rows", "ring_step", "ring_time", "ulysses_time", "scaling"]


@dataclass(frozen=True)
class Machine:
    flops: float = 400e12            # FLOP/s one GPU's attention forward reaches (bf16, H200: ~400-550)
    nvlink: float = 450e9            # bytes/s per direction per GPU inside a node (H200 NVLink 4: 900 GB/s both ways)
    ib: float = 50e9                 # bytes/s per direction per GPU between nodes (400 Gb/s InfiniBand)
    gpus_per_node: int = 8

    def ring_bw(self, world: int) -> float:
        """The ring is as fast as its slowest link: NVLink inside one node, InfiniBand past it."""
        return self.nvlink if world <= self.gpus_per_node else self.ib


H200_NODE = Machine()


def overlap_rows(bw: float, flops: float = H200_NODE.flops, heads: int = 1, kv_heads: int = 1,
                 elem: int = 2, causal: bool = True, backward: bool = False) -> float:
    """n*: the rows per rank from which one ring step's K/V transfer takes no longer than its compute."""
    f = 0.5 if causal else 1.0
    if backward:   # 2.5x the FLOPs; K/V (e bytes) plus dK/dV accumulators (4 bytes) travel
        return kv_heads * (elem + 4) * flops / (2 * 2.5 * f * heads * bw)
    return kv_heads * elem * flops / (2 * f * heads * bw)


def ring_step(n: int, B: int = 1, H: int = 32, H_kv: int = 8, D: int = 128, elem: int = 2,
              causal: bool = True, bw: float = H200_NODE.nvlink, flops: float = H200_NODE.flops):
    """(compute seconds, transfer seconds, bytes, FLOPs) of one ring step of n rows."""
    f = 0.5 if causal else 1.0
    fl = f * 4.0 * B * H * n * n * D
    by = 2.0 * B * H_kv * n * D * elem
    return fl / flops, by / bw, by, fl


def ring_time(N: int, W: int, m: Machine = H200_NODE, **shape) -> float:
    """Seconds for the ring forward over W ranks: the first step computes the local block; each of
    the W-1 others waits for the slower of its transfer and its compute (they overlap)."""
    n = N / W
    tc, tm, _, _ = ring_step(n, bw=m.ring_bw(W), flops=m.flops, **shape)
    return tc + (W - 1) * max(tc, tm)


def ulysses_time(N: int, W: int, m: Machine = H200_NODE, B: int = 1, H: int = 32, H_kv: int = 8,
                 D: int = 128, elem: int = 2, causal: bool = True):
    """Seconds for the all-to-all forward over W ranks, or None where it cannot run (W > H)."""
    if W > H:
        return None
    n = N / W
    f = 0.5 if causal else 1.0
    compute = f * 4.0 * B * (H / W) * N * N * D / m.flops
    kv = max(H_kv, W)                                  # K/V heads are copied once W > H_kv
    per_rank = B * n * D * elem * (W - 1) / W * (H + 2 * kv + H)     # Q, K, V in; O back
    if W <= m.gpus_per_node:
        comm = per_rank / m.nvlink
    else:                                              # the share bound for other nodes goes over IB
        off = (W - m.gpus_per_node) / (W - 1)
        comm = max(per_rank * off / m.ib, per_rank * (1 - off) / m.nvlink)
    return compute + comm


def scaling(N: int, worlds=None, m: Machine = H200_NODE, **shape) -> dict:
    """For each W: the ideal time (one GPU's compute divided by W), the ring's and Ulysses' times."""
    worlds = worlds or [2 ** i for i in range(1, 11)]
    f = 0.5 if shape.get("causal", True) else 1.0
    B, H, D = shape.get("B", 1), shape.get("H", 32), shape.get("D", 128)
    ideal = [f * 4.0 * B * H * N * N * D / m.flops / W for W in worlds]
    return {"W": list(worlds), "ideal": ideal,
            "ring": [ring_time(N, W, m, **shape) for W in worlds],
            "ulysses": [ulysses_time(N, W, m, **shape) for W in worlds]}
