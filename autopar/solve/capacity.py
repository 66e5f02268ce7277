"""Does the model fit anywhere on this cluster? A bound checked before any search.

Every parameter's weight, gradient and optimizer state live somewhere: on one
of the GPUs or, with CPU offload, in a node's host memory. However a layout
splits, shards or offloads them, the cluster holds at least

    parameters x (weight + gradient + optimizer bytes per parameter)

(16 B in bf16 with Adam: FSDP's fp32 shard 4 + its gradient 4 + Adam 8, or a
16-bit weight 2 + gradient 2 + fp32 master and moments 12). When that exceeds
every GPU's memory limit plus, where offload is allowed, every node's host
memory, no layout fits, and the planner says so in a second instead of
bounding, solving and re-planning for minutes (Llama 3 405B on 8 A100-40GB:
2 min 33 s). Activations, buffers and fragmentation only add to the need, so a
model this bound lets through may still not fit: the search decides then.

The advice is the same bound read backwards: the fewest GPUs (whole nodes,
doubling, as the planner's own GPU-count search steps) and the shipped devices
that could hold the states. They are stated as bounds ("at least"), not as
layouts that were planned and fit.
"""
from __future__ import annotations

from cost_models.hardware import ClusterSpec
from cost_models.memory import state_bytes_per_param

from autopar.errors import InfeasibleError
from autopar.solve.what_fits import doubled_clusters, larger_devices, size


def least_state_bytes(params: float, precision: str, optimizer: str) -> float:
    """Bytes the weights, gradients and optimizer state of `params` parameters take in all."""
    return params * sum(state_bytes_per_param(precision, optimizer))


def room_bytes(cluster: ClusterSpec, headroom: float, offload: bool) -> float:
    """What the cluster can hold them in: every GPU up to the planner's memory limit,
    and every node's host memory when layers may offload."""
    gpus = cluster.world_size * (1 - headroom) * cluster.device_profile.usable_memory_bytes
    return gpus + (cluster.nodes * cluster.host_memory_bytes if offload else 0.0)


def check_capacity(spec, cluster: ClusterSpec, *, offload_pin, precision: str, optimizer: str,
                   headroom: float, scaled_cluster) -> None:
    """Raise InfeasibleError when the model's states alone exceed the cluster's memory.
    `offload_pin`: the user's --offload (None: the planner may offload); `scaled_cluster`:
    the planner's (cluster, nodes) -> the same hardware with more nodes."""
    need = least_state_bytes(spec.total_params, precision, optimizer)
    offload = offload_pin in (None, "optimizer", "params")
    room = room_bytes(cluster, headroom, offload)
    if need <= room:
        return
    device = cluster.device_profile
    per_param = sum(state_bytes_per_param(precision, optimizer))
    host = (f" and the host memory of its {cluster.nodes} node(s) for CPU offload "
            f"({size(cluster.nodes * cluster.host_memory_bytes)})" if offload else " (CPU offload pinned off)")
    fixes = _bound_fixes(need, cluster, headroom, offload, precision, scaled_cluster)
    raise InfeasibleError(
        f"{spec.name} does not fit on {cluster.world_size} x {device.name}: its weights, gradients and "
        f"optimizer state alone take {size(need)} ({per_param} B per parameter, {precision} with {optimizer}), "
        f"more than its {cluster.world_size} GPUs ({size((1 - headroom) * device.usable_memory_bytes)} usable "
        f"each after the {headroom:.0%} memory headroom){host} hold together ({size(room)}); "
        f"no layout was searched",
        min_bytes_per_gpu=need / cluster.world_size if not offload else None,
        capacity_bytes=device.memory_bytes, device=device.name, fixes=fixes)


def _bound_fixes(need: float, cluster: ClusterSpec, headroom: float, offload: bool, precision: str,
                 scaled_cluster) -> list[dict]:
    """The fewest GPUs (whole nodes, doubling) and the smallest larger shipped device whose
    memory could hold the states; bounds, each to be planned to check."""
    fixes = []
    for bigger in doubled_clusters(cluster, scaled_cluster):
        if need <= room_bytes(bigger, headroom, offload):
            fixes.append({"change": "gpus_at_least", "gpus": bigger.world_size})
            break
    for name, other in larger_devices(cluster, precision):
        if need <= room_bytes(other, headroom, offload):
            fixes.append({"change": "device_at_least", "device": name,
                          "memory_bytes": other.device_profile.memory_bytes})
            break
    return fixes


__all__ = ["check_capacity", "least_state_bytes", "room_bytes"]
