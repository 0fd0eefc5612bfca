"""Reference implementations: the one canonical copy of every algorithm in the course.

Everything here is short, written with the FlashAttention-2 paper's symbols
(Algorithm 1) and checked against :func:`attention_naive` in the tests.  The
NumPy functions take one (batch, head) slice: ``q`` is (Nq, D), ``k`` and ``v``
are (Nk, D).  The torch function takes any leading dimensions, e.g. (B, H, N, D).

Conventions (shared with the kernels and the grader):
  * scale s = 1/sqrt(D) unless given;
  * causal is top-left aligned: query i sees keys j <= i (as SDPA's ``is_causal``);
  * LSE is the natural-log log-sum-exp of the scaled scores of each query row.

| math                  | code       |
|-----------------------|------------|
| S = s Q K^T           | ``s``      |
| m_i  (running max)    | ``m``      |
| l_i  (running sum)    | ``l``      |
| O~_i (unnormalised O) | ``acc``    |
| alpha = e^(m_old - m_new) | ``alpha`` |
| L_i = m_i + log l_i   | ``lse``    |
| D_i = rowsum(dO o O)  | ``delta``  |
"""
from __future__ import annotations

import math

import numpy as np

__all__ = [
    "causal_mask", "attention_naive", "attention_naive_torch",
    "online_softmax_update", "online_softmax", "merge_states",
    "attention_fa1", "attention_fa2", "attention_backward", "attention_backward_naive",
    "philox4x32", "dropout_threshold", "dropout_rate", "dropout_keep",
]


def _scale(d: int, scale):
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def causal_mask(nq: int, nk: int, row0: int = 0, col0: int = 0) -> np.ndarray:
    """Boolean (nq, nk) mask, True where query ``row0 + i`` may see key ``col0 + j`` (j <= i)."""
    rows = row0 + np.arange(nq)[:, None]
    cols = col0 + np.arange(nk)[None, :]
    return cols <= rows


# ----------------------------------------------------------------------------
# 1. naive attention: materialise S and P (N x N)
# ----------------------------------------------------------------------------

def attention_naive(q, k, v, causal: bool = False, scale=None):
    """O = softmax(s Q K^T) V, computed the obvious way. Returns ``(o, lse)``.

    Works in the dtype it is given (use float64 for a reference).
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    s = _scale(q.shape[-1], scale) * (q @ k.T)                 # S (Nq, Nk)
    if causal:
        s = np.where(causal_mask(*s.shape), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)                          # row max (safe softmax)
    p = np.exp(s - m)                                          # unnormalised P
    l = p.sum(axis=-1, keepdims=True)                          # row sum
    o = (p / l) @ v                                            # O = P V
    lse = (m + np.log(l))[:, 0]                                # L = m + log l
    return o, lse


def attention_naive_torch(q, k, v, causal: bool = False, scale=None, return_lse: bool = True):
    """Torch version of :func:`attention_naive` for tensors (..., N, D); differentiable.

    Returns ``(o, lse)`` (``lse`` is None when ``return_lse=False``, which skips its
    float32 copy of S: what a plain implementation would allocate).  Run it on float64
    inputs to get the reference the tests and the grader compare against; run it in
    fp16 to get "PyTorch's own error".
    """
    import torch

    s = _scale(q.shape[-1], scale) * (q @ k.transpose(-1, -2))  # S (..., Nq, Nk)
    if causal:
        nq, nk = s.shape[-2], s.shape[-1]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = None
    if return_lse:
        lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, dim=-1)
    p = torch.softmax(s, dim=-1)
    return p @ v, lse


# ----------------------------------------------------------------------------
# 2. online softmax: one streaming pass with a running max m and sum l
# ----------------------------------------------------------------------------

def online_softmax_update(m, l, x_block):
    """Fold one block of columns into the running state.  Start from m = -inf, l = 0.

        m_new = max(m, rowmax(x_block))
        l_new = e^(m - m_new) * l + rowsum(e^(x_block - m_new))     (alpha = e^(m - m_new))

    A row that has seen only -inf (every score masked so far) keeps m = -inf, l = 0: the
    exponent is taken against 0 there, since -inf - (-inf) would be NaN.
    """
    m_new = np.maximum(m, x_block.max(axis=-1))
    m_ref = np.where(np.isneginf(m_new), 0.0, m_new)   # guard: a fully masked row so far
    alpha = np.exp(m - m_ref)            # e^(-inf) = 0 on the first block
    l_new = alpha * l + np.exp(x_block - m_ref[:, None]).sum(axis=-1)
    return m_new, l_new


def online_softmax(x, block_size: int):
    """softmax(x) along the last axis of (R, N), reading x once in blocks of columns.

    The pass computes (m, l); the normalisation e^(x - m) / l is the write-out.
    """
    x = np.asarray(x)
    m = np.full(x.shape[0], -np.inf)
    l = np.zeros(x.shape[0])
    for j in range(0, x.shape[1], block_size):
        m, l = online_softmax_update(m, l, x[:, j:j + block_size])
    return np.exp(x - m[:, None]) / l[:, None]


def merge_states(m1, l1, acc1, m2, l2, acc2):
    """Merge two partial softmax states over disjoint sets of keys.

    Each state is (m, l, acc) with acc = sum_j e^(s_j - m) v_j (unnormalised).
    The merge is associative and commutative, which is what split-KV decoding
    and ring attention rely on.  O = acc / l once every part is merged.
    """
    m = np.maximum(m1, m2)
    # a part that has seen nothing has m = -inf; give it weight 0, not e^(nan)
    a1 = np.where(np.isneginf(m1), 0.0, np.exp(m1 - np.where(np.isneginf(m), 0.0, m)))
    a2 = np.where(np.isneginf(m2), 0.0, np.exp(m2 - np.where(np.isneginf(m), 0.0, m)))
    l = a1 * l1 + a2 * l2
    acc = a1[..., None] * acc1 + a2[..., None] * acc2
    return m, l, acc


# ----------------------------------------------------------------------------
# 3. tiled attention: FA1 and FA2 loop orders
# ----------------------------------------------------------------------------

def _kv_blocks(i0: int, bq: int, nk: int, bk: int, causal: bool):
    """Start columns of the K/V blocks query rows [i0, i0+bq) must visit.

    Causal block skipping: a block whose first key is after the last query of the
    tile is entirely masked, so it is never loaded.
    """
    hi = min(nk, i0 + bq) if causal else nk
    return range(0, hi, bk)


def attention_fa2(q, k, v, causal: bool = False, block_q: int = 64, block_k: int = 64, scale=None):
    """FlashAttention-2 order: outer loop over Q tiles, inner loop over K/V tiles.

    The state (m, l, acc) of one Q tile stays "on chip" for the whole inner loop
    and O is normalised once, at the end (deferred normalisation).
    Returns ``(o, lse)``.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    nq, d = q.shape
    nk = k.shape[0]
    sc = _scale(d, scale)
    o = np.empty((nq, v.shape[1]), dtype=np.result_type(q, v))
    lse = np.empty(nq, dtype=o.dtype)
    for i0 in range(0, nq, block_q):                      # one program per Q tile on a GPU
        qi = q[i0:i0 + block_q]                            # Q_i (Br, D): load once
        br = qi.shape[0]
        m = np.full(br, -np.inf)                           # m_i
        l = np.zeros(br)                                   # l_i
        acc = np.zeros((br, v.shape[1]))                   # O~_i
        for j0 in _kv_blocks(i0, br, nk, block_k, causal):
            kj, vj = k[j0:j0 + block_k], v[j0:j0 + block_k]  # K_j, V_j (Bc, D)
            s = sc * (qi @ kj.T)                           # S_ij (Br, Bc)
            if causal and j0 + kj.shape[0] - 1 > i0:       # only diagonal tiles need the mask
                s = np.where(causal_mask(br, kj.shape[0], i0, j0), s, -np.inf)
            m_new = np.maximum(m, s.max(axis=1))           # m_i^(j)
            p = np.exp(s - m_new[:, None])                 # P~_ij
            alpha = np.exp(m - m_new)                      # e^(m_old - m_new)
            l = alpha * l + p.sum(axis=1)                  # l_i^(j)
            acc = alpha[:, None] * acc + p @ vj            # O~_i^(j) = diag(alpha) O~ + P~ V_j
            m = m_new
        o[i0:i0 + br] = acc / l[:, None]                   # diag(l)^-1 O~, once
        lse[i0:i0 + br] = m + np.log(l)                    # L_i
    return o, lse


def attention_fa1(q, k, v, causal: bool = False, block_q: int = 64, block_k: int = 64, scale=None):
    """FlashAttention-1 order: outer loop over K/V tiles, inner loop over Q tiles.

    Every inner step reads O_i, m_i, l_i from "HBM", rescales, and writes them
    back normalised (the paper's Algorithm 1, line 12):
        O_i <- diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~_ij - m_new) P~_ij V_j)
    Returns ``(o, lse)``.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    nq, d = q.shape
    nk = k.shape[0]
    sc = _scale(d, scale)
    o = np.zeros((nq, v.shape[1]))                         # in HBM, normalised at all times
    m = np.full(nq, -np.inf)                               # in HBM
    l = np.zeros(nq)                                       # in HBM
    for j0 in range(0, nk, block_k):
        kj, vj = k[j0:j0 + block_k], v[j0:j0 + block_k]    # K_j, V_j stay on chip
        for i0 in range(0, nq, block_q):
            if causal and j0 > i0 + block_q - 1:           # tile entirely above the diagonal
                continue
            qi = q[i0:i0 + block_q]
            br = qi.shape[0]
            s = sc * (qi @ kj.T)
            if causal:
                s = np.where(causal_mask(br, kj.shape[0], i0, j0), s, -np.inf)
            m_tile = s.max(axis=1)                         # m~_ij (-inf: row fully masked here)
            p = np.exp(s - np.where(np.isneginf(m_tile), 0.0, m_tile)[:, None])  # P~_ij
            l_tile = p.sum(axis=1)                         # l~_ij
            mi, li, oi = m[i0:i0 + br], l[i0:i0 + br], o[i0:i0 + br]   # read from HBM
            m_new = np.maximum(mi, m_tile)
            a_old = np.exp(mi - m_new)                     # e^(m_i - m_new)
            a_new = np.exp(m_tile - m_new)                 # e^(m~_ij - m_new)
            l_new = a_old * li + a_new * l_tile
            o[i0:i0 + br] = ((li * a_old)[:, None] * oi + a_new[:, None] * (p @ vj)) / l_new[:, None]
            m[i0:i0 + br], l[i0:i0 + br] = m_new, l_new    # write back to HBM
    return o, m + np.log(l)


# ----------------------------------------------------------------------------
# 4. backward
# ----------------------------------------------------------------------------

def attention_backward_naive(q, k, v, do, causal: bool = False, scale=None):
    """Gradients of O = softmax(s Q K^T) V by the chain rule on full matrices. Returns (dq, dk, dv)."""
    q, k, v, do = (np.asarray(t) for t in (q, k, v, do))
    sc = _scale(q.shape[-1], scale)
    o, lse = attention_naive(q, k, v, causal, scale)
    s = sc * (q @ k.T)
    if causal:
        s = np.where(causal_mask(*s.shape), s, -np.inf)
    p = np.exp(s - lse[:, None])
    dv = p.T @ do                                          # dV = P^T dO
    dp = do @ v.T                                          # dP = dO V^T
    ds = p * (dp - (do * o).sum(axis=1, keepdims=True))    # dS = P o (dP - D)
    return sc * ds @ k, sc * ds.T @ q, dv


def attention_backward(q, k, v, o, lse, do, causal: bool = False, block_q: int = 64,
                       block_k: int = 64, scale=None):
    """FlashAttention-2 backward, tiled, as the Triton kernels do it. Returns (dq, dk, dv).

    Nothing N x N is stored: P is recomputed tile by tile from the saved LSE,
    P_ij = exp(S_ij - L_i), and softmax's Jacobian needs only the per-row scalar
    D_i = rowsum(dO_i o O_i)  (because rowsum(P o dP) = rowsum(dO o O)).

    dK, dV: K/V-stationary (outer loop over K/V tiles), dQ: Q-stationary; neither
    loop writes to a tile another iteration owns, so no atomics are needed.
    """
    q, k, v, o, lse, do = (np.asarray(t) for t in (q, k, v, o, lse, do))
    nq, d = q.shape
    nk = k.shape[0]
    sc = _scale(d, scale)
    delta = (do * o).sum(axis=1)                           # D_i (Nq,)

    def p_tile(i0, qi, j0, kj):
        s = sc * (qi @ kj.T)
        if causal:
            s = np.where(causal_mask(qi.shape[0], kj.shape[0], i0, j0), s, -np.inf)
        return np.exp(s - lse[i0:i0 + qi.shape[0], None])  # recompute P_ij from L

    dk, dv = np.zeros_like(k, dtype=float), np.zeros_like(v, dtype=float)
    for j0 in range(0, nk, block_k):                       # K/V-stationary
        kj, vj = k[j0:j0 + block_k], v[j0:j0 + block_k]
        i_first = (j0 // block_q) * block_q if causal else 0   # Q tiles above are fully masked
        for i0 in range(i_first, nq, block_q):
            qi, doi = q[i0:i0 + block_q], do[i0:i0 + block_q]
            p = p_tile(i0, qi, j0, kj)                     # P_ij (Br, Bc)
            dv[j0:j0 + block_k] += p.T @ doi               # dV_j += P_ij^T dO_i
            ds = p * (doi @ vj.T - delta[i0:i0 + block_q, None])   # dS_ij = P o (dP - D)
            dk[j0:j0 + block_k] += sc * ds.T @ qi          # dK_j += s dS_ij^T Q_i

    dq = np.zeros_like(q, dtype=float)
    for i0 in range(0, nq, block_q):                       # Q-stationary
        qi, doi = q[i0:i0 + block_q], do[i0:i0 + block_q]
        for j0 in _kv_blocks(i0, qi.shape[0], nk, block_k, causal):
            kj, vj = k[j0:j0 + block_k], v[j0:j0 + block_k]
            p = p_tile(i0, qi, j0, kj)
            ds = p * (doi @ vj.T - delta[i0:i0 + block_q, None])
            dq[i0:i0 + block_q] += sc * ds @ kj            # dQ_i += s dS_ij K_j
    return dq, dk, dv


# ----------------------------------------------------------------------------
# 6. attention variants (notebook 08): the naive torch reference, S materialised
# ----------------------------------------------------------------------------

def variant_scores_torch(q, k, *, scale=None, is_causal: bool = False, window=None, softcap=None,
                         alibi_slopes=None, attn_mask=None):
    """Scores S (B, H, Nq, Nk) of every variant, in the kernels' order, -inf where not visible.

    q (B, H, Nq, D), k (B, H_kv, Nk, D) with H % H_kv == 0 (GQA: query head h reads K/V head
    h // (H / H_kv)).  Order: scale; soft-cap ``c * tanh(s / c)``; ALiBi ``s -= slope * |i - j|``
    (slopes (H,) or (B, H)); an additive float ``attn_mask``; then the keep-test: a bool
    ``attn_mask`` (True = attend), ``is_causal`` (j <= i) and ``window=(left, right)``
    (i - left <= j <= i + right, -1 unbounded), all top-left aligned.
    """
    import torch

    H, Hk = q.shape[1], k.shape[1]
    if H != Hk:
        k = k.repeat_interleave(H // Hk, dim=1)
    s = _scale(q.shape[-1], scale) * (q @ k.transpose(-1, -2))
    nq, nk = s.shape[-2], s.shape[-1]
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        sl = alibi_slopes.to(s.dtype)
        sl = sl[None, :, None, None] if sl.dim() == 1 else sl[:, :, None, None]
        s = s - sl * (i - j).abs().to(s.dtype)
    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            s = s + attn_mask.to(s.dtype)
    if is_causal:
        keep = keep & (j <= i)
    if window is not None:
        left, right = window
        if left >= 0:
            keep = keep & (j >= i - left)
        if right >= 0:
            keep = keep & (j <= i + right)
    return s.masked_fill(~keep, float("-inf"))


# ------------------------------------------------------------------ dropout's bits (the kernels' own)

DROPOUT_GROUP = 16   # scores per Philox call: four 32-bit words, one byte per score


def dropout_threshold(p: float) -> int:
    """The byte the kernels compare with: a score is dropped when its random byte is below it.

    round(256 p), at least 1 when p > 0 and at most 255, so the rate that is really applied is a whole number
    of 1/256ths (:func:`dropout_rate`): p = 0.1 drops 26/256 = 0.1016 of the weights, p = 0.001 drops 1/256.
    """
    if p <= 0:
        return 0
    return min(255, max(1, int(math.floor(p * 256 + 0.5))))


def dropout_rate(p: float) -> float:
    """The dropout probability the kernels apply for ``dropout_p = p`` (p rounded to 1/256ths); kept weights
    are scaled by 1 / (1 - dropout_rate(p)), so the expectation of O is the undropped one exactly."""
    return dropout_threshold(p) / 256.0


def philox4x32(seed: int, c0, c1, c2, c3, rounds: int = 10):
    """Philox-4x32 (Salmon et al., 2011) in NumPy, as Triton's ``tl.philox``: counters (c0, c1, c2, c3) of
    uint32 (any broadcastable arrays), key = the seed's low and high 32 bits; four uint32 arrays out."""
    m32 = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = np.broadcast_arrays(np.asarray(c0).astype(np.uint64) & m32, np.asarray(c1).astype(np.uint64) & m32,
                                         np.asarray(c2).astype(np.uint64) & m32, np.asarray(c3).astype(np.uint64) & m32)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(rounds):
        pa, pb = a * c0, b * c2                                  # 32 x 32 -> 64 bits: exact in uint64
        c0, c1, c2, c3 = (pb >> np.uint64(32)) ^ c1 ^ k0, pb & m32, (pa >> np.uint64(32)) ^ c3 ^ k1, pa & m32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
    return c0, c1, c2, c3


def dropout_keep(seed: int, bh: int, rows, cols, p: float, rounds: int = 10) -> np.ndarray:
    """The kernels' dropout mask, bit for bit: bool (len(rows), len(cols)), True = kept.

    Score (row i, column j) of (batch * H + head) ``bh``: Philox with key ``seed`` and counter
    (j // 16, i, bh, 0) gives four 32-bit words for the 16 columns of that group; column j takes byte
    j % 4 of word (j // 4) % 4 and is kept when that byte is >= :func:`dropout_threshold` (p).  A pure
    function of (seed, batch, head, row, column): any tile asks for its own part and gets the same bits.
    ``rounds``: Philox's rounds (the kernels use 10; ``scripts/dropout_probe.py`` times fewer).
    """
    r = np.asarray(rows, dtype=np.int64).reshape(-1, 1)
    c = np.asarray(cols, dtype=np.int64).reshape(1, -1)
    words = philox4x32(seed, c // DROPOUT_GROUP, r, bh, 0, rounds)
    slot = np.broadcast_to(c % DROPOUT_GROUP, words[0].shape)
    word = np.choose(slot // 4, words)
    byte = (word >> (np.uint64(8) * (slot % 4).astype(np.uint64))) & np.uint64(0xFF)
    return byte >= np.uint64(dropout_threshold(p))


def attention_variants_torch(q, k, v, *, dropout_mask=None, dropout_p: float = 0.0, **score_kw):
    """(O, LSE) of every variant, naive and differentiable (run it in float64 for the tests' reference).

    ``score_kw``: the arguments of :func:`variant_scores_torch`.  A row that sees no key gives
    O = 0 and LSE = -inf (and zero gradients), never NaN.  Dropout: ``dropout_mask`` (bool, True =
    kept, broadcastable to S) is applied to the normalised P, kept values scaled by 1 / (1 - p);
    the LSE is that of the undropped scores.
    """
    import torch

    H, Hk = q.shape[1], k.shape[1]
    s = variant_scores_torch(q, k, **score_kw)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)                 # a row with no key: any shift
    e = torch.exp(s - m)
    l_ = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(l_ == 0, torch.ones_like(l_), l_)
    lse = (m + torch.log(l_))[..., 0]
    if dropout_mask is not None:
        p = torch.where(dropout_mask, p / (1.0 - dropout_p), torch.zeros_like(p))
    vv = v.repeat_interleave(H // Hk, dim=1) if H != Hk else v
    return p @ vv, lse


def attention_varlen_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """Packed (total, H, D) sequences: :func:`attention_variants_torch` per sequence; LSE (H, total_q).

    ``alibi_slopes`` may be (H,) or (S, H) (one row per sequence); ``dropout_mask`` a list with one
    (1, H, Nq_i, Nk_i) mask per sequence.
    """
    import torch

    cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qi = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]
        ki = k[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        vi = v[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        if qi.shape[2] == 0:
            continue
        if ki.shape[2] == 0:                                               # no keys: O = 0, LSE = -inf
            outs.append(torch.zeros_like(q[cq[b]:cq[b + 1]]))
            lses.append(torch.full((q.shape[1], qi.shape[2]), float("-inf"), dtype=q.dtype, device=q.device))
            continue
        kwb = dict(kw)
        sl = kw.get("alibi_slopes")
        if sl is not None and sl.dim() == 2:
            kwb["alibi_slopes"] = sl[b]
        if kw.get("dropout_mask") is not None:
            kwb["dropout_mask"] = kw["dropout_mask"][b]
        o, lse = attention_variants_torch(qi, ki, vi, **kwb)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, -1)
# 5. decoding against a KV cache (flashlab.flash_decode's reference)
# ----------------------------------------------------------------------------

def decode_reference(q, k_cache, v_cache, cache_seqlens=None, *, block_table=None, is_causal: bool = False,
                     scale=None, softcap=None, window=None, dtype=None):
    """Attention of q (B, H, Nq, D) against a contiguous or paged KV cache, the plain way. Returns (o, lse).

    Same arguments as ``flashlab.flash_decode``; computed in ``dtype`` (default float64) in torch,
    one sequence at a time:
      * paged: the sequence's keys are gathered block by block, k[b] = cat_m k_cache[block_table[b, m]];
      * query row t sits at position p = len_b - Nq + t (bottom-right); key j < len_b is seen when
        p - left <= j <= p + right (window; -1 unbounded) and j <= p when causal;
      * scores s = scale * q k^T, then softcap * tanh(s / softcap) if softcap is given;
      * GQA: query head h reads KV head h // (H / H_kv).
    A row that sees no key gets o = 0 and lse = -inf.  o is returned in ``dtype``, lse in float32 or
    float64 (the wider of ``dtype`` and float32).
    """
    import torch

    dtype = dtype or torch.float64
    B, H, Nq, D = q.shape
    H_kv = k_cache.shape[1]
    G = H // H_kv
    sc = _scale(D, scale)
    left, right = (-1, -1) if window is None else window
    if block_table is not None:
        cap = block_table.shape[1] * k_cache.shape[2]
    else:
        cap = k_cache.shape[2]
    lens = [cap] * B if cache_seqlens is None else [int(x) for x in cache_seqlens]
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    o = torch.zeros((B, H, Nq, D), dtype=dtype)
    lse = torch.full((B, H, Nq), float("-inf"), dtype=lse_dtype)
    for b in range(B):
        n = lens[b]
        if block_table is not None:
            nb = -(-n // k_cache.shape[2])
            idx = block_table[b, :nb].long().cpu()
            k = k_cache.cpu()[idx].transpose(0, 1).reshape(H_kv, -1, D)[:, :n]   # (H_kv, n, D)
            v = v_cache.cpu()[idx].transpose(0, 1).reshape(H_kv, -1, D)[:, :n]
        else:
            k, v = k_cache[b, :, :n].cpu(), v_cache[b, :, :n].cpu()
        if n == 0:
            continue
        k = k.to(dtype).repeat_interleave(G, dim=0)                     # (H, n, D)
        v = v.to(dtype).repeat_interleave(G, dim=0)
        s = sc * (q[b].cpu().to(dtype) @ k.transpose(-1, -2))           # (H, Nq, n)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        pos = n - Nq + torch.arange(Nq)[:, None]
        j = torch.arange(n)[None, :]
        keep = torch.ones(Nq, n, dtype=torch.bool)
        if is_causal:
            keep &= j <= pos
        if left >= 0:
            keep &= j >= pos - left
        if right >= 0:
            keep &= j <= pos + right
        s = s.masked_fill(~keep, float("-inf"))
        seen = keep.any(dim=-1)                                          # (Nq,)
        ls = torch.logsumexp(s.to(lse_dtype), dim=-1)                    # -inf where nothing is seen
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)                    # all -inf row: NaN -> 0
        o[b] = (p @ v) * seen[None, :, None]
        lse[b] = ls
    return o, lse


__all__.append("decode_reference")


# ----------------------------------------------------------------------------
# 6. beyond one kernel: split-KV merge, a ring step, the ring in one process (notebook 09)
# ----------------------------------------------------------------------------

def merge_partials(o_parts, lse_parts):
    """Merge S normalised partial results over disjoint key sets (split-KV decoding, ring steps).

    o_parts (S, ..., N, D), lse_parts (S, ..., N) natural log; a part with no key has lse = -inf
    (its O is ignored).  LSE = log sum_s e^(LSE_s); O = sum_s e^(LSE_s - LSE) O_s: notebook 02's
    ``merge_states`` with acc_s = l_s O_s and m_s + log l_s = LSE_s.  Returns (o, lse)."""
    o_parts, lse_parts = np.asarray(o_parts, dtype=float), np.asarray(lse_parts, dtype=float)
    m = lse_parts.max(axis=0)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    w = np.where(np.isneginf(lse_parts), 0.0, np.exp(lse_parts - m_safe))       # (S, ..., N), <= 1
    total = w.sum(axis=0)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    o_sum = (np.where(w[..., None] > 0, w[..., None] * np.where(np.isfinite(o_parts), o_parts, 0.0), 0.0)).sum(0)
    o = o_sum / np.where(total > 0, total, 1.0)[..., None]
    return o, lse


def ring_step(q, k, v, q_pos, k_pos, o, lse, causal: bool = False, scale=None):
    """One ring step on one rank: attend this rank's queries q (n, D) to the K/V block it holds now
    (m, D), masked by GLOBAL positions (q_pos (n,), k_pos (m,): query at p sees keys at <= p), and
    merge into the state (o (n, D) normalised, lse (n,); lse = -inf: nothing seen yet).
    Returns the new (o, lse); rows that see no key of the block keep their state."""
    q, k, v = np.asarray(q, dtype=float), np.asarray(k, dtype=float), np.asarray(v, dtype=float)
    s = _scale(q.shape[1], scale) * (q @ k.T)
    if causal:
        s = np.where(np.asarray(k_pos)[None, :] <= np.asarray(q_pos)[:, None], s, -np.inf)
    m = s.max(axis=1)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m_safe[:, None])
    l = p.sum(axis=1)
    with np.errstate(divide="ignore"):
        lse_b = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    o_b = (p @ v) / np.where(l > 0, l, 1.0)[:, None]
    return merge_partials(np.stack([o, o_b]), np.stack([lse, lse_b]))


def ring_attention_sim(q, k, v, world: int, layout: str = "zigzag", causal: bool = False, scale=None):
    """Ring attention with every rank simulated in one process (NumPy): q, k, v (N, D) the whole
    sequence; each rank keeps its shard of q, the K/V shards go around the ring (rank r holds the
    shard of rank r - s at step s), each step is :func:`ring_step`.  Returns (o, lse) in sequence
    order; equal to attention on the whole sequence."""
    from .distributed.layout import positions, step_source
    q, k, v = np.asarray(q, dtype=float), np.asarray(k, dtype=float), np.asarray(v, dtype=float)
    n = q.shape[0]
    pos = [np.array(positions(r, world, n, layout)) for r in range(world)]
    o, lse = np.zeros_like(q), np.full(n, -np.inf)
    for r in range(world):
        o_r, lse_r = np.zeros((len(pos[r]), q.shape[1])), np.full(len(pos[r]), -np.inf)
        for step in range(world):
            src = pos[step_source(r, world, step)]
            o_r, lse_r = ring_step(q[pos[r]], k[src], v[src], pos[r], src, o_r, lse_r, causal, scale)
        o[pos[r]], lse[pos[r]] = o_r, lse_r
    return o, lse


__all__ += ["merge_partials", "ring_step", "ring_attention_sim"]
