"""Work split with a forked child (autopar/two_processes.py): the same answers
as one process, the child's share really computed there, its failures run
again here, and no child left behind."""
from __future__ import annotations

import os
import time

import pytest

from autopar import two_processes
from autopar.two_processes import Beside, map_split, may_fork

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not os.sys.platform.startswith("linux"),
                                reason="fork is Linux's way here")


@pytest.fixture
def forking(monkeypatch):
    monkeypatch.setenv("AUTOPAR_FORK", "1")
    assert may_fork()


def _children() -> set[int]:
    """This process's children, zombies included (/proc: a child not reaped stays listed)."""
    me, out = os.getpid(), set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                out.add(int(name))
    return out


@pytest.fixture
def no_child_left():
    before = _children()
    yield
    assert _children() <= before, "a forked child was left running or unreaped"


def test_map_split_same_answers_child_computes_its_share(forking, no_child_left):
    me = os.getpid()
    out = map_split(lambda j: (j * j, os.getpid()), list(range(7)), weights=[1, 2, 1, 2, 1, 2, 1])
    assert [v for v, _ in out] == [j * j for j in range(7)]
    by = {pid for _, pid in out}
    assert me in by and len(by) == 2  # both processes computed a share
    assert out[0][1] == me  # the first job runs before the fork (the child starts warm)


def test_map_split_without_fork_runs_here(monkeypatch):
    monkeypatch.setenv("AUTOPAR_FORK", "0")
    me = os.getpid()
    assert all(pid == me for _, pid in map_split(lambda j: (j, os.getpid()), list(range(5))))


def test_map_split_child_failure_is_raised_here(forking, no_child_left):
    def fn(j):
        if j == 4:
            raise ValueError("job 4 fails")
        return j
    theirs = [i + 1 for i in two_processes._child_share([1.0] * 5)]
    assert 4 in theirs  # the failing job is the child's: the parent runs it again and raises
    with pytest.raises(ValueError, match="job 4 fails"):
        map_split(fn, list(range(6)))


def test_child_share_balances_weights():
    theirs = two_processes._child_share([2, 1, 2, 1, 2, 1, 2, 1, 2])
    mine = [i for i in range(9) if i not in theirs]
    w = [2, 1, 2, 1, 2, 1, 2, 1, 2]
    assert abs(sum(w[i] for i in theirs) - sum(w[i] for i in mine)) <= 1


def test_beside_items_ready_then_stopped(forking, no_child_left):
    me = os.getpid()

    def items():
        for k in range(50):
            yield k, (k + 1, os.getpid())
    ahead = Beside(items)
    deadline = time.monotonic() + 30
    while len(ahead.ready()) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    done = ahead.stop()
    assert done == {k: (k + 1, done[k][1]) for k in range(50)}
    assert all(pid != me for _, pid in done.values())


def test_beside_stop_ends_a_long_child(forking, no_child_left):
    def items():
        for k in range(10 ** 9):
            time.sleep(0.01)
            yield k, k
    ahead = Beside(items)
    time.sleep(0.1)
    t0 = time.monotonic()
    done = ahead.stop()
    assert time.monotonic() - t0 < 5
    assert all(k == v for k, v in done.items())


def test_beside_without_fork_computes_nothing(monkeypatch):
    monkeypatch.setenv("AUTOPAR_FORK", "0")
    ran = []
    ahead = Beside(lambda: iter([(1, ran.append(1))]))
    assert ahead.ready() == {} and ahead.stop() == {} and ran == []


def test_no_process_to_be_had_computes_everything_here(forking, monkeypatch):
    """fork failing (EAGAIN, ENOMEM) is no error: the jobs run here, nothing is ahead."""
    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(os, "fork", no_fork)
    me = os.getpid()
    assert map_split(lambda j: (j + 1, os.getpid()), list(range(5))) == [(j + 1, me) for j in range(5)]
    ahead = Beside(lambda: iter([(1, 2)]))
    assert ahead.ready() == {} and ahead.stop() == {}
