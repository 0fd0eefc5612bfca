"""A tiny character-level GPT whose attention is pluggable: the end-to-end test of a backward pass.

    >>> from flashlab import gpt
    >>> data = gpt.CharData(gpt.load_text(), block_size=64)
    >>> cfg = gpt.GPTConfig(vocab_size=data.vocab_size, block_size=64)
    >>> run = gpt.train("flashlab", cfg, data, steps=200)      # or "sdpa", "naive", or your own function
    >>> run["loss"][-1], run["step_ms"], run["peak_mib"]

Attention is any function ``attn(q, k, v) -> o`` on (B, H, T, head_dim) tensors, causal.
:func:`attention_fn` names the built-in ones; :func:`attention_from_kernels` turns a learner's
``flash_backward`` (notebook 07's exercise) into one, through a ``torch.autograd.Function``.

The same ``seed`` gives the same initial weights and the same batches whatever the attention, so
two runs differ only by the attention's rounding: the loss curves of two correct attentions agree
within that noise.  The model (pre-LayerNorm blocks, GELU MLP, tied embeddings) follows GPT-2's
layout at toy scale; no dropout, no weight decay on biases and norms.

The text is an excerpt of the Jargon File (public domain), shipped in ``flashlab/data``.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from importlib import resources

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import device

__all__ = ["load_text", "CharData", "GPTConfig", "GPT", "attention_fn", "attention_from_kernels",
           "train", "sample", "set_attention", "cpu_config", "gpu_config", "smooth"]


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------

def load_text(name: str = "jargon.txt") -> str:
    """A text shipped with flashlab (``flashlab/data``; see its README for the source and licence)."""
    return resources.files("flashlab").joinpath("data", name).read_text(encoding="utf-8")


class CharData:
    """Characters -> integer ids; the first 90% trains, the rest validates; random windows as batches."""

    def __init__(self, text: str, block_size: int, dev=None):
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        cut = int(0.9 * len(ids))
        self.train_ids, self.val_ids = ids[:cut], ids[cut:]
        self.block_size = block_size
        self.device = dev or device.DEVICE

    def encode(self, s: str) -> list:
        return [self.stoi[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, batch_size: int, gen: torch.Generator, split: str = "train"):
        """(x, y): (batch_size, block_size) ids and the same shifted by one character."""
        ids = self.train_ids if split == "train" else self.val_ids
        start = torch.randint(0, len(ids) - self.block_size - 1, (batch_size,), generator=gen)
        x = torch.stack([ids[s:s + self.block_size] for s in start.tolist()])
        y = torch.stack([ids[s + 1:s + 1 + self.block_size] for s in start.tolist()])
        return x.to(self.device), y.to(self.device)


# ----------------------------------------------------------------------------
# attention, pluggable
# ----------------------------------------------------------------------------

def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _naive(q, k, v):
    t = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def _flashlab(q, k, v):
    from .attention import flash_attention
    return flash_attention(q, k, v, causal=True)


def attention_fn(name):
    """"sdpa" (PyTorch's scaled_dot_product_attention), "flashlab" (flashlab.flash_attention: Triton
    forward and backward) or "naive" (S and P materialised); a callable is returned as it is."""
    if callable(name):
        return name
    fns = {"sdpa": _sdpa, "flashlab": _flashlab, "naive": _naive}
    if name not in fns:
        raise ValueError(f"unknown attention {name!r}; use one of {sorted(fns)} or a function attn(q, k, v) -> o")
    return fns[name]


def attention_from_kernels(flash_backward, flash_forward=None):
    """Causal attention whose backward is ``flash_backward(q, k, v, o, lse, do, dq, dk, dv, causal)`` (the
    exercise's contract: it writes dQ, dK, dV in place).  The forward is ``flash_forward(q, k, v, o, lse,
    causal)`` if given, else flashlab's own kernel.  Inputs must be fp16/bf16/fp32 with a head dim the
    kernels take (16, 32, 64, 128); bf16 in the interpreter is computed in fp32, as flashlab does."""
    from .kernels import launch_forward

    def fwd(q, k, v, o, lse, causal):
        launch_forward(q, k, v, o, lse, causal, 1.0 / math.sqrt(q.shape[-1]))

    forward = flash_forward or fwd

    class LearnerAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            dt = q.dtype
            if device.INTERPRET and dt == torch.bfloat16:
                q, k, v = q.float(), k.float(), v.float()
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            forward(q, k, v, o, lse, True)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.dt = dt
            return o.to(dt)

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            do = do.to(q.dtype)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            flash_backward(q, k, v, o, lse, do, dq, dk, dv, True)
            return dq.to(ctx.dt), dk.to(ctx.dt), dv.to(ctx.dt)

    return LearnerAttention.apply


# ----------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------

@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64      # context length T
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64          # head_dim = n_embd / n_head


def cpu_config(vocab_size: int) -> GPTConfig:
    """Small enough to train a few hundred steps through the Triton interpreter in about a minute."""
    return GPTConfig(vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32)


def gpu_config(vocab_size: int) -> GPTConfig:
    """A realistic little model: 6 layers, 6 heads of 64, context 256 (about 10.8 M parameters)."""
    return GPTConfig(vocab_size, block_size=256, n_layer=6, n_head=6, n_embd=384)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attn):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.attn = attn

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, H, T, hd)
        y = self.attn(q, k, v)                                                               # (B, H, T, hd)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, attn="sdpa"):
        super().__init__()
        self.cfg = cfg
        attn = attention_fn(attn)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg, attn) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight                      # tied embeddings
        self.apply(self._init)
        for name, p in self.named_parameters():                 # GPT-2: residual projections scaled down
            if name.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


# ----------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------

def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def train(attn, cfg: GPTConfig, data: CharData, steps: int = 200, batch_size: int = 16, lr: float = 3e-3,
          seed: int = 0, dtype=None, eval_every: int = 0, eval_batches: int = 4, log=None) -> dict:
    """Train a fresh GPT for ``steps`` AdamW steps; returns a dict of plain numbers:

    loss (per step, train batch), val (list of (step, validation loss)), step_ms (median time of a
    step after the first 5), peak_mib (peak GPU memory during training above the model's weights:
    activations, gradients, optimiser state; None on the CPU), params, config, attention, dtype,
    device, and the trained ``model``.

    ``dtype``: torch.bfloat16 trains under autocast (GPU); default float32.  ``seed`` fixes the initial
    weights and the batches, so runs with different attentions see exactly the same data.
    """
    dev = data.device
    torch.manual_seed(seed)
    model = GPT(cfg, attn).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))))
    gen = torch.Generator().manual_seed(seed + 1)
    val_gen = torch.Generator().manual_seed(seed + 2)
    val_batches = [data.batch(batch_size, val_gen, "val") for _ in range(eval_batches)] if eval_every else []
    use_autocast = dtype is not None and dtype != torch.float32
    losses, times, val = [], [], []

    def evaluate():
        model.eval()
        with torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=use_autocast):
            v = sum(model(x, y)[1].item() for x, y in val_batches) / len(val_batches)
        model.train()
        return v

    if dev.type == "cuda":
        _sync(dev)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for step in range(steps):
        x, y = data.batch(batch_size, gen)
        _sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=dtype, enabled=use_autocast):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if eval_every and (step % eval_every == 0 or step == steps - 1):
            val.append((step, evaluate()))
        if log and (step % max(1, steps // 10) == 0 or step == steps - 1):
            log(f"step {step:>4}  loss {losses[-1]:.3f}")
    peak = None
    if dev.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    steady = sorted(times[5:] or times)
    return {
        "attention": attn if isinstance(attn, str) else getattr(attn, "__name__", "custom"),
        "loss": losses, "val": val,
        "step_ms": 1e3 * steady[len(steady) // 2],
        "peak_mib": peak,
        "params": sum(p.numel() for p in model.parameters()),
        "config": asdict(cfg), "batch_size": batch_size, "steps": steps, "lr": lr, "seed": seed,
        "dtype": str(dtype or torch.float32).replace("torch.", ""), "device": str(dev),
        "model": model,
    }


def set_attention(model: GPT, attn) -> GPT:
    """Swap the attention of every block (e.g. to sample with SDPA from weights trained with flashlab)."""
    fn = attention_fn(attn)
    for blk in model.blocks:
        blk.attn = fn
    return model


@torch.no_grad()
def sample(model: GPT, data: CharData, prompt: str = ":", n: int = 200, temperature: float = 0.8,
           seed: int = 0) -> str:
    """Continue ``prompt`` by ``n`` characters (sampling needs only the forward)."""
    model.eval()
    gen = torch.Generator(device=data.device).manual_seed(seed)
    idx = torch.tensor([data.encode(prompt)], device=data.device)
    for _ in range(n):
        logits = model(idx[:, -model.cfg.block_size:])[:, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        idx = torch.cat([idx, nxt], 1)
    model.train()
    return data.decode(idx[0].tolist())


def smooth(xs, k: int = 10):
    """Moving average over ``k`` steps (for plotting noisy per-step losses)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out
