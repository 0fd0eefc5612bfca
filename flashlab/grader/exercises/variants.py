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

Beyond the values: a call into code that already holds the answer (flashlab.variants, flashlab's references
and kernels, this module's references; torch's autograd for the backward) is refused; dropout_backward may ask
keep() for one tile at a time and, on a 1024 x 1024 case, peak below 3/4 of the mask's size in bools (so a
stored mask, or the tiles of one kept, shows); gqa_head_map's pair must agree with itself.  Each exercise's
cases include edges that land exactly on a tile boundary, where an off-by-one changes the answer, and the
named bugs are the slips a learner makes (floor for ceil, an edge one key off, h % G, a search of cu_seqlens,
a mask drawn with tile-local indices or scaled twice, ...).
"""
from __future__ import annotations

import math

import numpy as np

import os
from contextlib import contextmanager

from ...reference import dropout_keep, dropout_rate
from ...variants import band_tile_ranges, varlen_program
from .. import requirements as Rq
from ..core import Bug, Case, Exercise
from . import register

_PY = dict(timeout=60.0, budget=100.0, notebook="08", bugs_exact=True)   # the bugs' outputs exact: two slips show


def _exact(case, name, ref):
    return 0.0


# ----------------------------------------------------------------------------
# library code handed in: flashlab's own versions of these answers, the grader's references
# ----------------------------------------------------------------------------

_HERE = os.path.abspath(__file__)
_ALLOWED_HERE = {"keep", "watched", "_watch"}   # the mask function handed to dropout_backward; the watcher


def _watch(found: list, autograd: bool = False):
    """Note the first call into code that already holds the answer: flashlab.variants (its band_tile_ranges,
    varlen_program, dropout_mask), flashlab.op, flashlab's references and kernels, this grader's own
    references (and, for a backward, torch's autograd)."""
    root = Rq._flashlab_dir()
    lib = {os.path.join(root, "variants.py"): "flashlab.variants", os.path.join(root, "op.py"): "flashlab.op"}
    return Rq.watch_calls(found, files=lib, own=(_HERE, __name__, _ALLOWED_HERE), autograd=autograd)


def _library_message(found: list, what: str) -> list:
    if not found:
        return []
    if found[0].startswith("torch's autograd"):
        return [f"your code calls {found[0]}: the exercise asks for the {what} written out (dV, dP, dS, dQ, dK "
                f"as in the equations, tile by tile), not derived by autograd"]
    return [f"your code calls {found[0]}: the exercise asks for your own {what}, not flashlab's (which is what "
            f"your answer is compared with)"]


# ----------------------------------------------------------------------------
# window_tile_bounds: f(start_m, block_m, block_n, nk, left, right) -> (lo, full_lo, full_hi, hi)
# ----------------------------------------------------------------------------

# (nq, nk, block_m, block_n, left, right): windows both sides, causal (right 0), unbounded (-1), a band that
# misses the keys (nq > nk), a right edge that lands on a tile's first key (right = 1), ragged tiles; and edges
# that land exactly on a tile boundary, where an off-by-one shows: left = block_m - 1 + block_n (full_lo),
# right = block_n - 1 (full_hi), left = 1 (mod block_n) (lo), the window 1024 as (255, 0) of 128 x 64
WINDOW_SHAPES = [(256, 256, 64, 32, 40, 0), (300, 300, 64, 64, 100, 0), (200, 180, 32, 64, 17, 5),
                 (128, 128, 32, 32, 0, 1), (250, 100, 64, 32, 0, 4), (150, 150, 64, 16, -1, 7),
                 (150, 140, 16, 64, 9, -1), (100, 100, 32, 32, -1, -1), (77, 301, 32, 64, 130, 130),
                 (129, 129, 128, 32, 64, 0), (122, 18, 16, 64, 0, 0), (256, 256, 64, 32, 95, 0),
                 (200, 230, 32, 32, 65, 31), (1024, 1024, 128, 64, 255, 0)]

_STAGE = {0: "never loaded", 1: "masked", 2: "unmasked"}


def _stage_map(fn, case, watch=False):
    """For every (Q tile, K tile): 0 never loaded, 1 masked stage, 2 unmasked stage; plus contract problems."""
    p = case.params
    nq, nk, bm, bn = p["nq"], p["nk"], p["block_m"], p["block_n"]
    tq, tk = -(-nq // bm), -(-nk // bn)
    out = np.zeros((tq, tk))
    problems, found = [], []
    for t in range(tq):
        if watch:
            with _watch(found):
                got = fn(t, bm, bn, nk, p["left"], p["right"])
        else:
            got = fn(t, bm, bn, nk, p["left"], p["right"])
        if not (isinstance(got, (tuple, list)) and len(got) == 4):
            return {"_contract": [f"return a 4-tuple (lo, full_lo, full_hi, hi), got {got!r}"]}
        lo, flo, fhi, hi = (int(x) for x in got)
        if hi == 0 and lo == flo == fhi == 0:
            continue
        if not (0 <= lo <= flo <= fhi <= hi <= nk):
            why = ""
            if 0 <= lo <= hi <= nk:             # lo and hi fine: the unmasked run's edges are not clamped
                why = ("; a band narrower than block_m + block_n - 1 has no unmasked tile: " if flo > fhi else
                       "; ") + "clamp full_lo into [lo, hi] and full_hi into [full_lo, hi]"
            problems.append(f"Q tile {t}: got (lo, full_lo, full_hi, hi) = {(lo, flo, fhi, hi)}; they must satisfy "
                            f"0 <= lo <= full_lo <= full_hi <= hi <= nk = {nk} (or be (0, 0, 0, 0) for no key)" + why)
            break
        if (lo % bn and lo != hi) or (flo % bn and flo != hi) or (fhi % bn and fhi != hi):
            problems.append(f"Q tile {t}: lo = {lo}, full_lo = {flo}, full_hi = {fhi} must be multiples of block_n "
                            f"= {bn} (or equal to hi): they are key offsets where a K tile starts (the loops step "
                            f"by block_n from lo), not tile numbers")
            break
        for c0 in range(lo, hi, bn):
            out[t, c0 // bn] = 2 if flo <= c0 < fhi else 1
    if problems:
        return {"_contract": problems}
    res = {"stage": out}
    if watch:
        res["_violations"] = _library_message(found, "band bounds")
    return res


def _window_run(fn, case):
    return _stage_map(fn, case, watch=True)


def _window_ref(case):
    return _stage_map(lambda t, bm, bn, nk, l, r: band_tile_ranges(t * bm, bm, bn, nk, l, r), case)


class _WindowCase(Case):
    def describe(self) -> str:
        p = self.params
        return (f"Nq={p['nq']}, Nk={p['nk']}, block_m={p['block_m']}, block_n={p['block_n']}, "
                f"window=({p['left']}, {p['right']})")


def _window_cases(rng):
    Case = _WindowCase  # noqa: N806
    cases = []
    for i, (nq, nk, bm, bn, left, right) in enumerate(WINDOW_SHAPES):
        cases.append(Case({"nq": nq, "nk": nk, "block_m": bm, "block_n": bn, "left": left, "right": right}, {},
                          visible=(i == 0)))
    for _ in range(2):
        nq, nk = (int(x) for x in rng.integers(40, 500, size=2))
        bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
        left = int(rng.choice([-1, 0, int(rng.integers(1, 200))]))
        right = int(rng.choice([-1, 0, int(rng.integers(1, 50))]))
        cases.append(Case({"nq": nq, "nk": nk, "block_m": bm, "block_n": bn, "left": left, "right": right}, {}))
    return cases


def _window_locate(case, name, idx):
    bm, bn, nq, nk = case.params["block_m"], case.params["block_n"], case.params["nq"], case.params["nk"]
    t, u = idx[0], idx[1]
    r1 = (t + 1) * bm - 1                   # the tile's last row, as the bounds take it (a full tile)
    want = int(_window_ref(case)["stage"][t, u])
    why = {0: "no row of the Q tile sees a key of this K tile, so it must not be loaded",
           1: "some but not all of its (row, key) pairs are visible (or it runs past Nk): it needs the mask",
           2: "every row of the Q tile sees every key of this K tile: it belongs to the unmasked stage"}[want]
    rows = f"rows {t * bm} to {min(r1, nq - 1)}" + (f"; taken as full, to row {r1}" if r1 >= nq else "")
    return (f"Q tile {t} ({rows}), K tile {u} (keys {u * bn} to {min((u + 1) * bn, nk) - 1}) "
            f"[stage codes: 0 never loaded, 1 masked, 2 unmasked; expected {want} ({_STAGE[want]}): {why}]")


def _big(x):
    return (1 << 40) if x < 0 else x


def _wbug(fn):
    return lambda case: _stage_map(fn, case)


def _bounds(t, bm, bn, nk, left, right, first_off=0, lo_ceil=False, flo_off=0, flo_floor=False, fhi_off=0,
            fhi_ceil=False):
    """band_tile_ranges written out, with one mistake switched on (for the named bugs)."""
    r0, before, after = t * bm, _big(left), _big(right)
    first = max(r0 - before + first_off, 0)
    hi = min(r0 + bm + after, nk)
    if first >= hi:
        return 0, 0, 0, 0
    lo = (-(-first // bn) if lo_ceil else first // bn) * bn
    a = max(r0 + bm - 1 - before + flo_off, 0)
    flo = (a // bn if flo_floor else -(-a // bn)) * bn
    b = min(r0 + after + 1 + fhi_off, nk)
    fhi = (-(-b // bn) if fhi_ceil else b // bn) * bn
    lo = min(lo, hi)
    flo = min(max(flo, lo), hi)
    return lo, flo, min(max(fhi, flo), hi), hi


def _no_missing_check(t, bm, bn, nk, left, right):
    r0, before, after = t * bm, _big(left), _big(right)
    hi = min(r0 + bm + after, nk)
    lo = min(max(r0 - before, 0) // bn * bn, hi)
    flo = min(max(-(-max(r0 + bm - 1 - before, 0) // bn) * bn, lo), hi)
    fhi = min(max(min(r0 + after + 1, nk) // bn * bn, flo), hi)
    return lo, flo, fhi, hi


def _first_row_for_left(t, bm, bn, nk, left, right):
    return _bounds(t, bm, bn, nk, left, right, flo_off=-(bm - 1))     # full_lo from r0 - left


def _last_row_for_right(t, bm, bn, nk, left, right):
    return _bounds(t, bm, bn, nk, left, right, fhi_off=bm - 1)        # full_hi from r0 + block_m - 1 + right


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


def _all_unmasked(t, bm, bn, nk, left, right):
    lo, _, _, hi = band_tile_ranges(t * bm, bm, bn, nk, left, right)
    return lo, lo, hi, hi


def _all_masked(t, bm, bn, nk, left, right):
    lo, _, _, hi = band_tile_ranges(t * bm, bm, bn, nk, left, right)
    return lo, lo, lo, hi


def _with(**kw):
    return lambda t, bm, bn, nk, left, right: _bounds(t, bm, bn, nk, left, right, **kw)


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
    Bug("no_masked_stage", "every visited tile run without the mask",
        "only K tiles that every row of the Q tile sees entirely may skip the mask; the tiles crossing the band's "
        "edges (and a ragged last tile) must be masked, or keys outside the window enter the softmax. The left "
        "edge of the unmasked run is set by the row whose band starts furthest right, the right edge by the row "
        "whose band ends furthest left (and by nk); round each inward to a whole K tile, clamp both into [lo, hi].",
        _wbug(_all_unmasked)),
    Bug("no_unmasked_stage", "every visited tile run with the mask",
        "this is correct but pays the mask on every tile: the middle stage [full_lo, full_hi) must be the widest "
        "run of K tiles that every row sees entirely. Which row of the Q tile has the band that starts furthest "
        "right, and which the band that ends furthest left? Their edges, rounded inward to whole K tiles, bound "
        "the run.",
        _wbug(_all_masked)),
    Bug("full_hi_rounded_up", "full_hi rounded UP to a whole K tile",
        "the unmasked stage may only hold tiles wholly inside the band: round min(r0 + right + 1, nk) DOWN "
        "(// block_n * block_n); rounding up lets the tile crossing the right edge (or the ragged end) run "
        "without its mask.", _wbug(_with(fhi_ceil=True))),
    Bug("full_lo_rounded_down", "full_lo rounded DOWN to a whole K tile",
        "the unmasked stage starts at the first K tile lying wholly right of the last row's left edge "
        "r0 + block_m - 1 - left: round UP (ceil) to a tile start; rounding down lets the tile crossing the left "
        "edge run without its mask.", _wbug(_with(flo_floor=True))),
    Bug("ragged_tile_unmasked", "the ragged last K tile counted as unmasked",
        "a K tile that runs past Nk needs the masked loads: full_hi is at most (nk // block_n) * block_n.",
        _wbug(_ragged_unmasked)),
    Bug("lo_rounded_up", "lo rounded UP to a whole K tile",
        "lo is the start of the K tile that HOLDS the first visible key max(r0 - left, 0): round down "
        "(first // block_n * block_n); rounding up skips the tile where the band begins.",
        _wbug(_with(lo_ceil=True))),
    Bug("first_key_off_by_one", "the first visible key one too far right",
        "row r0 sees keys r0 - left ... r0 + right, both ends INCLUDED: the first key is max(r0 - left, 0), not "
        "r0 - left + 1. When r0 - left is the last key of a K tile, that tile is never loaded.",
        _wbug(_with(first_off=1))),
    Bug("hi_off_by_one", "the end one key short",
        "the last row r0 + block_m - 1 sees keys up to r0 + block_m - 1 + right INCLUDED: the exclusive end is "
        "min(r0 + block_m + right, nk). One short, a tile whose first key is that last key is never loaded.",
        _wbug(_hi_off_by_one)),
    Bug("full_lo_off_by_one", "full_lo one key too far right",
        "the last row r0 + block_m - 1 sees keys from r0 + block_m - 1 - left on (included): full_lo = "
        "ceil((r0 + block_m - 1 - left) / block_n) * block_n. From r0 + block_m - left, a tile that every row sees "
        "runs masked whenever the edge falls on a tile boundary (correct, but the unmasked stage is not the "
        "widest).", _wbug(_with(flo_off=1))),
    Bug("full_hi_off_by_one", "full_hi one key too far left",
        "the first row r0 sees keys up to r0 + right INCLUDED, so the exclusive end of what it sees is "
        "r0 + right + 1: full_hi = min(r0 + right + 1, nk) // block_n * block_n. Without the + 1, a tile whose last "
        "key is r0 + right runs masked (correct, but the unmasked stage is not the widest).",
        _wbug(_with(fhi_off=-1))),
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


def _gqa_collect(fn, case, watch=False):
    H, Hk = case.params["H"], case.params["H_kv"]
    found = []
    if watch:
        with _watch(found):
            got = fn(H, Hk)
    else:
        got = fn(H, Hk)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return {"_contract": [f"return a pair (kv_head, group), got {got!r}"]}
    try:
        kv, grp = np.asarray(got[0], dtype=np.float64), np.asarray(got[1], dtype=np.float64)
    except (TypeError, ValueError):
        return {"_contract": [f"kv_head and group must be lists of ints (group: H_kv lists of equal length), got "
                              f"{got!r}"]}
    contract = []
    if kv.shape != (H,):
        contract.append(f"kv_head: shape {kv.shape}, expected ({H},): one K/V head per query head")
    if grp.shape != (Hk, H // Hk):
        contract.append(f"group: shape {grp.shape}, expected ({Hk}, {H // Hk}): the query heads of each K/V head")
    if contract:
        return {"_contract": contract}
    out = {"kv_head": kv, "group": grp}
    if watch:
        out["_violations"] = _library_message(found, "head mapping") + _gqa_consistency(kv, grp, H, Hk)
    return out


def _gqa_consistency(kv, grp, H, Hk):
    """What is wrong with the pair as a mapping, said once each (beside the values' comparison)."""
    G = H // Hk
    for name, a in (("kv_head", kv), ("group", grp)):
        bad = np.argwhere(a != np.round(a))
        if bad.size:
            i = tuple(int(x) for x in bad[0])
            return [f"{name}{list(i)} = {a[i]:g} is not a whole number: a head is an index, so use integer "
                    f"division (h // G), not h / G"]
    bad = np.argwhere((kv < 0) | (kv >= Hk))
    if bad.size:
        h = int(bad[0][0])
        return [f"kv_head[{h}] = {kv[h]:g} is not a K/V head: there are H_kv = {Hk} (0 ... {Hk - 1})"]
    bad = np.argwhere((grp < 0) | (grp >= H))
    if bad.size:
        i, j = (int(x) for x in bad[0])
        return [f"group[{i}][{j}] = {grp[i, j]:g} is not a query head: there are H = {H} (0 ... {H - 1})"]
    for hk in range(Hk):
        row = [int(x) for x in grp[hk]]
        if row != sorted(row):
            return [f"group[{hk}] = {row} is not in increasing order"]
    for h in range(H):
        hk = int(kv[h])
        if h not in {int(x) for x in grp[hk]}:
            where = [i for i in range(Hk) if h in {int(x) for x in grp[i]}]
            return [f"kv_head and group disagree: query head {h} reads K/V head {hk} (kv_head[{h}] = {hk}), but "
                    f"group[{hk}] = {[int(x) for x in grp[hk]]} does not list it"
                    + (f" (group[{where[0]}] does)" if where else "")
                    + f": the dK/dV program of K/V head hk sums exactly the G = {G} query heads that read it"]
    return []


def _gqa_run(fn, case):
    return _gqa_collect(fn, case, watch=True)


def _gqa_ref_fn(H, Hk):
    g = H // Hk
    return [h // g for h in range(H)], [[hk * g + i for i in range(g)] for hk in range(Hk)]


def _kv_only(kv_fn):
    """A mistake in kv_head alone (whatever the candidate's group): compared on kv_head only."""
    return lambda c: {"kv_head": np.asarray([kv_fn(h, c.params["H"], c.params["H_kv"])
                                             for h in range(c.params["H"])], dtype=np.float64)}


def _group_only(g_fn):
    def out(c):
        H, Hk = c.params["H"], c.params["H_kv"]
        return {"group": np.asarray([[g_fn(hk, i, H, Hk) for i in range(H // Hk)] for hk in range(Hk)],
                                    dtype=np.float64)}
    return out


GQA_BUGS = [
    Bug("interleaved", "query head h mapped to K/V head h % H_kv",
        "consecutive query heads share a K/V head (K/V is repeated with repeat_interleave, not repeat): "
        "kv_head = h // (H // H_kv), and K/V head hk serves query heads hk*G ... hk*G + G - 1.",
        _kv_only(lambda h, H, Hk: h % Hk)),
    Bug("modulo_group", "query head h mapped to K/V head h % G",
        "h % G is h's position INSIDE its group (0 ... G - 1), not the group: the K/V head is the group number, "
        "kv_head = h // G with G = H // H_kv.", _kv_only(lambda h, H, Hk: h % (H // Hk))),
    Bug("divided_by_kv_heads", "h // H_kv instead of h // G",
        "divide by the group size G = H // H_kv (query heads per K/V head), not by H_kv; and K/V head hk serves "
        "query heads hk*G ... hk*G + G - 1 (steps of G, not of H_kv).",
        lambda c: [_kv_only(lambda h, H, Hk: h // Hk)(c), _group_only(lambda hk, i, H, Hk: hk * Hk + i)(c)]),
    Bug("group_interleaved", "group[hk] listed as hk, hk + H_kv, hk + 2*H_kv, ...",
        "that is the group of K/V.repeat (heads interleaved); with repeat_interleave the G query heads of K/V head "
        "hk are consecutive: hk*G, hk*G + 1, ..., hk*G + G - 1.", _group_only(lambda hk, i, H, Hk: hk + i * Hk)),
    Bug("group_one_based", "the group's query heads counted from 1",
        "heads are numbered from 0: K/V head hk serves query heads hk*G + i for i = 0 ... G - 1.",
        _group_only(lambda hk, i, H, Hk: hk * (H // Hk) + i + 1)),
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


def _varlen_collect(fn, case, watch=False):
    p = case.params
    cu, bm, H = list(p["cu_seqlens"]), p["block_m"], p["H"]
    mx = max(max(b - a for a, b in zip(cu[:-1], cu[1:])), 1)
    nt = -(-mx // bm)
    n = nt * (len(cu) - 1) * H
    rows, found = [], []
    for pid in range(n):
        try:
            if watch:
                with _watch(found):
                    got = fn(pid, list(cu), mx, bm, H)
            else:
                got = fn(pid, list(cu), mx, bm, H)
        except Exception as e:
            e.add_note(f"(raised for program pid = {pid} of {n}: the grid has cdiv(max_seqlen = {mx}, block_m = "
                       f"{bm}) = {nt} tiles per (sequence, head), S = {len(cu) - 1} sequences, H = {H} heads)")
            raise
        if not (isinstance(got, (tuple, list)) and len(got) == 4):
            return {"_contract": [f"return a 4-tuple (seq, head, row0, rows), got {got!r} for pid {pid}"]}
        rows.append([float(x) for x in got])
    a = np.asarray(rows)
    ref_rows = np.asarray([r[3] for r in _vref(case)[0]], dtype=np.float64)
    out = {"seq": a[:, 0], "head": a[:, 1], "rows": a[:, 3]}
    out["row0"] = np.where(ref_rows > 0, a[:, 2], 0.0)      # a program that stores nothing may say any row0
    if watch:
        out["_violations"] = _library_message(found, "program map")
    return out


def _varlen_run(fn, case):
    return _varlen_collect(fn, case, watch=True)


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


def _vref(case):
    """The reference as a list of (seq, head, row0, rows), one per program, and max_seqlen."""
    p = case.params
    cu, bm, H = list(p["cu_seqlens"]), p["block_m"], p["H"]
    mx = max(max(b - a for a, b in zip(cu[:-1], cu[1:])), 1)
    return [varlen_program(pid, cu, mx, bm, H) for pid in range(-(-mx // bm) * (len(cu) - 1) * H)], mx


def _vcol(case, name, f):
    """One output column, f(pid, seq, head, row0, rows, cu, max_seqlen, block_m, H) per program."""
    ref, mx = _vref(case)
    p = case.params
    vals = [f(pid, *r, list(p["cu_seqlens"]), mx, p["block_m"], p["H"]) for pid, r in enumerate(ref)]
    if name == "row0":
        vals = [v if r[3] > 0 else 0 for v, r in zip(vals, ref)]
    return np.asarray(vals, dtype=np.float64)


def _tiles_from_total(pid, cu, mx, bm, H):
    n_tiles = -(-cu[-1] // bm)
    tile, bh = pid % n_tiles, pid // n_tiles
    b, h = bh // H, bh % H
    if b >= len(cu) - 1:
        return 0, 0, 0, 0
    return b, h, cu[b] + tile * bm, max(0, min(bm, cu[b + 1] - cu[b] - tile * bm))


def _swapped(pid, cu, mx, bm, H):
    S = len(cu) - 1
    tile, bh = pid % -(-mx // bm), pid // -(-mx // bm)
    b, h = bh % S, bh // S
    return b, h, cu[b] + tile * bm, max(0, min(bm, cu[b + 1] - cu[b] - tile * bm))


def _searched(side, off):
    def seq(pid, b, h, r0, n, cu, mx, bm, H):
        s = int(np.searchsorted(np.asarray(cu), r0, side=side)) - off
        return min(max(s, 0), len(cu) - 2)
    return seq


VARLEN_BUGS = [
    Bug("local_row", "row0 counted from the sequence's start, not the packed tensor's",
        "the sequence's rows are cu_seqlens[b] ... cu_seqlens[b + 1] - 1 of the packed tensor: row0 = "
        "cu_seqlens[b] + tile * block_m.",
        lambda c: {"row0": _vcol(c, "row0", lambda pid, b, h, r0, n, cu, mx, bm, H: r0 - cu[b])}),
    Bug("padded_row0", "row0 as in a padded (S, max_seqlen) layout",
        "the packed tensor has no padding: sequence b starts at row cu_seqlens[b], not at b * max_seqlen, so "
        "row0 = cu_seqlens[b] + tile * block_m.",
        lambda c: {"row0": _vcol(c, "row0", lambda pid, b, h, r0, n, cu, mx, bm, H: b * mx + r0 - cu[b])}),
    Bug("rows_not_clamped", "rows not clamped to [0, block_m]",
        "a tile past the sequence's end has no rows (0, not a negative number), and a tile inside it has at most "
        "block_m: rows = max(0, min(block_m, length - tile * block_m)).",
        lambda c: [{"rows": _vcol(c, "rows", f)} for f in (
            lambda pid, b, h, r0, n, cu, mx, bm, H: cu[b + 1] - r0,
            lambda pid, b, h, r0, n, cu, mx, bm, H: min(bm, cu[b + 1] - r0),
            lambda pid, b, h, r0, n, cu, mx, bm, H: max(0, cu[b + 1] - r0))]),
    Bug("rows_full_tile", "every tile that starts inside the sequence counted as block_m rows",
        "the last tile of a sequence is usually partial: rows = min(block_m, length - tile * block_m) (and 0 past "
        "the end); the kernel masks its loads and stores with it.",
        lambda c: {"rows": _vcol(c, "rows", lambda pid, b, h, r0, n, cu, mx, bm, H: bm if r0 < cu[b + 1] else 0)}),
    Bug("rows_one_short", "rows counted to cu_seqlens[b + 1] - 1",
        "cu_seqlens[b + 1] is one PAST the sequence's last row: the length is cu_seqlens[b + 1] - cu_seqlens[b], "
        "and rows = max(0, min(block_m, length - tile * block_m)).",
        lambda c: {"rows": _vcol(c, "rows", lambda pid, b, h, r0, n, cu, mx, bm, H: max(0, min(bm, cu[b + 1] - 1 - r0)))}),
    Bug("head_fastest", "(sequence, head) index fastest instead of the tile",
        "the grid puts the tile index fastest (pid % n_tiles), as program_tile does, so that programs launched "
        "together share a (sequence, head) and its K/V stay in L2.",
        _vbug(lambda pid, cu, mx, bm, H: varlen_program(
            (pid % ((len(cu) - 1) * H)) * -(-mx // bm) + pid // ((len(cu) - 1) * H), cu, mx, bm, H))),
    Bug("sequence_head_swapped", "sequence and head swapped in the grid order",
        "after the tile comes the head, then the sequence: with bh = pid // n_tiles, head = bh % H and "
        "seq = bh // H (not seq = bh % S, head = bh // S).",
        lambda c: (lambda o: {"seq": o["seq"], "head": o["head"]})(_varlen_collect(_swapped, c))),
    Bug("tiles_from_total", "tiles per sequence counted from the packed length",
        "the grid has cdiv(max_seqlen, block_m) tiles per (sequence, head): the longest sequence's, not the "
        "packed total's.", _vbug(_tiles_from_total)),
    Bug("sequence_searched", "the sequence found by searching cu_seqlens for the tile's row",
        "a program's sequence comes from its id, seq = (pid // n_tiles) // H; a search of cu_seqlens for row0 "
        "(np.searchsorted, bisect) cannot tell an empty sequence (cu_seqlens repeats a value there) and puts a "
        "tile past a short sequence's end in the next sequence.",
        lambda c: [{"seq": _vcol(c, "seq", _searched(side, off))} for side, off in (("right", 1), ("left", 1),
                                                                                    ("left", 0))]),
]


def _varlen_locate(case, name, idx):
    p = case.params
    pid = idx[0]
    ref, mx = _vref(case)
    b, h, r0, n = ref[pid]
    cu = p["cu_seqlens"]
    nt = -(-mx // p["block_m"])
    tile = pid % nt
    return (f"program pid = {pid} (block_m = {p['block_m']}, H = {p['H']}, {nt} tiles per (sequence, head)): "
            f"it computes tile {tile} of sequence {b}, head {h}; sequence {b} is "
            + (f"packed rows {cu[b]} ... {cu[b + 1] - 1} (length {cu[b + 1] - cu[b]})" if cu[b + 1] > cu[b]
               else f"empty (cu_seqlens[{b}] = cu_seqlens[{b + 1}] = {cu[b]})"))


# ----------------------------------------------------------------------------
# dropout_backward: f(q, k, v, o, lse, do, p, keep, block_q, block_k) -> (dq, dk, dv)
# ----------------------------------------------------------------------------

def keep_function(seed: int, p: float):
    """The kernels' dropout mask for one (batch, head): keep(rows, cols) -> bool (len(rows), len(cols)), True =
    kept, a pure function of (seed, row, column) -- forward v4's Philox bits, from their NumPy copy
    (flashlab.reference.dropout_keep, batch * H + head = 0)."""
    def keep(rows, cols):
        return dropout_keep(seed, 0, rows, cols, p)
    return keep


_MEMORY_CASE = (1024, 1024, 8, 0.1, 64, 32)      # large enough that a stored mask shows in the memory peak


def _dropout_cases(rng):
    spec = [(32, 32, 16, 0.2, 16, 16, True), (40, 70, 8, 0.3, 16, 8, False), (70, 40, 16, 0.5, 32, 16, False),
            (37, 37, 16, 0.0, 16, 16, False), (53, 61, 16, 0.1, 8, 32, False), (1, 9, 8, 0.4, 4, 4, False),
            _MEMORY_CASE + (False,)]
    cases = []
    for nq, nk, d, p_asked, bq, bk, vis in spec:
        q, k, v = rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, d))
        seed = int(rng.integers(0, 2**31))
        p = dropout_rate(p_asked)                    # the kernels apply p in 1/256ths (one random byte a score)
        o, lse = _dropout_forward(q, k, v, p, keep_function(seed, p))
        do = rng.standard_normal((nq, d))
        params = {"Nq": nq, "Nk": nk, "D": d, "p": p, "block_q": bq, "block_k": bk, "seed": seed}
        if (nq, nk, d, p_asked, bq, bk) == _MEMORY_CASE:
            params["check"] = "memory bound"
        cases.append(Case(params, {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do}, vis))
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


def _dropout_grads(case, z=None, zscale=None, delta_from=None, drop_dp=True, drop_dv=True, drop_ds=False,
                   delta_div=1.0, scale_p=True, scale_grads=True, rescale_dp=True):
    """dQ, dK, dV of the case (the reference), or with one mistake switched on (the named bugs)."""
    i = case.inputs
    q, k, v, o, lse, do, p = i["q"], i["k"], i["v"], i["o"], i["lse"], i["do"], case.params["p"]
    if z is None:
        z = keep_function(case.params["seed"], p)(np.arange(q.shape[0]), np.arange(k.shape[0]))
    sc = 1 / math.sqrt(q.shape[1])
    P = np.exp((sc if scale_p else 1.0) * (q @ k.T) - lse[:, None])
    zs = z / (1 - p) if zscale is None else z * zscale
    dv = (P * zs).T @ do if drop_dv else P.T @ do
    dp = do @ v.T
    if drop_dp:
        dp = dp * (zs if rescale_dp else z)
    delta = (do * (o if delta_from is None else delta_from)).sum(1) / delta_div
    ds = P * (dp - delta[:, None])
    if drop_ds:
        ds = ds * zs
    g = sc if scale_grads else 1.0
    return {"dq": g * ds @ k, "dk": g * ds.T @ q, "dv": dv}


def _dropout_run(f, case):
    i = case.inputs
    p = case.params
    keep = keep_function(p["seed"], p["p"])
    calls = []

    def watched(rows, cols):
        r, c = np.asarray(rows).reshape(-1), np.asarray(cols).reshape(-1)
        calls.append(r.size * c.size)
        return keep(r, c)

    args = (i["q"].copy(), i["k"].copy(), i["v"].copy(), i["o"].copy(), i["lse"].copy(), i["do"].copy(), p["p"],
            watched, p["block_q"], p["block_k"])
    found, peak = [], []
    memory = p.get("check") == "memory bound"
    with (Rq.peak_memory(peak) if memory else _nothing()):
        with _watch(found, autograd=True):
            out = f(*args)
    res = {"_contract": [], "_violations": _library_message(found, "backward")}
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
        res["_violations"].append("keep() was never called: the backward must regenerate the forward's mask "
                                  "(the same keep(rows, cols) the forward used), not draw a new one or skip it")
    nq, nk = p["Nq"], p["Nk"]
    if memory and peak and peak[0] > nq * nk * 3 // 4:
        res["_violations"].append(
            f"your code's memory peaked at {peak[0] / 2**20:.2f} MiB on this {nq} x {nk} case, while the whole mask "
            f"Z as bools is {nq * nk / 2**20:.2f} MiB (the scores P in float64: {nq * nk * 8 / 2**20:.0f} MiB): hold "
            f"one block_q x block_k tile of Z (and of P) at a time and let it go; do not keep the tiles keep() gave "
            f"you, nor assemble Z, P or S whole")
    return res


@contextmanager
def _nothing():
    yield


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


def _tile_local_mask(case):
    """Z drawn with each tile's own row and column numbers (0 ... block - 1) instead of the global ones."""
    p = case.params
    nq, nk, bq, bk = p["Nq"], p["Nk"], p["block_q"], p["block_k"]
    keep = keep_function(p["seed"], p["p"])
    z = np.zeros((nq, nk), dtype=bool)
    for i0 in range(0, nq, bq):
        for j0 in range(0, nk, bk):
            r, c = min(bq, nq - i0), min(bk, nk - j0)
            z[i0:i0 + r, j0:j0 + c] = keep(np.arange(r), np.arange(c))
    return _dropout_grads(case, z=z)


def _inverted_mask(case):
    nq, nk = case.params["Nq"], case.params["Nk"]
    return _dropout_grads(case, z=~keep_function(case.params["seed"], case.params["p"])(np.arange(nq), np.arange(nk)))


def _undropped_o(case):
    i = case.inputs
    P = np.exp((i["q"] @ i["k"].T) / math.sqrt(i["q"].shape[1]) - i["lse"][:, None])
    return _dropout_grads(case, delta_from=P @ i["v"])


def _if_dropping(fn):
    return lambda c: fn(c) if c.params["p"] > 0 else None


DROPOUT_BUGS = [
    Bug("no_rescale", "kept values not scaled by 1 / (1 - p)",
        "the forward scaled the kept weights by 1 / (1 - p): so do dV = (P o Z)^T dO / (1 - p) and "
        "dP = (dO V^T) o Z / (1 - p).", _if_dropping(lambda c: _dropout_grads(c, zscale=1.0))),
    Bug("wrong_rescale", "kept values scaled by (1 - p) or by 1 / (1 - p)^2",
        "the kept weights are scaled by exactly 1 / (1 - p), once: Z / (1 - p) in dV and in dP (not Z * (1 - p), "
        "and not a second time in the other).",
        _if_dropping(lambda c: [_dropout_grads(c, zscale=1 - c.params["p"]),
                                _dropout_grads(c, zscale=1 / (1 - c.params["p"]) ** 2)])),
    Bug("dp_not_dropped", "the mask applied to dV but not to dP",
        "O = (P o Z) V / (1 - p) depends on P only through the kept entries: dP = (dO V^T) o Z / (1 - p) before "
        "dS = P o (dP - Delta).", _if_dropping(lambda c: _dropout_grads(c, drop_dp=False))),
    Bug("dp_not_rescaled", "dP masked but not scaled by 1 / (1 - p)",
        "dP = (dO V^T) o Z / (1 - p): the same 1 / (1 - p) as in dV.",
        _if_dropping(lambda c: _dropout_grads(c, rescale_dp=False))),
    Bug("dv_not_dropped", "the mask applied to dP but not to dV",
        "dV = (P o Z)^T dO / (1 - p): the values only receive gradient through the weights the forward kept.",
        _if_dropping(lambda c: _dropout_grads(c, drop_dv=False))),
    Bug("ds_dropped", "the mask applied again to dS",
        "Z enters once, in dP = (dO V^T) o Z / (1 - p); then dS = P o (dP - Delta) with the undropped P, no second "
        "Z.", _if_dropping(lambda c: _dropout_grads(c, drop_ds=True))),
    Bug("mask_transposed", "the mask drawn as keep(cols, rows)",
        "in the K/V-stationary loop the tile is transposed, but the mask is still a function of (query row, key "
        "column): call keep(rows, cols) with the query rows first, and transpose the result if you need Z^T.",
        _if_dropping(_transposed_mask)),
    Bug("tile_local_indices", "keep() asked with each tile's own indices (0 ... block - 1)",
        "the mask is a function of the GLOBAL query row and key column, as the kernel's Philox counters are: for "
        "the tile at (i0, j0) call keep(np.arange(i0, i0 + rows), np.arange(j0, j0 + cols)).",
        _if_dropping(_tile_local_mask)),
    Bug("mask_inverted", "keep() read as the DROPPED entries",
        "keep(rows, cols) is True where a weight is KEPT (the fraction 1 - p); use it as Z directly, not ~Z.",
        _if_dropping(_inverted_mask)),
    Bug("delta_undropped", "Delta from the undropped output",
        "Delta_i = rowsum(dO_i o O_i) with O the forward's output, which is the dropped one (the o you are "
        "given), not P V.", _if_dropping(_undropped_o)),
    Bug("delta_rescaled", "Delta divided by (1 - p)",
        "Delta_i = rowsum(dO_i o O_i) with the o you are given: that O already carries the 1 / (1 - p); do not "
        "scale Delta again.", _if_dropping(lambda c: _dropout_grads(c, delta_div=1 - c.params["p"]))),
    Bug("scores_unscaled", "P recomputed without the scale 1/sqrt(D)",
        "the forward's P = exp(s Q K^T - L) with s = 1/sqrt(D): recompute it with the same s (lse was computed "
        "from the scaled scores).", lambda c: _dropout_grads(c, scale_p=False)),
    Bug("grads_unscaled", "dQ and dK without the scale 1/sqrt(D)",
        "S = s Q K^T, so dQ = s dS K and dK = s dS^T Q: the chain rule brings the factor s = 1/sqrt(D) into both.",
        lambda c: _dropout_grads(c, scale_grads=False)),
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
     "entirely, none past nk), [full_hi, hi) masked. lo, full_lo, full_hi are key offsets, multiples of block_n "
     "(full_lo and full_hi may also equal hi); lo the "
     "largest, hi the smallest (<= nk) that still cover every visible key; the unmasked stage the widest. "
     "No visible key: (0, 0, 0, 0)."),
    _window_cases, _window_run, _window_ref, _exact, _window_locate, WINDOW_BUGS,
    requirements=("0 <= lo <= full_lo <= full_hi <= hi <= nk", "lo, full_lo, full_hi whole K tiles",
                  "your own code: no call of flashlab.variants (band_tile_ranges) or the grader's reference"),
    hint=("Work the failing Q tile out by hand with the case's numbers: which keys its first row r0 and its last row "
          "r0 + block_m - 1 see; lo is the start of the K tile holding the first key any row sees, hi one past the "
          "last; full_lo and full_hi bound the K tiles lying wholly inside both rows' ranges. Then compare with what "
          "your function returns for that tile."), **_PY))

register(Exercise(
    "gqa_head_map",
    ("f(H, H_kv) -> (kv_head, group). Python ints, H % H_kv == 0, G = H // H_kv. kv_head: H ints, the K/V head "
     "query head h reads (consecutive query heads share one, as K/V.repeat_interleave(G, dim=1) would); group: "
     "H_kv lists of G ints, the query heads whose dK/dV the program of K/V head hk sums, in increasing order."),
    _gqa_cases, _gqa_run, lambda c: _gqa_collect(_gqa_ref_fn, c), _exact,
    lambda case, name, idx: (f"query head {idx[0]}" if name == "kv_head" else f"K/V head {idx[0]}, entry {idx[1]}"),
    GQA_BUGS, requirements=("kv_head and group agree: group[hk] lists exactly the query heads h with "
                            "kv_head[h] == hk, in increasing order",),
    hint=("Write kv_head and group out by hand for the failing case's H and H_kv (G = H // H_kv query heads per K/V "
          "head, consecutive ones sharing it) and compare them with yours, head by head."), **_PY))

register(Exercise(
    "varlen_program_map",
    ("f(pid, cu_seqlens, max_seqlen, block_m, H) -> (seq, head, row0, rows). Python ints; cu_seqlens a list of "
     "S + 1 cumulative lengths (cu_seqlens[0] = 0). The packed forward's grid has cdiv(max_seqlen, block_m) * S * H "
     "programs, the tile index fastest, then the head, then the sequence. Return what program pid computes: its "
     "sequence, its head, row0 the packed row of its tile's first row, and rows the number of the tile's "
     "block_m rows inside the sequence (0 when the tile starts past the sequence's end: it then stores nothing, "
     "and row0 is not checked)."),
    _varlen_cases_typed, _varlen_run, lambda c: _varlen_collect(varlen_program, c), _exact, _varlen_locate,
    VARLEN_BUGS, requirements=("your own code: no call of flashlab.variants (varlen_program)",), **_PY))

register(Exercise(
    "dropout_backward",
    ("f(q, k, v, o, lse, do, p, keep, block_q, block_k) -> (dq, dk, dv). NumPy float64, one (batch, head): q "
     "(Nq, D), k and v (Nk, D), scale 1/sqrt(D), not causal. The forward dropped each weight with the mask "
     "keep(rows, cols) (a function: bool (len(rows), len(cols)), True = kept, the same every time it is asked) "
     "and scaled the kept ones: o = (P o Z) V / (1 - p); lse is the undropped softmax's. Return the gradients "
     "for dO = do, written out (no autograd), regenerating Z tile by tile (at most block_q x block_k entries per "
     "call, global row and column indices), never storing it whole."),
    _dropout_cases, _dropout_run, _dropout_ref, _dropout_tol, _dropout_locate, DROPOUT_BUGS, dtype="float64",
    requirements=("the mask regenerated tile by tile: no keep() call larger than one tile",
                  "nothing N x N kept: on a 1024 x 1024 case the memory peak stays under 3/4 of the mask's size in "
                  "bools (no stored tiles of Z, no P or S whole)",
                  "the backward written out: no torch autograd, no flashlab reference"), **_PY))
