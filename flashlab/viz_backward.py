"""Figures for notebook 07 (the backward pass and the tiny GPT).  Every function returns a Figure.

Recorded GPU numbers live in ``flashlab/data`` (JSON written by ``scripts/record_part3.py``, with the
machine, versions and date inside); :func:`load_record` returns None when a record is missing, and the
notebook then says so instead of showing anything.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .bench import load_record  # one loader for every recorded run
from . import viz  # noqa: F401  (registers the PNG display of bare Figures in notebooks)

__all__ = ["load_record", "fig_backward_tiles", "fig_loss_curves", "fig_bwd_tflops", "fig_bwd_sweep",
           "fig_atomic_dq"]




# ----------------------------------------------------------------------------
# which tiles each backward kernel visits
# ----------------------------------------------------------------------------

def _tile_kind(i, j, bm, bn, nq, nk, causal):
    """'skip' (every score masked), 'diag' (the diagonal crosses it: needs the mask), or 'full'."""
    if not causal:
        return "full"
    first_q, last_q = i * bm, min((i + 1) * bm, nq) - 1
    first_k, last_k = j * bn, min((j + 1) * bn, nk) - 1
    if first_k > last_q:
        return "skip"
    if last_k <= first_q:
        return "full"
    return "diag"


def fig_backward_tiles(nq=256, nk=256, bm=64, bn=64, causal=True, program=1):
    """The score matrix as tiles, seen by the two backward kernels: one program of the dK/dV kernel owns a
    column of tiles (K_j, V_j stay on chip, Q tiles stream), one program of the dQ kernel owns a row."""
    tr, tc = math.ceil(nq / bm), math.ceil(nk / bn)
    fig = Figure(figsize=(10, 4.6))
    colors = {"full": "#cfe2f3", "diag": "#f9cb9c", "skip": "white"}
    for panel, kernel in enumerate(("dkdv", "dq")):
        ax = fig.add_subplot(1, 2, panel + 1)
        prog = min(program, (tc if kernel == "dkdv" else tr) - 1)
        for i in range(tr):
            for j in range(tc):
                kind = _tile_kind(i, j, bm, bn, nq, nk, causal)
                mine = (j == prog) if kernel == "dkdv" else (i == prog)
                ax.add_patch(Rectangle((j, i), 1, 1, facecolor=colors[kind], edgecolor="gray",
                                       hatch="//" if kind == "skip" else None, lw=0.8))
                if mine and kind != "skip":
                    ax.add_patch(Rectangle((j + 0.06, i + 0.06), 0.88, 0.88, fill=False, edgecolor="C3", lw=2.2))
        if kernel == "dkdv":
            live = [i for i in range(tr) if _tile_kind(i, prog, bm, bn, nq, nk, causal) != "skip"]
            if live:
                ax.annotate("", xy=(prog + 0.5, live[-1] + 0.85), xytext=(prog + 0.5, live[0] + 0.15),
                            arrowprops=dict(arrowstyle="->", color="C3", lw=1.5))
            title = (f"dK/dV kernel: program {prog} keeps K_{prog}, V_{prog} on chip\n"
                     f"and streams Q tiles down its column (red)")
            for j in range(tc):   # keys that no query sees (causal, Nk > Nq)
                if causal and j * bn > nq - 1:
                    ax.text(j + 0.5, tr - 0.5, "dK=dV=0\nstill\nwritten", ha="center", va="center", fontsize=7,
                            color="C3")
        else:
            live = [j for j in range(tc) if _tile_kind(prog, j, bm, bn, nq, nk, causal) != "skip"]
            if live:
                ax.annotate("", xy=(live[-1] + 0.85, prog + 0.5), xytext=(live[0] + 0.15, prog + 0.5),
                            arrowprops=dict(arrowstyle="->", color="C3", lw=1.5))
            title = (f"dQ kernel: program {prog} keeps Q_{prog}, dO_{prog}, L, D on chip\n"
                     f"and streams K/V tiles along its row (red)")
        ax.set_xlim(0, tc)
        ax.set_ylim(tr, 0)
        ax.set_aspect("equal")
        ax.set_xticks(np.arange(tc) + 0.5, [str(j) for j in range(tc)])
        ax.set_yticks(np.arange(tr) + 0.5, [str(i) for i in range(tr)])
        ax.set_xlabel(f"K/V tile j ({bn} keys)")
        ax.set_ylabel(f"Q tile i ({bm} queries)")
        ax.set_title(title, fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, facecolor=colors["full"], edgecolor="gray"),
               Rectangle((0, 0), 1, 1, facecolor=colors["diag"], edgecolor="gray"),
               Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="gray", hatch="//")]
    fig.legend(handles, ["computed, no mask needed", "crosses the diagonal: mask j > i", "skipped (never loaded)"],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ----------------------------------------------------------------------------
# training curves
# ----------------------------------------------------------------------------

def _smooth(xs, k):
    xs = np.asarray(xs, dtype=float)
    if k <= 1 or len(xs) < 2:
        return xs
    c = np.cumsum(np.insert(xs, 0, 0.0))
    out = np.empty_like(xs)
    for i in range(len(xs)):
        lo = max(0, i - k + 1)
        out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
    return out


def fig_loss_curves(runs: dict, title: str = "Training loss, same seed and batches", smooth: int = 1,
                    reference: str | None = None):
    """``runs``: name -> per-step training losses.  Top: the curves (thin: per step; thick: a moving
    average over ``smooth`` steps).  Bottom: each run minus ``reference`` (default: the first run)."""
    names = list(runs)
    reference = reference or names[0]
    fig = Figure(figsize=(7.5, 5.4))
    ax, ax2 = fig.add_subplot(3, 1, (1, 2)), fig.add_subplot(3, 1, 3)
    styles = ["-", "--", ":", "-."]
    for n, name in enumerate(names):
        y = np.asarray(runs[name], dtype=float)
        x = np.arange(len(y))
        if smooth > 1:
            ax.plot(x, y, color=f"C{n}", alpha=0.25, lw=0.8)
        ax.plot(x, _smooth(y, smooth), styles[n % 4], color=f"C{n}", lw=1.8, label=name)
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    ref = np.asarray(runs[reference], dtype=float)
    for n, name in enumerate(names):
        if name == reference:
            continue
        y = np.asarray(runs[name], dtype=float)
        m = min(len(y), len(ref))
        ax2.plot(np.arange(m), y[:m] - ref[:m], color=f"C{n}", lw=1.0, label=f"{name} - {reference}")
    ax2.axhline(0, color="k", lw=0.6)
    ax2.set_xlabel("step")
    ax2.set_ylabel("difference")
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------
# recorded GPU measurements
# ----------------------------------------------------------------------------

def fig_bwd_tflops(rows, dtype="float16", title=None):
    """Backward TFLOP/s against N, one panel per head dim, causal dashed; ``rows``: the record's
    ``bwd_bench`` list (provider, D, causal, N, tflops, status)."""
    ds = sorted({r["D"] for r in rows})
    fig = Figure(figsize=(5.2 * len(ds), 4.6))
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    handles = {}
    for p, d in enumerate(ds):
        ax = fig.add_subplot(1, len(ds), p + 1)
        ns = sorted({r["N"] for r in rows if r["D"] == d})
        for n, prov in enumerate(provs):
            for causal in (False, True):
                pts = sorted((r["N"], r["tflops"]) for r in rows if r["provider"] == prov and r["D"] == d
                             and r["causal"] == causal and r["status"] == "ok" and r.get("dtype", dtype) == dtype)
                if pts:
                    (line,) = ax.plot(*zip(*pts), "o-" if not causal else "s--", color=f"C{n}", ms=4)
                    handles[f"{prov}{', causal' if causal else ''}"] = line
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("sequence length N (16k tokens per batch)")
        ax.set_ylabel("backward TFLOP/s")
        ax.set_title(f"D = {d}, {dtype}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1 + 0.03 * (len(handles) > 8), 1, 1))
    return fig


def fig_bwd_sweep(sweep):
    """The backward tile sweep: TFLOP/s of each candidate configuration per (D, causal); the chosen one
    outlined.  ``sweep``: {"configs": [...], "chosen": {D: config}, "results": [{D, causal, config, tflops}]}."""
    configs = sweep["configs"]
    groups = sorted({(r["D"], r["causal"]) for r in sweep["results"]})
    fig = Figure(figsize=(9, 4))
    ax = fig.add_subplot()
    width = 0.8 / len(configs)
    for c, cfg in enumerate(configs):
        xs, ys, chosen = [], [], []
        for g, (d, causal) in enumerate(groups):
            val = [r["tflops"] for r in sweep["results"] if r["D"] == d and r["causal"] == causal and r["config"] == cfg]
            if val:
                xs.append(g + (c - (len(configs) - 1) / 2) * width)
                ys.append(val[0])
                chosen.append(sweep["chosen"].get(str(d)) == cfg)
        bars = ax.bar(xs, ys, width, color=f"C{c}", label=cfg)
        for b, ch in zip(bars, chosen):
            if ch:
                b.set_edgecolor("k")
                b.set_linewidth(2)
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), "chosen", ha="center", va="bottom",
                        fontsize=7, rotation=90)
    ax.set_xticks(range(len(groups)), [f"D={d}, {'causal' if c else 'non-causal'}" for d, c in groups])
    ax.set_ylabel("backward TFLOP/s (fp16, N = 16384)")
    ax.set_ylim(0, max(r["tflops"] for r in sweep["results"]) * 1.25)
    gpu = sweep.get("machine", {}).get("gpu", "GPU")
    ax.set_title(f"Tile sweep of the backward on {gpu}, fp16, N = 16384, recorded {sweep.get('date', '')}\n"
                 "(dK/dV tile / dQ tile, warps, stages)", fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def fig_atomic_dq(atomic, title=None, atomic_label="atomic dQ"):
    """Left: share of dQ elements whose bits differ between identical runs (two kernels vs atomic dQ).
    Right: backward TFLOP/s of each.  ``atomic``: the record's ``atomic`` dict; ``title``: the figure's
    (device, dtype, when); ``atomic_label``: e.g. "atomic dQ (acq_rel)" for the memory ordering it ran."""
    det, tim = atomic["determinism"], atomic["timing"]
    fig = Figure(figsize=(10, 4))
    ax = fig.add_subplot(1, 2, 1)
    labels = [f"D={r['D']}{' c' if r['causal'] else ''}\nN={r['N']}" for r in det]
    x = np.arange(len(det))
    a = [100 * r["canonical_differ"] for r in det]
    b = [100 * r["atomic_differ"] for r in det]
    ax.bar(x - 0.2, a, 0.4, label="two kernels (canonical)")
    ax.bar(x + 0.2, b, 0.4, label=atomic_label, color="C3")
    for xi, (va, vb) in enumerate(zip(a, b)):
        ax.text(xi - 0.2, va, f"{va:.2g}" if va else "0", ha="center", va="bottom", fontsize=7)
        ax.text(xi + 0.2, vb, f"{vb:.2g}", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, max(b + a + [1e-3]) * 1.35)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("% of dQ elements whose bits differ\nbetween identical runs")
    ax.set_title(f"Bitwise repeatability over {det[0]['runs']} runs", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    ax2 = fig.add_subplot(1, 2, 2)
    labels = [f"D={r['D']}{' c' if r['causal'] else ''}\nN={r['N']}" for r in tim]
    x = np.arange(len(tim))
    tc = [r.get("canonical_tflops", math.nan) for r in tim]
    ta = [r.get("atomic_tflops", math.nan) for r in tim]
    ax2.bar(x - 0.2, tc, 0.4, label="two kernels (canonical)")
    ax2.bar(x + 0.2, ta, 0.4, label=atomic_label, color="C3")
    ax2.set_ylim(0, np.nanmax(tc + ta + [1.0]) * 1.3)
    ax2.set_xticks(x, labels, fontsize=7)
    ax2.set_ylabel("backward TFLOP/s (kernels only)")
    ax2.set_title("Speed (c: causal; fp16, 16k tokens)", fontsize=10)
    ax2.legend(fontsize=8, loc="upper left")
    ax2.grid(True, axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
