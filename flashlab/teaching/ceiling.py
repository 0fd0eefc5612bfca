"""One matmul ceiling per run: measured once (on a GPU) or read from one recording, reused by every "% of peak".

Notebooks 04-07 divide kernel rates by "the ceiling".  Which ceiling changes the percentage by up to a
quarter, so a notebook asks this module once, in the dtype of the kernels it compares, and uses that one
number everywhere:

    >>> from flashlab.teaching import ceiling
    >>> c = ceiling.get(torch.float16)       # live on a GPU (cached for the process), recorded on a CPU
    >>> print(c.label)                       # what it is: size, dtype, device, live or recorded (and when)
    >>> c.percent(517)                       # '74 %'

On a GPU it times ``torch.matmul`` on random ``n``-cubed matrices (``triton.testing.do_bench``, median,
after a warm-up).  On a CPU it returns the matmul recorded beside notebook 04/05's timings
(``flashlab/data/h200_part2.json``: 4096^3 fp16, H200, 2026-11-30), or None if that file is missing.

The course's other H200 matmul figures, and why they differ (see :data:`RECONCILE`):
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import bench, device

RECORD = "h200_part2.json"
N = 4096

RECONCILE = (
    "Recorded earlier, for comparison only (not this run): four matmul rates of the same H200 appear in the "
    "course's recordings: ~790 TFLOP/s (notebook 01, bf16, 8192^3), 698 (notebook 04 and 05's recording, fp16, "
    "4096^3, 2026-11-30 10:51 UTC), 692 (fp16 4096^3, an earlier GPU run of notebook 05) and 650 (fp16, 8192^3, recorded beside notebook 06's FA1 and L2 timings at 15:27 UTC). "
    "They are one GPU measured at different times, sizes and dtypes: the H200's clock follows its power and "
    "temperature, so a longer or later run can be 5-20 % slower, and neither matches the datasheet's 989 "
    "(dense fp16 at the boost clock). None is wrong; mixing them is. So each notebook takes one, in its "
    "kernels' dtype, from the same run as its kernels when it runs on a GPU, and names it wherever it divides "
    "by it.")


@dataclass(frozen=True)
class Ceiling:
    tflops: float
    dtype: str
    n: int
    device: str
    live: bool
    when: str = ""          # the recording's date; "" when measured now

    @property
    def label(self) -> str:
        how = "measured now" if self.live else f"recorded {self.when}"
        return f"torch.matmul {self.n}^3 {self.dtype} on {self.device}, {how}: {self.tflops:.0f} TFLOP/s"

    def percent(self, tflops: float) -> str:
        return f"{100 * tflops / self.tflops:.0f} %"


_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@functools.lru_cache(maxsize=None)
def _measure(dtype, n) -> Ceiling:
    from triton.testing import do_bench
    a, b = (torch.randn(n, n, device=device.DEVICE, dtype=dtype) for _ in range(2))
    a @ b
    ms = do_bench(lambda: a @ b, return_mode="median")
    return Ceiling(2 * n ** 3 / (ms * 1e-3) / 1e12, _SHORT.get(dtype, str(dtype)), n,
                   torch.cuda.get_device_name(), True)


def recorded(dtype=torch.float16) -> Ceiling | None:
    """The matmul recorded in flashlab/data/h200_part2.json for this dtype, or None."""
    rec = bench.load_record(RECORD)
    if rec is None:
        return None
    want = _SHORT.get(dtype)
    rows = [r for r in rec.get("matmul", []) if r["provider"] == "torch.matmul" and r["dtype"] == want]
    if not rows:
        return None
    r = rows[0]
    return Ceiling(r["tflops"], r["dtype"], r["M"], rec["machine"]["gpu"], False, rec["date"])


def get(dtype=torch.float16, n: int = N) -> Ceiling | None:
    """This run's ceiling: measured now on a GPU (once per process), else the recorded one (or None)."""
    if device.DEVICE.type == "cuda":
        return _measure(dtype, n)
    return recorded(dtype)


__doc__ += "\n" + RECONCILE
__all__ = ["Ceiling", "get", "recorded", "RECONCILE", "N", "RECORD"]
