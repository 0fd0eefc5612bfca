"""Notebook 09's graded exercises (NumPy, float64, no Triton): the split-KV merge, the zigzag shard
indices, and one ring step in one process.

* ``merge_partials(o_parts, lse_parts) -> (o, lse)``: S normalised partial results over disjoint
  key sets (a split-KV decode's splits) merged by log-sum-exp; reference
  :func:`flashlab.reference.merge_partials`.
* ``zigzag_indices(rank, world, n) -> indices``: the global rows rank ``rank`` holds in the zigzag
  layout; the grader calls it for every rank; reference :func:`flashlab.distributed.layout.positions`.
* ``ring_step(q, k, v, q_pos, k_pos, o, lse, causal) -> (o, lse)``: attend a rank's queries to the
  K/V block it holds, masked by global position, and merge into its state; cases are real steps of
  zigzag and contiguous rings; reference :func:`flashlab.reference.ring_step`.

Each exercise is declared once here (contract, cases, run, reference, tolerance, locate, known
bugs, requirements) and registered in :data:`flashlab.grader.exercises.EXERCISES`.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ... import reference as R
from ...distributed import layout as L
from .. import requirements as Rq
from ..core import Bug, Case, Exercise
from . import register
from .part1 import _array, _describe   # the NumPy exercises' checks of what a function returned

NUMPY_LIMITS = dict(timeout=60.0, budget=100.0, dtype="float64", notebook="09",
                    requirements=("no call to flashlab.reference, flashlab.attention or flashlab.distributed",))

CONTRACTS = {
    "merge_partials": (
        "merge_partials(o_parts, lse_parts) -> (o, lse). o_parts: (S, N, D) float64, the normalised outputs of S "
        "splits of the keys (each O_s = softmax over its own keys times V); lse_parts: (S, N), each split's "
        "natural-log log-sum-exp; a split with no keys for a row has lse = -inf (ignore its O). Return o (N, D) "
        "and lse (N,): LSE = log sum_s e^(LSE_s), O = sum_s e^(LSE_s - LSE) O_s, computed without overflow "
        "(LSE_s may be in the thousands). A row that no split saw (every LSE_s = -inf) gets O = 0 and LSE = -inf "
        "(never NaN)."),
    "zigzag_indices": (
        "zigzag_indices(rank, world, n) -> 1-d array of n // world ints: the global rows (0..n-1) that rank "
        "`rank` of `world` holds in the zigzag layout, in its local order. The sequence is cut into 2*world "
        "equal chunks; rank r holds chunk r, then chunk 2*world - 1 - r. n is divisible by 2*world."),
    "ring_step": (
        "ring_step(q, k, v, q_pos, k_pos, o, lse, causal) -> (o, lse). One ring step on one rank: q (n, D) "
        "this rank's queries at global positions q_pos (n,) ints; k, v (m, D) the K/V block it holds now, at "
        "global positions k_pos (m,); the state o (n, D) (normalised output so far) and lse (n,) (-inf: no key "
        "seen yet). Scale 1/sqrt(D). With causal, the query at position p sees the keys at positions <= p. "
        "Return the state after this block: (o, lse) merged by log-sum-exp; a row that sees no key of this "
        "block keeps its state (no NaN)."),
}


# ----------------------------------------------------------------------------
# shared: outputs as arrays, calls into the references watched
# ----------------------------------------------------------------------------

def _watch(found):
    """Note the first call into flashlab's references, flashlab.attention or flashlab.distributed."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return Rq.watch_calls(found, dirs={os.path.join(root, "distributed") + os.sep: "flashlab.distributed"})


def _call(f, name, *args):
    found = []
    with _watch(found):
        out = f(*args)
    msg = [f"your code calls {found[0]}: the exercise asks for your own {name}, written with NumPy "
           f"(the reference is what your answer is compared with)."] if found else []
    return out, msg


def _pair(out, names, exercise, res):
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        res["_contract"].append(f"{exercise} must return a pair ({', '.join(names)}): got {_describe(out)}")
        return res
    for name, x in zip(names, out):
        a = _array(name, x, res["_contract"])
        if a is not None:
            res[name] = a
    return res


def _tol(case, name, ref):
    return 1e-8 * max(1.0, float(np.nanmax(np.abs(np.where(np.isfinite(ref), ref, 0)))))


# ----------------------------------------------------------------------------
# merge_partials
# ----------------------------------------------------------------------------

def _parts(rng, s, n, d, nk=None, large=False, empty=0):
    """S splits of real attention: queries against S disjoint key sets; ``empty`` splits hold no key
    for the last rows (a sequence shorter than the split grid: lse = -inf, O = 0 as a kernel writes it)."""
    nk = nk or 8 * s
    q = rng.standard_normal((n, d)) * (60.0 if large else 1.0)
    k, v = rng.standard_normal((nk, d)), rng.standard_normal((nk, d))
    cuts = np.linspace(0, nk, s + 1).astype(int)
    o, lse = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        oo, ll = R.attention_naive(q, k[a:b], v[a:b])
        o.append(oo)
        lse.append(ll)
    o, lse = np.stack(o), np.stack(lse)
    if large:
        lse += 900.0                          # what unscaled logits in the thousands give: e^LSE overflows
    for j in range(empty):                    # the last splits see nothing for the second half of the rows
        o[s - 1 - j, n // 2:] = 0.0
        lse[s - 1 - j, n // 2:] = -np.inf
    return {"o_parts": o, "lse_parts": lse}


def _merge_cases(rng):
    spec = [(4, 3, 8, False, 0, True), (1, 5, 4, False, 0, False), (7, 6, 16, False, 0, False),
            (3, 4, 8, True, 0, False), (5, 8, 8, False, 2, False), (2, 4, 4, True, 1, False),
            (3, 6, 8, False, 3, False)]           # every split empty for the last rows: O = 0, LSE = -inf
    s, n = (int(x) for x in rng.integers(2, 12, size=2))
    spec.append((s, n, int(rng.choice([4, 8, 32])), bool(rng.integers(2)), int(rng.integers(0, s)), False))
    return [Case({"S": s, "N": n, "D": d, "rows": "empty splits" if e else "all splits hold keys",
                  "check": f"S={s} splits"},
                 _parts(rng, s, n, d, large=big, empty=e), visible=vis, large=big)
            for s, n, d, big, e, vis in spec]


def _merge_run(f, case):
    i = case.inputs
    out, msg = _call(f, "merge", i["o_parts"].copy(), i["lse_parts"].copy())
    return _pair(out, ("o", "lse"), "merge_partials", {"_violations": msg, "_contract": []})


def _merge_ref(case):
    o, lse = R.merge_partials(case.inputs["o_parts"], case.inputs["lse_parts"])
    return {"o": o, "lse": lse}


def _merge_bug(fn):
    def outputs(case):
        with np.errstate(all="ignore"):
            o, lse = fn(case.inputs["o_parts"], case.inputs["lse_parts"])
        return {"o": np.asarray(o, float), "lse": np.asarray(lse, float)}
    return outputs


def _no_max(o, lse):
    w = np.exp(lse)
    return (w[..., None] * o).sum(0) / w.sum(0)[..., None], np.log(w.sum(0))


def _not_divided(o, lse):
    m = lse.max(0)
    w = np.exp(lse - m)
    return (w[..., None] * o).sum(0), m + np.log(w.sum(0))


def _base2(o, lse):
    m = lse.max(0)
    w = np.exp2(lse - m)
    return (w[..., None] * o).sum(0) / w.sum(0)[..., None], m + np.log2(w.sum(0))


def _lse_is_max(o, lse):
    m = lse.max(0)
    w = np.exp(lse - m)
    return (w[..., None] * o).sum(0) / w.sum(0)[..., None], m


def _mean(o, lse):
    return o.mean(0), R.merge_partials(o, lse)[1]


MERGE_BUGS = [
    Bug("no_max", "e^LSE_s without subtracting the largest LSE",
        "e^LSE_s overflows to inf once LSE_s passes ~709 (inf/inf = NaN). Subtract m = max_s LSE_s first: "
        "w_s = e^(LSE_s - m) <= 1, LSE = m + log sum_s w_s.", _merge_bug(_no_max), nan_ok=True),
    Bug("not_divided", "the weighted sum not divided by the sum of the weights",
        "with w_s = e^(LSE_s - m), O = sum_s w_s O_s / sum_s w_s: each O_s is already normalised over its own "
        "keys, so the weights must sum to 1.", _merge_bug(_not_divided)),
    Bug("base2", "exp2/log2 on a natural-log LSE",
        "the LSE here is natural log (torch.logsumexp's): use np.exp and np.log. Kernels that work in base 2 "
        "convert at the boundary.", _merge_bug(_base2)),
    Bug("lse_is_max", "LSE = max_s LSE_s",
        "the merged LSE is the log of the summed mass of every split: m + log sum_s e^(LSE_s - m), not only the "
        "largest split's.", _merge_bug(_lse_is_max)),
    Bug("mean", "O = the mean of the O_s",
        "splits weigh by their softmax mass e^(LSE_s - LSE), not equally: a split whose keys score low adds "
        "little.", _merge_bug(_mean)),
]


# ----------------------------------------------------------------------------
# zigzag_indices
# ----------------------------------------------------------------------------

def _zz_cases(rng):
    spec = [(2, 8), (4, 64), (1, 6), (3, 36), (8, 160), (5, 20)]
    w = int(rng.integers(2, 9))
    spec.append((w, 2 * w * int(rng.integers(1, 9))))
    return [Case({"world": w, "N": n, "check": f"world={w}"}, {}, visible=(i == 0)) for i, (w, n) in enumerate(spec)]


def _zz_collect(fn, case, problems=None):
    w, n = case.params["world"], case.params["N"]
    rows = []
    for r in range(w):
        out = fn(r, w, n)
        a = _array("indices", out, problems if problems is not None else [])
        if a is None:
            return None
        a = np.asarray(a).reshape(-1)
        if a.shape != (n // w,):
            if problems is not None:
                problems.append(f"`indices` of rank {r} has {a.size} entries; a rank holds n // world = {n // w} rows")
            return None
        rows.append(a.astype(np.float64))
    return np.stack(rows)


def _zz_run(f, case):
    res = {"_contract": []}
    found = []
    with _watch(found):
        a = _zz_collect(f, case, res["_contract"])
    res["_violations"] = [f"your code calls {found[0]}: write the indices yourself (they are what the layout "
                          f"helpers compute)"] if found else []
    if a is not None:
        res["indices"] = a
    return res


def _zz_ref(case):
    w, n = case.params["world"], case.params["N"]
    return {"indices": np.array([L.positions(r, w, n, "zigzag") for r in range(w)], dtype=np.float64)}


def _zz_locate(case, name, idx):
    r, i = idx[0], idx[1]
    c = case.params["N"] // (2 * case.params["world"])
    half = "first" if i < c else "second"
    return f"rank {r}, local row {i} (its {half} chunk)"


def _chunks(fn):
    def rows(r, w, n):
        c = n // (2 * w)
        return [i for ch in fn(r, w) for i in range(ch * c, (ch + 1) * c)]
    return lambda case: {"indices": np.array([rows(r, case.params["world"], case.params["N"])
                                              for r in range(case.params["world"])], dtype=np.float64)}


ZZ_BUGS = [
    Bug("contiguous", "contiguous rows, not the zigzag",
        "rank r holds two chunks of n / (2·world) rows: chunk r and chunk 2·world - 1 - r (its mirror), not "
        "the rows [r·n/world, (r+1)·n/world).",
        lambda case: {"indices": np.array([L.positions(r, case.params["world"], case.params["N"], "contiguous")
                                           for r in range(case.params["world"])], dtype=np.float64)}),
    Bug("mirror_off_by_one", "the mirror chunk is 2·world - r",
        "chunks are numbered 0 .. 2·world - 1, so the mirror of chunk r is 2·world - 1 - r (rank 0 holds the "
        "first and the last chunk).", _chunks(lambda r, w: (r, 2 * w - r))),
    Bug("second_is_world_plus_r", "the second chunk is world + r",
        "world + r deals the halves out in the same order, so rank world - 1 still holds the two latest "
        "chunks and causal work is not balanced: mirror it, 2·world - 1 - r.", _chunks(lambda r, w: (r, w + r))),
    Bug("order_swapped", "the late chunk first",
        "keep the local rows in sequence order: chunk r, then chunk 2·world - 1 - r (ring attention's causal "
        "plan and the diagonal block rely on it).", _chunks(lambda r, w: (2 * w - 1 - r, r))),
]


# ----------------------------------------------------------------------------
# ring_step
# ----------------------------------------------------------------------------

def _ring_cases(rng):
    """Real ring steps: a rank's state after the steps before, and the block of this step."""
    spec = [("zigzag", 2, 1, 1, True, False, True), ("zigzag", 4, 2, 0, True, False, False),
            ("zigzag", 4, 1, 3, True, False, False), ("contiguous", 3, 0, 1, True, False, False),
            ("contiguous", 4, 3, 2, False, False, False), ("zigzag", 3, 0, 2, True, True, False),
            ("contiguous", 2, 1, 0, True, True, False)]
    w = int(rng.integers(2, 6))
    spec.append((str(rng.choice(L.LAYOUTS)), w, int(rng.integers(w)), int(rng.integers(w)),
                 bool(rng.integers(2)), False, False))
    cases = []
    for layout, w, rank, step, causal, big, vis in spec:
        c = int(rng.integers(2, 5))
        n = c * L.num_chunks(w, layout)
        d = int(rng.choice([4, 8]))
        q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
        if big:
            q = q * 2000.0                    # scores in the thousands: e^LSE overflows float64
        pos = [np.array(L.positions(r, w, n, layout)) for r in range(w)]
        o, lse = np.zeros((len(pos[rank]), d)), np.full(len(pos[rank]), -np.inf)
        for s in range(step):
            src = pos[L.step_source(rank, w, s)]
            o, lse = R.ring_step(q[pos[rank]], k[src], v[src], pos[rank], src, o, lse, causal)
        src = pos[L.step_source(rank, w, step)]
        inputs = {"q": q[pos[rank]], "k": k[src], "v": v[src], "q_pos": pos[rank].copy(), "k_pos": src.copy(),
                  "o": o, "lse": lse}
        where = "no key of this block visible to some rows" if causal and (src.min() > pos[rank].min()) else ""
        cases.append(Case({"layout": layout, "world": w, "rank": rank, "step": step, "causal": causal,
                           "N": n, "D": d, "rows": where or f"block of rank {L.step_source(rank, w, step)}",
                           "check": f"{layout}, world={w}, rank {rank}, step {step}"},
                          inputs, visible=vis, large=big))
    return cases


def _ring_args(case):
    i = case.inputs
    return (i["q"].copy(), i["k"].copy(), i["v"].copy(), i["q_pos"].copy(), i["k_pos"].copy(), i["o"].copy(),
            i["lse"].copy(), case.params["causal"])


def _ring_run(f, case):
    out, msg = _call(f, "ring step", *_ring_args(case))
    return _pair(out, ("o", "lse"), "ring_step", {"_violations": msg, "_contract": []})


def _ring_ref(case):
    o, lse = R.ring_step(*_ring_args(case))
    return {"o": o, "lse": lse}


def _ring_locate(case, name, idx):
    i = idx[0]
    return f"local query row {i} (global position {int(case.inputs['q_pos'][i])})"


def _block(q, k, v, mask):
    """(o_b, lse_b) of q against the block with a boolean mask, no guard for empty rows."""
    s = (q @ k.T) / math.sqrt(q.shape[1])
    s = np.where(mask, s, -np.inf)
    m = s.max(1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(1, keepdims=True)
    return (p / l) @ v, (m + np.log(l))[:, 0]


def _ring_bug(kind):
    def outputs(case):
        q, k, v, qp, kp, o, lse, causal = _ring_args(case)
        with np.errstate(all="ignore"):
            glob = (kp[None, :] <= qp[:, None]) if causal else np.ones((len(qp), len(kp)), bool)
            if kind == "local_mask":             # positions 0..n-1: np.tril on the block
                ob, lb = R.ring_step(q, k, v, np.arange(len(qp)), np.arange(len(kp)), np.zeros_like(o),
                                     np.full_like(lse, -np.inf), causal)
                return dict(zip(("o", "lse"), R.merge_partials(np.stack([o, ob]), np.stack([lse, lb]))))
            if kind == "no_mask":
                return dict(zip(("o", "lse"), R.ring_step(q, k, v, qp, kp, o, lse, False)))
            if kind == "replace":
                ob, lb = R.ring_step(q, k, v, qp, kp, np.zeros_like(o), np.full_like(lse, -np.inf), causal)
                return {"o": ob, "lse": lb}
            if kind == "nan_on_empty":
                ob, lb = _block(q, k, v, glob)
                m = np.maximum(lse, lb)
                w1, w2 = np.exp(lse - m), np.exp(lb - m)
                return {"o": (w1[:, None] * np.nan_to_num(o) + w2[:, None] * ob) / (w1 + w2)[:, None],
                        "lse": m + np.log(w1 + w2)}
            if kind == "no_max_merge":
                ob, lb = R.ring_step(q, k, v, qp, kp, np.zeros_like(o), np.full_like(lse, -np.inf), causal)
                w1, w2 = np.exp(lse), np.exp(lb)
                return {"o": (w1[:, None] * o + w2[:, None] * ob) / (w1 + w2)[:, None], "lse": np.log(w1 + w2)}
        raise AssertionError(kind)
    return outputs


RING_BUGS = [
    Bug("local_mask", "the causal mask by local row index",
        "a rank's rows are not at 0..n-1 of the sequence: compare global positions, key k_pos[j] visible to "
        "query q_pos[i] when k_pos[j] <= q_pos[i] (np.tril of the block is only right for the diagonal block "
        "of the contiguous layout).", _ring_bug("local_mask")),
    Bug("no_mask", "no causal mask", "with causal, mask the scores where k_pos[j] > q_pos[i] to -inf before the "
        "softmax.", _ring_bug("no_mask")),
    Bug("replace", "the state replaced by this block's result",
        "a step adds keys to what the rank has seen: merge (o, lse) with the block's (O_b, LSE_b) by log-sum-exp, "
        "do not overwrite it.", _ring_bug("replace")),
    Bug("nan_on_empty", "NaN where a row sees no key of the block",
        "a fully masked row has max = -inf and e^(s - max) = e^(nan); and before the first block lse = -inf "
        "too. Give such a part weight 0: use 0 in place of an -inf max, and keep the state where the block "
        "adds nothing.", _ring_bug("nan_on_empty"), nan_ok=True),
    Bug("no_max_merge", "merge weights e^LSE without the max",
        "e^LSE overflows for scores in the hundreds: weigh by e^(LSE - m), m = max(lse, LSE_b).",
        _ring_bug("no_max_merge"), nan_ok=True),
]


register(Exercise(
    "merge_partials", CONTRACTS["merge_partials"], _merge_cases, _merge_run, _merge_ref, _tol,
    lambda case, name, idx: f"row {idx[0]}", MERGE_BUGS, **NUMPY_LIMITS))
register(Exercise(
    "zigzag_indices", CONTRACTS["zigzag_indices"], _zz_cases, _zz_run, _zz_ref, lambda c, n, r: 0.0,
    _zz_locate, ZZ_BUGS, **NUMPY_LIMITS))
register(Exercise(
    "ring_step", CONTRACTS["ring_step"], _ring_cases, _ring_run, _ring_ref, _tol, _ring_locate, RING_BUGS,
    **NUMPY_LIMITS))
