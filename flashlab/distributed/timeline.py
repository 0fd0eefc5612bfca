"""A per-step timeline of :func:`~flashlab.distributed.ring_attention` on one rank (for the overlap
measurement of ``scripts/ring_scaling.py`` and notebook 09's recorded plots).

    from flashlab.distributed.timeline import Timeline, recording
    tl = Timeline(q.device)
    with recording(tl):
        ring_attention(q, k, v, is_causal=True).backward(do)
    tl.steps()      # [{"phase": "fwd", "step": 0, "start_ms": .., "compute_end_ms": .., "end_ms": .., ...}, ...]

The ring marks three moments of every step (nothing is recorded, and nothing costs, when no
timeline is installed; ``ring_attention``'s arguments and results are the same either way):

* ``start``: before the send of the current K/V block and the receive of the next are posted;
* ``compute_end``: after the step's kernels and merge (the backward: its kernels and dK/dV sums);
* ``end``: after the wait for the received block (the backward: and for the dK/dV accumulator).

On a GPU each mark is a CUDA event on the current stream.  NCCL runs the transfer on its own
stream, which waits for the current stream at ``start``; waiting on the request makes the current
stream wait for the transfer, so ``end - compute_end`` is the time the transfer was NOT hidden under
the step's compute (0 when it arrived during the compute: the next block was in flight).  On CPUs
(gloo) the marks are host clocks and the same difference is the time the wait blocked.
"""
from __future__ import annotations

import contextlib
import time

import torch

__all__ = ["Timeline", "recording"]

MARKS = ("start", "compute_end", "end")


class Timeline:
    """Marks of one rank's ring calls: (phase, step, mark) -> a CUDA event or a host time."""

    def __init__(self, device=None):
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = device.type == "cuda"
        self.marks = []                      # (phase, step, mark, event or seconds)

    def mark(self, phase: str, step: int, what: str) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((phase, step, what, e))
        else:
            self.marks.append((phase, step, what, time.perf_counter()))

    def clear(self) -> None:
        self.marks.clear()

    def _ms(self):
        """Milliseconds of every mark since the first one (synchronises the GPU)."""
        if not self.marks:
            return []
        if self.cuda:
            torch.cuda.synchronize()
            e0 = self.marks[0][3]
            return [e0.elapsed_time(m[3]) for m in self.marks]
        t0 = self.marks[0][3]
        return [(m[3] - t0) * 1e3 for m in self.marks]

    def steps(self) -> list:
        """One dict per (phase, step) in call order: start_ms, compute_end_ms, end_ms, compute_ms,
        exposed_ms (end - compute_end: the transfer's time not hidden by compute)."""
        rows = []
        for (phase, step, what, _), ms in zip(self.marks, self._ms()):
            if what == "start":
                rows.append({"phase": phase, "step": step, "start_ms": ms})
            elif rows and rows[-1]["phase"] == phase and rows[-1]["step"] == step:
                rows[-1][f"{what}_ms"] = ms
        out = []
        for r in rows:
            if all(f"{m}_ms" in r for m in MARKS):
                r["compute_ms"] = r["compute_end_ms"] - r["start_ms"]
                r["exposed_ms"] = max(0.0, r["end_ms"] - r["compute_end_ms"])
                out.append(r)
        return out


@contextlib.contextmanager
def recording(timeline: Timeline):
    """Install ``timeline`` in the ring for the duration of the block (one at a time per process)."""
    from . import ring
    before = ring._TIMELINE
    ring._TIMELINE = timeline
    try:
        yield timeline
    finally:
        ring._TIMELINE = before
