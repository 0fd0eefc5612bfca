"""A plain FA2 backward (Delta kernel, dK/dV kernel, dQ kernel) with switchable mistakes, for grading tests.

Written as a learner might (natural exp, the mask on every tile, its own tile sizes); each flag
reproduces one of the classic backward mistakes the grader must name.
"""
import math

import flashlab  # noqa: F401,I001  (first: it decides GPU vs interpreter before triton is imported)
import torch
import triton
import triton.language as tl


@triton.jit
def _delta(O, DO, Dl, sob, soh, som, sdb, sdh, sdm, H, Nq, BM: tl.constexpr, D: tl.constexpr,
           DELTA_NO_O: tl.constexpr, DELTA16: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rows = pid_m * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    ok = rows[:, None] < Nq
    o = tl.load(O + b * sob + h * soh + rows[:, None] * som + d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + d[None, :], mask=ok, other=0.0)
    if not DELTA16:               # (DELTA16: rowsum(dO o O) in the inputs' dtype)
        o = o.to(tl.float32)
        do = do.to(tl.float32)
    if DELTA_NO_O:
        o = o * 0 + 1
    tl.store(Dl + pid_bh * Nq + rows, tl.sum(o * do, 1), mask=rows < Nq)


@triton.jit
def _dkdv(Q, K, V, DO, L, Dl, DK, DV, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
          skgb, skgh, skgn, svgb, svgh, svgn, slb, slh, slm, H, Nq, Nk, scale,
          CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
          USE_DELTA: tl.constexpr, DELTA_FROM_P: tl.constexpr, SCALE: tl.constexpr, MASK: tl.constexpr,
          STORE_UNSEEN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    cols = pid_n * BN + tl.arange(0, BN)
    d = tl.arange(0, D)
    cok = cols < Nk
    k = tl.load(K + b * skb + h * skh + cols[:, None] * skn + d[None, :], mask=cok[:, None], other=0.0)
    v = tl.load(V + b * svb + h * svh + cols[:, None] * svn + d[None, :], mask=cok[:, None], other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BN) // BM * BM
    for start in range(lo, Nq, BM):
        rows = start + tl.arange(0, BM)
        rok = rows < Nq
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :], mask=rok[:, None], other=0.0)
        do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + d[None, :], mask=rok[:, None], other=0.0)
        lse = tl.load(L + b * slb + h * slh + rows * slm, mask=rok, other=0.0)
        delta = tl.load(Dl + pid_bh * Nq + rows, mask=rok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale          # (BM, BN)
        keep = rok[:, None] & cok[None, :]
        if CAUSAL and MASK:
            keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, float("-inf"))
        p = tl.exp(s - lse[:, None])
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        if DELTA_FROM_P:
            delta = tl.sum(p * dp, 1)
        if USE_DELTA:
            ds = p * (dp - delta[:, None])
        else:
            ds = p * dp
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee")
    if SCALE:
        dk = dk * scale
    sok = cok
    if not STORE_UNSEEN:
        sok = sok & ((cols * 0 + lo) < Nq)
    tl.store(DK + b * skgb + h * skgh + cols[:, None] * skgn + d[None, :], dk.to(DK.dtype.element_ty),
             mask=sok[:, None])
    tl.store(DV + b * svgb + h * svgh + cols[:, None] * svgn + d[None, :], dv.to(DV.dtype.element_ty),
             mask=sok[:, None])


@triton.jit
def _dq(Q, K, V, DO, L, Dl, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
        sqgb, sqgh, sqgm, slb, slh, slm, H, Nq, Nk, scale,
        CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
        USE_DELTA: tl.constexpr, DELTA_FROM_P: tl.constexpr, SCALE: tl.constexpr, MASK: tl.constexpr,
        DQ16: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rows = pid_m * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    rok = rows < Nq
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :], mask=rok[:, None], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + d[None, :], mask=rok[:, None], other=0.0)
    lse = tl.load(L + b * slb + h * slh + rows * slm, mask=rok, other=0.0)
    delta = tl.load(Dl + pid_bh * Nq + rows, mask=rok, other=0.0)
    dq = tl.zeros([BM, D], tl.float32)
    hi = Nk
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BM, Nk)
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        cok = cols < Nk
        k = tl.load(K + b * skb + h * skh + cols[:, None] * skn + d[None, :], mask=cok[:, None], other=0.0)
        v = tl.load(V + b * svb + h * svh + cols[:, None] * svn + d[None, :], mask=cok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        keep = rok[:, None] & cok[None, :]
        if CAUSAL and MASK:
            keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, float("-inf"))
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        if DELTA_FROM_P:
            delta = tl.sum(p * dp, 1)
        if USE_DELTA:
            ds = p * (dp - delta[:, None])
        else:
            ds = p * dp
        if DQ16:                  # the running dQ rounded to the inputs' dtype after every tile
            dq = (dq + tl.dot(ds.to(k.dtype), k, input_precision="ieee")).to(k.dtype).to(tl.float32)
        else:
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    if SCALE:
        dq = dq * scale
    tl.store(DQ + b * sqgb + h * sqgh + rows[:, None] * sqgm + d[None, :], dq.to(DQ.dtype.element_ty),
             mask=rok[:, None])


def make_backward(BM=16, BN=32, no_delta=False, delta_from_p=False, delta_no_o=False, scale_dq=True,
                  scale_dk=True, mask_dq=True, mask_dkdv=True, store_unseen=True, do_strides_from_o=False,
                  strides_from=None, delta16=False, delta_stored16=False, dq16=False):
    """``delta16``: Delta computed in the inputs' dtype; ``delta_stored16``: the Delta buffer allocated in
    the inputs' dtype; ``dq16``: dQ accumulated in the inputs' dtype.
    ``strides_from``: {tensor: other}, e.g. {"dv": "dk"}: dv addressed with dk's strides (a copy-pasted line)."""
    def flash_backward(q, k, v, o, lse, do, dq, dk, dv, causal):
        B, H, Nq, D = q.shape
        Nk = k.shape[2]
        scale = 1.0 / math.sqrt(D)
        st = {n: t.stride()[:3] for n, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("dq", dq),
                                              ("dk", dk), ("dv", dv))}
        if do_strides_from_o:
            st["do"] = st["o"]
        for target, source in (strides_from or {}).items():
            st[target] = st[source]
        delta = torch.empty((B, H, Nq), device=q.device, dtype=q.dtype if delta_stored16 else torch.float32)
        _delta[(triton.cdiv(Nq, 16), B * H)](o, do, delta, *st["o"], *st["do"], H, Nq, BM=16, D=D,
                                             DELTA_NO_O=delta_no_o, DELTA16=delta16)
        common = dict(CAUSAL=causal, BM=BM, BN=BN, D=D, USE_DELTA=not no_delta, DELTA_FROM_P=delta_from_p)
        _dkdv[(triton.cdiv(Nk, BN), B * H)](
            q, k, v, do, lse, delta, dk, dv, *st["q"], *st["k"], *st["v"], *st["do"],
            *st["dk"], *st["dv"], *lse.stride(), H, Nq, Nk, scale,
            SCALE=scale_dk, MASK=mask_dkdv, STORE_UNSEEN=store_unseen, **common)
        _dq[(triton.cdiv(Nq, BM), B * H)](
            q, k, v, do, lse, delta, dq, *st["q"], *st["k"], *st["v"], *st["do"],
            *st["dq"], *lse.stride(), H, Nq, Nk, scale, SCALE=scale_dq, MASK=mask_dq, DQ16=dq16, **common)
    return flash_backward
