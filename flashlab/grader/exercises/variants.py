"""Notebook 08 (attention variants): window_tile_bounds, gqa_head_map, varlen_program_map (plain Python)
and dropout_backward (NumPy float64).  None of them needs Triton.

Each is the piece of a variant that is easy to get wrong, graded alone:
  * window_tile_bounds: the key tiles a Q tile visits under a band i - left ... i + right, and which of
    them need no mask (forward v4's band_tiles; reference: flashlab.variants.band_tile_ranges);
  * gqa_head_map: which K/V head a query head reads, and which query heads a K/V head's dK/dV sums;
  * varlen_program_map: program id -> (sequence, head, first packed row, rows) of the packed forward
    (reference: flashlab.variants.varlen_program);
  * dropout_backward: dQ, dK, dV of one (batch, head) with the dropout mask regenerated tile by tile
    from a counter-based function, never stored.
"""
from __future__ import annotations

import math

import numpy as np

from ...variants import band_tile_ranges, varlen_program
from ..core import Bug, Case, Exercise
from . import register

_PY = dict(timeout=60.0, budget=100.0, notebook="08")


def _exact(case, name, ref):
    return 0.0


# ----------------------------------------------------------------------------
# window_tile_bounds: f(start_m, block_m, block_n, nk, left, right) -> (lo, full_lo, full_hi, hi)
# ----------------------------------------------------------------------------

# (nq, nk, block_m, block_n, left, right): windows both sides, causal (right 0), unbounded (-1), a band that
# misses the keys (nq > nk), a right edge that lands on a tile's first key (right = 1), ragged tiles
WINDOW_SHAPES = [(256, 256, 64, 32, 40, 0), (300, 300, 64, 64, 100, 0), (200, 180, 32, 64, 17, 5),
                 (128, 128, 32, 32, 0, 1), (250, 100, 64, 32, 0, 4), (150, 150, 64, 16, -1, 7),
                 (150, 140, 16, 64, 9, -1), (100, 100, 32, 32, -1, -1), (77, 301, 32, 64, 130, 130),
                 (129, 129, 128, 32, 64, 0), (122, 18, 16, 64, 0, 0)]


def _stage_map(fn, case):
    """For every (Q tile, K tile): 0 never loaded, 1 masked stage, 2 unmasked stage; plus contract problems."""
    p = case.params
    nq, nk, bm, bn = p["Nq"], p["Nk"], p["block_q"], p["block_k"]
    tq, tk = -(-nq // bm), -(-nk // bn)
    out = np.zeros((tq, tk))
    problems = []
    for t in range(tq):
        got = fn(t, bm, bn, nk, p["left"], p["right"])
        if not (isinstance(got, (tuple, list)) and len(got) == 4):
            return {"_contract": [f"return a 4-tuple (lo, full_lo, full_hi, hi), got {got!r}"]}
        lo, flo, fhi, hi = (int(x) for x in got)
        if hi == 0 and lo == flo == fhi == 0:
            continue
        if not (0 <= lo <= flo <= fhi <= hi <= nk):
            problems.append(f"Q tile {t}: got (lo, full_lo, full_hi, hi) = {(lo, flo, fhi, hi)}; they must satisfy "
                            f"0 <= lo <= full_lo <= full_hi <= hi <= nk = {nk} (or be (0, 0, 0, 0) for no key)")
            break
        if (lo % bn and lo != hi) or (flo % bn and flo != hi) or (fhi % bn and fhi != hi):
            problems.append(f"Q tile {t}: lo = {lo}, full_lo = {flo}, full_hi = {fhi} must be multiples of block_n "
                            f"= {bn} (the loops step by whole K tiles from lo)")
            break
        for c0 in range(lo, hi, bn):
            out[t, c0 // bn] = 2 if flo <= c0 < fhi else 1
    if problems:
        return {"_contract": problems}
    return {"stage": out}


def _window_ref(case):
    return _stage_map(lambda t, bm, bn, nk, l, r: band_tile_ranges(t * bm, bm, bn, nk, l, r), case)


class _WindowCase(Case):
    def describe(self) -> str:
        p = self.params
        return (f"Nq={p['Nq']}, Nk={p['Nk']}, block_m={p['block_q']}, block_n={p['block_k']}, "
                f"window=({p['left']}, {p['right']})")


def _window_cases(rng):
    Case = _WindowCase  # noqa: N806
    cases = []
    for i, (nq, nk, bm, bn, left, right) in enumerate(WINDOW_SHAPES):
        cases.append(Case({"Nq": nq, "Nk": nk, "block_q": bm, "block_k": bn, "left": left, "right": right}, {},
                          visible=(i == 0)))
    nq, nk = (int(x) for x in rng.integers(40, 500, size=2))
    bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
    left, right = int(rng.choice([-1, 0, int(rng.integers(1, 200))])), int(rng.choice([-1, 0, int(rng.integers(1, 50))]))
    cases.append(Case({"Nq": nq, "Nk": nk, "block_q": bm, "block_k": bn, "left": left, "right": right}, {}))
    return cases


def _window_locate(case, name, idx):
    bm, bn = case.params["block_q"], case.params["block_k"]
    t, u = idx[0], idx[1]
    return (f"Q tile {t} (rows {t * bm} to {(t + 1) * bm - 1}), K tile {u} (keys {u * bn} to {(u + 1) * bn - 1}); "
            f"stage codes: 0 never loaded, 1 masked, 2 unmasked")


def _big(x):
    return (1 << 40) if x < 0 else x


def _wbug(fn):
    return lambda case: _stage_map(fn, case)


def _no_missing_check(t, bm, bn, nk, left, right):
    r0, before, after = t * bm, _big(left), _big(right)
    hi = min(r0 + bm + after, nk)
    lo = min(max(r0 - before, 0) // bn * bn, hi)
    flo = min(max(-(-max(r0 + bm - 1 - before, 0) // bn) * bn, lo), hi)
    fhi = min(max(min(r0 + after + 1, nk) // bn * bn, flo), hi)
    return lo, flo, fhi, hi


def _first_row_for_left(t, bm, bn, nk, left, right):
    lo, flo, fhi, hi = band_tile_ranges(t * bm, bm, bn, nk, left, right)
    if hi == 0:
        return 0, 0, 0, 0
    flo = min(max(-(-max(t * bm - _big(left), 0) // bn) * bn, lo), hi)
    return lo, flo, max(fhi, flo), hi


def _last_row_for_right(t, bm, bn, nk, left, right):
    lo, flo, fhi, hi = band_tile_ranges(t * bm, bm, bn, nk, left, right)
    if hi == 0:
        return 0, 0, 0, 0
    fhi = min(max(min(t * bm + bm - 1 + _big(right) + 1, nk) // bn * bn, flo), hi)
    return lo, flo, fhi, hi


def _ragged_unmasked(t, bm, bn, nk, left, right):
    lo, flo, fhi, hi = band_tile_ranges(t * bm, bm, bn, nk, left, right)
    if hi == 0:
        return 0, 0, 0, 0
    if min(t * bm + _big(right) + 1, nk) == nk and fhi < hi:
        fhi = max(hi, flo)                       # the ragged last K tile treated as full
    return lo, flo, fhi, hi


def _hi_off_by_one(t, bm, bn, nk, left, right):
    r0 = t * bm
    first = max(r0 - _big(left), 0)
    hi = min(r0 + bm - 1 + _big(right), nk)
    if first >= hi:
        return 0, 0, 0, 0
    lo = first // bn * bn
    _, flo, fhi, _ = band_tile_ranges(r0, bm, bn, nk, left, right)
    flo = min(max(flo, lo), hi)
    return lo, flo, min(max(fhi, flo), hi), hi


def _unbounded_as_zero(t, bm, bn, nk, left, right):
    return band_tile_ranges(t * bm, bm, bn, nk, max(left, 0), max(right, 0))


WINDOW_BUGS = [
    Bug("band_misses_keys", "a band that misses every key still visits a tile",
        "when the first key the tile's first row sees, max(r0 - left, 0), is at or past the end "
        "min(r0 + block_m + right, nk), no key is visible: return (0, 0, 0, 0) instead of a masked tile.",
        _wbug(_no_missing_check)),
    Bug("left_edge_first_row", "unmasked tiles start where the FIRST row's window starts",
        "a K tile needs no mask only if EVERY row sees all of it: the binding row for the left edge is the "
        "tile's LAST row, so full_lo >= r0 + block_m - 1 - left (rounded up to a whole K tile).",
        _wbug(_first_row_for_left)),
    Bug("right_edge_last_row", "unmasked tiles end where the LAST row's window ends",
        "for the right edge the binding row is the tile's FIRST row, r0: a K tile is wholly visible only if "
        "its last key is <= r0 + right, so full_hi = min(r0 + right + 1, nk) rounded down to a K tile.",
        _wbug(_last_row_for_right)),
    Bug("ragged_tile_unmasked", "the ragged last K tile counted as unmasked",
        "a K tile that runs past Nk needs the masked loads: full_hi is at most (nk // block_n) * block_n.",
        _wbug(_ragged_unmasked)),
    Bug("hi_off_by_one", "the end one key short",
        "the last row r0 + block_m - 1 sees keys up to r0 + block_m - 1 + right INCLUDED: the exclusive end is "
        "min(r0 + block_m + right, nk). One short, a tile whose first key is that last key is never loaded.",
        _wbug(_hi_off_by_one)),
    Bug("unbounded_as_zero", "-1 (unbounded) read as 0",
        "left = -1 or right = -1 means no limit on that side (all keys before / after): use a number larger "
        "than any sequence, not 0.", _wbug(_unbounded_as_zero)),
]


# ----------------------------------------------------------------------------
# gqa_head_map: f(H, H_kv) -> (kv_head (H,), group (H_kv, G))
# ----------------------------------------------------------------------------

class _GqaCase(Case):
    def describe(self) -> str:
        return f"H={self.params['H']}, H_kv={self.params['H_kv']}"


def _gqa_cases(rng):
    spec = [(8, 2, True), (32, 8, False), (4, 1, False), (6, 6, False), (12, 3, False), (16, 4, False)]
    hk = int(rng.choice([2, 3, 4, 5]))
    spec.append((hk * int(rng.integers(2, 7)), hk, False))
    return [_GqaCase({"H": h, "H_kv": k}, {}, visible=v) for h, k, v in spec]


def _gqa_collect(fn, case):
    H, Hk = case.params["H"], case.params["H_kv"]
    got = fn(H, Hk)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return {"_contract": [f"return a pair (kv_head, group), got {got!r}"]}
    kv, grp = np.asarray(got[0], dtype=np.float64), np.asarray(got[1], dtype=np.float64)
    contract = []
    if kv.shape != (H,):
        contract.append(f"kv_head: shape {kv.shape}, expected ({H},): one K/V head per query head")
    if grp.shape != (Hk, H // Hk):
        contract.append(f"group: shape {grp.shape}, expected ({Hk}, {H // Hk}): the query heads of each K/V head")
    return {"_contract": contract} if contract else {"kv_head": kv, "group": grp}


def _gqa_ref_fn(H, Hk):
    g = H // Hk
    return [h // g for h in range(H)], [[hk * g + i for i in range(g)] for hk in range(Hk)]


GQA_BUGS = [
    Bug("interleaved", "query head h mapped to K/V head h % H_kv",
        "consecutive query heads share a K/V head (K/V is repeated with repeat_interleave, not repeat): "
        "kv_head = h // (H // H_kv), and K/V head hk serves query heads hk*G ... hk*G + G - 1.",
        lambda c: _gqa_collect(lambda H, Hk: ([h % Hk for h in range(H)],
                                              [[hk + i * Hk for i in range(H // Hk)] for hk in range(Hk)]), c)),
    Bug("divided_by_kv_heads", "h // H_kv instead of h // G",
        "divide by the group size G = H // H_kv (query heads per K/V head), not by H_kv.",
        lambda c: _gqa_collect(lambda H, Hk: ([h // Hk for h in range(H)],
                                              [[hk * (H // Hk) + i for i in range(H // Hk)] for hk in range(Hk)]), c)),
]


# ----------------------------------------------------------------------------
# varlen_program_map: f(pid, cu_seqlens, max_seqlen, block_m, H) -> (seq, head, row0, rows)
# ----------------------------------------------------------------------------

def _varlen_cases(rng):
    spec = [([0, 5, 40, 41, 100], 32, 2, True), ([0, 64, 128], 64, 3, False), ([0, 0, 30, 30, 95], 16, 2, False),
            ([0, 200], 64, 1, False), ([0, 1, 2, 3], 16, 4, False)]
    lens = rng.integers(0, 150, size=int(rng.integers(2, 6)))
    spec.append(([0] + np.cumsum(lens).astype(int).tolist(), int(rng.choice([16, 32, 64])), int(rng.integers(1, 4)),
                 False))
    return [Case({"cu_seqlens": cu, "block_m": bm, "H": h}, {}, visible=v) for cu, bm, h, v in spec]


def _varlen_collect(fn, case):
    p = case.params
    cu, bm, H = list(p["cu_seqlens"]), p["block_m"], p["H"]
    mx = max(max(b - a for a, b in zip(cu[:-1], cu[1:])), 1)
    n = -(-mx // bm) * (len(cu) - 1) * H
    rows = []
    for pid in range(n):
        got = fn(pid, list(cu), mx, bm, H)
        if not (isinstance(got, (tuple, list)) and len(got) == 4):
            return {"_contract": [f"return a 4-tuple (seq, head, row0, rows), got {got!r} for pid {pid}"]}
        rows.append([float(x) for x in got])
    a = np.asarray(rows)
    out = {"seq": a[:, 0], "head": a[:, 1], "rows": a[:, 3]}
    out["row0"] = np.where(a[:, 3] > 0, a[:, 2], 0.0)      # a program that stores nothing may say any row0
    return out


def _varlen_describe(case):
    p = case.params
    return f"cu_seqlens={p['cu_seqlens']}, block_m={p['block_m']}, H={p['H']}"


class _VarlenCase(Case):
    def describe(self) -> str:
        return _varlen_describe(self)


def _varlen_cases_typed(rng):
    return [_VarlenCase(c.params, c.inputs, c.visible) for c in _varlen_cases(rng)]


def _vbug(fn):
    return lambda case: _varlen_collect(fn, case)


def _tiles_from_total(pid, cu, mx, bm, H):
    n_tiles = -(-cu[-1] // bm)
    tile, bh = pid % n_tiles, pid // n_tiles
    b, h = bh // H, bh % H
    if b >= len(cu) - 1:
        return 0, 0, 0, 0
    return b, h, cu[b] + tile * bm, max(0, min(bm, cu[b + 1] - cu[b] - tile * bm))


VARLEN_BUGS = [
    Bug("local_row", "row0 counted from the sequence's start, not the packed tensor's",
        "the sequence's rows are cu_seqlens[b] ... cu_seqlens[b + 1] - 1 of the packed tensor: row0 = "
        "cu_seqlens[b] + tile * block_m.",
        _vbug(lambda pid, cu, mx, bm, H: (lambda b, h, r, n: (b, h, r - cu[b], n))(*varlen_program(pid, cu, mx, bm, H)))),
    Bug("rows_not_clamped", "rows not clamped to [0, block_m]",
        "a tile past the sequence's end has no rows (0, not a negative number), and a tile inside it has at most "
        "block_m: rows = max(0, min(block_m, length - tile * block_m)).",
        _vbug(lambda pid, cu, mx, bm, H: (lambda b, h, r, n: (b, h, r, (cu[b + 1] - cu[b]) - (r - cu[b])))(
            *varlen_program(pid, cu, mx, bm, H)))),
    Bug("head_fastest", "(sequence, head) index fastest instead of the tile",
        "the grid puts the tile index fastest (pid % n_tiles), as program_tile does, so that programs launched "
        "together share a (sequence, head) and its K/V stay in L2.",
        _vbug(lambda pid, cu, mx, bm, H: varlen_program(
            (pid % ((len(cu) - 1) * H)) * -(-mx // bm) + pid // ((len(cu) - 1) * H), cu, mx, bm, H))),
    Bug("tiles_from_total", "tiles per sequence counted from the packed length",
        "the grid has cdiv(max_seqlen, block_m) tiles per (sequence, head): the longest sequence's, not the "
        "packed total's.", _vbug(_tiles_from_total)),
]


def _varlen_locate(case, name, idx):
    p = case.params
    return f"program pid = {idx[0]} (block_m = {p['block_m']}, H = {p['H']})"


# ----------------------------------------------------------------------------
# dropout_backward: f(q, k, v, o, lse, do, p, keep, block_q, block_k) -> (dq, dk, dv)
# ----------------------------------------------------------------------------

_M64 = (1 << 64) - 1


def keep_function(seed: int, p: float):
    """A counter-based dropout mask: keep(rows, cols) -> bool (len(rows), len(cols)), True = kept, a pure
    function of (seed, row, column) like the kernels' Philox (here a SplitMix64 hash, in NumPy)."""
    def keep(rows, cols):
        r = np.asarray(rows, dtype=np.uint64).reshape(-1, 1)
        c = np.asarray(cols, dtype=np.uint64).reshape(1, -1)
        with np.errstate(over="ignore"):
            x = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + r * np.uint64(0xBF58476D1CE4E5B9)
                 + c * np.uint64(0x94D049BB133111EB))
            x ^= x >> np.uint64(30)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(27)
            x *= np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
        return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) >= p
    return keep


def _dropout_cases(rng):
    spec = [(32, 32, 16, 0.2, 16, 16, True), (40, 70, 8, 0.3, 16, 8, False), (70, 40, 16, 0.5, 32, 16, False),
            (37, 37, 16, 0.0, 16, 16, False), (53, 61, 16, 0.1, 8, 32, False), (1, 9, 8, 0.4, 4, 4, False)]
    cases = []
    for nq, nk, d, p, bq, bk, vis in spec:
        q, k, v = rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, d))
        seed = int(rng.integers(0, 2**31))
        o, lse = _dropout_forward(q, k, v, p, keep_function(seed, p))
        do = rng.standard_normal((nq, d))
        cases.append(Case({"Nq": nq, "Nk": nk, "D": d, "p": p, "block_q": bq, "block_k": bk, "seed": seed},
                          {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do}, vis))
    return cases


def _softmax_parts(q, k):
    s = (q @ k.T) / math.sqrt(q.shape[1])
    m = s.max(1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(1, keepdims=True)))[:, 0]
    return s, lse


def _dropout_forward(q, k, v, p, keep):
    s, lse = _softmax_parts(q, k)
    P = np.exp(s - lse[:, None])
    z = keep(np.arange(q.shape[0]), np.arange(k.shape[0]))
    return (P * z / (1 - p)) @ v, lse


def _dropout_grads(case, z=None, rescale=True, delta_from=None, drop_dp=True):
    i = case.inputs
    q, k, v, o, lse, do, p = i["q"], i["k"], i["v"], i["o"], i["lse"], i["do"], case.params["p"]
    if z is None:
        z = keep_function(case.params["seed"], p)(np.arange(q.shape[0]), np.arange(k.shape[0]))
    sc = 1 / math.sqrt(q.shape[1])
    P = np.exp(sc * (q @ k.T) - lse[:, None])
    zs = z / (1 - p) if rescale else z.astype(np.float64)
    dv = (P * zs).T @ do
    dp = do @ v.T
    if drop_dp:
        dp = dp * zs
    delta = (do * (o if delta_from is None else delta_from)).sum(1)
    ds = P * (dp - delta[:, None])
    return {"dq": sc * ds @ k, "dk": sc * ds.T @ q, "dv": dv}


def _dropout_run(f, case):
    i = case.inputs
    p = case.params
    keep = keep_function(p["seed"], p["p"])
    calls = []

    def watched(rows, cols):
        r, c = np.asarray(rows).reshape(-1), np.asarray(cols).reshape(-1)
        calls.append(r.size * c.size)
        return keep(r, c)

    out = f(i["q"].copy(), i["k"].copy(), i["v"].copy(), i["o"].copy(), i["lse"].copy(), i["do"].copy(), p["p"],
            watched, p["block_q"], p["block_k"])
    res = {"_contract": [], "_violations": []}
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        res["_contract"].append(f"return (dq, dk, dv), got {type(out).__name__}")
        return res
    for name, a in zip(("dq", "dk", "dv"), out):
        res[name] = np.asarray(a)
    tile = p["block_q"] * p["block_k"]
    if calls and max(calls) > tile:
        res["_violations"].append(
            f"keep() was asked for {max(calls)} entries at once, more than one {p['block_q']} x {p['block_k']} tile "
            f"({tile}): regenerate the mask tile by tile, as the kernel does, instead of storing it")
    if not calls and p["p"] > 0:
        res["_violations"].append("keep() was never called: the backward must regenerate the forward's mask")
    return res


def _dropout_ref(case):
    return _dropout_grads(case)


def _dropout_tol(case, name, ref):
    return 1e-8 * max(1.0, float(np.abs(ref).max()))


def _dropout_locate(case, name, idx):
    p = case.params
    if name == "dq":
        return f"dq row {idx[0]} (Q tile {idx[0] // p['block_q']}), column {idx[1]}"
    return f"{name} row {idx[0]} (K tile {idx[0] // p['block_k']}), column {idx[1]}"


def _transposed_mask(case):
    nq, nk = case.params["Nq"], case.params["Nk"]
    keep = keep_function(case.params["seed"], case.params["p"])
    return _dropout_grads(case, z=keep(np.arange(nk), np.arange(nq)).T)


def _undropped_o(case):
    i = case.inputs
    P = np.exp((i["q"] @ i["k"].T) / math.sqrt(i["q"].shape[1]) - i["lse"][:, None])
    return _dropout_grads(case, delta_from=P @ i["v"])


DROPOUT_BUGS = [
    Bug("no_rescale", "kept values not scaled by 1 / (1 - p)",
        "the forward scaled the kept weights by 1 / (1 - p): so do dV = (P o Z)^T dO / (1 - p) and "
        "dP = (dO V^T) o Z / (1 - p).", lambda c: _dropout_grads(c, rescale=False) if c.params["p"] > 0 else None),
    Bug("dp_not_dropped", "the mask applied to dV but not to dP",
        "O = (P o Z) V / (1 - p) depends on P only through the kept entries: dP = (dO V^T) o Z / (1 - p) before "
        "dS = P o (dP - Delta).", lambda c: _dropout_grads(c, drop_dp=False) if c.params["p"] > 0 else None),
    Bug("mask_transposed", "the mask drawn as keep(cols, rows)",
        "in the K/V-stationary loop the tile is transposed, but the mask is still a function of (query row, key "
        "column): call keep(rows, cols) with the query rows first, and transpose the result if you need Z^T.",
        lambda c: _transposed_mask(c) if c.params["p"] > 0 else None),
    Bug("delta_undropped", "Delta from the undropped output",
        "Delta_i = rowsum(dO_i o O_i) with O the forward's output, which is the dropped one (the o you are "
        "given), not P V.", lambda c: _undropped_o(c) if c.params["p"] > 0 else None),
]


# ----------------------------------------------------------------------------
# the exercises of notebook 08
# ----------------------------------------------------------------------------

register(Exercise(
    "window_tile_bounds",
    ("f(start_m, block_m, block_n, nk, left, right) -> (lo, full_lo, full_hi, hi). Python ints. Q tile start_m "
     "holds rows r0 = start_m*block_m ... r0 + block_m - 1 (treat it as full); query i sees keys i - left ... "
     "i + right (-1: unbounded on that side) that are < nk. The key loop visits [lo, hi) in three stages: "
     "[lo, full_lo) masked, [full_lo, full_hi) unmasked (whole K tiles of block_n keys that every row sees "
     "entirely, none past nk), [full_hi, hi) masked. lo, full_lo, full_hi are multiples of block_n; lo the "
     "largest, hi the smallest (<= nk) that still cover every visible key; the unmasked stage the widest. "
     "No visible key: (0, 0, 0, 0)."),
    _window_cases, _stage_map, _window_ref, _exact, _window_locate, WINDOW_BUGS,
    requirements=("0 <= lo <= full_lo <= full_hi <= hi <= nk", "lo, full_lo, full_hi whole K tiles"), **_PY))

register(Exercise(
    "gqa_head_map",
    ("f(H, H_kv) -> (kv_head, group). Python ints, H % H_kv == 0, G = H // H_kv. kv_head: H ints, the K/V head "
     "query head h reads (consecutive query heads share one, as K/V.repeat_interleave(G, dim=1) would); group: "
     "H_kv lists of G ints, the query heads whose dK/dV the program of K/V head hk sums, in increasing order."),
    _gqa_cases, _gqa_collect, lambda c: _gqa_collect(_gqa_ref_fn, c), _exact,
    lambda case, name, idx: (f"query head {idx[0]}" if name == "kv_head" else f"K/V head {idx[0]}, entry {idx[1]}"),
    GQA_BUGS, **_PY))

register(Exercise(
    "varlen_program_map",
    ("f(pid, cu_seqlens, max_seqlen, block_m, H) -> (seq, head, row0, rows). Python ints; cu_seqlens a list of "
     "S + 1 cumulative lengths (cu_seqlens[0] = 0). The packed forward's grid has cdiv(max_seqlen, block_m) * S * H "
     "programs, the tile index fastest, then the head, then the sequence. Return what program pid computes: its "
     "sequence, its head, row0 the packed row of its tile's first row, and rows the number of the tile's "
     "block_m rows inside the sequence (0 when the tile starts past the sequence's end: it then stores nothing, "
     "and row0 is not checked)."),
    _varlen_cases_typed, _varlen_collect, lambda c: _varlen_collect(varlen_program, c), _exact, _varlen_locate,
    VARLEN_BUGS, **_PY))

register(Exercise(
    "dropout_backward",
    ("f(q, k, v, o, lse, do, p, keep, block_q, block_k) -> (dq, dk, dv). NumPy float64, one (batch, head): q "
     "(Nq, D), k and v (Nk, D), scale 1/sqrt(D), not causal. The forward dropped each weight with the mask "
     "keep(rows, cols) (a function: bool (len(rows), len(cols)), True = kept, the same every time it is asked) "
     "and scaled the kept ones: o = (P o Z) V / (1 - p); lse is the undropped softmax's. Return the gradients "
     "for dO = do, regenerating Z tile by tile (at most block_q x block_k entries per call), never storing it."),
    _dropout_cases, _dropout_run, _dropout_ref, _dropout_tol, _dropout_locate, DROPOUT_BUGS, dtype="float64",
    requirements=("the mask regenerated tile by tile: no keep() call larger than one tile",), **_PY))
