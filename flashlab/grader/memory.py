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

import numpy as np
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


# ----------------------------------------------------------------------------
# the canaries, checked where the grader runs
# ----------------------------------------------------------------------------
# A run sends back every padded buffer whole (``returned``); the grader rebuilds the same buffers for the
# case without running anything (``layout_of``: the exercise's run, stopped where it hands the buffers
# over) and checks the padding and the outputs itself (``check_returned``).  What the process that ran
# the candidate says about them can only add to that.

_RECORDING: list = []


class _Recorded(Exception):
    """Stops a run that the grader calls only to learn the layout of its buffers."""


def hand_over(buffers: dict, outputs=()) -> None:
    """A run calls this just before the candidate with the Padded buffers it hands over; while the grader
    records a layout (``layout_of``), the run stops here."""
    if _RECORDING:
        _RECORDING[-1].update({n: (b, n in outputs) for n, b in buffers.items() if isinstance(b, Padded)})
        raise _Recorded


def returned(buffers: dict) -> dict:
    """The ``_buffers`` entry of a run's outputs: each Padded's whole allocation as a NumPy array
    (bfloat16 as float32, which holds it exactly)."""
    out = {}
    for n, b in buffers.items():
        flat = b.flat.detach()
        if flat.dtype == torch.bfloat16:
            flat = flat.float()
        out[n] = flat.cpu().numpy()
    return out


def layout_of(run, case) -> dict:
    """name -> (Padded as the grader made it, is an output) for the buffers ``run`` hands a candidate on
    ``case`` (``run`` stops at ``hand_over``, or where it calls the candidate: nothing runs).  Empty if
    the run hands over none."""
    def candidate(*a, **k):
        raise _Recorded

    _RECORDING.append({})
    try:
        run(candidate, case)
    except _Recorded:
        return _RECORDING[-1]
    except Exception:
        return {}
    finally:
        _RECORDING.pop()
    return {}


def _view_index(buf: Padded) -> np.ndarray:
    """Flat indices (into ``buf.flat``) of the elements of ``buf.view``, in the view's order."""
    base = (buf.view.data_ptr() - buf.flat.data_ptr()) // buf.view.element_size()
    idx = np.full((1,) * buf.view.dim(), base, dtype=np.int64)
    for dim, (size, stride) in enumerate(zip(buf.view.shape, buf.view.stride())):
        shape = [1] * buf.view.dim()
        shape[dim] = size
        idx = idx + (np.arange(size, dtype=np.int64) * stride).reshape(shape)
    return idx


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy()


def check_returned(layout: dict, buffers) -> tuple:
    """(stray messages, {output name: unwritten mask over its view}) from the buffers a run sent back,
    against the grader's ``layout``; a buffer missing or of the wrong size is a stray message too."""
    strays, unw = [], {}
    if not isinstance(buffers, dict):
        buffers = {}
    for name, (tpl, is_output) in layout.items():
        got = buffers.get(name)
        if (not isinstance(got, np.ndarray) or got.dtype.kind != "f" or got.ndim != 1
                or got.size != tpl.flat.numel()):
            strays.append(f"`{name}` did not come back whole from the process that ran your code, so what was "
                          f"written around it cannot be checked")
            continue
        idx = _view_index(tpl)
        pad = np.ones(got.size, dtype=bool)
        pad[idx.ravel()] = False
        around = got[pad]
        changed = ~np.isnan(around) if tpl.fill != tpl.fill else around != tpl.fill
        if changed.any():                # the message, from the same account as the run's own
            flat = torch.from_numpy(np.ascontiguousarray(got)).to(tpl.flat.dtype)
            offset = (tpl.view.data_ptr() - tpl.flat.data_ptr()) // tpl.view.element_size()
            view = torch.as_strided(flat, tpl.view.shape, tpl.view.stride(), offset)
            stray = stray_writes(Padded(name, flat, view, tpl.fill))
            strays.append(str(stray) if stray else f"{int(changed.sum())} element(s) around `{name}` were overwritten")
        inside = got[idx]
        if is_output:
            unw[name] = inside == tpl.fill
        elif not np.array_equal(inside, _as_numpy(tpl.view), equal_nan=True):
            strays.append(f"the input `{name}` was modified (inputs are read-only)")
    return strays, unw


def merge_checks(out: dict, strays: list, unw: dict) -> None:
    """Add the grader's own findings to a run's outputs (what the run reported stays, and can only add)."""
    told = out.get("_stray")
    told = [t for t in told if isinstance(t, str)] if isinstance(told, list) else []
    out["_stray"] = strays + [t for t in told if t not in strays]
    mine = out.get("_unwritten")
    mine = dict(mine) if isinstance(mine, dict) else {}
    for name, mask in unw.items():
        prev = mine.get(name)
        if isinstance(prev, np.ndarray) and prev.shape == mask.shape:
            mask = mask | prev.astype(bool)
        mine[name] = mask
    out["_unwritten"] = mine
