"""Drawing a :class:`~flashlab.viz.trace.KernelTrace`: each tensor as a grid, read / written / masked /
out of bounds, one program or several side by side; and the widget that steps through programs.

Figures use matplotlib's object API (no pyplot state): they work headless, in tests and in widgets.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .trace import BOTH, OOB, READ, UNTOUCHED, WRITTEN, _as_program


def _plane(t, program, arg):
    """The 2-D view drawn for ``arg``: (fixed, rdim, cdim, rows, cols).

    ``fixed``: {dim: index} of the leading dims held at the program's (its (b, h) for a 4-D tensor);
    ``rdim``/``cdim``: the dims drawn down and across (None: a single row or column).  A 1-D
    tensor is a row; per-row statistics such as an LSE (B, H, N) are a column beside the rows.
    """
    shape = t._arg[arg].shape
    nd = len(shape)
    if nd <= 1:
        return {}, None, (0 if nd else None), 1, (shape[0] if nd else 1)
    seen = [e.rows for e in t._by[(program, arg)] if len(e.rows)]
    seen = np.concatenate(seen) if seen else np.zeros((0, nd), np.int64)

    def mode(d):
        if not len(seen):
            return 0
        vals, counts = np.unique(seen[:, d], return_counts=True)
        return int(vals[np.argmax(counts)])

    fixed = {d: mode(d) for d in range(nd - 2)}
    if nd >= 3 and shape[-2] < shape[-1] and len(seen) and len(np.unique(seen[:, nd - 2])) == 1:
        fixed[nd - 2] = mode(nd - 2)                  # e.g. LSE (B, H, N): the program's row of N
        return fixed, nd - 1, None, shape[-1], 1
    return fixed, nd - 2, nd - 1, shape[-2], shape[-1]

def _cells(t, program, arg, plane):
    """(read, written, masked, oob) as (n, 2) arrays of (row, col) in ``plane``."""
    fixed, rdim, cdim = plane[:3]
    shape = t._arg[arg].shape
    nd = len(shape)
    none = np.zeros((0, 2), np.int64)

    def to_rc(idx):
        idx = np.asarray(idx, dtype=np.int64).reshape(-1, nd)
        if nd == 0:
            return none
        for d, v in fixed.items():
            idx = idx[idx[:, d] == v]
        r = idx[:, rdim] if rdim is not None else np.zeros(len(idx), np.int64)
        c = idx[:, cdim] if cdim is not None else np.zeros(len(idx), np.int64)
        return np.stack([r, c], axis=1)

    def flat_rc(ops):
        fl = [e.flat for e in t._by[(program, arg)] if e.op in ops]
        if not fl or nd == 0:
            return none
        fl = np.unique(np.concatenate(fl))
        return to_rc(np.stack(np.unravel_index(fl, shape), axis=1))

    ms = [e.masked for e in t._by[(program, arg)] if len(e.masked)]
    oob = [o.index for o in t.out_of_bounds if o.program == program and o.arg == arg and isinstance(o.index, tuple)]
    return (flat_rc(("load", "atomic")), flat_rc(("store", "atomic")),
            to_rc(np.unique(np.concatenate(ms), axis=0)) if ms else none, to_rc(oob) if oob else none)

def figure(t, program=None, args=None, max_programs=6, cell=None) -> Figure:
    """Each tensor as a grid of its elements, for one program or several side by side.

    ``program``: a program id (tuple or int), a list of them, or None (all, up to ``max_programs``
    of them, evenly spread).  ``args``: which tensors (default: every tensor the kernel touched).
    Blue: read; orange: written; purple: both; hatched: masked-off lanes; red: out of bounds.
    4-D (B, H, N, D) tensors show the (N, D) plane of the program's (b, h); lanes outside a tensor
    are drawn in the margin around it.  For a streamed tensor (loaded tile by tile) the count of
    loads of each tile is written beside it (``·``: never loaded).
    """
    if program is None:
        progs = t.programs
        if len(progs) > max_programs:
            pick = np.unique(np.linspace(0, len(progs) - 1, max_programs).round().astype(int))
            progs = [progs[i] for i in pick]
    elif isinstance(program, list):
        progs = [_as_program(p) for p in program]
    else:
        progs = [_as_program(program)]
    for p in progs:
        if p not in set(t.programs):
            raise ValueError(f"program must be one of the grid's program ids (grid {t.grid}), got {p}")
    names = list(args or [a for a in t._arg if any(e.arg == a for e in t.events)] or list(t._arg))
    streamed = set(t._streamed())
    planes = {}
    for a in names:
        for p in progs:
            plane = _plane(t, p, a)
            planes[(p, a)] = (plane, plane[3], plane[4], _cells(t, p, a, plane))
    ext = {}        # (r0, r1, c0, c1): the tensor plus the margin its lanes reach into, same for all programs
    for a in names:
        nr, nc = planes[(progs[0], a)][1], planes[(progs[0], a)][2]
        r0, r1, c0, c1 = 0, nr, 0, nc
        for p in progs:
            for pts in planes[(p, a)][3][2:]:
                if len(pts):
                    r0, r1 = min(r0, int(pts[:, 0].min())), max(r1, int(pts[:, 0].max()) + 1)
                    c0, c1 = min(c0, int(pts[:, 1].min())), max(c1, int(pts[:, 1].max()) + 1)
        mr, mc = max(2, nr // 2), max(2, nc // 2)       # a readable margin: half the tensor again at most
        ext[a] = (max(r0, -mr), min(r1, nr + mr), max(c0, -mc), min(c1, nc + mc))
    # layout in inches: a block of panels (one per tensor) per program; blocks in a grid
    extra = {a: (max(1.5, 0.12 * (ext[a][3] - ext[a][2]))
                 if a in streamed and t._tile_axis(a, None) == planes[(progs[0], a)][0][1] else 0) for a in names}
    thick = 3                                                          # a vector is drawn 3 cells thick
    pw = {a: (ext[a][3] - ext[a][2] + 1 if planes[(progs[0], a)][0][2] is not None else thick) + extra[a]
          for a in names}                                              # panel widths in cells
    ph = {a: ext[a][1] - ext[a][0] + 1 if planes[(progs[0], a)][0][1] is not None else thick for a in names}
    gap, pad_l = 0.55, 0.45                                            # inches between panels (tick labels)
    title_w = {a: 0.075 * max(map(len, _title_parts(t, progs[0], a, planes[(progs[0], a)][0]))) for a in names}
    n = len(progs)
    best = None
    def slots(c):
        return {a: max(pw[a] * c, title_w[a]) for a in names}

    for ncol in range(1, n + 1):
        nrow = math.ceil(n / ncol)
        c = cell or min(0.22, 3.2 / (max(ph.values()) * max(1, nrow) ** 0.5),
                        12.5 / (sum(pw.values()) * ncol + 1e-9))
        w = ncol * (sum(slots(c).values()) + gap * len(names)) + pad_l
        h = nrow * (max(ph.values()) * c + (1.0 if n > 1 else 0.75))
        score = abs(math.log((w + 0.01) / (h + 1.1) / 1.7)) + (0 if w <= 16 and h <= 11 else 5)
        if best is None or score < best[0]:
            best = (score, ncol, nrow, c, w, h)
    _, ncol, nrow, c, w, h = best
    c = max(c, 0.012)
    top, bottom = (0.6 if n > 1 else 0.45), 0.55
    W, H = max(w, 4.5), h + top + bottom
    fig = Figure(figsize=(W, H))
    block_h = max(ph.values()) * c + (1.0 if n > 1 else 0.75)
    sl = slots(c)
    for k, p in enumerate(progs):
        bi, bj = divmod(k, ncol)
        x0 = x = pad_l + bj * (sum(sl.values()) + gap * len(names))
        y_top = H - top - bi * block_h - 0.5                           # below the panels' titles
        for a in names:
            wa, ha = pw[a] * c, ph[a] * c
            ax = fig.add_axes([(x + (sl[a] - wa) / 2) / W, (y_top - ha) / H, wa / W, ha / H])
            _draw(t, ax, p, a, planes[(p, a)], ext[a], a in streamed, extra[a])
            x += sl[a] + gap
        if n > 1:
            fig.text((x0 - 0.4) / W, (y_top + 0.55) / H,
                     f"program {p if len(p) > 1 else p[0]}", fontsize=8.5, fontweight="bold", ha="left", va="bottom")
    title = f"{t.name}, grid {t.grid}"
    if n == 1:
        title += f": what program {progs[0] if len(progs[0]) > 1 else progs[0][0]} read and wrote"
    elif n < len(t.programs):
        title += f": {n} of its {len(t.programs)} programs"
    fig.text(0.5, 1 - 0.12 / H, title, fontsize=10, ha="center", va="top")
    handles = [Rectangle((0, 0), 1, 1, facecolor=col, edgecolor="0.5", lw=0.5, hatch=hh)
               for col, hh in ((READ, None), (WRITTEN, None), (BOTH, None), ("white", "////"), (OOB, None))]
    fig.legend(handles, ["read", "written", "read and written", "masked lane", "out of bounds"],
               loc="lower center", ncol=5, fontsize=7.5, frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig

def _draw(t, ax, program, arg, plane, ext, streamed, extra=0):
    (fixed, rdim, cdim, _, _), nr, nc, (reads, writes, masked, oob) = plane
    r0, r1, c0, c1 = ext
    img = np.ones((nr, nc, 3)) * np.asarray(to_rgb(UNTOUCHED))
    rd = np.zeros((nr, nc), bool)
    wr = np.zeros((nr, nc), bool)
    rd[reads[:, 0], reads[:, 1]] = True
    wr[writes[:, 0], writes[:, 1]] = True
    img[rd & ~wr] = to_rgb(READ)
    img[wr & ~rd] = to_rgb(WRITTEN)
    img[rd & wr] = to_rgb(BOTH)
    ax.imshow(img, extent=(0, nc, nr, 0), interpolation="nearest", aspect="auto")
    ax.add_patch(Rectangle((0, 0), nc, nr, fill=False, edgecolor="0.25", lw=0.8))
    # masked lanes: hatched runs (one rectangle per run of a row); out of bounds: red cells
    for pts, kw in ((masked, dict(fill=False, hatch="////", edgecolor="0.45", lw=0)),
                    (oob, dict(facecolor=OOB, edgecolor="none", alpha=0.85))):
        if not len(pts):
            continue
        pts = pts[(pts[:, 0] >= r0) & (pts[:, 0] < r1) & (pts[:, 1] >= c0) & (pts[:, 1] < c1)]
        for r in np.unique(pts[:, 0]):
            cols = np.unique(pts[pts[:, 0] == r, 1])
            starts = np.flatnonzero(np.diff(np.concatenate([[cols[0] - 2], cols])) != 1)
            ends = np.concatenate([starts[1:], [len(cols)]])
            for s, e in zip(starts, ends):
                ax.add_patch(Rectangle((cols[s], r), cols[e - 1] - cols[s] + 1, 1, **kw))
    ax_t = t._tile_axis(arg, None) if streamed else None
    if streamed and ax_t in (rdim, cdim):
        counts = t.loads_per_tile(program, arg)
        block = t.tile_size(arg)
        for j, c in enumerate(counts):
            lo, mid = j * block, j * block + min(block, (nr if ax_t == rdim else nc) - j * block) / 2
            color = "0.15" if c else "0.6"
            if ax_t == rdim:
                if j:
                    ax.plot([0, nc], [lo, lo], color="white", lw=1.0)
                ax.text(c1 + 0.6, mid, f"{c}×", fontsize=7, va="center", ha="left", color=color)
            else:
                if j:
                    ax.plot([lo, lo], [0, nr], color="white", lw=1.0)
                ax.text(mid, r0 - 0.7, f"{c}×", fontsize=7, ha="center", va="bottom", color=color)
    ax.set_xlim(*((c0 - 0.5, c1 + 0.5 + extra) if cdim is not None else (-0.06, 1.06 + extra / 3)))
    ax.set_ylim(*((r1 + 0.5, r0 - 0.5) if rdim is not None else (1.06, -0.06)))
    name, dims = _title_parts(t, program, arg, plane[0])
    col_tiles = streamed and ax_t == cdim and ax_t != rdim
    ax.set_title(f"{name}\n({dims})", fontsize=8, pad=17 if col_tiles else 4)
    _ticks(ax, (r0, r1) if rdim is not None else None, (c0, c1) if cdim is not None else None)
    ax.tick_params(labelsize=6, length=2)
    for sp in ax.spines.values():
        sp.set_visible(False)

def _title_parts(t, program, arg, plane):
    fixed = plane[0]
    shape = t._arg[arg].shape
    where = "[" + ", ".join(str(fixed[d]) if d in fixed else ":" for d in range(len(shape))) + "]" if fixed else ""
    return f"{arg}{where}", "×".join(map(str, shape)) or "scalar"


def _ticks(ax, rows, cols):
    """Index ticks along each drawn dim (None: a single row or column, no ticks), margins included."""
    def pick(lo, hi):
        n = hi - lo
        step = 1 if n <= 12 else 4 if n <= 40 else 8 if n <= 80 else 16 if n <= 160 else 32 if n <= 640 else 128
        return np.arange(-(-lo // step) * step, hi, step)
    for rng, setter in ((cols, ax.set_xticks), (rows, ax.set_yticks)):
        if rng is None or rng[1] - rng[0] <= 1:
            setter([])
        else:
            at = pick(*rng)
            setter(at + 0.5, [str(i) for i in at])


def interact_trace(t, programs=None, **figure_kw):
    """A slider over the traced programs (ipywidgets), redrawing ``t.figure(program)``.

    Where ipywidgets is missing, returns the figure of the first program (a static picture)."""
    progs = t.programs if programs is None else [_as_program(p) for p in programs]
    try:
        import ipywidgets as widgets
        from IPython.display import display
    except ImportError:
        return t.figure(progs[0], **figure_kw)
    out = widgets.Output()
    label = widgets.Label()

    def show(i):
        p = progs[i]
        label.value = f"program {p if len(p) > 1 else p[0]}"
        out.clear_output(wait=True)
        with out:
            display(t.figure(p, **figure_kw))

    slider = widgets.IntSlider(value=0, min=0, max=max(len(progs) - 1, 0), description="program #")
    slider.observe(lambda ch: show(ch["new"]), names="value")
    show(0)
    return widgets.VBox([widgets.HBox([slider, label]), out])
