"""What the lowering checks and probes before it builds anything (issue 30's
split of `parallel_model.lower`): the plan against the model with no process
group (every rank refuses alike, before any collective), then one traced
forward on fake tensors that gives each block's tensor-parallel roles and
the pipeline's stand-in outputs, the split blocks run once on fake tensors
over the real tp mesh, and the head Linears the model reads by weight."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from autopar.compression import problem as compression_problem
from autopar.errors import AutoparError, PlanMismatchError
from autopar.lower import (batch_norm, compression, data_parallel, expert_parallel, pipeline_parallel, tensor_parallel,
                           weight_reads,
                           what_runs)
from autopar.lower.model_io import forward_kwargs
from autopar.lower.model_layers import ModelLayout
from autopar.plan import Plan
from autopar.plan_file import ep_problem


def check_plan(model: nn.Module, plan: Plan, layout: ModelLayout) -> None:
    """Everything about the plan that needs no process group."""
    pp, tp = plan.mesh.pp, plan.mesh.tp
    n_stages = len(plan.stages)
    for st in plan.stages:
        if st.pp_rank != st.index % pp:
            raise PlanMismatchError(f"stage {st.index} is on pp rank {st.pp_rank}; lowering places stage i on i % pp")
    if n_stages % pp:
        raise PlanMismatchError(f"{n_stages} stages do not spread evenly over pp={pp} ranks")
    if pp > 1:
        pipeline_parallel.check_stage_cuts(layout, n_stages)
        pipeline_parallel.check_schedule(plan)
        for i in range(n_stages):  # every stage on every rank: all ranks refuse alike
            pipeline_parallel.check_stand_ins(model, layout, i, n_stages)
    elif n_stages != 1:
        raise PlanMismatchError(f"a plan with pp=1 must have one stage, this one has {n_stages}")
    if tp > 1:
        check_tied_styles(layout)
    batch_norm.whole_batch_refusal(model, plan)
    why = data_parallel.hsdp_refusal() if plan.mesh.hsdp else None
    if why:
        raise PlanMismatchError(f"mesh.dp_shard {plan.mesh.dp_shard} (HSDP) cannot run: {why}",
                                hint="drop dp_shard from the plan (shard over the whole dp), or upgrade torch")
    why = compression_problem(plan.grad_reduce_dtype, plan.precision, plan.mesh.dp) or compression.refusal(
        plan, data_parallel.uses_replicate(plan))
    if why:
        raise PlanMismatchError(f"grad_reduce_dtype {plan.grad_reduce_dtype!r} cannot run: {why}",
                                hint="drop grad_reduce_dtype from the plan (gradients reduced as held)")
    why = ep_problem(plan) or expert_parallel.ep_refusal(model, plan.mesh.ep)
    if why:
        raise PlanMismatchError(f"mesh.ep {plan.mesh.ep} cannot run: {why}", hint="drop ep from the plan")
    optimizer_only = [c.name for c in plan.layer_choices if c.offload == "optimizer"]
    if optimizer_only:
        raise PlanMismatchError(
            f"layer(s) {', '.join(optimizer_only[:4])} offload only the optimizer state, which this lowering "
            f"cannot run: FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer state together",
            hint="re-plan (the planner offers offload 'params' with zero 3), or edit the plan's offload")


def check_tied_styles(layout: ModelLayout) -> None:
    """Both ends of a tied weight (embedding and head) must be split alike
    under tp: their gradients are summed shard by shard. Checked from the
    plan alone, on every rank, before any process group exists."""
    for names in layout.tied:
        styles = {}
        for n in names:
            layer = next((l for l in layout.layers for p in l.paths if n.startswith(p + ".")), None)
            if layer is not None:
                styles[layer.choice.name] = "split" if layer.choice.tp_style != "replicate" else "replicate"
        if len(set(styles.values())) > 1:
            raise PlanMismatchError(
                f"tied weight {' = '.join(names)}: its ends' layers are tensor-parallel differently "
                f"({', '.join(f'{k}: {v}' for k, v in styles.items())})",
                hint="give both layers the same tp_style, or re-plan with `autopar plan`")


@dataclass
class Probed:
    """What the fake-tensor probes found (see `probe`)."""

    block_plans: dict = field(default_factory=dict)  # block index -> tensor_parallel.BlockPlan
    block_inputs: dict = field(default_factory=dict)  # block index -> (args, kwargs) it was called with
    pre_outputs: dict = field(default_factory=dict)  # what pipeline stand-ins must return
    unverified: list = field(default_factory=list)  # notes: run as planned, not shown to run beforehand
    whole: frozenset = frozenset()  # ids of modules tp leaves whole (read by weight, and their tied ends)
    read_outside: set = field(default_factory=set)  # layer paths whose parameters are read outside their forward


def probe(model: nn.Module, plan: Plan, layout: ModelLayout, args: tuple, mesh, holders: dict) -> Probed:
    """The probes on every rank alike (every block, not only this rank's), so a
    refusal is raised by all ranks before any schedule runs. `args`: one
    micro-batch's example inputs."""
    pp, tp = plan.mesh.pp, plan.mesh.tp
    n_stages = len(plan.stages)
    found = Probed()
    split_blocks = [l for l in layout.layers if l.position == "block" and l.choice.tp_style != "replicate"]
    if pp > 1 or (tp > 1 and split_blocks):
        _record(model, plan, layout, args, found, n_stages)
    if tp > 1 and split_blocks:
        _check_split_blocks(model, plan, split_blocks, found, mesh["tp"])
    if data_parallel.wraps(plan) and not data_parallel.uses_replicate(plan):  # FSDP2 units
        found.read_outside = weight_reads.read_outside(
            model, {p: model.get_submodule(p) for l in layout.layers for p in l.paths}, args, forward_kwargs(model))
    if tp > 1:
        split = [l for l in layout.layers if l.choice.tp_style != "replicate"]
        found.whole, why = weight_reads.read_by_weight(model, split, holders, args)
        found.unverified += [f"{p}: {w}, so it runs whole (tp splits only layers the model calls)"
                             for p, w in why.items()]
    return found


def sequence_parallel(plan: Plan, layer) -> bool:
    """Whether a block runs on sequence shards: the plan's switch, or the layer's own style."""
    return plan.sequence_parallel or layer.choice.tp_style == "sequence"


def _record(model, plan, layout, args, found: Probed, n_stages: int) -> None:
    """Tensor-parallel roles and pipeline stand-in outputs from one traced forward
    of the whole model; under pp, every stage's forward chained on its stand-ins."""
    block_paths = {l.block_index: l.paths[0] for l in layout.layers if l.position == "block"}
    stand_ins = pipeline_parallel.stand_in_modules(model, layout) if plan.mesh.pp > 1 else {}
    try:
        found.block_plans, found.block_inputs, found.pre_outputs = what_runs.record_blocks(
            model, {i: model.get_submodule(p) for i, p in block_paths.items()}, args, forward_kwargs(model),
            stand_ins)
    except AutoparError:
        raise
    except Exception as exc:  # noqa: BLE001 - every rank fails alike, before any collective
        # Pipelines and tp are cut from one forward on fake tensors; a model that
        # cannot run there cannot be cut.
        raise PlanMismatchError(
            f"the model's forward cannot run on fake tensors, which tensor and pipeline parallelism are "
            f"cut from: {what_runs.first_line(exc)}",
            hint="plan with data parallelism / ZeRO only (`autopar plan` offers only those for this model)")
    if plan.mesh.pp > 1:
        pipeline_parallel.check_block_outputs(found.block_plans, block_paths, found.pre_outputs)
        why = what_runs.pipeline_failure(model, layout, n_stages, args,
                                         {i: bp.returns for i, bp in found.block_plans.items()},
                                         found.pre_outputs, plan.micro_batch_size)
        if why:
            raise PlanMismatchError(why, hint="plan without pipeline parallelism (pp=1) for this model; "
                                              "`autopar plan` does not offer it")


def _check_split_blocks(model, plan, split_blocks, found: Probed, tp_mesh) -> None:
    """Each split block kind runs once, split as lowering splits it, on fake tensors
    over the real tp mesh (no data moves) on every rank: a block DTensor cannot
    run is refused by all ranks before any step."""
    tp = plan.mesh.tp
    tensor_parallel.register_cpu_attention_sharding()
    for l in split_blocks:
        if sequence_parallel(plan, l):
            tensor_parallel.check_sequence_split(l.paths[0], found.block_plans[l.block_index], tp)
    for sp in sorted({sequence_parallel(plan, l) for l in split_blocks}):
        paths = {l.block_index: l.paths[0] for l in split_blocks if sequence_parallel(plan, l) == sp}
        failures, undecided = what_runs.block_failures(
            model, {i: model.get_submodule(p) for i, p in paths.items()}, (), {}, tp, sp,
            recorded=(found.block_plans, found.block_inputs), mesh=tp_mesh, allow_replicated=True)
        found.unverified += [f"tp={tp}{' with sequence parallelism' if sp else ''} not shown to run before the "
                             f"first step (the fake-tensor check stopped at {u}); lowered as the plan asks"
                             for u in undecided]
        if failures:
            i, why = min(failures.items())
            raise PlanMismatchError(
                f"block {paths[i]!r} cannot run split over tp={tp}{' with sequence parallelism' if sp else ''}: "
                f"{why}",
                hint="plan with `autopar plan` / autopar.plan (it offers only layouts that run), or without "
                     f"{'sequence parallelism' if sp else 'tensor parallelism'} for this model")
