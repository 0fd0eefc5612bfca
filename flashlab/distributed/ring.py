"""Ring attention on torch.distributed: each rank keeps its queries, K/V blocks go around the ring.

    import torch.distributed as dist
    from flashlab.distributed import ring_attention, shard
    dist.init_process_group("nccl")                      # gloo on CPUs (the interpreter)
    r, W = dist.get_rank(), dist.get_world_size()
    q, k, v = (shard(t, r, W, "zigzag") for t in (Q, K, V))   # (B, H, N/W, D) each
    o = ring_attention(q, k, v, is_causal=True)          # this rank's rows of attention(Q, K, V)
    o.sum().backward()                                   # dQ here; dK/dV come home around the ring

The forward, on rank r of W, for steps s = 0 .. W-1 (rank r holds the K/V shard of rank r-s):

  1. post the send of the current K/V block to rank r+1 and the receive of the next from r-1
     (one ``dist.batch_isend_irecv``), so the next block is in flight while this one is computed;
  2. compute the step's tiles (``layout.step_plan``: full, diagonal or skipped, by global
     position) with the single-GPU kernel, ``flashlab.attention._forward`` -> (O_s, LSE_s);
  3. merge into the running (O, LSE) by log-sum-exp (notebook 02's merge, for normalised parts):
     LSE' = log(e^LSE + e^LSE_s), O' = e^(LSE-LSE')·O + e^(LSE_s-LSE')·O_s;
  4. wait for the receive.

The backward goes around the ring once more with K/V, and with a dK/dV accumulator for the block
(as zhuzilin's ring-flash-attention does): at each step the rank adds its contribution to the
accumulator of the block it holds and passes it on with the block; after W steps the accumulator
of every block has every rank's contribution and one last send brings it home.  Each step's
backward runs ``flashlab.attention._backward`` with the GLOBAL O and LSE (P = e^(S - LSE) must be
the softmax over all keys, and D = rowsum(dO∘O) uses the final O); dQ stays local.

GQA: k and v may have H_kv heads, H % H_kv == 0 (query head h reads K/V head h // (H/H_kv)); the
blocks travel with H_kv heads (fewer bytes) and go to the kernels as they are: with H_kv < H each
step runs forward v4 / backward v5 (``flashlab.variants``), whose programs read K/V head
h // (H/H_kv) and sum dK/dV over each group of query heads, so no step copies K/V per query head.

Bytes per step: K and V of one shard in the forward (2·B·H_kv·(N/W)·D elements of q's dtype); in
the backward K and V again plus the float32 dK/dV accumulators.  Non-contiguous inputs are copied
once into dense buffers for the sends.

Limits: one sequence length for every rank (the shard's, N/W); no attention mask, dropout or
window; the transfers are P2P sends of whole shards (no chunking of a block into several messages).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import layout as L

# a per-step recorder (flashlab.distributed.timeline.recording installs one); None: no marks, no cost
_TIMELINE = None


def _mark(phase, step, what):
    if _TIMELINE is not None:
        _TIMELINE.mark(phase, step, what)

__all__ = ["ring_attention", "merge_attention", "all_gather_sequence", "simulate_ring"]


# ----------------------------------------------------------------------------
# the merge (notebook 02's, for normalised partial outputs)
# ----------------------------------------------------------------------------

def merge_attention(o, lse, o_part, lse_part):
    """Merge a partial result (o_part, lse_part) over other keys into (o, lse); returns new tensors.

    o: (..., N, D) float32, lse: (..., N) float32 natural log.  A part that saw no key has
    lse = -inf and weight 0 (never e^(nan)).  Same rule as :func:`flashlab.reference.merge_states`,
    which merges unnormalised (m, l, acc): here acc = l·o and lse = m + log l.  The weights are taken
    against the larger LSE and divided by their sum, as the GPU kernel and ``merge_partials`` do: weighed
    against the merged LSE, its float32 rounding (1e-8 relative is 4e-4 absolute at LSE 5e4) scaled O."""
    m = torch.maximum(lse, lse_part)
    safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.exp(lse - safe))          # <= 1
    w_part = torch.where(torch.isneginf(lse_part), torch.zeros_like(lse_part), torch.exp(lse_part - safe))
    total = w + w_part
    new = torch.where(total > 0, safe + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    mine = torch.where(torch.isneginf(lse)[..., None], 0.0, w[..., None] * o.float())      # an unseen O: 0, not NaN
    part = torch.where(torch.isneginf(lse_part)[..., None], 0.0, w_part[..., None] * o_part.float())
    return (mine + part) / torch.where(total > 0, total, torch.ones_like(total))[..., None], new


def _merge_into(o, lse, o_part, lse_part):
    """:func:`merge_attention` written into the views ``o``, ``lse`` (the running state's rows of a
    tile): on a GPU one fused kernel (:func:`flashlab.kernels.merge.merge_into`: one read of each
    input, one write), elsewhere the readable element-wise merge above, copied in."""
    if o.is_cuda and o.stride(-1) == 1 and o_part.stride(-1) == 1:
        from ..kernels.merge import merge_into
        merge_into(o, lse, o_part, lse_part)
        return
    mo, ml = merge_attention(o, lse, o_part, lse_part)
    o.copy_(mo)
    lse.copy_(ml)


# ----------------------------------------------------------------------------
# the ring
# ----------------------------------------------------------------------------

class _Ring:
    """Rank, world and the global ranks of the two neighbours in ``group``."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        g = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = g((self.rank + 1) % self.world)
        self.prev = g((self.rank - 1) % self.world)

    def pass_on(self, tensors):
        """Post sends of ``tensors`` to the next rank and receives of as many from the previous one.
        Returns (received buffers, requests); wait on the requests before reading the buffers."""
        tensors = [t.contiguous() for t in tensors]             # P2P sends whole, dense buffers
        recv = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        return recv, dist.batch_isend_irecv(ops)


def _wait(reqs):
    for r in reqs or ():
        r.wait()


def _expand_heads(t, h):
    """(B, H_kv, N, D) -> (B, H, N, D): query head h reads K/V head h // (H / H_kv)."""
    g = h // t.shape[1]
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _step_forward(q, k, v, causal, scale, allow_tf32):
    """(O_s, LSE_s) of one block: the plain kernels, or with fewer K/V heads forward v4 (no copy of K/V)."""
    from ..attention import _forward
    if k.shape[1] == q.shape[1]:
        return _forward(q, k, v, causal, scale, allow_tf32)
    from .. import variants
    o, lse, _ = variants._forward(q, k, v, None, None, None, None, q.shape[2], k.shape[2], -1, 0 if causal else -1,
                                  0.0, 0.0, 0, scale, allow_tf32)
    return o, lse


def _step_backward(q, k, v, o, lse, do, causal, scale, allow_tf32):
    """(dQ, dK, dV) of one block, dK/dV with k's heads (backward v5 sums each group of query heads)."""
    from ..attention import _backward
    if k.shape[1] == q.shape[1]:
        return _backward(q, k, v, o, lse, do, causal, scale, allow_tf32)
    from .. import variants
    return variants._backward(q, k, v, o, lse, do, None, None, None, None, q.shape[2], k.shape[2], -1,
                              0 if causal else -1, 0.0, 0.0, 0, scale, allow_tf32)


def _ring_forward(q, k, v, causal, scale, allow_tf32, ring, layout):
    B, H, n, D = q.shape
    o = torch.zeros((B, H, n, D), device=q.device, dtype=torch.float32)
    lse = torch.full((B, H, n), -math.inf, device=q.device, dtype=torch.float32)
    kv = [k, v]                                          # the block held now: rank (r - step)'s
    for step in range(ring.world):
        reqs = None
        _mark("fwd", step, "start")
        if step + 1 < ring.world:
            nxt, reqs = ring.pass_on(kv)                 # (1) the next block in flight during (2)-(3)
        ke, ve = kv
        for t in L.step_plan(ring.rank, ring.world, step, n, layout, causal):     # full, diagonal or none
            o_s, lse_s = _step_forward(q[:, :, t.q], ke[:, :, t.kv], ve[:, :, t.kv], t.causal, scale,
                                       allow_tf32)                                                    # (2)
            _merge_into(o[:, :, t.q], lse[:, :, t.q], o_s, lse_s)                                   # (3)
        _mark("fwd", step, "compute_end")
        if reqs is not None:
            _wait(reqs)                                  # (4)
            kv = nxt
        _mark("fwd", step, "end")
    return o.to(q.dtype), lse


def _ring_backward(q, k, v, o, lse, do, causal, scale, allow_tf32, ring, layout):
    B, H, n, D = q.shape
    h_kv = k.shape[1]
    dq = torch.zeros((B, H, n, D), device=q.device, dtype=torch.float32)
    kv = [k, v]
    dkv = None                        # the accumulator of the block held now (None: zeros, at step 0)
    dkv_reqs = None
    last = ring.world == 1            # one rank: nothing to pass on
    for step in range(ring.world):
        kv_reqs = None
        _mark("bwd", step, "start")
        if step + 1 < ring.world:
            nxt, kv_reqs = ring.pass_on(kv)
        ke, ve = kv
        dk_s = torch.zeros((B, h_kv, n, D), device=q.device, dtype=torch.float32)
        dv_s = torch.zeros_like(dk_s)
        for t in L.step_plan(ring.rank, ring.world, step, n, layout, causal):
            dq_t, dk_t, dv_t = _step_backward(q[:, :, t.q], ke[:, :, t.kv], ve[:, :, t.kv], o[:, :, t.q],
                                              lse[:, :, t.q].contiguous(), do[:, :, t.q], t.causal, scale,
                                              allow_tf32)
            dq[:, :, t.q] += dq_t
            dk_s[:, :, t.kv] += dk_t
            dv_s[:, :, t.kv] += dv_t
        _mark("bwd", step, "compute_end")
        _wait(dkv_reqs)               # the accumulator that came with this block (in flight during compute)
        if dkv is not None:
            dk_s, dv_s = dk_s + dkv[0], dv_s + dkv[1]
        if last:
            dkv = (dk_s, dv_s)
        else:
            dkv, dkv_reqs = ring.pass_on([dk_s, dv_s])   # on with the block; the last send brings it home
        if kv_reqs is not None:
            _wait(kv_reqs)
            kv = nxt
        _mark("bwd", step, "end")
    _wait(dkv_reqs)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, allow_tf32, ring, layout):
        o, lse = _ring_forward(q, k, v, causal, scale, allow_tf32, ring, layout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, scale, allow_tf32, ring, layout)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if torch.is_grad_enabled():        # create_graph=True: an error, not a silently wrong second derivative
            from ..variants import refuse_double_backward
            refuse_double_backward()
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, o, lse, do.contiguous(), *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _check(q, k, v, layout, group, scale):
    from ..attention import check_inputs
    if layout not in L.LAYOUTS:
        raise ValueError(f"layout must be one of {L.LAYOUTS}, got {layout!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention needs torch.distributed: call torch.distributed.init_process_group("
                           "'nccl') (GPUs) or ('gloo') (CPUs) in every rank first, then pass each rank's shard "
                           "(flashlab.distributed.shard)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor (B, H, N/W, D), this rank's shard of the sequence; "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    B, H, n, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"q, k, v must agree on batch and head dim: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape[2] != n:
        raise ValueError(f"q, k, v must be shards of one sequence, with the same length on every rank (dim 2): "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    h_kv = k.shape[1]
    if h_kv < 1 or H % h_kv:
        raise ValueError(f"the query heads H = {H} must be a multiple of the key/value heads H_kv = {h_kv} "
                         f"(GQA: query head h reads K/V head h // (H / H_kv))")
    if layout == "zigzag" and n % 2:
        raise ValueError(f"a zigzag shard is two equal chunks, so its length (dim 2) must be even, got {n}: "
                         f"the sequence length must be divisible by 2·world; with is_causal=True pad it at its end "
                         f"(and drop the padded rows), or use layout='contiguous'")
    check_inputs(q, k[:, :1].expand(B, H, n, D), v[:, :1].expand(B, H, n, D), scale)


_SAME_SHAPES: set = set()   # (group, shapes, device) whose shards every rank was seen to agree on


def _check_same_shapes(q, k, group):
    """Every rank must pass shards of one shape; each checks its own, so a rank with a longer shard than its
    peers would only fail inside the transport (gloo: "Received data size doesn't match"; NCCL: a hang).
    One small all-gather the first time a shape is seen on this group, then remembered."""
    key = (group, tuple(q.shape), tuple(k.shape), q.device)
    if key in _SAME_SHAPES:
        return
    dev = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([*q.shape, k.shape[1]], dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    shapes = [tuple(t.tolist()) for t in every]
    if len(set(shapes)) > 1:
        said = "; ".join(f"rank {r}: (B, H, n, D) = {s[:4]}, H_kv = {s[4]}" for r, s in enumerate(shapes))
        raise ValueError(f"every rank must pass a shard of the same shape, got {said}; cut the sequence into "
                         "equal shards with flashlab.distributed.shard")
    _SAME_SHAPES.add(key)


def ring_attention(q, k, v, is_causal: bool = False, *, group=None, layout: str = "zigzag",
                   scale: float | None = None, return_lse: bool = False, allow_tf32: bool = False,
                   causal: bool | None = None):
    """Attention over a sequence sharded across the ranks of ``group``; every rank calls it.

    Args:
        q: (B, H, N/W, D), this rank's rows of the sequence in ``layout`` (see
            :func:`flashlab.distributed.shard`); k, v: (B, H_kv, N/W, D), the same rows, H % H_kv == 0.
        is_causal: top-left causal mask over the GLOBAL positions (query i sees keys j <= i).
        group: a torch.distributed process group (None: the default group).
        layout: "zigzag" (2W chunks, rank r holds chunks r and 2W-1-r; balanced when causal) or
            "contiguous" (rank r holds rows [r·N/W, (r+1)·N/W)).
        scale: softmax scale, default 1/sqrt(D).
        return_lse: also return the log-sum-exp of this rank's rows over all keys, (B, H, N/W) float32.
        allow_tf32: as in ``flash_attention``.  ``causal``: alias of ``is_causal``.

    Returns this rank's rows of the output (B, H, N/W, D) in q's dtype (and the LSE).  Differentiable
    in q, k, v.
    """
    if causal is not None:
        is_causal = causal
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    _check(q, k, v, layout, group, scale)
    _check_same_shapes(q, k, group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, lse = _RingAttention.apply(q, k, v, bool(is_causal), scale, bool(allow_tf32), _Ring(group), layout)
    return (o, lse) if return_lse else o


def all_gather_sequence(x, layout: str = "zigzag", dim: int = 2, group=None):
    """Every rank's shard of ``x`` put back in sequence order (an all-gather; for checks and demos)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return L.gather(parts, layout, dim)


def simulate_ring(q, k, v, world: int, is_causal: bool = False, *, layout: str = "zigzag",
                  scale: float | None = None, allow_tf32: bool = False):
    """The ring's forward with every rank played in turn by this one process (no torch.distributed):
    q (B, H, N, D), k, v (B, H_kv, N, D) the WHOLE sequence; the same tiles (``step_plan``), kernels
    (``attention._forward``) and merge as :func:`ring_attention`, on any device.  Returns (o, lse) in
    sequence order.  For notebooks and for timing one rank's steps on one GPU."""
    from ..attention import _forward
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    outs, lses = [], []
    for rank in range(world):
        qr = L.shard(q, rank, world, layout)
        n = qr.shape[2]
        o = torch.zeros((B, H, n, D), device=q.device, dtype=torch.float32)
        lse = torch.full((B, H, n), -math.inf, device=q.device, dtype=torch.float32)
        for step in range(world):
            src = L.step_source(rank, world, step)
            ke, ve = (_expand_heads(L.shard(t, src, world, layout), H) for t in (k, v))
            for t in L.step_plan(rank, world, step, n, layout, is_causal):
                o_s, lse_s = _forward(qr[:, :, t.q], ke[:, :, t.kv], ve[:, :, t.kv], t.causal, scale, allow_tf32)
                _merge_into(o[:, :, t.q], lse[:, :, t.q], o_s, lse_s)
        outs.append(o.to(q.dtype))
        lses.append(lse)
    return L.gather(outs, layout), L.gather([x[..., None] for x in lses], layout)[..., 0]
