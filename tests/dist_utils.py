"""Spawn harness for multi-rank tests: real gloo worlds on 127.0.0.1.

`run_world(fn, world_size, *args, timeout=...)` starts `world_size` fresh
processes (forked from a fork server that imported torch and autopar and did
nothing else, so no torch state from the test; see `_context`), initialises a gloo
process group in each with the torchrun environment variables set (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), calls `fn(rank,
world_size, *args)` and returns the list of per-rank return values.

Why a hard timeout: a rank that dies or diverges leaves the others blocked in
a collective forever. The parent waits on a queue with a deadline, and on
timeout or on any rank's exception it kills every rank it started and raises
with that rank's traceback, so a broken lowering fails a test, never hangs it.

Starting a world still costs a process group and the test module's import per
rank, so a test should run many checks inside one world: `fn` may return a
dict of results per check.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TestStdio:
    """The test's stdout / stderr as they are when the world starts (capfd's files inside a
    test), handed to each rank: a rank forked from the fork server would otherwise write to
    the server's, which belong to whichever test started it. Pickled while the rank starts,
    so multiprocessing passes the two descriptors to the fork server with the request."""

    def __reduce__(self):
        from multiprocessing import reduction
        return _stdio_in_rank, (reduction.DupFd(1), reduction.DupFd(2))


def _stdio_in_rank(out, err):
    return out.detach(), err.detach()


def _worker(rank, world_size, port, fn, args, results, env, stdio=None):
    if stdio is not None:
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(stdio[0], 1)
        os.dup2(stdio[1], 2)
    os.environ.clear()
    os.environ.update(env)  # the test's environment now, not the fork server's at its start
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # One thread per rank: 8 ranks share 2 cores; more threads only thrash.
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
        # Rank 0 hosts the TCPStore: a rank that finishes first (a refusal
        # raised before its peers are done creating the mesh's groups) must
        # not take the store down under them ("Broken pipe" in new_group).
        try:
            if dist.is_initialized():
                dist.barrier()
        except Exception:  # a peer that failed reports itself; this rank's result is in
            pass
    except BaseException:  # report everything: the parent must not wait for a dead rank
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    # Flush the result to the parent, then skip interpreter teardown: gloo
    # occasionally aborts there (see shared notes).
    results.close()
    results.join_thread()
    os._exit(0)


# What nearly every rank function imports (transformers when installed: the fork server
# skips a module that fails to import).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
            "torch.distributed.pipelining", "autopar", "autopar.lower", "autopar.capture", "autopar.train",
            "transformers"]


def _context():
    """A fork server with torch, autopar and transformers imported once: each rank forks
    from a process that never ran a torch op nor joined a process group (as fresh as a
    spawned one), without importing them again. Spawned, a 4-rank world importing
    autopar.lower and transformers took 36 s on this 2-core machine under load, forked from
    the server 0.35 s. What a preloaded module read from the environment at import is the
    server's; every rank gets the test's environment as it is when the world starts."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_world(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, env, _TestStdio()),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"world of {world_size} ranks timed out after {timeout:.0f} s; "
                                   f"ranks done: {sorted(out)}")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in out]
                if dead and results.empty():
                    time.sleep(0.5)  # a result may still be in flight
                    if results.empty():
                        raise RuntimeError(f"rank(s) {dead} exited without a result (exit codes "
                                           f"{[procs[i].exitcode for i in dead]})")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]


def one_process_sgd(model, batches, loss_fn, lr: float) -> tuple[list[float], object]:
    """The reference a lowered run is held to: a copy of `model` trained by plain
    SGD on `batches` in this process; (losses, the trained copy)."""
    import copy

    import torch
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = loss_fn(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, ref


def signal_after_rows(job, metrics, send, rows: int = 2, within_s: float = 240.0) -> bool:
    """Call `send()` once the running `job` (a Popen) has written `rows` metrics rows to
    `metrics` (a path): a signal that lands inside the run. False if the job ended first."""
    deadline = time.monotonic() + within_s
    while job.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            send()
            return True
        time.sleep(0.01)
    return False
