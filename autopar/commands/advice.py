"""What would fit, when nothing does: the hint the CLI prints under an
out-of-memory InfeasibleError.

"Does not fit" alone leaves the user guessing; an ML-infra engineer's next
moves are more GPUs, a device with more memory, CPU offload or a smaller
micro-batch. The planner measured the numbers (smallest footprint per GPU,
smallest GPU count that fits; autopar.errors.InfeasibleError fields); this
only turns them into those options, with shipped device profiles as the
"bigger device" candidates. No new prediction is made here.
"""
from __future__ import annotations

from autopar.errors import AutoparError, InfeasibleError

GB = 1e9


def _is_out_of_memory(exc: InfeasibleError) -> bool:
    if exc.min_bytes_per_gpu is not None:
        return True  # capacity_bytes alone says nothing: the CLI fills it in for every InfeasibleError
    # Planners that do not attach the numbers yet still say it in words.
    return " does not fit on " in exc.message


def bigger_devices(need_bytes: float | None, than_bytes: float | None, limit: int = 3) -> list[str]:
    """Shipped device profiles with more memory than `than_bytes` (and at least
    `need_bytes` when known), smallest first, as 'name (N GB)'."""
    from cost_models.hardware import shipped_devices

    floor = max(x for x in (need_bytes or 0.0, than_bytes or 0.0))
    found = sorted((d.memory_bytes, name) for name, d in shipped_devices().items()
                   if d.memory_bytes > floor and name != "cpu")
    return [f"{name} ({mem / GB:.0f} GB)" for mem, name in found[:limit]]


def infeasible_advice(exc: AutoparError, *, cluster_file: str | None = None) -> str | None:
    """The options that would make the model fit, one per line; None when `exc`
    is not an out-of-memory error (then the error's own hint stands).
    cluster_file: the --cluster file, where a device change is made instead of --device."""
    if not isinstance(exc, InfeasibleError) or not _is_out_of_memory(exc):
        return None
    lines = []
    if exc.hint:
        lines.append(exc.hint)
    if exc.min_bytes_per_gpu is not None:
        have = f" (this device: {exc.capacity_bytes / GB:.1f} GB)" if exc.capacity_bytes else ""
        lines.append(f"the smallest footprint any layout reaches is {exc.min_bytes_per_gpu / GB:.1f} GB per GPU{have}")
    if exc.smallest_world and not (exc.hint and str(exc.smallest_world) in exc.hint):
        lines.append(f"more GPUs: --gpus {exc.smallest_world} is the smallest count found to fit")
    elif not exc.smallest_world and not exc.hint:
        lines.append("more GPUs: ZeRO-3 divides parameters, gradients and optimizer state by the data-parallel size")
    devices = []
    if exc.capacity_bytes is not None:  # "bigger" needs to know the size it is compared with
        try:
            devices = bigger_devices(exc.min_bytes_per_gpu, exc.capacity_bytes)
        except Exception:  # noqa: BLE001 - advice must never hide the error it explains
            devices = []
    if devices:
        how = (f"device: {devices[0].split()[0]} in {cluster_file}" if cluster_file
               else f"--device {devices[0].split()[0]}")
        lines.append(f"a device with more memory: {', '.join(devices)}, e.g. {how}")
    lines.append("CPU offload: autopar tries --offload optimizer/params itself when you do not pin --offload; "
                 "a node with more host memory (host_memory_gib in a --cluster file) lets more of it move")
    lines.append("a smaller micro-batch or --checkpoint full lowers activation memory (model states stay the same)")
    return "what would fit:" + "".join(f"\n    - {line}" for line in lines)


__all__ = ["infeasible_advice", "bigger_devices"]
