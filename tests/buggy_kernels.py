"""A small, deliberately plain FA2 forward kernel with switchable mistakes, for grading tests.

It is what a learner might write (one loop, mask on every tile, natural exp) and
each flag reproduces a mistake the grader must catch.
"""
import math

import flashlab  # noqa: F401,I001  (first: it decides GPU vs interpreter before triton is imported)
import triton
import triton.language as tl


@triton.jit
def _learner_fwd(Q, K, V, O, LSE, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                 slb, slh, slm, H, Nq, Nk, scale,
                 CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                 RESCALE: tl.constexpr, MASK_TAIL: tl.constexpr, MASK_STORE: tl.constexpr,
                 LSE_BASE2: tl.constexpr, STRICT: tl.constexpr, WILD_STORE: tl.constexpr,
                 IGNORE_BH: tl.constexpr, MASK_SCORES: tl.constexpr = True, CAUSAL_KEEP: tl.constexpr = 0,
                 KV_Q_STRIDES: tl.constexpr = False, MASK_Q: tl.constexpr = True, ACC16: tl.constexpr = 0):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    if IGNORE_BH:
        b = 0
        h = 0
    rows = pid_m * BM + tl.arange(0, BM)
    cols0 = tl.arange(0, BN)
    d = tl.arange(0, D)
    if KV_Q_STRIDES:               # a copy-pasted pointer line: K and V offset with Q's strides
        skb, skh, skn, svb, svh, svn = sqb, sqh, sqm, sqb, sqh, sqm
    if MASK_Q:
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :], mask=rows[:, None] < Nq, other=0.0)
    else:   # rows past Nq read the padding; they are never stored, so the values are discarded
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + d[None, :])
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    if ACC16 == 1:                 # acc in the inputs' dtype: with fp16 inputs tl.dot accumulates in float16
        acc = tl.zeros([BM, D], V.dtype.element_ty)
    else:
        acc = tl.zeros([BM, D], tl.float32)
    for start in range(0, Nk, BN):
        cols = start + cols0
        if MASK_TAIL:
            kv_mask = cols[:, None] < Nk
        else:
            kv_mask = cols[:, None] < 1 << 30
        k = tl.load(K + b * skb + h * skh + cols[:, None] * skn + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + b * svb + h * svh + cols[:, None] * svn + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if MASK_SCORES:
            keep = cols[None, :] < Nk
        else:                          # the tail's loads are masked (other=0), its scores are not: S = 0 there
            keep = cols[None, :] < 1 << 30
        if CAUSAL:
            if CAUSAL_KEEP == 1:       # reversed: j >= i
                keep = keep & (cols[None, :] >= rows[:, None])
            elif CAUSAL_KEEP == 2:     # the condition written on the wrong side of tl.where: j > i
                keep = keep & (cols[None, :] > rows[:, None])
            elif STRICT:
                keep = keep & (cols[None, :] < rows[:, None])
            else:
                keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        if RESCALE and ACC16 != 1:
            acc = acc * alpha[:, None]
        if ACC16 == 1:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None].to(acc.dtype), input_precision="ieee")
        elif ACC16 == 2:           # the dot in float32, the running sum rounded to the inputs' dtype every tile
            acc = (acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")).to(v.dtype).to(tl.float32)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m = m_new
    acc = acc / l[:, None]
    lse = m + tl.log(l)
    if LSE_BASE2:
        lse = lse * 1.4426950408889634
    pid_b = pid_bh // H
    pid_h = pid_bh % H
    smask = rows < Nq
    if not MASK_STORE:
        smask = rows < 1 << 30
    tl.store(LSE + pid_b * slb + pid_h * slh + rows * slm, lse, mask=smask)
    o_ptrs = O + pid_b * sob + pid_h * soh + rows[:, None] * som + d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=smask[:, None])
    if WILD_STORE:
        tl.store(O + 50_000_000 + rows * 4096, tl.sum(acc, 1).to(O.dtype.element_ty))  # far outside any buffer


def make_forward(BM=16, BN=16, rescale=True, mask_tail=True, mask_store=True, lse_base2=False, strict=False,
                 wild_store=False, ignore_bh=False, scale_fn=lambda d: 1.0 / math.sqrt(d), mask_scores=True,
                 causal_keep=0, kv_q_strides=False, strides_from=None, mask_q=True, acc16=0):
    """``acc16``: 1, acc allocated in the inputs' dtype (tl.dot accumulates in it); 2, acc rounded to the
    inputs' dtype after every tile (the dot itself in float32).
    ``strides_from``: {tensor: other}, e.g. {"v": "k"}: v addressed with k's strides (a copy-pasted line)."""
    def flash_forward(q, k, v, o, lse, causal):
        B, H, Nq, D = q.shape
        Nk = k.shape[2]
        grid = (triton.cdiv(Nq, BM), B * H)
        st = {n: t.stride()[:3] for n, t in (("q", q), ("k", k), ("v", v), ("o", o))}
        for target, source in (strides_from or {}).items():
            st[target] = st[source]
        _learner_fwd[grid](q, k, v, o, lse, *st["q"], *st["k"], *st["v"], *st["o"],
                           lse.stride(0), lse.stride(1), lse.stride(2), H, Nq, Nk, scale_fn(D),
                           CAUSAL=causal, BM=BM, BN=BN, D=D, RESCALE=rescale, MASK_TAIL=mask_tail,
                           MASK_STORE=mask_store, LSE_BASE2=lse_base2, STRICT=strict, WILD_STORE=wild_store,
                           IGNORE_BH=ignore_bh, MASK_SCORES=mask_scores, CAUSAL_KEEP=causal_keep,
                           KV_Q_STRIDES=kv_q_strides, MASK_Q=mask_q, ACC16=acc16)
    return flash_forward
