"""What would fit, when nothing does: checked, never guessed.

When no layout fits, the planner's error says what it tried (the pins the
user set are not "allowed", they were held) and the smallest changes that
were *planned and found to fit*:

- releasing one pin (`--checkpoint none` -> the planner may checkpoint), on
  the same hardware: each pinned flag is freed in turn and re-planned;
- the memory headroom at 0 (the planner's safety margin is a knob as well);
- more GPUs: the planner's own doubling search (`planner._smallest_world`);
- a device with more memory: shipped profiles larger than this one, smallest
  first, each planned with the same pins until one fits (at most three).

Every entry of `what_would_fit` is a plan `autopar.plan` made (the same
search, pricing and memory limit as the user's, with the one change), so the
CLI advice (autopar/commands/advice.py) repeats numbers, it makes none. A
check that fails is only "no": it runs no GPU-count search or checks of its
own (`checking_a_fix`).
"""
from __future__ import annotations

from contextvars import ContextVar

from autopar.solve.constraints import FLAG, Constraints

DEVICES_TRIED = 3  # larger shipped devices planned at most; each is one search


def pinned_flag(pins: Constraints, key: str) -> str:
    """'--checkpoint none', '--schedule interleaved:3', '--sequence-parallel' as the user typed it."""
    value = getattr(pins, key)
    if key == "schedule" and pins.virtual_stages:
        value = f"{value}:{pins.virtual_stages}"
    if key == "sequence_parallel":
        return "--sequence-parallel" if value else "--no-sequence-parallel"
    return f"{FLAG.get(key, '--' + key.replace('_', '-'))} {value}"


def _pinned_keys(pins: Constraints) -> list[str]:
    return [k for k in ("checkpoint", "zero", "offload", "micro_batch", "tp", "pp", "dp", "schedule",
                        "sequence_parallel") if getattr(pins, k) is not None]


def tried_text(pins: Constraints) -> str:
    """What the search was allowed to use against memory, and what the pins held fixed:
    'even with ZeRO-3 and CPU offload allowed; --checkpoint none pinned'."""
    allowed = [name for key, name in (("zero", "ZeRO-3"), ("checkpoint", "full checkpointing"),
                                      ("offload", "CPU offload")) if getattr(pins, key) is None]
    held = [pinned_flag(pins, k) for k in ("zero", "checkpoint", "offload") if getattr(pins, k) is not None]
    parts = []
    if allowed:
        parts.append("even with " + _join(allowed) + " allowed")
    if held:
        parts.append(_join(held) + " pinned")
    return "; ".join(parts)


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def size(n: float) -> str:
    """Bytes in the unit their size needs (a test device has MB, a GPU GB)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


_NESTED = ContextVar("autopar_what_fits_nested", default=False)


def checking_a_fix() -> bool:
    """True inside one of what_would_fit's re-plans: a failure there is an answer
    ("does not fit"), so the planner skips its own GPU-count search and advice."""
    return _NESTED.get()


def fit_on(replan, model, cluster, pins: Constraints, global_batch_size, precision, optimizer,
           headroom: float = 0.0, time_limit_s: float = 1.0):
    """(peak bytes per GPU including the reserve, Plan) when `replan` (the planner's
    `plan`, handed down by the planner that asks) finds a layout under `pins` on
    `cluster` (the same search, pricing and memory limit as the user's), or None."""
    from autopar.errors import AutoparError
    from cost_models.errors import CostModelError

    pinned = {k: v for k, v in pins.to_dict().items() if k != "memory_headroom"}
    token = _NESTED.set(True)
    try:
        found = replan(model, cluster, global_batch_size=global_batch_size, constraints=pinned, precision=precision,
                       optimizer=optimizer, top_k=0, time_limit_s=time_limit_s, fusion=False,
                       memory_headroom=headroom)
    except (AutoparError, CostModelError):  # does not fit, no mesh for this count, no peak for this precision...
        return None
    finally:
        _NESTED.reset(token)
    return max(found.predicted.peak_memory_bytes) + cluster.device_profile.reserve_bytes, found


def _chosen(found, key: str) -> str:
    """What the plan found chose for a released pin, in the flag's words."""
    choices = found.layer_choices
    if key in ("zero", "checkpoint", "offload"):
        values = sorted({getattr(c, key) for c in choices}, key=str)
        return f"{key} " + "/".join(str(v) for v in values) + (" by layer" if len(values) > 1 else "")
    if key in ("tp", "pp", "dp"):
        return f"{key} {getattr(found.mesh, key)}"
    if key == "micro_batch":
        return f"micro-batch {found.micro_batch_size}"
    if key == "schedule":
        return "schedule " + found.schedule + (f":{found.virtual_stages}" if found.schedule == "interleaved" else "")
    return "sequence parallel " + ("on" if found.sequence_parallel else "off")


def what_would_fit(model, cluster, pins: Constraints, global_batch_size, precision, optimizer, *, replan,
                   headroom: float = 0.0, smallest_world: int | None = None,
                   time_limit_s: float = 1.0) -> list[dict] | None:
    """The changes checked to fit, smallest first: pins to release (same hardware), the
    memory headroom, the GPU count, a larger shipped device. Each a dict with `change`
    ('release' | 'headroom' | 'gpus' | 'device'), the values to pass and `peak_bytes` (per GPU, reserve included) where known.
    `replan`: the planner's `plan` (autopar/solve/planner.py passes itself), which re-plans each change."""
    if checking_a_fix():  # inside another check: "does not fit" is the whole answer
        return None
    out = []
    check = dict(global_batch_size=global_batch_size, precision=precision, optimizer=optimizer,
                 time_limit_s=time_limit_s)
    for key in _pinned_keys(pins):
        freed = Constraints(**{**pins.__dict__, key: None, **({"virtual_stages": None} if key == "schedule" else {})})
        found = fit_on(replan, model, cluster, freed, headroom=headroom, **check)
        if found:
            out.append({"change": "release", "flag": pinned_flag(pins, key), "peak_bytes": found[0],
                        "chose": _chosen(found[1], key), "memory_bytes": cluster.device_profile.memory_bytes})
    if headroom > 0:  # the planner's safety margin is a knob too: checked like a pin
        found = fit_on(replan, model, cluster, pins, headroom=0.0, **check)
        if found:
            out.append({"change": "headroom", "headroom": headroom, "peak_bytes": found[0],
                        "memory_bytes": cluster.device_profile.memory_bytes})
    if smallest_world:
        out.append({"change": "gpus", "gpus": smallest_world,
                    "frees": [pinned_flag(pins, k) for k in ("pp", "dp") if getattr(pins, k) is not None]})
    for name, other in larger_devices(cluster, precision)[:DEVICES_TRIED]:
        found = fit_on(replan, model, other, pins, headroom=headroom, **check)
        if found:
            out.append({"change": "device", "device": name, "memory_bytes": other.device_profile.memory_bytes,
                        "peak_bytes": found[0]})
            break
    return out


def doubled_clusters(cluster, scaled_cluster):
    """The same hardware with 2x, 4x, ... 4096x the nodes: the steps of the GPU-count
    searches (the planner's own, and the capacity bound's). `scaled_cluster`: the
    planner's (cluster, nodes) -> cluster."""
    nodes = cluster.nodes
    for _ in range(12):
        nodes *= 2
        yield scaled_cluster(cluster, nodes)


def larger_devices(cluster, precision: str) -> list:
    """[(name, the cluster with that device)] for the shipped GPUs with more memory than
    the cluster's that train in `precision`, smallest first."""
    from cost_models.hardware import ClusterSpec, shipped_devices

    device = cluster.device_profile
    out = []
    for _, name in sorted((d.memory_bytes, name) for name, d in shipped_devices().items()
                          if d.memory_bytes > device.memory_bytes and name != "cpu" and precision in d.peak_flops):
        d = cluster.to_dict()
        d.pop("world_size", None)
        d["device"] = name
        try:
            out.append((name, ClusterSpec.from_dict(d, file=cluster.source)))
        except Exception:  # noqa: BLE001 - a cluster file this device does not fit into: skip it
            continue
    return out


def fix_text(fix: dict, *, cluster_file: str | None = None) -> str:
    """One checked change in words: 'releasing --checkpoint none fits (checkpoint full, 6.1 MB of 8.6 MB per GPU)'."""
    if fix["change"] == "release":
        return (f"releasing {fix['flag']} fits ({fix['chose']}, {size(fix['peak_bytes'])} of "
                f"{size(fix['memory_bytes'])} per GPU)")
    if fix["change"] == "headroom":
        return (f"--memory-headroom 0 fits ({size(fix['peak_bytes'])} of {size(fix['memory_bytes'])} per GPU; "
                f"it leaves no room for what the cost model does not see, now {fix['headroom']:g})")
    if fix["change"] == "gpus_at_least":
        return (f"--gpus {fix['gpus']} at the least: fewer GPUs, with their nodes' host memory, cannot hold the "
                f"model's weights, gradients and optimizer state (a bound, not a plan: plan with --gpus "
                f"{fix['gpus']} to check a layout fits)")
    if fix["change"] == "device_at_least":
        where = f"device: {fix['device']} in {cluster_file}" if cluster_file else f"--device {fix['device']}"
        return (f"{where} at the least ({size(fix['memory_bytes'])} per GPU): the smallest shipped device whose "
                f"memory could hold the model's states on this many GPUs (a bound: plan to check)")
    if fix["change"] == "gpus":
        frees = f", with {_join(fix['frees'])} released" if fix.get("frees") else ""
        return f"--gpus {fix['gpus']} fits (the smallest of the doubled GPU counts planned{frees})"
    where = f"device: {fix['device']} in {cluster_file}" if cluster_file else f"--device {fix['device']}"
    return (f"{where} fits ({size(fix['peak_bytes'])} of {size(fix['memory_bytes'])} per GPU; "
            "the smallest shipped device with more memory that does)")


def hint_text(fixes: list[dict] | None) -> str | None:
    """The planner's hint (what a library caller reads): the checked changes, or that none was found
    (None: nothing was checked)."""
    if fixes is None:
        return None
    if not fixes:
        return ("nothing autopar tried fits: no single pin released, no GPU count up to 4096x this one "
                f"and none of the {DEVICES_TRIED} next larger shipped devices")
    return "what fits: " + "; ".join(fix_text(f) for f in fixes)


__all__ = ["what_would_fit", "tried_text", "fix_text", "hint_text", "fit_on", "checking_a_fix", "larger_devices", "doubled_clusters"]
