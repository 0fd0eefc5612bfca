"""Notebook 06's FA1-against-FA2 and L2 (grid order) results: byte models, verdicts and figures.

The record these read is ``flashlab/data/h200_fa1_l2.json``, written on a GPU by
``scripts/record_part2b.py`` (its docstring lists the keys).  Every function takes the record (a
dict), so the notebook, the tests and a synthetic record all go through the same code.
"""
from __future__ import annotations

import math

from matplotlib.figure import Figure


# ------------------------------------------------------------------------------------- byte models

def fa2_bytes(B, H, N, D, block_m, elem=2, reread=True):
    """HBM bytes of an FA2 forward (non-causal): Q, O once, a float32 LSE; K and V once (``reread=False``,
    the ideal) or once per Q tile of ``block_m`` rows (``reread=True``: no K/V tile served by L2)."""
    tr = math.ceil(N / block_m) if reread else 1
    return B * H * (2 * N * D * elem + 4 * N + tr * 2 * N * D * elem)


def fa1_bytes(B, H, N, D, block_m, block_n, elem=2):
    """HBM bytes of flashlab's FA1-order forward (non-causal, K/V re-reads served by L2): K and V once;
    per K/V tile, Q read again, the float32 O read and written, m and l read and written; O and the
    LSE written once at the end.  (FA1's paper counts O in the input dtype; here it is float32.)"""
    tc = math.ceil(N / block_n)
    per_step = N * D * elem + 2 * N * D * 4 + 4 * N * 4
    return B * H * (2 * N * D * elem + tc * per_step + N * D * elem + 4 * N)


def l2_share_min(nbytes_nocache, nbytes_ideal, seconds, bandwidth):
    """The smallest share of the K/V re-reads that must have come from L2: in ``seconds`` HBM moves at most
    ``bandwidth * seconds`` bytes; whatever the no-cache model needs beyond that was not read from HBM.
    0 means the timing alone cannot tell."""
    reread = nbytes_nocache - nbytes_ideal
    if reread <= 0:
        return 0.0
    return max(0.0, 1.0 - (bandwidth * seconds - nbytes_ideal) / reread)


# ------------------------------------------------------------------------------------------ timings

FALLBACKS = []   # timings that could not use CUDA graphs (scripts/record_part2b.py records them)


def cuda_time(fn, label=""):
    """Median ms of ``fn`` over CUDA-graph replays (``triton.testing.do_bench_cudagraph``: the FA1-order
    kernel launches once per K/V tile, and graphs leave the launches' CPU cost out for every kernel
    alike); plain ``do_bench`` if a graph cannot be captured."""
    import torch
    from triton.testing import do_bench, do_bench_cudagraph
    fn()
    try:
        return do_bench_cudagraph(fn, rep=60, return_mode="median")
    except Exception as e:  # noqa: BLE001  (an old Triton, or a capture problem: say so, time without graphs)
        msg = f"{label}: no CUDA graph ({type(e).__name__}: {str(e).splitlines()[0][:80]}); plain do_bench"
        print("  " + msg)
        FALLBACKS.append(msg)
        torch.cuda.synchronize()
        return do_bench(fn, return_mode="median")


def _setup(n, d, tokens, hidden, cfg, b_h=None):
    import torch

    from . import device
    from .kernels import forward_config
    b, h = b_h or (max(1, tokens // n), hidden // d)
    cfg = cfg or forward_config(d, torch.float16)
    q, k, v = (torch.randn(b, h, n, d, device=device.DEVICE, dtype=torch.float16) for _ in range(3))
    return b, h, cfg, q, k, v, torch.empty_like(q), torch.empty(b, h, n, device=device.DEVICE)


def many_heads(d, n_sm, hidden=2048, per_sm=8):
    """(B, H) with H = hidden / D and B * H >= per_sm * n_sm: so many heads that, interleaved, the
    programs running at the same time (about one or two per SM) all belong to different heads."""
    h = hidden // d
    return -(-per_sm * n_sm // h), h


def measure_fa1_vs_fa2(n, d, causal, cfg=None, tokens=16384, hidden=2048, timer=cuda_time, b_h=None):
    """One row of the record's "fa1" section: the FA1-order kernel and flashlab's FA2 v1 at the same tiles
    (default: the forward's hand-picked config; FA1 with :func:`~flashlab.teaching.fa1_forward.fa1_config`'s
    warps), fp16, B = tokens / N, H = hidden / D."""
    from .bench import flops
    from .kernels import launch_forward
    from .teaching.fa1_forward import fa1_config, fa1_forward
    b, h, cfg, q, k, v, o, lse = _setup(n, d, tokens, hidden, cfg, b_h)
    c1 = fa1_config(cfg)
    fl = flops(b, h, n, n, d, causal)
    row = dict(D=d, N=n, B=b, H=h, causal=causal, config=[cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages],
               fa1_config=[c1.block_m, c1.block_n, c1.num_warps, c1.num_stages])
    fns = {"fa1": lambda: fa1_forward(q, k, v, o, lse, causal, config=c1),
           "fa2": lambda: launch_forward(q, k, v, o, lse, causal, d ** -0.5, version="v1", config=cfg)}
    for key, fn in fns.items():
        ms = timer(fn, f"{key} D={d} N={n} causal={causal}")
        row[key + "_ms"], row[key + "_tflops"] = ms, fl / (ms * 1e-3) / 1e12
    row["fa1_bytes"] = fa1_bytes(b, h, n, d, cfg.block_m, cfg.block_n)
    row["fa2_bytes_nocache"] = fa2_bytes(b, h, n, d, cfg.block_m)
    return row


def measure_grid_orders(n, d, bandwidth, cfg=None, tokens=16384, hidden=2048, timer=cuda_time, b_h=None):
    """The record's "l2" rows for one (N, D): the same FA2 forward (v1's code, non-causal) with the Q tile
    index fastest and with the (batch, head) index fastest, and flashlab's v1 itself beside the first."""
    from .bench import flops
    from .kernels import launch_forward
    from .teaching.fa1_forward import ordered_forward
    b, h, cfg, q, k, v, o, lse = _setup(n, d, tokens, hidden, cfg, b_h)
    fl = flops(b, h, n, n, d, False)
    ideal = fa2_bytes(b, h, n, d, cfg.block_m, reread=False)
    nocache = fa2_bytes(b, h, n, d, cfg.block_m)
    rows = []
    for order in ("tile-fastest", "head-fastest"):
        ms = timer(lambda: ordered_forward(q, k, v, o, lse, False, config=cfg, head_fastest=order == "head-fastest"),
                   f"{order} D={d} N={n}")
        rows.append(dict(D=d, N=n, B=b, H=h, order=order, ms=ms, tflops=fl / (ms * 1e-3) / 1e12,
                         config=[cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages],
                         kv_bytes_per_head=2 * n * d * 2, ideal_bytes=ideal, nocache_bytes=nocache,
                         hbm_max_bytes=bandwidth * ms * 1e-3,
                         l2_share_min=l2_share_min(nocache, ideal, ms * 1e-3, bandwidth)))
    rows[0]["v1_ms"] = timer(lambda: launch_forward(q, k, v, o, lse, False, d ** -0.5, version="v1", config=cfg),
                             f"v1 D={d} N={n}")
    return rows


# ------------------------------------------------------------------------------------------ verdicts

def fa2_over_fa1(record):
    """{(D, causal): [(N, FA2 TFLOP/s / FA1 TFLOP/s), ...]} from the record's "fa1" rows."""
    out = {}
    for r in record["fa1"]:
        out.setdefault((r["D"], r["causal"]), []).append((r["N"], r["fa2_tflops"] / r["fa1_tflops"]))
    return {k: sorted(v) for k, v in out.items()}


def fa1_verdict(record, claim=(1.3, 1.5)):
    """A sentence on the claim "FA2 is 1.3-1.5x FA1", computed from the record."""
    ratios = [x for v in fa2_over_fa1(record).values() for _, x in v]
    lo, hi = min(ratios), max(ratios)
    inside = sum(claim[0] <= x <= claim[1] for x in ratios)
    above = sum(x > claim[1] for x in ratios)
    below = sum(x < claim[0] for x in ratios)
    return (f"FA2 / FA1 ranges from {lo:.2f}x to {hi:.2f}x over {len(ratios)} cases: "
            f"{inside} inside the claimed {claim[0]}-{claim[1]}x, {above} above it, {below} below it.")


def _key(r):
    return r["D"], r["N"], r["B"] * r["H"]


def order_slowdown(record):
    """{(D, N, B*H): head-fastest time / tile-fastest time} from the record's "l2" rows."""
    t = {(*_key(r), r["order"]): r["ms"] for r in record["l2"]}
    return {(d, n, bh): t[(d, n, bh, "head-fastest")] / t[(d, n, bh, "tile-fastest")]
            for d, n, bh, o in sorted(t) if o == "tile-fastest" and (d, n, bh, "head-fastest") in t}


def l2_verdict(record, threshold=1.1):
    """Sentences on whether the K/V re-reads of the normal order hit L2, computed from the record.

    The verdict rests on the "clean" rows: B*H at least 4x the SM count (``record["machine"]["sms"]``),
    where interleaved programs running together all belong to different heads; without the SM count,
    on the rows with the most heads per head dim.  The other rows are listed after it.
    """
    slow = order_slowdown(record)
    if not slow:
        return "No grid-order rows in the record."
    n_sm = (record.get("machine") or {}).get("sms")
    clean = {k: x for k, x in slow.items() if n_sm and k[2] >= 4 * n_sm}
    if not clean:
        most = {d: max(bh for d2, _, bh in slow if d2 == d) for d, _, _ in slow}
        clean = {k: x for k, x in slow.items() if k[2] == most[k[0]]}
    shares = {_key(r): r["l2_share_min"] for r in record["l2"] if r["order"] == "tile-fastest"}
    hits = [x >= threshold for x in clean.values()]
    where = ", ".join(f"D={d} N={n} B*H={bh}" for d, n, bh in clean)
    proved = any(shares.get(k, 0) > 0 for k in clean)
    if all(hits):
        verdict = (f"With many heads ({where}) the interleaved order is {min(clean.values()):.2f}x slower or more: "
                   "the normal order owes that much to K/V re-reads served by L2"
                   + (", and its time alone proves some of them never reached HBM." if proved else
                      "; the time alone cannot prove it (its bound is 0 %): a DRAM byte counter would."))
    elif not any(hits):
        verdict = (f"With many heads ({where}) interleaving the heads costs less than {threshold:.1f}x: the timings "
                   "do not show the normal order depending on L2.")
    else:
        verdict = f"Mixed: with many heads ({where}) some cases slow down by {threshold:.1f}x or more, some do not."
    parts = [f"D={d}, N={n}, B*H={bh}: {x:.2f}x slower interleaved; at least {shares.get((d, n, bh), 0):.0%} of "
             "the re-reads from L2 in the normal order (bound from the time)" for (d, n, bh), x in slow.items()]
    return verdict + "\n" + "\n".join(parts)


# ------------------------------------------------------------------------------------------- figures

def fig_fa1_vs_fa2(record, title=None):
    """TFLOP/s against N of the FA1-order kernel and FA2 (v1, same tiles), one panel per head dim."""
    ds = sorted({r["D"] for r in record["fa1"]})
    if all(len({r["N"] for r in record["fa1"] if r["D"] == d}) == 1 for d in ds):
        return _fig_fa1_vs_fa2_bars(record, title)
    fig = Figure(figsize=(5.2 * len(ds), 3.8))
    axes = fig.subplots(1, len(ds), squeeze=False)[0]
    for ax, d in zip(axes, ds):
        for causal, ls in ((False, "-"), (True, "--")):
            rows = sorted((r for r in record["fa1"] if r["D"] == d and r["causal"] == causal), key=lambda r: r["N"])
            if not rows:
                continue
            ns = [r["N"] for r in rows]
            c = " causal" if causal else ""
            ax.plot(ns, [r["fa2_tflops"] for r in rows], ls, marker="o", color="C0", alpha=0.55 if causal else 1,
                    label=f"FA2 (v1){c}")
            ax.plot(ns, [r["fa1_tflops"] for r in rows], ls, marker="s", color="C3", alpha=0.55 if causal else 1,
                    label=f"FA1 order{c}")
            for r in rows:
                ax.annotate(f"{r['fa2_tflops'] / r['fa1_tflops']:.2f}x", (r["N"], r["fa2_tflops"]),
                            textcoords="offset points", xytext=(0, 5 if not causal else -11), ha="center",
                            fontsize=7, color="0.3")
        ns = sorted({r["N"] for r in record["fa1"] if r["D"] == d})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        top = max(max(r["fa2_tflops"], r["fa1_tflops"]) for r in record["fa1"] if r["D"] == d)
        ax.set_ylim(0, 1.2 * top)
        ax.set_xlabel("sequence length N (16k tokens per batch)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"D={d} (labels: FA2 / FA1)", fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(title or "FA1's loop order against FA2's, same tiles, fp16", fontsize=10)
    fig.tight_layout()
    fig.subplots_adjust(right=1 - 1.6 / fig.get_figwidth())
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    return fig


def _fig_fa1_vs_fa2_bars(record, title=None):
    """One sequence length per head dim: grouped bars (FA2 v1, FA1 order) per (D, causal), the ratio above."""
    rows = sorted(record["fa1"], key=lambda r: (r["D"], r["causal"]))
    fig = Figure(figsize=(1.5 * len(rows) + 2.5, 3.6))
    ax = fig.add_subplot()
    w = 0.38
    for j, (key, label, color) in enumerate((("fa2_tflops", "FA2 order (v1)", "C0"), ("fa1_tflops", "FA1 order", "C3"))):
        xs = [i + (j - 0.5) * w for i in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], w, color=color, label=label)
        for x, r in zip(xs, rows):
            ax.text(x, r[key], f"{r[key]:.0f}", ha="center", va="bottom", fontsize=7)
    for i, r in enumerate(rows):
        top = max(r["fa2_tflops"], r["fa1_tflops"])
        ax.text(i, top * 1.09, f"FA2/FA1 {r['fa2_tflops'] / r['fa1_tflops']:.2f}x", ha="center", fontsize=8, color="0.25")
    ax.set_xticks(range(len(rows)), [f"D={r['D']}, N={r['N']}\n{'causal' if r['causal'] else 'non-causal'}" for r in rows],
                  fontsize=8)
    ax.set_ylim(0, 1.3 * max(max(r["fa2_tflops"], r["fa1_tflops"]) for r in rows))
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or "FA1's loop order against FA2's, same tiles, fp16", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def fig_roofline_pair(models: dict, measured: dict, ceiling: tuple, bandwidth: float, title: str = ""):
    """Two panels side by side, no inset.

    Left, the roofline: the measured matmul ``ceiling`` = (FLOP/s, label), the bandwidth slope, and one
    marker on the bound for each byte model (``models``: name -> (FLOPs, bytes)).  Right, the measured rates
    (``measured``: name -> FLOP/s; all of one shape, so one intensity: bars, not markers stacked at one x)
    against the ceiling and each model's bound."""
    import numpy as np
    peak = ceiling[0]
    fig = Figure(figsize=(12, 4.2))
    ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    ai = np.logspace(0, 4.3, 200)
    ax.loglog(ai, np.minimum(peak, bandwidth * ai) / 1e12, color="k", lw=1.5,
              label=f"min({ceiling[1]}, {bandwidth / 1e12:.1f} TB/s x intensity)")
    ridge = peak / bandwidth
    ax.axvline(ridge, color="gray", lw=0.8, ls=":")
    ax.text(ridge * 1.08, peak / 1e12 / 12, f"ridge {ridge:.0f} FLOP/byte", fontsize=8, color="gray")
    bounds = {}
    for i, (name, (flops, nbytes)) in enumerate(models.items()):
        x = flops / nbytes
        bounds[name] = min(peak, bandwidth * x)
        ax.plot([x], [bounds[name] / 1e12], "o", color=f"C{i}", ms=8,
                label=f"{name}: {x:.0f} FLOP/byte, bound {bounds[name] / 1e12:.0f} TFLOP/s")
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("where the byte models put the kernel", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    names = list(measured)
    ys = np.arange(len(names))
    vals = [measured[n] / 1e12 for n in names]
    bx.barh(ys, vals, color="C7")
    for y, v in zip(ys, vals):
        bx.text(v, y, f" {v:.0f} ({100 * v * 1e12 / peak:.0f} %)", va="center", fontsize=8)
    bx.axvline(peak / 1e12, color="k", lw=1.5)
    bx.text(peak / 1e12, -0.75, f" {ceiling[1]}", fontsize=7, va="bottom", ha="left")
    for i, (name, b) in enumerate(bounds.items()):
        if b < peak:
            bx.axvline(b / 1e12, color=f"C{i}", lw=1.2, ls="--")
            bx.text(b / 1e12, -0.75, f"{name.split(':')[0]} bound ", fontsize=7, color=f"C{i}", ha="right", va="bottom")
    bx.set_yticks(ys, names, fontsize=8)
    bx.invert_yaxis()
    bx.set_xlim(0, peak / 1e12 * 1.25)
    bx.set_ylim(len(names) - 0.2, -1.0)
    bx.set_xlabel("TFLOP/s (% of the ceiling)")
    bx.set_title("measured rates", fontsize=9)
    bx.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def fig_grid_order(record, title=None):
    """TFLOP/s of the same FA2 kernel in the two grid orders, per (D, N)."""
    rows = record["l2"]
    keys = sorted({_key(r) for r in rows})
    t = {(*_key(r), r["order"]): r["tflops"] for r in rows}
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    w = 0.38
    for j, (order, color) in enumerate((("tile-fastest", "C0"), ("head-fastest", "C1"))):
        xs = [i + (j - 0.5) * w for i in range(len(keys))]
        ys = [t.get((*k, order), float("nan")) for k in keys]
        ax.bar(xs, ys, w, color=color, label=f"{order}" + (" (v1's order)" if j == 0 else ""))
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(keys)), [f"D={d}\nN={n}\nB·H={bh}" for d, n, bh in keys], fontsize=8)
    ax.set_ylim(0, 1.25 * max(r["tflops"] for r in rows))
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or "The same forward, two grid orders (fp16, non-causal)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- autotuning's choices

def autotune_choices(ns, d, dtype=None, causal=False, tokens=16384, hidden=2048) -> list:
    """Run the op's forward and backward once at each N (B = tokens // N, H = hidden // d) and return
    the configs autotuning chose for the versions the op ran: ``flashlab.kernels.tuned_configs()`` rows
    with "N" added.
    GPU only (the interpreter does not autotune)."""
    import torch

    from . import kernels
    from .attention import flash_attention
    if not kernels.autotune_enabled(torch.empty(0, d, dtype=dtype or torch.float16), 1 << 30):
        raise RuntimeError("autotuning runs on a CUDA GPU only (and FLASHLAB_AUTOTUNE=0 turns it off)")
    dtype = dtype or torch.float16
    rows = []
    for n in ns:
        b, h = max(1, tokens // n), max(1, hidden // d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        flash_attention(q, k, v, causal).backward(torch.randn(b, h, n, d, device="cuda", dtype=dtype))
        key = kernels._n_key(n, n)
        waves = kernels.tiles.grid_class(b * h, n, kernels.plan.device_facts().sms)
        rows += [{"N": n, **c} for c in ran_by_the_op(kernels.tuned_configs(), kernels.default_versions(dtype, d, key, causal),
                                                       key, d, causal, dtype, waves)]
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def ran_by_the_op(tuned, used, n_key, d, causal, dtype, grid_class=None) -> list:
    """The ``tuned_configs()`` rows of one key whose version is the op's (``used``: default_versions'
    {"fwd": ..., "bwd": ...}); versions tuned earlier in the same process are left out, and so are other grid
    classes when ``grid_class`` is given."""
    return [c for c in tuned
            if c["n_key"] == n_key and c["head_dim"] == d and c["causal"] == causal
            and (grid_class is None or c.get("grid_class", grid_class) == grid_class)
            and c["dtype"] == str(dtype).replace("torch.", "")
            and c["kernel"].split()[1] == used["fwd" if c["kernel"].startswith("fwd") else "bwd"]]


def format_autotune(rows) -> str:
    """A table: one row per (head dim, N), one column per kernel (forward, dK/dV, dQ), cells
    "version: BLOCK_M x BLOCK_N, warps w / stages s"."""
    names = {"fwd": "forward", "dkdv": "dK/dV", "dq": "dQ", "bwd": "one-pass backward"}
    kinds = list(dict.fromkeys(r["kernel"].split()[0] for r in rows))
    keys = sorted({(r["head_dim"], r["N"]) for r in rows})
    lines = [f"{'D':>4} {'N':>6}  " + "  ".join(f"{names.get(k, k):>20}" for k in kinds)]
    for d, n in keys:
        cells = []
        for kind in kinds:
            r = next((r for r in rows if (r["head_dim"], r["N"]) == (d, n) and r["kernel"].split()[0] == kind), None)
            cells.append(f"{r['kernel'].split()[1]}: {r['block_m']}x{r['block_n']}, {r['num_warps']}w/{r['num_stages']}s"
                         if r else "-")
        lines.append(f"{d:>4} {n:>6}  " + "  ".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)
