"""Work split between this process and one forked child, with the same answers
as this process alone computes.

Planning a large model is pure Python on one core (capture, fake-tensor runs,
the search, the cost model); a second core sits idle. Two kinds of work there
are independent of what this process does meanwhile:
* the lowering's checks of what runs (what_runs.py): one block split at each
  tp degree, with and without sequence parallelism, run on fake tensors, ten
  or so runs of 0.1-0.3 s, each independent of the others: `map_split`;
* the uniform-layout check (solve/refine.py) prices layouts in an order
  known before the search starts, and only which of them it reads depends on
  the search's answer: `Beside` prices them in that order while the search
  runs, and the check reads what is ready and prices the rest itself; the
  fusion pass traces the model's blocks while the lowering's checks run.
Every answer is a pure function of inputs both processes hold at the fork,
so it does not matter which process computed it (the memo tables and caches
that differ only make a repeated computation faster).

Forking is safe only where nothing else can be inside a lock the child
needs: not inside a process group (NCCL / gloo threads), and only where
fork is the platform's way (Linux); it pays only where a core is idle (not
on one core, nor when the processes running now, this one included, leave none). AUTOPAR_FORK=0 turns
it off, AUTOPAR_FORK=1 forks wherever it is safe (the tests). The answers are the same either way. The child writes nothing to stdout / stderr
(a spinner thread of the parent's may hold their locks at the fork) and ends
with os._exit (no atexit handler, no second flush of the parent's buffers).
A child that fails, dies or is late is ignored: its share runs here.
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import sys
import tempfile
import time
from typing import Callable, Iterable

import torch.distributed as dist


def may_fork() -> bool:
    """Whether to fork a helper: Linux, no process group, and a core idle (or AUTOPAR_FORK=1)."""
    asked = os.environ.get("AUTOPAR_FORK", "auto")  # "0": never, "1": wherever it is safe, "auto": when it pays
    if asked == "0" or not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    if dist.is_available() and dist.is_initialized():
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    # a second process helps only where a core is idle; on a busy machine it slows both
    return asked == "1" or (cores >= 2 and _runnable() < cores)


def _runnable() -> float:
    """Processes running or ready to run now, this one included: /proc/loadavg's fourth
    field ("2/80": 2 runnable of 80), not the load average, whose minute-long memory
    counted a planner that had just ended as busy and kept the next one from forking."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return os.getloadavg()[0] + 1


def map_split(fn: Callable, jobs: list, weights: list[float] | None = None) -> list:
    """[fn(job) for job in jobs], about half of the weight run by a forked child.
    fn's answers must pickle; an exception raised by fn for a job is raised here,
    when this process runs that job (the child's failures are run again here)."""
    if len(jobs) < 3 or not may_fork():
        return [fn(j) for j in jobs]
    # The first job runs before the fork: its one-time work (torch's lazy imports and
    # op registrations, DTensor's first sharding rules: a third of a first run) is
    # then done once, and the child starts warm.
    answers: dict[int, object] = {0: fn(jobs[0])}
    weights = weights or [1.0] * len(jobs)
    theirs = [i + 1 for i in _child_share(weights[1:])]
    pipe = ()
    try:
        pipe = read_end, write_end = os.pipe()
        pid = _fork(lambda: _write_all(write_end, pickle.dumps([fn(jobs[i]) for i in theirs])))
    except OSError:  # no process or pipe to be had (EAGAIN, ENOMEM, EMFILE): all of it here
        for fd in pipe:
            os.close(fd)
        return [answers[0]] + [fn(j) for j in jobs[1:]]
    os.close(write_end)
    t0 = time.monotonic()
    try:
        for i in range(1, len(jobs)):
            if i not in theirs:
                answers[i] = fn(jobs[i])
        got = _collect(read_end, deadline_s=3 * (time.monotonic() - t0) + 30.0)
    finally:  # Ctrl-C or a failure here: the child goes with it
        _stop(pid)
        os.close(read_end)
    for i, answer in zip(theirs, got if got is not None else []):
        answers[i] = answer
    for i in theirs:  # the child's share it did not answer: run here
        if i not in answers:
            answers[i] = fn(jobs[i])
    return [answers[i] for i in range(len(jobs))]


class Beside:
    """`items()` -> (key, value) pairs computed by a forked child while this
    process goes on; `ready()` is what it has finished so far (a dict), `stop()`
    ends it. Without fork, nothing is computed beside: ready() is empty and the
    reader computes every value itself, as it must for any key missing."""

    def __init__(self, items: Callable[[], Iterable[tuple]]):
        self._pid = None
        self._fd = None
        self._done: dict = {}
        self._offset = 0
        if not may_fork():
            return
        # A file, not a pipe: the child never waits for this process to read.
        try:
            out = tempfile.TemporaryFile()
            self._fd = os.dup(out.fileno())
            out.close()
            fd = self._fd
            self._pid = _fork(lambda: _write_frames(fd, items()))
        except OSError:  # no temporary file or process to be had: nothing is computed beside
            self.stop()

    def ready(self) -> dict:
        if self._fd is not None:
            self._read_frames()
        return self._done

    def finish(self, timeout_s: float) -> dict:
        """What is ready once the child has finished its items (or after `timeout_s`), the child ended."""
        end = time.monotonic() + timeout_s
        while self._pid is not None and time.monotonic() < end:
            if os.waitpid(self._pid, os.WNOHANG)[0]:
                self._pid = None  # reaped
                break
            time.sleep(0.005)
        return self.stop()

    def stop(self) -> dict:
        """What was ready, the child ended (call it once the values are read)."""
        done = self.ready()
        if self._pid is not None:
            _stop(self._pid)
            self._pid = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return done

    def _read_frames(self) -> None:
        # os.pread: the child's writes move the file offset both processes share
        while True:
            head = os.pread(self._fd, 8, self._offset)
            if len(head) < 8:
                return
            (size,) = struct.unpack("<Q", head)
            body = os.pread(self._fd, size, self._offset + 8)
            if len(body) < size:  # being written
                return
            # our own child's bytes, written a moment ago (nothing a user loads)
            key, value = pickle.loads(body)
            self._done[key] = value
            self._offset += 8 + size


def _fork(work: Callable[[], None]) -> int:
    """pid of a child that runs `work` with stdout / stderr on /dev/null and exits."""
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.stdout = sys.stderr = open(devnull, "w")  # see the module docstring: no shared stream
        work()
        status = 0
    except BaseException:  # noqa: BLE001 - the parent computes this share itself
        pass
    finally:
        os._exit(status)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_frames(fd: int, items: Iterable[tuple]) -> None:
    parent = os.getppid()
    for key, value in items:
        if os.getppid() != parent:  # the parent is gone (killed): nobody reads these
            return
        body = pickle.dumps((key, value))
        _write_all(fd, struct.pack("<Q", len(body)) + body)


def _child_share(weights: list[float]) -> list[int]:
    """Indices of the jobs the child runs: largest first onto the lighter side
    (this process takes ties), so both finish at about the same time."""
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    parent = child = 0.0
    theirs = []
    for i in order:
        if child < parent:
            theirs.append(i)
            child += weights[i]
        else:
            parent += weights[i]
    return sorted(theirs)


def _collect(read_end: int, deadline_s: float):
    """The child's pickled answer from the pipe, or None (failed, died or late)."""
    chunks, end = [], time.monotonic() + deadline_s
    while True:
        left = end - time.monotonic()
        if left <= 0 or not select.select([read_end], [], [], left)[0]:
            return None
        chunk = os.read(read_end, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    try:
        # our own child's bytes, made a moment ago (nothing a user loads)
        return pickle.loads(b"".join(chunks)) if chunks else None
    except Exception:  # noqa: BLE001 - cut short: the parent computes the share
        return None


def _stop(pid: int) -> None:
    """End the child (if it still runs) and reap it."""
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
