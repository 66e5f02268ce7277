"""The DeviceMesh every parallelism is laid on: axes ("pp", "dp", "tp").

Rank order is pp-major, tp-minor: the tp group of a rank is its neighbours
(same node on a GPU cluster, where tensor-parallel traffic belongs), dp groups
stride over tp, and pp groups stride over the whole dp x tp slab. Stage i of
the plan runs on pp coordinate i % pp.

Under HSDP (`Mesh.dp_shard` < dp) the mesh keeps its three axes, so everything
that reads mesh["dp"] (the loss and token counts, the data's dp rank,
BatchNorm, ZeroRedundancyOptimizer) sees the whole dp; `hsdp_mesh` unflattens
dp into ("dp_replicate", "dp_shard") for FSDP2, the shard axis inner so a
shard group is neighbouring tp slabs (one node when dp_shard x tp fits it),
the order torchtitan's parallel_dims lays them in.

Under context parallelism (`Mesh.cp` > 1) the mesh has a fourth axis, "cp",
between dp and tp (pp, dp, cp, tp: torchtitan's order), so mesh["dp"] still
names the ranks holding different samples; `data_mesh` flattens dp x cp into
the one group that shards and reduces the parameters (torchtitan's dp_shard_cp).

Everything that could make ranks disagree (world size, missing launcher
environment) is checked here, before the first collective, so a wrong launch
fails with a message instead of hanging.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.errors import PlanMismatchError
from autopar.plan import Plan

AXES = ("pp", "dp", "tp")
CP_AXES = ("pp", "dp", "cp", "tp")
HSDP_AXES = ("dp_replicate", "dp_shard")
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> None:
    """Join the launcher's process group (torchrun or SLURM), or use the one already set up."""
    if dist.is_initialized():
        return
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        # srun without torchrun: translate SLURM's variables to torch's.
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    missing = [k for k in _LAUNCH_ENV if k not in os.environ]
    if missing:
        raise PlanMismatchError(
            f"no torch.distributed process group and no launcher environment (missing {', '.join(missing)})",
            hint="start the program with torchrun (e.g. `torchrun --nproc_per_node 8 train.py`) or srun, "
                 "or call torch.distributed.init_process_group() before autopar.compile")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, **_restart_store())


def _restart_store() -> dict:
    """After torchrun restarts failed ranks, a store of their own for the new attempt.

    torchrun's agent keeps one TCPStore for the whole job (static and c10d rendezvous
    alike, torch 2.13), and init_process_group's keys carry no attempt number: the
    restarted ranks read the dead attempt's addresses and cannot connect ("Gloo
    connectFullMesh failed ... Connection refused"). A prefix per attempt keeps them apart.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return {"store": dist.PrefixStore(f"autopar/attempt-{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def check_world_size(plan: Plan) -> None:
    world = dist.get_world_size()
    m = plan.mesh
    if m.world_size != world:
        raise PlanMismatchError(
            f"the plan is for {m.world_size} ranks (pp={m.pp} x dp={m.dp}{f' x cp={m.cp}' if (m.cp or 1) > 1 else ''} "
            f"x tp={m.tp}) but this job has {world}",
            hint=f"launch {m.world_size} processes, or re-plan for {world} GPUs (autopar plan ... --gpus {world})")


def build_mesh(plan: Plan) -> DeviceMesh:
    check_world_size(plan)
    m = plan.mesh
    if device_type() == "cpu":
        # DTensor warns on every CPU mesh that its random ops are not offset-tracked there,
        # once per compile and rank. autopar initialises weights whole, layer by layer
        # (materialize.py), so the only DTensor random ops left are dropout masks under tp
        # (on CPU ranks the tp shards draw from one generator state: still dropout, not one
        # process's masks). docs/lowering.md says so once instead of every rank every run.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    if (m.cp or 1) > 1:
        return init_device_mesh(device_type(), (m.pp, m.dp, m.cp, m.tp), mesh_dim_names=CP_AXES)
    return init_device_mesh(device_type(), (m.pp, m.dp, m.tp), mesh_dim_names=AXES)


_DATA_MESHES: dict = {}


def data_mesh(plan: Plan, mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that shard and reduce the same parameters: dp, or under context
    parallelism dp x cp flattened (cp inner), as torchtitan's dp_shard_cp; kept, since
    a flattened dim is not to be sliced from the root again. Collective the first time."""
    if (plan.mesh.cp or 1) == 1:
        return mesh["dp"]
    if id(mesh) not in _DATA_MESHES or _DATA_MESHES[id(mesh)][0] is not mesh:
        _DATA_MESHES[id(mesh)] = (mesh, mesh["dp", "cp"]._flatten("dp_cp"))
    return _DATA_MESHES[id(mesh)][1]


def hsdp_mesh(plan: Plan, mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D (dp_replicate, dp_shard) mesh of this rank's dp group, which FSDP2's
    fully_shard runs as HSDP. Unflattened from "dp" (DeviceMesh._unflatten, as
    torchtitan builds its meshes) rather than built 4-D and flattened: torch 2.13
    deprecates slicing a flattened dim from the root mesh. Collective: every rank calls it."""
    m = plan.mesh
    return mesh._unflatten("dp", (m.replicas, m.dp_shard), HSDP_AXES)[HSDP_AXES]


def local_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
