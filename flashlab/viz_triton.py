"""Figures for part 2 (notebooks 04 and 05: Triton kernels).  Every function returns a Figure.

Kept apart from :mod:`flashlab.viz` (part 1); the same rules: matplotlib's object API, no
pyplot state, headless, and each figure draws only numbers it is given.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .viz import _finish_loglog

COLORS = {"naive": "#cf222e", "learner": "#8250df", "flashlab": "#1f6feb", "sdpa-flash": "#2da44e",
          "sdpa-cudnn": "#bf8700", "SDPA": "#2da44e", "v1 (taught)": "#0a3069", "yours": "#8250df",
          "solution": "#8250df", "flashlab (op)": "#54aeff"}


def _color(p, j):
    """A provider's colour: the course's fixed ones, light blue for a dated op row ("op 2026-11-30")."""
    if p in COLORS:
        return COLORS[p]
    return "#54aeff" if p.startswith("op ") else f"C{(j + 4) % 10}"


def fig_program_blocks(n=23, block=8):
    """A vector of n elements cut into blocks of ``block``: one Triton program each; lanes past n masked."""
    nprog = -(-n // block)
    fig = Figure(figsize=(min(12, 0.42 * nprog * block + 1.5), 1.9))
    ax = fig.add_subplot()
    for p in range(nprog):
        for lane in range(block):
            i = p * block + lane
            ok = i < n
            ax.add_patch(Rectangle((i, 0), 0.92, 0.92, facecolor=f"C{p}" if ok else "white",
                                   edgecolor=f"C{p}", hatch=None if ok else "//", alpha=0.55 if ok else 1))
            ax.text(i + 0.46, 0.46, str(i), ha="center", va="center", fontsize=7, color="black" if ok else "gray")
        ax.text(p * block + block / 2, 1.25, f"program_id(0) = {p}", ha="center", fontsize=8, color=f"C{p}")
    ax.set_xlim(-0.2, nprog * block + 0.2)
    ax.set_ylim(-0.4, 1.6)
    ax.axis("off")
    ax.set_title(f"n = {n}, BLOCK = {block}: grid = cdiv(n, BLOCK) = {nprog} programs; "
                 f"hatched lanes fail offs < n (masked)", fontsize=9)
    fig.tight_layout()
    return fig


def fig_strided_view(rows=4, cols=5, pad=3, transposed=False):
    """A matrix view inside a padded buffer: which memory slots element (i, j) occupies.

    Row-major with ``pad`` extra slots per row: address(i, j) = i * (cols + pad) + j.
    Transposed view of such a buffer: address(i, j) = j * (rows + pad) + i.
    """
    fig = Figure(figsize=(9, 2.4))
    ax = fig.add_subplot()
    if transposed:
        row_len, n_lines = rows + pad, cols
        stride = (1, rows + pad)
    else:
        row_len, n_lines = cols + pad, rows
        stride = (cols + pad, 1)
    total = row_len * n_lines
    for a in range(total):
        r, c = divmod(a, row_len)
        inside = c < (rows if transposed else cols)
        i, j = (c, r) if transposed else (r, c)
        ax.add_patch(Rectangle((a, 0), 0.92, 0.92, facecolor=f"C{i}" if inside else "#eeeeee",
                               edgecolor="gray", alpha=0.6 if inside else 1))
        ax.text(a + 0.46, 0.46, f"{i},{j}" if inside else "pad", ha="center", va="center", fontsize=6)
        ax.text(a + 0.46, -0.35, str(a), ha="center", va="center", fontsize=6, color="gray")
    ax.set_xlim(-0.2, total + 0.2)
    ax.set_ylim(-0.8, 1.2)
    ax.axis("off")
    kind = "transposed view" if transposed else "row-major view"
    ax.set_title(f"{rows}x{cols} {kind} in a padded buffer: strides = {stride}; "
                 f"element (i, j) lives at i*{stride[0]} + j*{stride[1]} (colour = row i, grey = padding)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def fig_memory_hierarchy(gpus: dict):
    """Sizes (bytes) and bandwidths (bytes/s) per level for a few GPUs, on log axes.

    ``gpus``: name -> {level: (size_bytes, bandwidth_bytes_per_s or None)}.
    """
    fig = Figure(figsize=(8, 3.6))
    ax = fig.add_subplot()
    markers = {"registers": "s", "shared memory": "o", "L2": "^", "DRAM": "D"}
    for gi, (gpu, levels) in enumerate(gpus.items()):
        for level, (size, bw) in levels.items():
            if bw is None:
                continue
            ax.scatter(size, bw, color=f"C{gi}", marker=markers.get(level, "o"), s=50)
            ax.annotate(f"{gpu} {level}", (size, bw), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("capacity (bytes, whole chip)")
    ax.set_ylabel("bandwidth (bytes/s)")
    ax.set_title("Small and fast on chip, large and slow off chip\n"
                 "(datasheets; shared-memory bandwidth derived)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def fig_tflops_vs_n(rows, title="Forward TFLOP/s", ceiling=None):
    """One panel per head dim: TFLOP/s against N per provider. ``rows``: dicts with provider, N, D, tflops.

    A linear TFLOP/s axis (the rates span one order of magnitude at most), one legend for the figure, and
    ``ceiling``: an optional (TFLOP/s, label) drawn across every panel (the run's measured matmul)."""
    ds = sorted({r["D"] for r in rows})
    fig = Figure(figsize=(4.6 * len(ds) + 2.6, 3.8))
    provs = []
    for r in rows:
        if r["provider"] not in provs:
            provs.append(r["provider"])
    handles = {}
    top = 0.0
    for i, d in enumerate(ds):
        ax = fig.add_subplot(1, len(ds), i + 1)
        for j, p in enumerate(provs):
            pts = sorted((r["N"], r["tflops"]) for r in rows if r["D"] == d and r["provider"] == p
                         and r.get("tflops") is not None and np.isfinite(r["tflops"]))
            if pts:
                x, y = zip(*pts)
                top = max(top, max(y))
                (h,) = ax.plot(x, y, "o-", label=p, color=_color(p, j), ms=4)
                handles.setdefault(p, h)
        if ceiling is not None:
            h = ax.axhline(ceiling[0], color="black", ls="--", lw=1, label=ceiling[1])
            handles.setdefault(ceiling[1], h)
            top = max(top, ceiling[0])
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, top * 1.08 if top else 1)
        ax.set_xlabel("N (tokens per sequence; B = 16384 / N)")
        if i == 0:
            ax.set_ylabel("TFLOP/s")
        ax.set_title(f"D = {d}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.subplots_adjust(right=1 - 2.5 / fig.get_figwidth())
    fig.legend(list(handles.values()), list(handles), fontsize=8, loc="center right")
    return fig


def fig_peak_memory(ns_by_provider: dict, title="Peak memory of one forward"):
    """Peak extra memory (bytes) against N per provider; ``None``: the provider ran out of memory there.

    The y axis is symmetric-log (linear below 1 MiB), so 0 MiB is drawn at 0, not at an invented floor; the
    point where a provider ran out of memory is marked with a cross at the top, labelled with its N."""
    fig = Figure(figsize=(7.2, 4))
    ax = fig.add_subplot()
    top = max([b for pts in ns_by_provider.values() for _, b in pts if b] or [2**20]) / 2**20
    for j, (p, pts) in enumerate(ns_by_provider.items()):
        color = _color(p, j)
        ok = [(n, b) for n, b in pts if b is not None]
        if ok:
            x, y = zip(*ok)
            ax.plot(x, np.asarray(y) / 2**20, "o-", label=p, color=color, ms=4)
        for n, b in pts:
            if b is None:
                ax.plot([n], [top * 2], "x", color=color, ms=10, mew=2)
                ax.annotate(f"{p}: out of memory at N = {n:,}", (n, top * 2), textcoords="offset points",
                            xytext=(-6, -14), ha="right", fontsize=8, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(-0.1, top * 6)
    return _finish_loglog(fig, ax, "N", "MiB above the inputs and the output (0 drawn at 0)", title,
                          legend_loc="center left")


def fig_grouped_bars(groups: dict, ylabel: str, title: str = "", log=False, hline=None):
    """groups: group label -> {series: value}; one bar per series within each group.
    ``hline``: optional (value, label) drawn across, e.g. a datasheet peak."""
    labels = list(groups)
    series = []
    for g in groups.values():
        for s in g:
            if s not in series:
                series.append(s)
    fig = Figure(figsize=(max(7, 1.3 * len(labels) * max(1, len(series)) / 2 + 3.5), 3.4))
    ax = fig.add_subplot()
    w = 0.8 / max(1, len(series))
    for si, s in enumerate(series):
        xs = [i + si * w for i in range(len(labels))]
        vals = [groups[g].get(s, np.nan) for g in labels]
        ax.bar(xs, vals, width=w, label=s, color=COLORS.get(s, f"C{si}"))
    ax.set_xticks([i + w * (len(series) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=8)
    if hline is not None:
        ax.axhline(hline[0], color="black", ls="--", lw=1, label=hline[1])
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def fig_fa2_grid(nq=300, block_m=64, B=2, H=3):
    """The FA2 forward's grid: program (pid0, pid1) = (query tile, b * H + h); the last tile is ragged."""
    tr = -(-nq // block_m)
    bh = B * H
    fig = Figure(figsize=(min(11, 1.3 * tr + 2), 0.55 * bh + 1.4))
    ax = fig.add_subplot()
    for j in range(bh):
        for i in range(tr):
            rows = min(block_m, nq - i * block_m)
            ax.add_patch(Rectangle((i, bh - 1 - j), 0.94, 0.9, facecolor=f"C{j // H}",
                                   alpha=0.25 + 0.5 * rows / block_m, edgecolor="black", lw=0.5))
            ax.text(i + 0.47, bh - 1 - j + 0.45, f"({i}, {j})\nrows {i * block_m}..{i * block_m + rows - 1}",
                    ha="center", va="center", fontsize=6.5)
        ax.text(-0.1, bh - 1 - j + 0.45, f"b={j // H}, h={j % H}", ha="right", va="center", fontsize=7)
    ax.set_xlim(-0.9, tr + 0.1)
    ax.set_ylim(-0.2, bh + 0.2)
    ax.axis("off")
    ax.set_title(f"grid = (cdiv(Nq={nq}, BLOCK_M={block_m}), B*H = {bh}) = {tr * bh} programs, "
                 f"(program_id(0), program_id(1)) each", fontsize=9)
    fig.tight_layout()
    return fig
