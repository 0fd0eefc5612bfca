"""Padded, poisoned buffers: how the grader catches out-of-bounds reads and writes.

Every tensor a learner's kernel touches is a *view* into a larger buffer:

    inputs   (B, H, N + PAD, D) filled with NaN, viewed as [:, :, :N]  plus PAD_FLAT NaNs before and after
    outputs  the same shape, filled with a SENTINEL value

so a read past the end of any (batch, head) row block brings NaN into the result
and a write past it changes a sentinel.  The views are non-contiguous on purpose:
a kernel must use ``.stride()``, as real kernels do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_ROWS = 8      # extra rows after each (batch, head) block
PAD_FLAT = 16384  # extra elements before and after the whole buffer
SENTINEL = {torch.float16: 1234.0, torch.bfloat16: 1232.0, torch.float32: 123456.0}


@dataclass
class Padded:
    name: str
    flat: torch.Tensor        # the whole allocation
    view: torch.Tensor        # what the candidate sees
    fill: float               # NaN for inputs, SENTINEL for outputs

    def padding_mask(self) -> torch.Tensor:
        """Boolean over ``flat``: True on elements outside ``view``."""
        mask = torch.ones(self.flat.numel(), dtype=torch.bool, device=self.flat.device)
        idx = _view_flat_indices(self.view, self.flat)
        mask[idx] = False
        return mask


def _view_flat_indices(view: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    offset = view.data_ptr() - flat.data_ptr()
    assert offset % view.element_size() == 0
    base = offset // view.element_size()
    idx = torch.zeros(view.shape, dtype=torch.long, device=flat.device)
    for dim, (size, stride) in enumerate(zip(view.shape, view.stride())):
        shape = [1] * view.dim()
        shape[dim] = size
        idx = idx + (torch.arange(size, device=flat.device) * stride).view(shape)
    return (base + idx).flatten()


def padded(name: str, values: torch.Tensor, fill: float | None = None, row_dim: int = -2) -> Padded:
    """A poisoned buffer holding ``values``; ``row_dim`` (the N axis) gets PAD_ROWS extra rows."""
    dtype, dev = values.dtype, values.device
    fill = float("nan") if fill is None else fill
    shape = list(values.shape)
    row_dim = row_dim % values.dim()
    big = shape.copy()
    big[row_dim] += PAD_ROWS
    inner = 1
    for s in big:
        inner *= s
    flat = torch.full((PAD_FLAT + inner + PAD_FLAT,), fill, dtype=dtype, device=dev)
    body = flat[PAD_FLAT:PAD_FLAT + inner].view(big)
    view = body.narrow(row_dim, 0, shape[row_dim])
    view.copy_(values)
    return Padded(name, flat, view, fill)


def output_buffer(name: str, shape, dtype, dev, row_dim: int = -2) -> Padded:
    """An output the candidate must fill: sentinel inside and around it."""
    return padded(name, torch.full(shape, SENTINEL[dtype], dtype=dtype, device=dev), SENTINEL[dtype], row_dim)


@dataclass
class Stray:
    name: str
    count: int
    first_offset: int    # relative to the start of the view (negative: before it)
    where: str

    def __str__(self):
        return f"{self.count} element(s) around `{self.name}` were overwritten ({self.where})"


def stray_writes(buf: Padded) -> Stray | None:
    """Did anything write into the padding of ``buf``?"""
    pad = buf.padding_mask()
    vals = buf.flat[pad]
    changed = ~(vals == buf.fill) if buf.fill == buf.fill else ~torch.isnan(vals)
    n = int(changed.sum())
    if n == 0:
        return None
    pos = torch.nonzero(pad).flatten()[changed]
    first = int(pos[0])
    start = buf.view.data_ptr() - buf.flat.data_ptr()
    start //= buf.view.element_size()
    if first < start:
        where = f"first one {start - first} elements before the start of `{buf.name}`"
    elif first >= start + _extent(buf.view):
        where = f"first one {first - start - _extent(buf.view) + 1} elements past the end of `{buf.name}`"
    elif buf.view.dim() == 2:
        where = "in the padding after a row: a column index past the row's end, or strides not used"
    else:
        where = "in the gaps between (batch, head) blocks: a row index past N, or strides not used"
    return Stray(buf.name, n, first - start, where)


def _extent(view: torch.Tensor) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(view.shape, view.stride()))


def unwritten(buf: Padded) -> torch.Tensor:
    """Boolean mask over the view: elements still holding the sentinel (never written)."""
    return buf.view == buf.fill
