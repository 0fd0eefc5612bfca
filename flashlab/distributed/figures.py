"""Notebook 09's figures; each function returns a matplotlib Figure (object API, no pyplot state)."""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Polygon, Rectangle

from .. import viz as _viz  # noqa: F401  (registers the PNG display of these pyplot-free Figures in IPython)
from . import cost as C
from . import layout as L

__all__ = ["fig_programs_vs_sms", "fig_split_merge", "fig_block_table", "fig_ring_schedule",
           "fig_overlap", "fig_cost_model", "fig_ring_timeline", "fig_ring_scaling"]

_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _color(i):
    return _COLORS[i % len(_COLORS)]


# ----------------------------------------------------------------------------
# decoding: programs vs SMs, the split and the merge, the block table
# ----------------------------------------------------------------------------

def fig_programs_vs_sms(B=8, H_kv=8, splits=(1, 4), n_sms=132, cols=12):
    """The SMs a decode step keeps busy: one program per (sequence, K/V head, split)."""
    fig = Figure(figsize=(4.2 * len(splits), 3.4))
    for a, s in enumerate(splits):
        ax = fig.add_subplot(1, len(splits), a + 1)
        progs = B * H_kv * s
        waves = math.ceil(progs / n_sms)
        busy = [min(n_sms, max(0, progs - w * n_sms)) for w in range(waves)]
        rows = math.ceil(n_sms / cols)
        for i in range(n_sms):
            r, c = divmod(i, cols)
            on = i < busy[0]
            ax.add_patch(Rectangle((c, rows - 1 - r), 0.9, 0.9, color=_color(0) if on else "#e6e6e6"))
        ax.set_xlim(-0.2, cols)
        ax.set_ylim(-0.2, rows)
        ax.set_aspect("equal")
        ax.axis("off")
        used = sum(busy) / (waves * n_sms)
        ax.set_title(f"{B}x{H_kv} (B x H_kv) x {s} split{'s' if s > 1 else ''} = {progs} programs\n"
                     f"{n_sms} SMs, {waves} wave{'s' if waves > 1 else ''}: {used:.0%} of SM slots busy",
                     fontsize=9)
    fig.suptitle("One query row per sequence: the grid is B·H_kv programs (one SM each)", fontsize=10)
    fig.tight_layout()
    return fig


def fig_split_merge(nk=4096, splits=4):
    """The keys of one (sequence, head) cut into splits; each gives (O_s, LSE_s); one merge."""
    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot(1, 1, 1)
    w = 1.0 / splits
    for s in range(splits):
        ax.add_patch(Rectangle((s * w, 0.7), w * 0.97, 0.18, color=_color(s)))
        ax.text((s + 0.5) * w, 0.79, f"keys {s * nk // splits}..{(s + 1) * nk // splits - 1}",
                ha="center", va="center", fontsize=8, color="white")
        ax.add_patch(Rectangle((s * w + 0.02, 0.35), w * 0.9, 0.15, facecolor="white", edgecolor=_color(s)))
        ax.text((s + 0.5) * w, 0.425, f"program {s}: $O_{s}$, $LSE_{s}$", ha="center", va="center", fontsize=8)
        ax.add_patch(FancyArrowPatch(((s + 0.5) * w, 0.69), ((s + 0.5) * w, 0.51), arrowstyle="->",
                                     mutation_scale=10))
        ax.add_patch(FancyArrowPatch(((s + 0.5) * w, 0.34), (0.5, 0.17), arrowstyle="->", mutation_scale=10,
                                     color="gray"))
    ax.add_patch(Rectangle((0.25, 0.02), 0.5, 0.15, facecolor="#f4f4f4", edgecolor="black"))
    ax.text(0.5, 0.095, r"merge: $LSE=\log\sum_s e^{LSE_s}$,  $O=\sum_s e^{LSE_s-LSE}\,O_s$",
            ha="center", va="center", fontsize=9)
    ax.text(0.0, 0.95, "one query row q (a program per split, all in parallel)", fontsize=9)
    ax.set_xlim(-0.01, 1.01)
    ax.set_ylim(0, 1)
    ax.axis("off")
    fig.tight_layout()
    return fig


def fig_block_table(block_table, seqlens, block_size, num_blocks=None):
    """A paged K/V cache: each sequence's logical blocks (left) and where they sit in the pool (right).

    ``block_table[b][m]`` = physical block of logical block m of sequence b (vLLM's page table)."""
    bt = [list(r) for r in block_table]
    num_blocks = num_blocks or (max(max(r) for r in bt) + 1)
    fig = Figure(figsize=(9, 0.6 * len(bt) + 2.0))
    ax = fig.add_subplot(1, 1, 1)
    pool_y = -1.6
    for b, (row, n) in enumerate(zip(bt, seqlens)):
        used = -(-n // block_size)
        y = len(bt) - 1 - b
        ax.text(-0.3, y + 0.4, f"seq {b} ({n} keys)", ha="right", va="center", fontsize=8)
        for m in range(used):
            fill = min(block_size, n - m * block_size) / block_size
            ax.add_patch(Rectangle((m, y), 0.9, 0.8, facecolor="white", edgecolor=_color(b)))
            ax.add_patch(Rectangle((m, y), 0.9 * fill, 0.8, color=_color(b), alpha=0.7))
            ax.text(m + 0.45, y + 0.4, f"{row[m]}", ha="center", va="center", fontsize=8)
    scale = max(max(len(r) for r in bt), 1) / num_blocks * 1.6
    owner = {}
    for b, (row, n) in enumerate(zip(bt, seqlens)):
        for m in range(-(-n // block_size)):
            owner[row[m]] = (b, m)
    for p in range(num_blocks):
        x = p * scale
        if p in owner:
            b, m = owner[p]
            ax.add_patch(Rectangle((x, pool_y), 0.9 * scale, 0.8, color=_color(b), alpha=0.7))
            ax.text(x + 0.45 * scale, pool_y + 0.4, f"{b},{m}", ha="center", va="center", fontsize=7)
        else:
            ax.add_patch(Rectangle((x, pool_y), 0.9 * scale, 0.8, facecolor="white", edgecolor="#bbbbbb"))
        ax.text(x + 0.45 * scale, pool_y - 0.25, str(p), ha="center", va="center", fontsize=6, color="gray")
    ax.text(-0.3, pool_y + 0.4, "physical pool", ha="right", va="center", fontsize=8)
    ax.set_xlim(-3.2, max(num_blocks * scale, max(len(r) for r in bt)) + 0.2)
    ax.set_ylim(pool_y - 0.6, len(bt) + 0.3)
    ax.axis("off")
    ax.set_title(f"Logical blocks of {block_size} keys (number: the physical block, from block_table); "
                 f"pool cells: (seq, logical block)", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------
# the ring: which tiles each rank computes at each step; balance
# ----------------------------------------------------------------------------

def fig_ring_schedule(world=4, layout="zigzag", causal=True):
    """One panel per ring step: the whole score matrix in chunks (queries down, keys across), each
    computed tile coloured by the rank that computes it (a triangle: the diagonal, with the mask);
    the last panel: work per rank, this layout against the other."""
    nc = L.num_chunks(world, layout)
    n_local = 2 * nc                               # rows per shard: any even count; chunks are what we draw
    n = n_local * world
    c = n // nc
    fig = Figure(figsize=(2.3 * (world + 1), 2.8))
    for step in range(world):
        ax = fig.add_subplot(1, world + 1, step + 1)
        for rank in range(world):
            pq = L.positions(rank, world, n, layout)
            pk = L.positions(L.step_source(rank, world, step), world, n, layout)
            for t in L.step_plan(rank, world, step, n_local, layout, causal):
                qs, ks = pq[t.q], pk[t.kv]
                for qi in sorted({p // c for p in qs}):
                    for kj in sorted({p // c for p in ks}):
                        if t.causal and kj != qi:
                            continue      # the masked tile's other chunk pairs are all masked
                        if t.causal:
                            ax.add_patch(Polygon([(kj, qi), (kj, qi + 1), (kj + 1, qi + 1)], color=_color(rank)))
                        else:
                            ax.add_patch(Rectangle((kj, qi), 1, 1, color=_color(rank)))
        ax.set_xlim(0, nc)
        ax.set_ylim(nc, 0)
        ax.set_aspect("equal")
        ax.set_xticks(np.arange(nc) + 0.5, [str(i) for i in range(nc)], fontsize=6)
        ax.set_yticks(np.arange(nc) + 0.5, [str(i) for i in range(nc)], fontsize=6)
        ax.grid(False)
        for i in range(nc + 1):
            ax.axhline(i, color="white", lw=0.5)
            ax.axvline(i, color="white", lw=0.5)
        ax.set_title(f"step {step}", fontsize=9)
        if step == 0:
            ax.set_ylabel("query chunk", fontsize=8)
        ax.set_xlabel("key chunk", fontsize=8)
    ax = fig.add_subplot(1, world + 1, world + 1)
    other = "contiguous" if layout == "zigzag" else "zigzag"
    x = np.arange(world)
    for j, lay in enumerate((layout, other)):
        work = [sum(L.step_work(r, world, s, lay, causal) for s in range(world)) for r in range(world)]
        ax.bar(x + 0.4 * j - 0.2, work, 0.4, label=lay, color=[_color(r) for r in range(world)],
               alpha=1.0 if j == 0 else 0.35, edgecolor="black" if j else None)
    ax.set_xticks(x, [f"rank {r}" for r in range(world)], fontsize=7)
    ax.set_ylabel("work (local blocks)", fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title("work per rank", fontsize=9)
    fig.suptitle(f"Ring attention, {layout} layout, {world} ranks ({'causal' if causal else 'non-causal'}): "
                 f"colour = the rank that computes the tile", fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------
# the overlap condition and the cost model
# ----------------------------------------------------------------------------

def fig_overlap(H=32, H_kv=8, D=128, elem=2, causal=True, m: C.Machine = C.H200_NODE, measured=None):
    """One ring step's compute and K/V transfer time against the rows per rank n, NVLink and IB;
    the transfer hides where compute is above it (n >= n*).  ``measured``: optional {n: seconds} of
    the step's kernel on one GPU (scripts/ring_bench.py), drawn as points."""
    ns = np.logspace(7, 17, 60, base=2)
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    tc = [C.ring_step(n, 1, H, H_kv, D, elem, causal, m.nvlink, m.flops)[0] for n in ns]
    ax.loglog(ns, np.array(tc) * 1e6, color="black", label=f"compute, {m.flops / 1e12:.0f} TFLOP/s")
    for bw, name, col in ((m.nvlink, "NVLink", _color(0)), (m.ib, "InfiniBand", _color(3))):
        tm = [C.ring_step(n, 1, H, H_kv, D, elem, causal, bw, m.flops)[1] for n in ns]
        star = C.overlap_rows(bw, m.flops, H, H_kv, elem, causal)
        ax.loglog(ns, np.array(tm) * 1e6, color=col, label=f"K/V transfer, {name} {bw / 1e9:.0f} GB/s")
        ax.axvline(star, color=col, ls=":", lw=1)
        ax.text(star * 1.08, 0.03, f"n* = {star:,.0f}", color=col, fontsize=8, rotation=90, va="bottom",
                transform=ax.get_xaxis_transform())
    if measured:
        xs = sorted(measured)
        ax.loglog(xs, [measured[x] * 1e6 for x in xs], "o", color="black", ms=4, label="measured step (one GPU)")
    ax.set_xlabel("rows per rank n = N / W")
    ax.set_ylabel("time per ring step (µs)")
    ax.set_title(f"Overlap: transfer hides under compute for n ≥ n*\n(B cancels; H = {H}, H_kv = {H_kv}, "
                 f"D = {D}, {'causal zigzag' if causal else 'non-causal'}, {8 * elem}-bit)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def fig_cost_model(seqlens=(131072, 1048576), H=32, H_kv=8, D=128, elem=2, causal=True,
                   m: C.Machine = C.H200_NODE):
    """Forward time of one attention layer against the number of GPUs W = 2..1024: ideal (one GPU's
    compute / W), ring (zigzag), all-to-all (Ulysses); where the machines stop."""
    worlds = [2 ** i for i in range(1, 11)]
    fig = Figure(figsize=(6.6 * len(seqlens), 4.4))
    for a, N in enumerate(seqlens):
        ax = fig.add_subplot(1, len(seqlens), a + 1)
        s = C.scaling(N, worlds, m, H=H, H_kv=H_kv, D=D, elem=elem, causal=causal)
        ax.loglog(worlds, np.array(s["ideal"]) * 1e3, "k--", lw=1, label="ideal: compute / W")
        ax.loglog(worlds, np.array(s["ring"]) * 1e3, "o-", color=_color(0), label="ring (zigzag)")
        uw = [w for w, t in zip(worlds, s["ulysses"]) if t is not None]
        ut = [t for t in s["ulysses"] if t is not None]
        ax.loglog(uw, np.array(ut) * 1e3, "s-", color=_color(1), label="all-to-all (Ulysses)")
        ax.axvline(m.gpus_per_node, color="gray", lw=1)
        ax.text(m.gpus_per_node * 1.05, s["ideal"][0] * 1e3, "one node: NVLink | past it: InfiniBand",
                fontsize=7, color="gray", rotation=90, va="top")
        ax.axvline(H, color=_color(1), lw=1, ls=":")
        ax.text(H * 1.05, s["ideal"][-1] * 1e3 * 2, f"Ulysses stops: W > H = {H}", fontsize=7,
                color=_color(1), rotation=90, va="bottom")
        star = C.overlap_rows(m.ib, m.flops, H, H_kv, elem, causal)
        w_star = N / star
        if w_star <= worlds[-1]:
            ax.axvline(w_star, color=_color(0), lw=1, ls=":")
            ax.text(w_star / 1.05, s["ideal"][0] * 1e3, f"ring past here: n < n* = {star:,.0f} (IB)",
                    fontsize=7, color=_color(0), rotation=90, va="top", ha="right")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs W")
        ax.set_ylabel("forward time of one layer (ms)")
        ax.set_title(f"N = {N:,} tokens, H = {H}, H_kv = {H_kv}, D = {D}, causal", fontsize=9)
        ax.legend(fontsize=7, loc="lower left")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("On paper (cost model, datasheet bandwidths): ring vs all-to-all", fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------
# recorded runs of scripts/ring_scaling.py (flashlab/data/h200_ring_scaling.json)
# ----------------------------------------------------------------------------

def fig_ring_timeline(record, max_ranks=4):
    """One fwd+bwd of the ring, per rank: each step's compute and the wait that compute did not hide
    (the timeline marks, top) and, where the GPU kernel trace was recorded, the compute kernels and
    NCCL's transfer kernels on their own lanes (bottom): a transfer bar under a compute bar is the
    next K/V block in flight during compute.  ``record``: the JSON of ``scripts/ring_scaling.py``."""
    o = record["overlap"]
    if "steps" not in o:
        raise ValueError(f"the record has no overlap timeline (overlap: not run: {o.get('not_run')})")
    ranks = sorted({s["rank"] for s in o["steps"]})[:max_ranks]
    kern = o["kernels"].get("ranks") if isinstance(o.get("kernels"), dict) else None
    panels = 2 if kern else 1
    fig = Figure(figsize=(10, 1.0 + 0.8 * len(ranks) * panels + 0.6 * panels))
    ax = fig.add_subplot(panels, 1, 1)
    phase_col = {"fwd": _color(0), "bwd": _color(2)}
    for y, r in enumerate(ranks):
        for st in (x for x in o["steps"] if x["rank"] == r):
            ax.broken_barh([(st["start_ms"], st["compute_ms"])], (y - 0.35, 0.7), color=phase_col[st["phase"]],
                           alpha=0.85 if st["step"] % 2 == 0 else 0.6)
            if st["exposed_ms"] > 0:
                ax.broken_barh([(st["compute_end_ms"], st["exposed_ms"])], (y - 0.35, 0.7), color=_color(3))
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel("ms from the rank's first step", fontsize=8)
    handles = [Rectangle((0, 0), 1, 1, color=phase_col["fwd"]), Rectangle((0, 0), 1, 1, color=phase_col["bwd"]),
               Rectangle((0, 0), 1, 1, color=_color(3))]
    ax.legend(handles, ["forward step: compute", "backward step: compute", "wait: transfer not hidden"],
              fontsize=7, loc="upper right", ncol=3)
    sh = o["shape"]
    ax.set_title(f"Ring steps, W = {o['world']}, n = {sh['n']:,} rows per rank, H = {sh['H']}, H_kv = {sh['H_kv']}, "
                 f"D = {sh['D']}, {sh['dtype']}, causal zigzag: {o['exposed_fraction']:.1%} of step time waits",
                 fontsize=9)
    if kern:
        ax2 = fig.add_subplot(panels, 1, 2)
        for y, r in enumerate(ranks):
            for i in kern.get(str(r), []):
                lane = y - 0.2 if i["kind"] == "compute" else y + 0.2
                ax2.broken_barh([(i["start_us"] / 1e3, max(i["dur_us"], 1.0) / 1e3)], (lane - 0.17, 0.34),
                                color=_color(0) if i["kind"] == "compute" else _color(1))
        ax2.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks], fontsize=8)
        ax2.set_ylim(len(ranks) - 0.5, -0.5)
        ax2.set_xlabel("ms from the rank's first kernel", fontsize=8)
        ax2.legend([Rectangle((0, 0), 1, 1, color=_color(0)), Rectangle((0, 0), 1, 1, color=_color(1))],
                   ["compute kernels", "NCCL transfer kernels (their own stream)"], fontsize=7, loc="upper right",
                   ncol=2)
        frac = o.get("overlap_fraction")
        ax2.set_title(f"GPU kernels ({o['kernels']['source']}): "
                      + (f"{frac:.0%} of transfer time runs under a compute kernel" if frac is not None else ""),
                      fontsize=9)
    fig.tight_layout()
    return fig


def fig_ring_scaling(record):
    """Weak and strong scaling of fwd+bwd (causal) from the record of ``scripts/ring_scaling.py``:
    the ratio to w times one GPU's throughput (top; the target line at 0.85) and TFLOP/s (bottom),
    per provider and size, against the number of GPUs w."""
    s = record["scaling"]
    if "rows" not in s:
        raise ValueError(f"the record has no scaling rows (scaling: not run: {s.get('not_run')})")
    kinds = [k for k in ("weak", "strong") if any(r["kind"] == k for r in s["rows"])]
    fig = Figure(figsize=(5.4 * len(kinds), 6.6))
    styles = {"ring zigzag": "o-", "ring contiguous": "s--", "torch context_parallel": "^:"}
    for a, kind in enumerate(kinds):
        top = fig.add_subplot(2, len(kinds), a + 1)
        bot = fig.add_subplot(2, len(kinds), len(kinds) + a + 1)
        sizes = sorted({r["size"] for r in s["rows"] if r["kind"] == kind})
        for j, size in enumerate(sizes):
            for prov, st in styles.items():
                rows = sorted((r for r in s["rows"] if r["kind"] == kind and r["size"] == size
                               and r["provider"] == prov and r["tflops"] is not None), key=lambda r: r["world"])
                if not rows:
                    continue
                lab = f"{prov}, {size:,}" + (" tokens/GPU" if kind == "weak" else " tokens")
                ws = [r["world"] for r in rows]
                rat = [(r["world"], r["ratio"]) for r in rows if r["ratio"] is not None]
                if rat:
                    top.plot([x for x, _ in rat], [y for _, y in rat], st, color=_color(j), label=lab, ms=4)
                bot.plot(ws, [r["tflops"] for r in rows], st, color=_color(j), label=lab, ms=4)
        if kind == "weak":
            tgt = s.get("target", {}).get("ratio_min")
            if tgt:
                top.axhline(tgt, color="gray", lw=1, ls=":")
                top.text(1, tgt, f" target {tgt:.0%} (zigzag, 64k tokens/GPU)", fontsize=7, color="gray",
                         va="bottom")
        top.axhline(1.0, color="black", lw=0.8)
        for ax in (top, bot):
            ax.set_xscale("log", base=2)
            ax.set_xticks(s["worlds"], [str(w) for w in s["worlds"]])
            ax.grid(True, alpha=0.3)
            ax.set_xlabel("GPUs w", fontsize=8)
        top_r = [r["ratio"] for r in s["rows"] if r["kind"] == kind and r["ratio"] is not None]
        top.set_ylim(0, max([1.15] + [1.05 * x for x in top_r]))
        top.set_ylabel("throughput / (w x one GPU)", fontsize=8)
        bot.set_ylabel("TFLOP/s, all ranks (fwd+bwd)", fontsize=8)
        top.set_title(f"{kind} scaling" + (" (fixed tokens per GPU)" if kind == "weak" else " (fixed total N)"),
                      fontsize=9)
        bot.legend(fontsize=6)
    sh = s["shape"]
    fig.suptitle(f"Ring attention fwd+bwd, causal, B = {sh['B']}, H = {sh['H']}, H_kv = {sh['H_kv']}, "
                 f"D = {sh['D']}, {sh['dtype']} ({record['machine'].get('gpu') or 'CPU processes'})", fontsize=10)
    fig.tight_layout()
    return fig
