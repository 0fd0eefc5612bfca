"""Notebook 08's four exercises under attack: right answers written several ways pass; plausible wrong ones
(off-by-one band edges, floor for ceil, h % G for h // G, a search of cu_seqlens, a mask drawn with the wrong
indices or scaled wrongly, a mask stored whole, library code handed in) fail, and the feedback names the
mistake and says where.  Plain Python and NumPy: no kernel runs here.
"""
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from flashlab import variants
from flashlab.grader import grade
from flashlab.grader.exercises import EXERCISES

ROOT = Path(__file__).resolve().parents[1]
BIG = 1 << 40


def _solutions():
    """The solution functions of solutions/08_variants.ipynb (its graded cells, without the grade() calls)."""
    nb = json.loads((ROOT / "solutions" / "08_variants.ipynb").read_text())
    ns = {"math": math, "np": np}
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and "### BEGIN SOLUTION" in src:
            exec(re.sub(r"^grade\(.*$", "", src, flags=re.M), ns)
    return ns


SOL = _solutions()


def test_the_four_exercises_are_notebook_08s():
    assert {n for n, ex in EXERCISES.items() if ex.notebook == "08"} == {
        "window_tile_bounds", "gqa_head_map", "varlen_program_map", "dropout_backward"}


# ----------------------------------------------------------------------------------------- window_tile_bounds

def _b(x):
    return BIG if x < 0 else x


def _bounds(t, bm, bn, nk, left, right, first_off=0, lo_ceil=False, flo_off=0, flo_floor=False, fhi_off=0,
            fhi_ceil=False, clamp=True, cap_hi=True, miss=True):
    """A learner's answer written from the statement, with one slip switched on."""
    r0, L, R = t * bm, _b(left), _b(right)
    first = max(r0 - L + first_off, 0)
    hi = min(r0 + bm + R, nk) if cap_hi else r0 + bm + R
    if miss and first >= hi:
        return 0, 0, 0, 0
    lo = (-(-first // bn) if lo_ceil else first // bn) * bn
    a = max(r0 + bm - 1 - L + flo_off, 0)
    flo = (a // bn if flo_floor else -(-a // bn)) * bn
    b = min(r0 + R + 1 + fhi_off, nk)
    fhi = (-(-b // bn) if fhi_ceil else b // bn) * bn
    if clamp:
        lo = min(lo, hi)
        flo = min(max(flo, lo), hi)
        fhi = min(max(fhi, flo), hi)
    return lo, flo, fhi, hi


def _brute(t, bm, bn, nk, left, right):
    r0 = t * bm
    vis = lambda i, j: (left < 0 or j >= i - left) and (right < 0 or j <= i + right)  # noqa: E731
    keys = [j for j in range(nk) if (left < 0 or j >= r0 - left) and (right < 0 or j <= r0 + bm - 1 + right)]
    if not keys:
        return 0, 0, 0, 0
    lo, hi = keys[0] // bn * bn, keys[-1] + 1
    full = [c0 for c0 in range(lo, hi, bn) if c0 + bn <= nk and vis(r0 + bm - 1, c0) and vis(r0, c0 + bn - 1)]
    return (lo, full[0], full[-1] + bn, hi) if full else (lo, lo, lo, hi)


def _hi_tile_aligned(t, bm, bn, nk, left, right):
    """hi rounded up to a K tile (capped at nk), the stages clamped to it: the same loop, so right too."""
    lo, _, _, hi = _bounds(t, bm, bn, nk, left, right)
    if hi == 0:
        return 0, 0, 0, 0
    hi = min(-(-hi // bn) * bn, nk)
    flo = min(max(-(-max(t * bm + bm - 1 - _b(left), 0) // bn) * bn, lo), hi)
    return lo, flo, min(max(min(t * bm + _b(right) + 1, nk) // bn * bn, flo), hi), hi


WINDOW_RIGHT = [SOL["window_tile_bounds"], _bounds, _brute, _hi_tile_aligned, lambda *a: list(_bounds(*a)),
                lambda *a: tuple(np.int64(x) for x in _bounds(*a))]

WINDOW_WRONG = [
    (dict(lo_ceil=True), "lo rounded UP"),
    (dict(first_off=1), "first visible key one too far right"),
    (dict(flo_floor=True), "full_lo rounded DOWN"),
    (dict(fhi_ceil=True), "full_hi rounded UP"),
    (dict(flo_off=1), "full_lo one key too far right"),
    (dict(fhi_off=-1), "full_hi one key too far left"),
    (dict(miss=False), "a band that misses every key still visits a tile"),
    (dict(clamp=False), "must satisfy 0 <= lo <= full_lo"),
    (dict(cap_hi=False), "<= hi <= nk"),
    ("all unmasked", "every visited tile run without the mask"),
    ("all masked", "every visited tile run with the mask"),
    ("tile numbers", "not tile numbers"),
    ("first row binds left", "unmasked tiles start where the FIRST row's window starts"),
    ("last row binds right", "unmasked tiles end where the LAST row's window ends"),
    ("hi one short", "the end one key short"),
    ("-1 as 0", "-1 (unbounded) read as 0"),
    ("library", "calls flashlab.variants.band_tile_ranges"),
]


def _window_attempt(spec):
    if isinstance(spec, dict):
        return lambda *a: _bounds(*a, **spec)
    if spec == "all unmasked":
        return lambda *a: (lambda lo, f, g, hi: (lo, lo, hi, hi))(*_bounds(*a))
    if spec == "all masked":
        return lambda *a: (lambda lo, f, g, hi: (lo, lo, lo, hi))(*_bounds(*a))
    if spec == "tile numbers":
        return lambda t, bm, bn, *r: tuple(x // bn if i < 3 else -(-x // bn)
                                           for i, x in enumerate(_bounds(t, bm, bn, *r)))
    if spec == "first row binds left":          # full_lo from the first row's left edge
        return lambda t, bm, bn, nk, l, r: _bounds(t, bm, bn, nk, l, r, flo_off=-(bm - 1))
    if spec == "last row binds right":          # full_hi from the last row's right edge
        return lambda t, bm, bn, nk, l, r: _bounds(t, bm, bn, nk, l, r, fhi_off=bm - 1)
    if spec == "hi one short":
        def f(t, bm, bn, nk, l, r):
            lo, flo, fhi, hi = _bounds(t, bm, bn, nk, l, r)
            hi = min(t * bm + bm - 1 + _b(r), nk)
            return (0, 0, 0, 0) if max(t * bm - _b(l), 0) >= hi else (lo, min(flo, hi), min(fhi, hi), hi)
        return f
    if spec == "-1 as 0":
        return lambda t, bm, bn, nk, l, r: _bounds(t, bm, bn, nk, max(l, 0), max(r, 0))
    if spec == "library":
        return lambda t, bm, bn, nk, l, r: variants.band_tile_ranges(t * bm, bm, bn, nk, l, r)
    raise KeyError(spec)


# ----------------------------------------------------------------------------------------- gqa_head_map

def _gqa(kv, grp):
    return lambda H, Hk: ([kv(h, H, Hk) for h in range(H)],
                          [[grp(hk, i, H, Hk) for i in range(H // Hk)] for hk in range(Hk)])


_KV = lambda h, H, Hk: h // (H // Hk)              # noqa: E731
_GRP = lambda hk, i, H, Hk: hk * (H // Hk) + i      # noqa: E731

def _gqa_torch(H, Hk):
    import torch
    kv = torch.arange(Hk).repeat_interleave(H // Hk)          # as K/V would be repeated for SDPA
    return kv.tolist(), [torch.nonzero(kv == hk).flatten().tolist() for hk in range(Hk)]


GQA_RIGHT = [SOL["gqa_head_map"], _gqa(_KV, _GRP), _gqa_torch,
             lambda H, Hk: (np.arange(H) // (H // Hk), np.arange(H).reshape(Hk, H // Hk)),
             lambda H, Hk: (tuple(h * Hk // H for h in range(H)),
                            tuple(tuple(range(hk * H // Hk, (hk + 1) * H // Hk)) for hk in range(Hk)))]

GQA_WRONG = [
    (_gqa(lambda h, H, Hk: h % Hk, lambda hk, i, H, Hk: hk + i * Hk), "h % H_kv"),
    (_gqa(lambda h, H, Hk: h % (H // Hk), _GRP), "h % G"),
    (_gqa(lambda h, H, Hk: h // Hk, _GRP), "h // H_kv instead of h // G"),
    (_gqa(_KV, lambda hk, i, H, Hk: hk * Hk + i), "h // H_kv instead of h // G"),
    (_gqa(_KV, lambda hk, i, H, Hk: hk + i * Hk), "group[hk] listed as hk, hk + H_kv"),
    (_gqa(_KV, lambda hk, i, H, Hk: hk * (H // Hk) + i + 1), "counted from 1"),
    (_gqa(_KV, lambda hk, i, H, Hk: hk * (H // Hk) + (H // Hk) - 1 - i), "not in increasing order"),
    (_gqa(lambda h, H, Hk: h / (H // Hk), _GRP), "not a whole number"),
    (_gqa(lambda h, H, Hk: round(h / (H // Hk)), _GRP), "is not a K/V head"),
    (_gqa(lambda h, H, Hk: (h + 1) // (H // Hk) % Hk, _GRP), "kv_head and group disagree: query head"),
    (lambda H, Hk: ([[_GRP(hk, i, H, Hk) for i in range(H // Hk)] for hk in range(Hk)],
                    [_KV(h, H, Hk) for h in range(H)]), "expected (8,): one K/V head per query head"),
]


# ----------------------------------------------------------------------------------------- varlen_program_map

def _vl(pid, cu, mx, bm, H, n_tiles=None, order="tile-head-seq", row0="packed", rows="clamped", search=None):
    """A learner's varlen_program_map, with one slip switched on."""
    S = len(cu) - 1
    nt = n_tiles(cu, mx, bm) if n_tiles else -(-mx // bm)
    tile, bh = pid % nt, pid // nt
    if order == "head-fastest":
        bh, tile = pid % (S * H), pid // (S * H)
    b, h = (bh // H, bh % H) if order != "seq-then-head" else (bh % S, bh // S)
    if b >= S:
        return 0, 0, 0, 0
    r0 = cu[b] + tile * bm
    if search:
        b = min(max(int(np.searchsorted(np.asarray(cu), r0, side=search[0])) - search[1], 0), S - 1)
    end = cu[b + 1] - (1 if rows == "one short" else 0)
    n = {"clamped": max(0, min(bm, end - r0)), "one short": max(0, min(bm, end - r0)), "raw": end - r0,
         "min only": min(bm, end - r0), "full": bm if r0 < end else 0}[rows]
    r = {"packed": r0, "local": r0 - cu[b], "padded": b * mx + tile * bm}[row0]
    return b, h, r, n


def _vl_divmod(pid, cu, mx, bm, H):
    bh, tile = divmod(pid, (mx + bm - 1) // bm)
    seq, head = divmod(bh, H)
    r0 = cu[seq] + tile * bm
    return seq, head, r0, int(np.clip(cu[seq + 1] - r0, 0, bm))


VARLEN_RIGHT = [SOL["varlen_program_map"], _vl, _vl_divmod,
                lambda pid, cu, mx, bm, H: (lambda s, h, r, n: (s, h, r if n else -1, n))(*_vl(pid, cu, mx, bm, H)),
                lambda pid, cu, mx, bm, H: tuple(np.int32(x) for x in _vl(pid, np.asarray(cu).tolist(), mx, bm, H))]

VARLEN_WRONG = [
    (dict(row0="local"), "row0 counted from the sequence's start"),
    (dict(row0="padded"), "padded (S, max_seqlen) layout"),
    (dict(rows="raw"), "rows not clamped"),
    (dict(rows="min only"), "rows not clamped"),
    (dict(rows="full"), "counted as block_m rows"),
    (dict(rows="one short"), "rows counted to cu_seqlens[b + 1] - 1"),
    (dict(order="head-fastest"), "(sequence, head) index fastest"),
    (dict(order="seq-then-head"), "sequence and head swapped"),
    (dict(n_tiles=lambda cu, mx, bm: -(-cu[-1] // bm)), "counted from the packed length"),
    (dict(search=("right", 1)), "searching cu_seqlens"),
    (dict(search=("left", 1)), "searching cu_seqlens"),
    (dict(search=("left", 0)), "searching cu_seqlens"),
    (dict(n_tiles=lambda cu, mx, bm: max(mx // bm, 1)), "raised for program pid"),     # floor: an IndexError
    ("library", "calls flashlab.variants.varlen_program"),
]


def _varlen_attempt(spec):
    if spec == "library":
        return lambda *a: variants.varlen_program(*a)

    def f(pid, cu, mx, bm, H):
        S, nt = len(cu) - 1, (spec.get("n_tiles") or (lambda cu, mx, bm: -(-mx // bm)))(cu, mx, bm)
        if "n_tiles" in spec and spec["n_tiles"](cu, mx, bm) < -(-mx // bm):
            b = (pid // nt) // H
            return b, 0, cu[b], cu[b + 1] - cu[b]            # indexes past the sequences: raises
        return _vl(pid, cu, mx, bm, H, **spec) if S else None
    return f


# ----------------------------------------------------------------------------------------- dropout_backward

def _drop(bug=None):
    """A learner's tiled NumPy dropout backward; ``bug`` plants one mistake."""
    def f(q, k, v, o, lse, do, p, keep, block_q, block_k):
        nq, d = q.shape
        nk = k.shape[0]
        sc = 1 / math.sqrt(d)
        if bug == "delta from P V":
            o = np.exp(sc * q @ k.T - lse[:, None]) @ v
        delta = (do * o).sum(1) / ((1 - p) if bug == "delta / (1 - p)" else 1)
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        stored = {}
        for i0 in range(0, nq, block_q):
            for j0 in range(0, nk, block_k):
                qi, doi, kj, vj = q[i0:i0 + block_q], do[i0:i0 + block_q], k[j0:j0 + block_k], v[j0:j0 + block_k]
                rows, cols = np.arange(i0, i0 + len(qi)), np.arange(j0, j0 + len(kj))
                if bug == "tile-local indices":
                    z = keep(np.arange(len(qi)), np.arange(len(kj)))
                elif bug == "keep(cols, rows)":
                    z = keep(cols, rows).T
                elif bug == "~keep":
                    z = ~keep(rows, cols)
                elif bug == "fresh random mask":
                    z = np.random.default_rng(0).random((len(qi), len(kj))) >= p
                elif bug == "tiles kept":
                    if not stored:
                        stored.update({(a, b): keep(np.arange(a, min(a + block_q, nq)), np.arange(b, min(b + block_k, nk)))
                                       for a in range(0, nq, block_q) for b in range(0, nk, block_k)})
                    z = stored[i0, j0]
                else:
                    z = keep(rows, cols)
                z_kept = z
                z = z * {"no 1/(1-p)": 1.0, "* (1 - p)": 1 - p, "/ (1 - p)^2": 1 / (1 - p) ** 2}.get(bug, 1 / (1 - p))
                P = np.exp((1.0 if bug == "P unscaled" else sc) * qi @ kj.T - lse[i0:i0 + block_q, None])
                dv[j0:j0 + block_k] += (P.T if bug == "dV undropped" else (P * z).T) @ doi
                dp = doi @ vj.T if bug == "dP undropped" else (doi @ vj.T) * (z_kept if bug == "dP not rescaled" else z)
                ds = P * (dp - delta[i0:i0 + block_q, None]) * (z if bug == "dS dropped" else 1)
                g = 1.0 if bug == "grads unscaled" else sc
                dq[i0:i0 + block_q] += g * ds @ kj
                dk[j0:j0 + block_k] += g * ds.T @ qi
        return dq, dk, dv
    return f


def _drop_whole(q, k, v, o, lse, do, p, keep, block_q, block_k):
    sc = 1 / math.sqrt(q.shape[1])
    z = keep(np.arange(q.shape[0]), np.arange(k.shape[0])) / (1 - p)
    P = np.exp(sc * q @ k.T - lse[:, None])
    ds = P * ((do @ v.T) * z - (do * o).sum(1)[:, None])
    return sc * ds @ k, sc * ds.T @ q, (P * z).T @ do


def _drop_autograd(q, k, v, o, lse, do, p, keep, block_q, block_k):
    import torch
    nq, nk = q.shape[0], k.shape[0]
    z = np.block([[keep(np.arange(a, min(a + block_q, nq)), np.arange(b, min(b + block_k, nk)))
                   for b in range(0, nk, block_k)] for a in range(0, nq, block_q)])
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = (torch.softmax(t[0] @ t[1].T / math.sqrt(q.shape[1]), -1) * torch.tensor(z) / (1 - p)) @ t[2]
    out.backward(torch.tensor(do))
    return tuple(x.grad.numpy() for x in t)


def _drop_reference(q, k, v, o, lse, do, p, keep, block_q, block_k):
    import torch
    from flashlab.reference import attention_variants_torch
    z = torch.tensor(keep(np.arange(q.shape[0]), np.arange(k.shape[0])))
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = attention_variants_torch(*(x[None, None] for x in t), dropout_p=p, dropout_mask=z[None, None])[0]
    out.backward(torch.tensor(do)[None, None])
    return tuple(x.grad.numpy() for x in t)


DROPOUT_RIGHT = [SOL["dropout_backward"], _drop()]

DROPOUT_WRONG = [
    (_drop("no 1/(1-p)"), "not scaled by 1 / (1 - p)"),
    (_drop("* (1 - p)"), "scaled by (1 - p) or by 1 / (1 - p)^2"),
    (_drop("/ (1 - p)^2"), "scaled by (1 - p) or by 1 / (1 - p)^2"),
    (_drop("dP undropped"), "the mask applied to dV but not to dP"),
    (_drop("dV undropped"), "the mask applied to dP but not to dV"),
    (_drop("dP not rescaled"), "dP masked but not scaled by 1 / (1 - p)"),
    (_drop("dS dropped"), "the mask applied again to dS"),
    (_drop("keep(cols, rows)"), "keep(cols, rows)"),
    (_drop("tile-local indices"), "each tile's own indices"),
    (_drop("~keep"), "read as the DROPPED entries"),
    (_drop("delta from P V"), "Delta from the undropped output"),
    (_drop("delta / (1 - p)"), "Delta divided by (1 - p)"),
    (_drop("P unscaled"), "P recomputed without the scale"),
    (_drop("grads unscaled"), "dQ and dK without the scale"),
    (_drop("fresh random mask"), "keep() was never called"),
    (_drop("tiles kept"), "memory peaked"),
    (_drop_whole, "more than one"),
    (_drop_autograd, "not derived by autograd"),
    (_drop_reference, "calls flashlab.reference.attention_variants_torch"),
]


# ----------------------------------------------------------------------------------------- the verdicts

RIGHT = ([("window_tile_bounds", f) for f in WINDOW_RIGHT] + [("gqa_head_map", f) for f in GQA_RIGHT]
         + [("varlen_program_map", f) for f in VARLEN_RIGHT] + [("dropout_backward", f) for f in DROPOUT_RIGHT])

WRONG = ([("window_tile_bounds", _window_attempt(s), w) for s, w in WINDOW_WRONG]
         + [("gqa_head_map", f, w) for f, w in GQA_WRONG]
         + [("varlen_program_map", _varlen_attempt(s), w) for s, w in VARLEN_WRONG]
         + [("dropout_backward", f, w) for f, w in DROPOUT_WRONG])


@pytest.mark.parametrize("name,f", RIGHT, ids=[f"{n}-{i}" for i, (n, _) in enumerate(RIGHT)])
def test_right_answers_pass(name, f):
    r = grade(name, f)
    assert r.passed, str(r)


@pytest.mark.parametrize("name,f,words", WRONG, ids=[f"{n}-{w[:30]}" for n, _, w in WRONG])
def test_wrong_answers_fail_and_say_what_and_where(name, f, words):
    r = str(grade(name, f))
    assert r.startswith("FAILED"), r
    assert words in r, f"expected {words!r} in the feedback:\n{r}"
    if "This looks like a known bug" in r or "Requirement not met" in r:
        return
    # no named bug: the first failure still says where (a tile, a program, a head) and what
    assert re.search(r"Q tile \d|program pid = \d|query head \d|K/V head \d|must|shape|raised for program", r), r


def test_a_named_bug_is_never_a_wrong_diagnosis():
    """Each planted bug is named by its own title, not another's (the bugs' outputs differ somewhere)."""
    for name in ("window_tile_bounds", "gqa_head_map", "varlen_program_map", "dropout_backward"):
        titles = [b.title for b in EXERCISES[name].bugs]
        assert len(set(titles)) == len(titles), name
    r = str(grade("gqa_head_map", _gqa(lambda h, H, Hk: h % (H // Hk), _GRP)))
    assert "h % G" in r and "h // H_kv instead" not in r, r


# ----------------------------------------------------------------------------------------- feedback details

def test_dropout_cases_show_p():
    """Each dropout case line says its p: the p = 0 case, which every mask bug passes, shows why."""
    cases = EXERCISES["dropout_backward"].make_cases(np.random.default_rng(0))
    assert all(f"p={c.params['p']}" in c.describe() for c in cases)
    assert any("p=0.0," in c.describe() for c in cases)
    r = str(grade("dropout_backward", _drop("tile-local indices")))     # right at p = 0 only
    assert re.search(r"✅ hidden case \d+ +Nq=37, Nk=37, D=16, p=0\.0,", r), r


def test_dp_not_rescaled_is_only_a_bug_where_p_is_positive():
    ex = EXERCISES["dropout_backward"]
    bug = next(b for b in ex.bugs if b.key == "dp_not_rescaled")
    for c in ex.make_cases(np.random.default_rng(1)):
        out, ref = bug.outputs(c), ex.reference(c)
        if c.params["p"] == 0:
            assert out is None
        else:
            assert any(np.abs(out[k] - ref[k]).max() > ex.tolerance(c, k, ref[k]) for k in ref)


def _window_unclamped(t, bm, bn, nk, left, right):
    """lo and hi right, full_lo and full_hi computed but never clamped into [lo, hi]."""
    lo, _, _, hi = _bounds(t, bm, bn, nk, left, right)
    if hi == 0:
        return 0, 0, 0, 0
    flo = -(-max(t * bm + bm - 1 - _b(left), 0) // bn) * bn
    return lo, flo, min(t * bm + _b(right) + 1, nk) // bn * bn, hi


def test_window_and_gqa_hints_point_somewhere():
    """No 'equations above the exercise' (their cells have none): an unclamped run is told to clamp, a broken
    contract gets no hint beside its own line, a wrong answer no known bug explains the exercise's own hint."""
    r = str(grade("window_tile_bounds", _window_unclamped))
    assert r.startswith("FAILED") and "Hint:" not in r, r
    assert ("a band narrower than block_m + block_n - 1 has no unmasked tile: clamp full_lo into [lo, hi] and "
            "full_hi into [full_lo, hi]") in r, r
    r = str(grade("window_tile_bounds", lambda t, bm, bn, nk, l, r: _bounds(t, bm, bn, nk, r, l)))  # left/right swapped
    assert r.startswith("FAILED") and "equations above" not in r, r
    assert "Hint: Work the failing Q tile out by hand" in r, r
    r = str(grade("gqa_head_map", _gqa(lambda h, H, Hk: (h + 1) // (H // Hk) % Hk, _GRP)))
    assert r.startswith("FAILED") and "equations above" not in r and "Hint: Write kv_head and group out by hand" in r, r


def test_two_window_slips_are_not_reported_as_one():
    """Both edges bound by the wrong row: the bug named is one of several; one slip alone is not said to be."""
    both = lambda t, bm, bn, nk, l, r: _bounds(t, bm, bn, nk, l, r, flo_off=-(bm - 1), fhi_off=bm - 1)  # noqa: E731
    r = str(grade("window_tile_bounds", both))
    assert "This looks like a known bug (one of possibly several:" in r, r
    for spec in ("first row binds left", "last row binds right"):
        r = str(grade("window_tile_bounds", _window_attempt(spec)))
        assert "This looks like a known bug, " in r and "possibly several" not in r, r


def test_window_locate_stays_inside_the_keys_and_rows():
    ex = EXERCISES["window_tile_bounds"]
    case = next(c for c in ex.make_cases(np.random.default_rng(0)) if c.params["nk"] == 18)     # block_n = 64
    where = ex.locate(case, "stage", (0, 0))
    assert "keys 0 to 17)" in where and "rows 0 to 15)" in where, where
    case = next(c for c in ex.make_cases(np.random.default_rng(0)) if c.params["nq"] == 129)    # block_m = 128
    where = ex.locate(case, "stage", (1, 4))
    assert "rows 128 to 128; taken as full, to row 255)" in where and "keys 128 to 128)" in where, where


# ----------------------------------------------------------------------------------------- notebook 08's record

RECORD = ROOT / "docs" / "bench_h200_2026-12-05_variants.json"     # the variants' latest H200 record
RECORD_H100 = ROOT / "docs" / "bench_h100_2026-12-05_variants_lse_smem.json"   # and the latest H100 one


def _record(path=RECORD) -> dict:
    """(variant, provider) -> row of a record (the latest H200 one unless told)."""
    return {(r["variant"], r["provider"]): r for r in json.loads(path.read_text())["rows"]}


@pytest.mark.parametrize("name,path", [("H200", RECORD), ("H100", RECORD_H100)])
def test_notebook_08_h200_table_is_the_benchmark_record(name, path):
    """The H200 and H100 numbers notebook 08 prints are the variants' latest records', rounded, and labelled as
    recorded."""
    nb = json.loads((ROOT / "notebooks" / "08_variants.ipynb").read_text())
    src = next("".join(c["source"]) for c in nb["cells"] if f"{name} = [" in "".join(c["source"]))
    src = src[src.index(f"{name} = ["):]
    table = eval(src[src.index("["):src.index("]\n") + 1])          # noqa: S307 - our own notebook's literal
    rec = _record(path)
    ours_key = {"GQA": ("gqa", "flashlab"), "window": ("window", "flashlab"), "packed": ("docs", "flashlab varlen"),
                "soft-cap": ("softcap", "flashlab"), "padding": ("padding", "flashlab"),
                "dropout": ("dropout", "flashlab p=0.1")}
    others = {"cuDNN": ("gqa", "sdpa-cudnn"), "SDPA flash": ("gqa", "sdpa-flash"),
              "SDPA efficient": ("padding", "sdpa-efficient"), "without dropout": ("dropout", "flashlab p=0.0")}
    rate = lambda key: (round(rec[key]["fwd_tflops"]), round(rec[key]["bwd_tflops"]))  # noqa: E731
    for name, _shape, ours, flex, other in table:
        variant, provider = next(v for k, v in ours_key.items() if k in name)
        assert ours == rate((variant, provider)), name
        if flex:
            assert flex == rate((variant, "flex")), name
        for label, fwd, bwd in re.findall(r"([A-Za-z][A-Za-z_ ]*?) (\d+) / (\d+)", other):
            key = (variant, "torch varlen_attn") if label.strip() == "varlen_attn" else others[label.strip()]
            assert (int(fwd), int(bwd)) == rate(key), (name, label)
    md = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "recorded" in md and "2026-12-05" in md and path.name in md


def test_notebook_08_links_resolve_and_prose_matches_the_record():
    """Every relative link of notebook 08 (lecture and exercises) names a file of the repository, and the
    dropout cost in the prose is the record's."""
    for folder in ("notebooks", "solutions", "exercises"):
        nb = json.loads((ROOT / folder / "08_variants.ipynb").read_text())
        md = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        for target in re.findall(r"\]\(([^)]+)\)", md):
            if target.startswith(("http://", "https://", "#")):
                continue
            assert (ROOT / folder / target.split("#")[0]).resolve().exists(), (folder, target)
    nb = json.loads((ROOT / "notebooks" / "08_variants.ipynb").read_text())
    md = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    rec = _record()
    t_drop = rec[("dropout", "flashlab p=0.1")]["fwd_ms"] + rec[("dropout", "flashlab p=0.1")]["bwd_ms"]
    t_plain = rec[("dropout", "flashlab p=0.0")]["fwd_ms"] + rec[("dropout", "flashlab p=0.0")]["bwd_ms"]
    assert f"{t_drop:.2f} ms against {t_plain:.2f} ms" in md and f"{t_plain / t_drop:.2f}× the speed" in md
    assert f"about {t_drop / t_plain:.1f}×" in md
