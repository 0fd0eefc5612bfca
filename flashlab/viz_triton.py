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


# ------------------------------------------------------------------ forward v6's schedule (notebook 06, section 8)

def ws_schedule(n_tiles: int = 5, stages: int = 3, consumers: int = 2, gemm: float = 1.0, softmax: float = 1.0,
                copy: float = 1.5, rescale: float = 0.5, issue: float = 0.3) -> list:
    """A schematic of forward v6's schedule: events (lane, start, end, label, kind), kind in "copy", "gemm",
    "softmax", "rescale", "wait".  Not a measurement: every product takes ``gemm``, every softmax ``softmax``, the rescale
    of O by alpha ``rescale``, every TMA copy of K_j and V_j ``copy`` time units (drawn as one copy; the kernel
    has a barrier per operand).  ``consumers=1`` is one program whose warpgroups move in lockstep: the same warps
    then issue each refill, which costs them ``issue`` (waiting on the stage's barrier, the copy's setup); with
    consumers, a producer warp of its own issues them.

    The rules are the kernel's: the producer refills stage j % stages once every consumer has arrived on its
    "empty" barrier (done with tile j - stages); a consumer issues S_j = Q K_j^T when K_j has landed and, with it,
    P_{j-1} V_{j-1}; its softmax of S_j starts when S_j is done and overlaps P_{j-1} V_{j-1}; it releases stage
    j - 1 when that product is done and then rescales O (O *= alpha: the accumulator's registers, on the
    warpgroup's own units) before it issues the next pair.  The tensor cores run one product at a time, in the
    order issued, so with two consumers one's softmax and rescale can run while the other's products occupy
    them; with one, nothing covers the rescale.  Which consumer goes next is the one whose clock is earliest: an
    idealised warp scheduler, not the hardware's."""
    events = []
    tc_free = 0.0                                       # when the tensor cores finish what was issued so far
    landed = {}                                         # tile -> when K_j, V_j are in shared memory
    released = {}                                       # (consumer, tile) -> when it arrived on "empty"
    issue_t = 0.0

    def copy_tile(j):
        nonlocal issue_t
        start = issue_t
        if j >= stages:                                 # wait until every consumer is done with tile j - stages
            start = max(start, max(released[(w, j - stages)] for w in range(consumers)))
        events.append(("producer warp", start, start + 0.15, f"K{j} V{j}", "copy"))
        events.append(("TMA (copies in flight)", start + 0.15, start + 0.15 + copy, f"K{j},V{j}", "copy"))
        landed[j] = start + 0.15 + copy
        issue_t = start + 0.15

    state = [dict(t=0.0, j=0) for _ in range(consumers)]   # each consumer's clock and its next tile
    for j in range(min(stages, n_tiles)):
        copy_tile(j)
    next_copy = min(stages, n_tiles)
    # advance the consumers in turn, always the one whose clock is earliest (the warp scheduler's choice)
    while any(s["j"] <= n_tiles for s in state):
        w = min((i for i, s in enumerate(state) if s["j"] <= n_tiles), key=lambda i: state[i]["t"])
        s, j = state[w], state[w]["j"]
        lane = f"consumer warpgroup {w}"
        t = s["t"]
        if j < n_tiles:
            if landed[j] > t:
                events.append((lane, t, landed[j], "wait", "wait"))
                t = landed[j]
            s_start = max(t, tc_free)
            s_end = s_start + gemm
            events.append(("tensor cores", s_start, s_end, f"S{j} ({w})", "gemm"))
            tc_free = s_end
        if j > 0:                                       # P_{j-1} V_{j-1}, issued with S_j
            pv_start = max(t, tc_free)
            pv_end = pv_start + gemm
            events.append(("tensor cores", pv_start, pv_end, f"PV{j - 1} ({w})", "gemm"))
            tc_free = pv_end
        if j < n_tiles:
            events.append((lane, s_end, s_end + softmax, f"softmax {j}", "softmax"))
            t = s_end + softmax
        if j > 0:
            t = max(t, pv_end)
            released[(w, j - 1)] = t
            events.append((lane, t, t + rescale, "×α" if j < n_tiles else "÷ℓ", "rescale"))
            t += rescale
            while next_copy < n_tiles and all((v, next_copy - stages) in released for v in range(consumers)):
                if consumers == 1:                      # the same warps issue the refill
                    events.append((lane, t, t + issue, f"issue K{next_copy} V{next_copy}", "copy"))
                    t += issue
                    issue_t = max(issue_t, t)
                copy_tile(next_copy)
                next_copy += 1
        s["t"], s["j"] = t, j + 1
    return events


def tensor_core_busy(events) -> float:
    """The fraction of the schedule's span during which the tensor cores run a product."""
    gemms = [(a, b) for lane, a, b, _, kind in events if kind == "gemm"]
    span = max(b for _, _, b, _, _ in events) - min(a for _, a, _, _, _ in events)
    return sum(b - a for a, b in gemms) / span


def fig_ws_schedule(n_tiles: int = 5, stages: int = 3):
    """Forward v6's schedule as lanes in time (schematic, from :func:`ws_schedule`), the same 128 query rows two
    ways, both with the overlapped products and the ring of stages: as one program whose two warpgroups move in
    lockstep and issue their own copies (scripts/gluon_probe.py's overlap kernel: each product twice as large,
    both softmaxes at once), and as forward v6's producer and two consumer partitions of 64 rows each."""
    kinds = {"copy": "#8c959f", "gemm": "#1f6feb", "softmax": "#bf8700", "rescale": "#f2cc60", "wait": "#f6f8fa"}
    fig = Figure(figsize=(12, 5.6))
    axes = fig.subplots(2, 1, sharex=True)
    panels = ((1, 2.0, "schematic: one program, both warpgroups in lockstep, issuing their own copies"),
              (2, 1.0, "schematic: forward v6, a producer warp and two consumer partitions of 64 rows"))
    for ax, (consumers, gemm, what) in zip(axes, panels):
        ev = ws_schedule(n_tiles, stages, consumers, gemm=gemm)
        lanes = ["producer warp", "TMA (copies in flight)", "tensor cores"] + \
                ([f"consumer warpgroup {w}" for w in range(consumers)] if consumers > 1 else
                 ["both warpgroups"])
        for lane, a, b, label, kind in ev:
            lane = "both warpgroups" if consumers == 1 and lane.startswith("consumer") else lane
            y = len(lanes) - 1 - lanes.index(lane)
            y0, h = y - 0.38, 0.76
            if lane.startswith("TMA"):                  # copies overlap in flight: one thin row per tile
                j = int(label.split(",")[0][1:])
                y0, h = y - 0.38 + (j % stages) * 0.76 / stages, 0.76 / stages
            ax.add_patch(Rectangle((a, y0), b - a, h, facecolor=kinds[kind], edgecolor="white",
                                   hatch="//" if kind == "wait" else None, alpha=0.9))
            if b - a >= 0.6 and kind not in ("wait", "rescale"):
                label = label.replace(",", "") if lane.startswith("TMA") else label
                ax.text((a + b) / 2, y0 + h / 2, label if consumers > 1 else label.replace(" (0)", ""),
                        ha="center", va="center", fontsize=6 if lane.startswith("TMA") else 7,
                        color="white" if kind == "gemm" else "black")
        names = [("copies issued (the same warps)" if consumers == 1 and n == "producer warp" else n) for n in lanes]
        ax.set_yticks(range(len(lanes)), list(reversed(names)), fontsize=8)
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        end = max(b for _, _, b, _, _ in ev)
        ax.set_xlim(0, 27)
        ax.set_title(f"{what}: tensor cores busy {100 * tensor_core_busy(ev):.0f} % of the time, "
                     f"done at t = {end:.1f} units", fontsize=9)
    axes[-1].set_xlabel("time (schematic units: a 64-row product 1, a softmax 1, O's rescale (×α) 0.5, a copy of "
                        "K_j and V_j 1.5; not measured)")
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="#8c959f") for c in kinds.values()]
    fig.legend(handles, ["TMA copy", "product on the tensor cores", "softmax (the warpgroup's own units)",
                         "O *= alpha, O /= l (its own units)", "waiting for a tile"], loc="upper center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig
