"""Figures for the notebooks.  Every function returns a matplotlib Figure.

They use matplotlib's object API (no pyplot state), so they work headless, in
tests, and inside widgets; ``interact_*`` wrap them in ipywidgets sliders.  A
notebook always shows a static figure before a widget, so that an executed copy
(or an HTML/PDF export) reads without a live kernel; the notebooks in the
repository are stored without outputs, so run them to see the figures.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .. import reference as R

# Ceilings measured on the H200 the course's numbers come from (see the README's benchmark record).
H200_BANDWIDTH = 4.3e12      # bytes/s, device-to-device copy (read + write)
H200_MATMUL = 790e12         # FLOP/s, 8192^3 bf16 matmul on random data


def _finish_loglog(fig, ax, xlabel, ylabel, title, legend_loc="best", legend_size=8):
    """The common ending of the course's log-scale line plots: labels, legend, grid, layout."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size, loc=legend_loc)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------
# 01: the N^2 wall
# ----------------------------------------------------------------------------

def naive_bytes(N, D, B=1, H=1, elem=2):
    """HBM bytes of a naive forward: read Q, K; write S; read S; write P; read P, V; write O."""
    N = np.asarray(N, dtype=float)
    return elem * B * H * (4 * N * D + 4 * N * N)


def flash_bytes(N, D, B=1, H=1, elem=2):
    """HBM bytes of an ideal fused forward: read Q, K, V once, write O (and a float32 LSE)."""
    N = np.asarray(N, dtype=float)
    return elem * B * H * 4 * N * D + 4 * B * H * N


def attention_flops(N, D, B=1, H=1):
    N = np.asarray(N, dtype=float)
    return 4.0 * B * H * N * N * D


def fig_memory_vs_n(ns, D=64, B=1, H=16, elem=2, measured=None):
    """Extra memory of naive attention (S and P kept for the backward) vs a fused kernel, against N.

    ``measured``: optional dict name -> list of bytes measured for ``ns`` on a GPU.
    """
    ns = np.asarray(ns, dtype=float)
    fig = Figure(figsize=(6.4, 4))
    ax = fig.add_subplot()
    ax.loglog(ns, 2 * elem * B * H * ns ** 2 / 2**30, "--", color="C3",
              label=f"S and P: 2·B·H·N²·{elem} bytes (model)")
    ax.loglog(ns, (elem * B * H * ns * D + 4 * B * H * ns) / 2**30, "--", color="C0",
              label=f"O and LSE: B·H·N·({elem}·D + 4) bytes (model)")
    for i, (name, vals) in enumerate((measured or {}).items()):
        ax.loglog(ns[:len(vals)], np.asarray(vals) / 2**30, "o-", color=f"C{i + 1}", label=f"{name} (measured)")
    h200 = 141e9 / 2**30                                  # 141 GB (10^9 bytes) = 131 GiB
    ax.axhline(h200, color="gray", lw=0.8)
    ax.text(ns[0], h200 * 1.15, f"one H200: 141 GB = {h200:.0f} GiB", color="gray", fontsize=8)
    return _finish_loglog(fig, ax, "sequence length N", "GiB above the inputs",
                          f"Memory of one attention call, B={B}, H={H}, D={D}, {8 * elem}-bit")


def fig_roofline(points, bandwidth=H200_BANDWIDTH, peak=H200_MATMUL, title="Roofline (H200)"):
    """Place kernels on a roofline. ``points``: dict name -> (FLOPs, bytes) or (FLOPs, bytes, measured FLOP/s)."""
    fig = Figure(figsize=(6.4, 4))
    ax = fig.add_subplot()
    ai = np.logspace(-1, 4, 200)
    ax.loglog(ai, np.minimum(peak, bandwidth * ai) / 1e12, color="k", lw=1.5)
    ridge = peak / bandwidth
    ax.axvline(ridge, color="gray", lw=0.8, ls=":")
    ax.text(ridge * 1.1, peak / 1e12 / 30, f"ridge: {ridge:.0f} FLOP/byte", fontsize=8, color="gray")
    for i, (name, pt) in enumerate(points.items()):
        flops, nbytes = pt[0], pt[1]
        x = flops / nbytes
        bound = min(peak, bandwidth * x)
        ax.plot([x], [bound / 1e12], "o", color=f"C{i}", label=f"{name}: {x:.0f} FLOP/B, bound {bound / 1e12:.0f} TFLOP/s")
        if len(pt) > 2 and pt[2]:
            ax.plot([x], [pt[2] / 1e12], "x", color=f"C{i}", ms=9)
    measured = [(i, name, pt) for i, (name, pt) in enumerate(points.items()) if len(pt) > 2 and pt[2]]
    if len(measured) > 1:   # on a log axis, kernels within a few per cent overlap: read them off bars
        inset = ax.inset_axes([0.07, 0.5, 0.36, 0.4])
        ys = np.arange(len(measured))
        inset.barh(ys, [pt[2] / 1e12 for _, _, pt in measured], color=[f"C{i}" for i, _, _ in measured])
        for y, (_, _, pt) in zip(ys, measured):
            bound = min(peak, bandwidth * pt[0] / pt[1]) / 1e12
            inset.plot([bound, bound], [y - 0.4, y + 0.4], color="k", lw=1)
            inset.text(pt[2] / 1e12, y, f" {pt[2] / 1e12:.0f}", va="center", fontsize=6)
        inset.set_yticks(ys)
        inset.set_yticklabels([name.split(" (")[0] for _, name, _ in measured], fontsize=6)
        inset.invert_yaxis()
        inset.tick_params(axis="x", labelsize=6)
        inset.set_xlim(0, peak / 1e12 * 1.15)
        inset.set_title("measured (bars) vs bound (|), TFLOP/s", fontsize=6)
    return _finish_loglog(fig, ax, "arithmetic intensity (FLOP per HBM byte)", "TFLOP/s", title,
                          legend_loc="lower right", legend_size=7)


def fig_op_breakdown(times_ms: dict, fused_ms: float | None = None, title="Where the time goes"):
    """Horizontal bars: per-operator time of naive attention, and one fused call beside it."""
    names = list(times_ms)
    vals = [times_ms[n] for n in names]
    fig = Figure(figsize=(6.4, 0.45 * (len(names) + 3) + 1))
    ax = fig.add_subplot()
    y = np.arange(len(names))
    ax.barh(y, vals, color="C3")
    labels = list(names)
    if fused_ms is not None:
        ax.barh([len(names) + 0.5], [sum(vals)], color="C3", alpha=0.4)
        ax.barh([len(names) + 1.5], [fused_ms], color="C0")
        labels += ["naive total", "one fused call"]
        y = np.concatenate([y, [len(names) + 0.5, len(names) + 1.5]])
    ax.set_yticks(y)
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------
# 02: online softmax
# ----------------------------------------------------------------------------

def online_softmax_trace(x_row, block_size):
    """(m, l) after each block of one row: the states the stepper shows."""
    m, l = np.array([-np.inf]), np.array([0.0])
    states = []
    for j in range(0, len(x_row), block_size):
        m, l = R.online_softmax_update(m, l, np.asarray(x_row[j:j + block_size])[None, :])
        states.append((float(m[0]), float(l[0]), j + block_size))
    return states


def fig_online_softmax(x_row, block_size=4, step=None):
    """One row streamed in blocks: what has been seen, the running max m and sum l, and the
    partial softmax e^(x - m)/l against the true one.  ``step``: blocks seen (default: all)."""
    x_row = np.asarray(x_row, dtype=float)
    states = online_softmax_trace(x_row, block_size)
    step = len(states) if step is None else max(1, min(step, len(states)))
    m, l, seen = states[step - 1]
    seen = min(seen, len(x_row))
    fig = Figure(figsize=(8, 4.2))
    ax1, ax2 = fig.add_subplot(2, 2, (1, 2)), fig.add_subplot(2, 2, 3)
    ax3 = fig.add_subplot(2, 2, 4)
    idx = np.arange(len(x_row))
    ax1.bar(idx[:seen], x_row[:seen], color="C0", label="seen")
    ax1.bar(idx[seen:], x_row[seen:], color="0.85", label="not yet read")
    for j in range(0, len(x_row), block_size):
        ax1.axvline(j - 0.5, color="gray", lw=0.5)
    ax1.axhline(m, color="C3", ls="--", label=f"running max m = {m:.2f}")
    ax1.set_title(f"after block {step} of {len(states)}:  m = {m:.3f},  l = {l:.3f}")
    ax1.legend(fontsize=7, loc="upper right")
    ms = [s[0] for s in states[:step]]
    ls = [s[1] for s in states[:step]]
    ax2.plot(range(1, step + 1), ms, "o-", color="C3", label="m")
    ax2b = ax2.twinx()
    ax2b.plot(range(1, step + 1), ls, "s-", color="C2", label="l")
    ax2.set_xlabel("blocks read")
    ax2.set_ylabel("m (running max)", color="C3")
    ax2b.set_ylabel("ℓ (running sum)", color="C2")
    ax2.set_xlim(0.5, len(states) + 0.5)
    true = np.exp(x_row - x_row.max())
    true /= true.sum()
    partial = np.exp(x_row[:seen] - m) / l
    ax3.bar(idx, true, color="0.8", label="softmax(x)")
    ax3.plot(idx[:seen], partial, "o", color="C0", ms=3, label="e^(x - m)/l so far")
    ax3.set_title("partial result vs the true softmax", fontsize=9)
    ax3.legend(fontsize=7)
    fig.tight_layout()
    return fig


def interact_online_softmax(x_row, block_size=4):
    """A slider over blocks (ipywidgets), redrawing :func:`fig_online_softmax`."""
    import ipywidgets as widgets
    from IPython.display import display
    n_blocks = math.ceil(len(x_row) / block_size)
    out = widgets.Output()

    def show(step):
        out.clear_output(wait=True)
        with out:
            display(fig_online_softmax(x_row, block_size, step))

    slider = widgets.IntSlider(value=1, min=1, max=n_blocks, description="blocks read")
    slider.observe(lambda ch: show(ch["new"]), names="value")
    show(1)
    return widgets.VBox([slider, out])


# ----------------------------------------------------------------------------
# 03: tiles
# ----------------------------------------------------------------------------

def tile_schedule(nq, nk, bq, bk, order="fa2", causal=False):
    """The (Q tile, K/V tile) pairs in the order a loop visits them; causal skips tiles above the diagonal."""
    tr, tc = math.ceil(nq / bq), math.ceil(nk / bk)

    def live(i, j):
        return not causal or j * bk <= min((i + 1) * bq, nq) - 1

    if order == "fa2":
        return [(i, j) for i in range(tr) for j in range(tc) if live(i, j)]
    return [(i, j) for j in range(tc) for i in range(tr) if live(i, j)]


def fig_tiles(nq=256, nk=256, bq=64, bk=64, step=None, order="fa2", causal=False):
    """The score matrix S as tiles: done, on chip now, skipped (causal), and what sits in SRAM."""
    sched = tile_schedule(nq, nk, bq, bk, order, causal)
    tr, tc = math.ceil(nq / bq), math.ceil(nk / bk)
    step = len(sched) if step is None else max(1, min(step, len(sched)))
    cur = sched[step - 1]
    done = set(sched[:step - 1])
    live = set(sched)
    fig = Figure(figsize=(5.2, 5.2))
    ax = fig.add_subplot()
    for i in range(tr):
        for j in range(tc):
            if (i, j) == cur:
                color = "C1"
            elif (i, j) in done:
                color = "C0"
            elif (i, j) not in live:
                color = "white"
            else:
                color = "0.9"
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor=color, edgecolor="gray", hatch="//" if (i, j) not in live else None))
    ax.set_xlim(0, tc)
    ax.set_ylim(tr, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"K/V tile j ({bk} keys each)")
    ax.set_ylabel(f"Q tile i ({bq} queries each)")
    name = "FA2: outer loop over Q tiles" if order == "fa2" else "FA1: outer loop over K/V tiles"
    state = (f"on chip: Q_{cur[0]}, K_{cur[1]}, V_{cur[1]}, and (m, l, O~) of Q_{cur[0]}" if order == "fa2"
             else f"on chip: K_{cur[1]}, V_{cur[1]}; Q_{cur[0]}, O_{cur[0]}, m, l read from and written to HBM")
    ax.set_xticks(np.arange(tc) + 0.5, [str(j) for j in range(tc)])
    ax.set_yticks(np.arange(tr) + 0.5, [str(i) for i in range(tr)])
    ax.set_title(f"{name}, step {step}/{len(sched)}" + ("\n(hatched: skipped by causal masking)" if causal else "")
                 + f"\n{state}", fontsize=8)
    fig.tight_layout()
    return fig


def interact_tiles(nq=256, nk=256, bq=64, bk=64, causal=False):
    import ipywidgets as widgets
    from IPython.display import display
    out = widgets.Output()
    order = widgets.ToggleButtons(options=[("FA2 (Q outer)", "fa2"), ("FA1 (K/V outer)", "fa1")])
    caus = widgets.Checkbox(value=causal, description="causal")
    slider = widgets.IntSlider(value=1, min=1, max=len(tile_schedule(nq, nk, bq, bk, "fa2", causal)),
                               description="step")

    def redraw(*_):
        slider.max = len(tile_schedule(nq, nk, bq, bk, order.value, caus.value))
        out.clear_output(wait=True)
        with out:
            display(fig_tiles(nq, nk, bq, bk, slider.value, order.value, caus.value))

    for w in (order, caus, slider):
        w.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([order, caus]), slider, out])


def hbm_traffic(N, D, bq, bk, elem=2):
    """Modelled HBM bytes of one head's forward for naive, FA1 and FA2 (the tiles' loads and stores)."""
    N = np.asarray(N, dtype=float)
    tr, tc = np.ceil(N / bq), np.ceil(N / bk)
    naive = elem * (4 * N * D + 4 * N * N)
    # FA1: K, V once; per K/V tile: read all of Q, read and write O, read and write m and l (fp32)
    fa1 = elem * 2 * N * D + tc * (elem * 3 * N * D + 4 * 4 * N)
    # FA2: Q once, O once, LSE once; per Q tile: read all of K and V
    fa2 = elem * 2 * N * D + 4 * N + tr * elem * 2 * N * D
    return {"naive": naive, "FA1": fa1, "FA2": fa2}


def fig_hbm_traffic(ns, D=64, bq=128, bk=64, elem=2):
    ns = np.asarray(ns, dtype=float)
    t = hbm_traffic(ns, D, bq, bk, elem)
    fig = Figure(figsize=(6.4, 4))
    ax = fig.add_subplot()
    for name, style in (("naive", "C3"), ("FA1", "C2"), ("FA2", "C0")):
        ax.loglog(ns, t[name] / 2**20, "o-", color=style, ms=3, label=name)
    ax.loglog(ns, elem * 4 * ns * D / 2**20, "k:", label="lower bound: read Q, K, V, write O")
    return _finish_loglog(fig, ax, "sequence length N", "MiB moved to/from HBM (one head)",
                          f"Modelled HBM traffic, D={D}, B_r={bq}, B_c={bk}, {8 * elem}-bit")


def fig_bars(values: dict, ylabel: str, title: str = ""):
    """A plain bar chart (for measured timings)."""
    fig = Figure(figsize=(6, 3.2))
    ax = fig.add_subplot()
    names = list(values)
    ax.bar(names, [values[n] for n in names], color=[f"C{i}" for i in range(len(names))])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    for i, n in enumerate(names):
        ax.text(i, values[n], f"{values[n]:.3g}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    return fig


def fig_error_vs(xs, errs: dict, xlabel: str, title: str = ""):
    """Error curves (log y), e.g. the diag(l)^-1 pitfall against the number of tiles."""
    fig = Figure(figsize=(6, 3.6))
    ax = fig.add_subplot()
    for name, e in errs.items():
        e = np.asarray(e, dtype=float)
        ax.semilogy(xs, np.where(np.isfinite(e), np.maximum(e, 1e-18), np.nan), "o-", label=name)
    return _finish_loglog(fig, ax, xlabel, "max |error| vs naive", title)


# ----------------------------------------------------------------------------
# notebooks: show a bare Figure as a PNG
# ----------------------------------------------------------------------------

def _png(fig: Figure) -> bytes:
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _register_ipython_display() -> None:
    """Let ``display(fig)`` (and a cell ending in a figure) render these pyplot-free Figures."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    ip.display_formatter.formatters["image/png"].for_type(Figure, _png)


_register_ipython_display()


# ---------------------------------------------------------------- notebook 06: causal stages and versions

def fig_causal_stages(nq=300, nk=300, block_m=64, block_n=32, causal=True):
    """Tiles of S as the forward kernels v2/v3 visit them: unmasked, masked (diagonal / ragged), skipped."""
    from ..kernels.bounds import tile_kinds
    kinds = np.array(tile_kinds(nq, nk, block_m, block_n, causal))
    fig = Figure(figsize=(5.4, 5.0))
    ax = fig.add_subplot()
    colors = {0: "white", 1: "C0", 2: "C1"}
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            r0, c0 = i * block_m, j * block_n
            ax.add_patch(Rectangle((c0, r0), min(block_n, nk - c0), min(block_m, nq - r0),
                                   facecolor=colors[int(kinds[i, j])], edgecolor="0.6", lw=0.5,
                                   hatch="//" if kinds[i, j] == 0 else None))
    ax.set_xlim(0, nk)
    ax.set_ylim(nq, 0)
    if causal:
        ax.plot([0, min(nq, nk)], [0, min(nq, nk)], color="k", lw=1)
    counts = [int((kinds == k).sum()) for k in (1, 2, 0)]
    ax.set_xlabel(f"key j (tiles of block_n = {block_n})")
    ax.set_ylabel(f"query i (tiles of block_m = {block_m})")
    ax.set_title(f"Nq={nq}, Nk={nk}: {counts[0]} unmasked (blue), {counts[1]} masked (orange), "
                 f"{counts[2]} skipped", fontsize=8)
    fig.tight_layout()
    return fig


def fig_tflops_vs_n(series: dict, seqlens, title="", ceiling=None):
    """TFLOP/s against N, one line per name in ``series`` ({name: [TFLOP/s per N]})."""
    fig = Figure(figsize=(6.0, 3.8))
    ax = fig.add_subplot()
    for name, ys in series.items():
        ax.plot(seqlens, ys, marker="o", label=name)
    if ceiling:
        ax.axhline(ceiling[1], color="0.5", ls="--", lw=1)
        ax.text(seqlens[0], ceiling[1] * 0.97, ceiling[0], fontsize=7, va="top", color="0.4")
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [str(n) for n in seqlens])
    ax.set_ylim(0, None)
    ax.set_xlabel("sequence length N (16k tokens per batch)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------
# the class leaderboard (flashlab.grader.ranking)
# ----------------------------------------------------------------------------

def fig_leaderboard(board, title: str = ""):
    """A leaderboard (``flashlab.grader.ranking.Leaderboard``) as bars: one panel per exercise, the
    students' geometric-mean TFLOP/s in rank order, then every student who does not rank, marked with why
    (no bar: failed, timed out, wrong at a timed shape, ...); the references as horizontal lines."""
    exercises = list(dict.fromkeys(e.exercise for e in board.entries))
    n = max(1, len(exercises))
    widths = [max(4, sum(e.kind == "student" for e in board.entries if e.exercise == ex)) for ex in exercises] or [4]
    fig = Figure(figsize=(min(14.0, 2.0 + 0.55 * sum(widths) + 1.6 * n), 4.6))
    axes = fig.subplots(1, n, squeeze=False, width_ratios=widths)[0]
    from ..grader.ranking import REFERENCE_LABELS
    known = list(REFERENCE_LABELS.values())
    colors = ["#2ca02c", "#d62728", "#7f7f7f", "#9467bd", "#8c564b"]     # one per reference, in every panel
    for ax, ex in zip(axes, exercises):
        labels = board.shape_labels.get(ex, [])
        students = [e for e in board.entries if e.exercise == ex and e.kind == "student"]
        refs = [e for e in board.entries if e.exercise == ex and e.kind == "reference"]
        scores = [e.score(labels) if e.status == "ranked" else None for e in students]
        top = max([s for s in scores if s] + [r.score(labels) or 0 for r in refs] + [1.0])
        xs = np.arange(len(students))
        ax.bar(xs, [s or 0 for s in scores], color="#1f77b4", width=0.7)
        for x, e, s in zip(xs, students, scores):
            if s:
                ax.text(x, s, f"{s:.0f}", ha="center", va="bottom", fontsize=7)
            else:
                ax.text(x, top * 0.02, e.status, rotation=90, ha="center", va="bottom", fontsize=7,
                        color="#d62728")
        for i, r in enumerate(refs):
            s = r.score(labels)
            c = colors[(known.index(r.name) if r.name in known else len(known) + i) % len(colors)]
            if s:
                ax.axhline(s, color=c, ls="--", lw=1.2, label=f"{r.name}: {s:.0f}")
        ax.set_xticks(xs, [(f"{e.rank}. " if e.rank else "") + e.name[:18] for e in students],
                      rotation=35, ha="right", fontsize=8)
        ax.set_xlim(-0.6, max(len(students), 3) - 0.4)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("TFLOP/s (geometric mean)")
        ax.set_title(f"{ex} ({len(labels)} shapes)", fontsize=9)
        if refs:
            ax.legend(fontsize=7, loc="upper right")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title or ("Leaderboard, fp16, 16k tokens" + (f" — {board.note}" if board.note else "")), fontsize=9)
    fig.tight_layout()
    return fig
