"""Read a saved plan JSON (`autopar plan ... --json > plan.json`) for `report`,
`compile` and `autopar.compile(plan=...)`, and refuse one that is not a plan
autopar could have written.

Plan.from_dict checks the schema version and unknown fields; a hand-edited
file can still be well-formed JSON with nonsense in it (tp "eight", 7 stages
on a pp 4 mesh, ZeRO 5). Each such value would otherwise surface as a
TypeError deep in the report or the lowering, so this checks every field
those stages read and names the first bad one with its JSON path.
"""
from __future__ import annotations

import json
import os

from autopar.compression import problem as compression_problem
from autopar.errors import AutoparError, PlanMismatchError
from autopar.plan import Plan
from autopar.plan_schema import (CHECKPOINTS, OFFLOADS, PRECISIONS, SCHEDULES, TP_STYLES, is_number,
                                 is_positive_int, type_problem)

REGENERATE = "regenerate it with `autopar plan MODEL --gpus N --json > plan.json`"


def load_plan_file(path: str):
    """The Plan saved at `path`, checked (PlanMismatchError naming the field otherwise)."""
    if not os.path.isfile(path):
        raise PlanMismatchError(f"plan file not found: {path}",
                                hint="save one with `autopar plan MODEL --gpus N --json > plan.json`")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanMismatchError(f"cannot read plan file {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanMismatchError(f"{path} is not valid JSON: {exc}",
                                hint="a plan file is the output of `autopar plan ... --json`") from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise PlanMismatchError(f"{path} is not an autopar plan (no schema_version field)", hint=REGENERATE)
    try:
        plan = Plan.from_dict(data)
    except AutoparError as exc:
        raise PlanMismatchError(f"{path}: {exc.message}", hint=exc.hint or REGENERATE) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # A stage or layer entry missing a field, or a field of the wrong shape.
        what = f"missing field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise PlanMismatchError(f"{path} is not a valid autopar plan ({what})", hint=REGENERATE) from None
    problem = plan_problem(plan)
    if problem:
        raise PlanMismatchError(f"{path} is not a consistent autopar plan: {problem}",
                                hint=f"was it edited by hand? {REGENERATE}")
    return plan


def plan_problem(plan) -> str | None:
    """The first inconsistency in `plan` as 'field: what is wrong', or None."""
    try:  # a Plan built in Python (not from JSON) can hold anything: check it as its JSON
        problem = type_problem(plan.to_dict())
    except Exception:  # noqa: BLE001 - not even convertible: name what is not a Plan
        problem = "the plan's fields cannot be read as a plan (build it with autopar.plan or Plan.from_dict)"
    if problem:
        return problem
    m = plan.mesh
    for axis in ("pp", "dp", "tp"):
        if not is_positive_int(getattr(m, axis)):
            return f"mesh.{axis} must be a positive integer, got {getattr(m, axis)!r}"
    for key in ("global_batch_size", "micro_batch_size", "num_micro_batches", "virtual_stages"):
        if not is_positive_int(getattr(plan, key)):
            return f"{key} must be a positive integer, got {getattr(plan, key)!r}"
    if plan.schedule not in SCHEDULES:
        return f"schedule must be one of {', '.join(SCHEDULES)}, got {plan.schedule!r}"
    if plan.schedule == "accumulate" and m.pp != 1:
        return f"schedule 'accumulate' is the schedule without a pipeline; mesh.pp {m.pp} needs gpipe, 1f1b or interleaved"
    if plan.precision not in PRECISIONS:
        return f"precision must be bf16, fp16 or fp32, got {plan.precision!r}"
    if not isinstance(plan.sequence_parallel, bool):
        return f"sequence_parallel must be true or false, got {plan.sequence_parallel!r}"
    samples = m.dp * plan.micro_batch_size * plan.num_micro_batches
    if plan.global_batch_size != samples:
        return (f"global_batch_size {plan.global_batch_size} != dp {m.dp} x micro_batch_size "
                f"{plan.micro_batch_size} x num_micro_batches {plan.num_micro_batches} = {samples}")
    problem = _cluster_problem(plan.cluster, m.world_size)
    if problem:
        return problem
    v = plan.virtual_stages if plan.schedule == "interleaved" else 1
    if len(plan.stages) != m.pp * v:
        return (f"stages has {len(plan.stages)} entries; mesh.pp {m.pp}"
                + (f" x virtual_stages {v}" if v > 1 else "") + f" needs {m.pp * v}")
    seen = set()
    for i, st in enumerate(plan.stages):
        if st.index != i or st.pp_rank != i % m.pp:
            return (f"stages[{i}] has index {st.index!r} and pp_rank {st.pp_rank!r}; expected index {i} "
                    f"on pp rank {i % m.pp} (stage i runs on pp rank i % pp)")
        if not st.layers:
            return f"stages[{i}] has no layers"
        for j, c in enumerate(st.layers):
            where = f"stages[{i}].layers[{j}] ({c.name!r})"
            if c.name in seen:
                return f"{where}: layer {c.name!r} is placed twice"
            seen.add(c.name)
            if c.zero not in (0, 1, 2, 3) or isinstance(c.zero, bool):
                return f"{where}.zero must be 0, 1, 2 or 3, got {c.zero!r}"
            for key, allowed in (("checkpoint", CHECKPOINTS), ("offload", OFFLOADS), ("tp_style", TP_STYLES)):
                if getattr(c, key) not in allowed:
                    return f"{where}.{key} must be one of {', '.join(allowed)}, got {getattr(c, key)!r}"
            if not isinstance(c.module_paths, list):
                return f"{where}.module_paths must be a list of module names"
    problem = (hsdp_problem(plan) or compression_problem(plan.grad_reduce_dtype, plan.precision, m.dp * (m.cp or 1))
               or ep_problem(plan) or cp_problem(plan))
    if problem:
        return problem
    num_layers = plan.model.get("num_layers") if isinstance(plan.model, dict) else None
    if num_layers is not None and num_layers != len(seen):
        return f"model.num_layers is {num_layers!r} but the stages place {len(seen)} layers"
    if (plan.solver or {}).get("status") == "manual":  # hand-made (plan_for_model): nothing was predicted
        return None
    return _predicted_problem(plan.predicted, m.pp)


def hsdp_problem(plan) -> str | None:
    """mesh.dp_shard (HSDP) must divide dp, and shards ZeRO states: every layer at ZeRO >= 1."""
    m = plan.mesh
    if m.dp_shard is None:
        return None
    if not is_positive_int(m.dp_shard) or m.dp % m.dp_shard:
        return (f"mesh.dp_shard {m.dp_shard!r} must divide mesh.dp {m.dp} (dp = replicas x dp_shard); "
                f"pick a divisor of {m.dp} or drop dp_shard")
    zero0 = [c.name for c in plan.layer_choices if c.zero == 0]
    if m.hsdp and zero0:
        return (f"mesh.dp_shard {m.dp_shard} (HSDP) shards ZeRO states, but layer {zero0[0]!r}"
                + (f" and {len(zero0) - 1} more" if len(zero0) > 1 else "")
                + " have zero 0; set their zero to 1, 2 or 3, or drop dp_shard")
    return None


def ep_problem(plan) -> str | None:
    """mesh.ep must divide the ranks it folds into (dp), and runs, as lowered today, beside
    data and pipeline parallelism (not tp, not HSDP): one line saying which."""
    m = plan.mesh
    if m.ep is None or m.ep == 1:
        return None
    if not is_positive_int(m.ep) or m.ep_fold_ranks % m.ep:
        return (f"mesh.ep {m.ep!r} must divide mesh.dp {m.dp} (expert parallelism folds into data "
                f"parallelism: dp = efsdp x ep); pick a divisor of {m.dp} or drop ep")
    if m.tp > 1 or m.hsdp:
        return (f"mesh.ep {m.ep} runs beside data and pipeline parallelism only (tp 1, no dp_shard), this plan "
                f"has tp {m.tp}{', dp_shard ' + str(m.dp_shard) if m.hsdp else ''}; drop ep or those axes")
    if (m.cp or 1) > 1:
        return (f"mesh.ep {m.ep} does not run beside context parallelism yet (cp {m.cp}); drop ep or cp")
    return None


def cp_problem(plan) -> str | None:
    """mesh.cp (context parallelism) cuts a sequence into 2 x cp load-balanced chunks:
    it needs a token model whose seq_len 2 x cp divides."""
    cp = plan.mesh.cp
    if cp is None or cp == 1:
        return None
    if not is_positive_int(cp):
        return f"mesh.cp must be a positive integer, got {cp!r}"
    if not plan.seq_len:
        return f"mesh.cp {cp} cuts sequences, but the plan has no seq_len (not a token model); drop cp"
    if plan.seq_len % (2 * cp):
        return (f"mesh.cp {cp} needs seq_len {plan.seq_len} in 2 x cp = {2 * cp} equal chunks (the causal load "
                f"balancing); pad the sequence to a multiple of {2 * cp} or change cp")
    return None


def _cluster_problem(cluster, world: int) -> str | None:
    if not isinstance(cluster, dict):
        return "cluster must be an object (the ClusterSpec as saved by autopar plan)"
    nodes, gpn = cluster.get("nodes"), cluster.get("gpus_per_node")
    if nodes is None and gpn is None:
        return None  # a plan made from a bare mesh: nothing to compare
    if not is_positive_int(nodes) or not is_positive_int(gpn):
        return f"cluster.nodes and cluster.gpus_per_node must be positive integers, got {nodes!r} and {gpn!r}"
    if nodes * gpn != world:
        return (f"the mesh pp x dp x tp = {world} GPUs but cluster says {nodes} nodes x {gpn} = {nodes * gpn} "
                "GPUs")
    return None


def _predicted_problem(p, pp: int) -> str | None:
    for key in ("step_time_s", "tokens_per_s", "samples_per_s", "tflops_per_gpu", "mfu"):
        if key == "tokens_per_s" and p.tokens_per_s is None:
            continue  # not a token model: throughput is samples/s only
        if not is_number(getattr(p, key)) or getattr(p, key) < 0:
            return f"predicted.{key} must be a non-negative number, got {getattr(p, key)!r}"
    if not is_number(p.step_time_s) or p.step_time_s <= 0:
        return f"predicted.step_time_s must be positive, got {p.step_time_s!r}"
    if not isinstance(p.peak_memory_bytes, list) or not all(is_number(x) for x in p.peak_memory_bytes):
        return "predicted.peak_memory_bytes must be a list of numbers (one per pp rank)"
    if p.peak_memory_bytes and len(p.peak_memory_bytes) != pp:
        return f"predicted.peak_memory_bytes has {len(p.peak_memory_bytes)} entries for {pp} pp ranks"
    if not isinstance(p.memory_breakdown, list) or not all(isinstance(b, dict) for b in p.memory_breakdown):
        return "predicted.memory_breakdown must be a list of objects (one per pp rank)"
    if not isinstance(p.time_breakdown, dict):
        return "predicted.time_breakdown must be an object"
    if not isinstance(p.comm, list) or not all(isinstance(c, dict) for c in p.comm):
        return "predicted.comm must be a list of objects"
    return None


__all__ = ["load_plan_file", "plan_problem", "hsdp_problem", "cp_problem", "type_problem"]
