"""What would fit, when nothing does: the hint the CLI prints under an
out-of-memory InfeasibleError.

"Does not fit" alone leaves the user guessing; a wrong guess is worse (a
bigger GPU that does not help, full checkpointing offered after the user
pinned --checkpoint none). The planner re-planned each candidate change and
attached those that fit (`InfeasibleError.fixes`, autopar/solve/what_fits.py):
a pin to release, the memory headroom, a GPU count, a larger shipped device.
This only words them; it suggests nothing that was not checked and makes no
new prediction.
"""
from __future__ import annotations

from autopar.errors import AutoparError, InfeasibleError

GB = 1e9


def _is_out_of_memory(exc: InfeasibleError) -> bool:
    if exc.min_bytes_per_gpu is not None or exc.fixes is not None:
        return True  # capacity_bytes alone says nothing: the CLI fills it in for every InfeasibleError
    # Planners that do not attach the numbers yet still say it in words.
    return " does not fit on " in exc.message


def infeasible_advice(exc: AutoparError, *, cluster_file: str | None = None) -> str | None:
    """The changes that were checked to make the model fit, one per line; None when
    `exc` is not an out-of-memory error (then the error's own hint stands).
    cluster_file: the --cluster file, where a device change is made instead of --device."""
    if not isinstance(exc, InfeasibleError) or not _is_out_of_memory(exc):
        return None
    from autopar.solve.what_fits import fix_text, size

    lines = []
    if exc.fixes:
        lines += [fix_text(f, cluster_file=cluster_file) for f in exc.fixes]
    elif exc.fixes is not None:  # searched, and nothing fits
        lines.append("nothing autopar tried fits: no single pin released, no GPU count up to 4096x this one and "
                     "no larger shipped device")
        lines.append("not tried: a shorter --seq-len, a smaller --batch-size, more host memory for CPU offload "
                     "(host_memory_gib in a --cluster file), or a smaller model")
    else:  # an InfeasibleError raised without the planner's checks: only what it measured
        if exc.hint:
            lines.append(exc.hint)
        if exc.smallest_world and not (exc.hint and str(exc.smallest_world) in exc.hint):
            lines.append(f"more GPUs: --gpus {exc.smallest_world} is the smallest count found to fit")
    if exc.min_bytes_per_gpu is not None:
        have = f" (this device: {size(exc.capacity_bytes)})" if exc.capacity_bytes else ""
        lines.append(f"the smallest footprint any layout reaches without offload is "
                     f"{size(exc.min_bytes_per_gpu)} per GPU{have}")
    if not lines:
        return None
    return "what would fit:" + "".join(f"\n    - {line}" for line in lines)


__all__ = ["infeasible_advice"]
