"""A tensor-parallel DeviceMesh over torch's fake process-group backend: the
lowering's checks (what_runs.py) split a block over tp ranks on fake tensors in
one process, on rank 0 of a real job or in a process without one, and no
collective moves data or waits for another rank."""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist


_FAKE_GROUP = "autopar_fake_tp{}"


@contextlib.contextmanager
def fake_tp_mesh(size: int):
    """A 1-D DeviceMesh of `size` ranks over torch's fake backend, this process at
    coordinate 0, whatever process group it is in: the same mesh, so the same
    answers, in a process without one and on any rank of a real world.

    DTensor asks the default group for this process's rank, so a process
    without one gets a fake world of one rank for the duration. The mesh's
    group is a fake group beside the default one, registered under a fixed
    name per size (DTensor's sharding caches keep the meshes of earlier checks
    and find their group again by that name) and removed afterwards. Its
    dimension is named so that it never equals a real mesh in those caches."""
    from torch.distributed.device_mesh import DeviceMesh

    with _default_group_or_fake_one():
        me = dist.get_rank()
        ranks = [me] + [r for r in range(size + 1) if r != me][:size - 1]  # global ranks; this one first
        with _fake_group(_FAKE_GROUP.format(size), ranks) as group:
            yield DeviceMesh.from_group(group, "cpu", mesh_dim_names=("autopar_fake_tp",))


@contextlib.contextmanager
def _default_group_or_fake_one():
    if dist.is_initialized():
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook  # init_process_group prefixes "[rank0]" to every later traceback
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


@contextlib.contextmanager
def _fake_group(name: str, ranks: list[int]):
    """A process group of torch's fake backend (collectives do nothing), known to
    c10d by `name` and as `ranks` (global rank -> group rank) as `dist.new_group`
    records one, but made without it: new_group is a collective on the default
    group, and planning runs on rank 0 alone."""
    from torch._C._distributed_c10d import (FakeProcessGroup, ProcessGroup, _register_process_group,
                                            _unregister_process_group)
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    group = ProcessGroup(FakeStore(), 0, len(ranks))
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM,
                            FakeProcessGroup._create_internal(0, len(ranks)))
    group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    group._set_group_name(name)
    world = c10d._world
    tables = (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config)
    _register_process_group(name, group)
    for table, value in zip(tables, (("fake", None), name, {r: i for i, r in enumerate(ranks)}, "fake")):
        table[group] = value
    try:
        yield group
    finally:
        for table in tables:
            table.pop(group, None)
        _unregister_process_group(name)
