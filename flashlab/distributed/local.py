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

__all__ = ["run_local", "free_port"]


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
    their results in rank order."""
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
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

