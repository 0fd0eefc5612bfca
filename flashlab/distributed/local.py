"""Run a function on W local processes joined by torch.distributed: tests and notebook demos.

    from flashlab.distributed.local import run_local
    outs = run_local(fn, world=2)        # fn(rank, world, *args) in each process; its return values

Each process initialises a process group (gloo by default: CPUs; the same code runs on NCCL with
one GPU per process) on a free localhost port, runs ``fn``, and sends its return value back (it
must pickle; small tensors do).  An exception in any rank is raised here with that rank's traceback;
past ``timeout`` seconds every process is killed and a TimeoutError raised, so a hung ring (a send
without its receive) cannot hang the caller.  Processes are forked where the platform allows (a
function defined in a notebook then needs no pickling), spawned elsewhere.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback

__all__ = ["run_local", "free_port", "ring_check"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, backend, args, out, threads):
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            res = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        out.put((rank, True, res))
    except BaseException:           # noqa: BLE001 - everything goes back to the caller
        out.put((rank, False, traceback.format_exc()))


def run_local(fn, world: int = 2, args: tuple = (), *, backend: str = "gloo", timeout: float = 120.0,
              threads: int = 1):
    """Run ``fn(rank, world, *args)`` in ``world`` processes of one process group; return the list of
    their results in rank order.  ``backend="nccl"``: one GPU per rank (rank r on cuda:r); processes
    are then spawned, so ``fn`` must be importable (defined in a module, e.g. :func:`ring_check`)."""
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    import torch
    cuda_started = torch.cuda.is_available() and torch.cuda.is_initialized()
    # a forked child cannot use CUDA once the parent has; spawned children re-import fn's module
    method = "fork" if "fork" in mp.get_all_start_methods() and not cuda_started and backend != "nccl" else "spawn"
    ctx = mp.get_context(method)
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, backend, args, out, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"run_local: {world - len(results)} of {world} ranks did not finish within "
                                   f"{timeout:.0f} s (ranks done: {sorted(results)}); all were stopped")
            try:
                rank, ok, res = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"run_local: rank {dead[0]} died (exit code {procs[dead[0]].exitcode})")
                continue
            if not ok:
                raise RuntimeError(f"run_local: rank {rank} raised:\n{res}")
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
    return [results[r] for r in range(world)]



def ring_check(rank, world, B=1, H=4, H_kv=2, N=64, D=32, layout="zigzag", causal=True, seed=0):
    """One rank of a check: ring attention on this rank's shard against the single-process op on the
    whole sequence (every rank draws the same data), forward and backward.  Returns a dict of the
    largest differences (o, lse, dq, dk, dv) and this rank's ring time in seconds.  CPU tensors on
    gloo (the interpreter), cuda:rank on NCCL."""
    import time

    import torch

    import flashlab
    from .layout import shard
    from .ring import all_gather_sequence, ring_attention

    dev = torch.device("cuda", rank) if flashlab.device.GPU else torch.device("cpu")
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(seed)
    Q, dO = (torch.randn(B, H, N, D, generator=g) for _ in range(2))
    K, V = (torch.randn(B, H_kv, N, D, generator=g) for _ in range(2))
    Q, K, V, dO = (t.to(dev, dtype) for t in (Q, K, V, dO))
    q, k, v, do = (shard(t, rank, world, layout).requires_grad_(t is not dO) for t in (Q, K, V, dO))
    t0 = time.perf_counter()
    o, lse = ring_attention(q, k, v, is_causal=causal, layout=layout, return_lse=True)
    o.backward(do)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    got = [all_gather_sequence(t, layout) for t in (o.detach(), lse[..., None], q.grad, k.grad, v.grad)]
    grp = H // H_kv
    Qr, Kr, Vr = (t.detach().clone().requires_grad_() for t in (Q, K, V))
    oo, lo = flashlab.flash_attention(Qr, Kr.repeat_interleave(grp, 1), Vr.repeat_interleave(grp, 1), causal,
                                      return_lse=True)
    oo.backward(dO)
    want = (oo, lo[..., None], Qr.grad, Kr.grad, Vr.grad)
    diff = {name: float((a.detach().float() - b.detach().float()).abs().max()) for name, a, b in
            zip(("o", "lse", "dq", "dk", "dv"), got, want)}
    return dict(diff, seconds=seconds, rows_per_rank=q.shape[2])
