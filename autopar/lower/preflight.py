"""What the lowering checks and probes before it builds anything (issue 30's
split of `parallel_model.lower`): the plan against the model with no process
group (every rank refuses alike, before any collective), then one traced
forward on fake tensors that gives each block's tensor-parallel roles and
the pipeline's stand-in outputs, the split blocks run once on fake tensors
over the real tp mesh, and the head Linears the model reads by weight."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.errors import AutoparError, PlanMismatchError
from autopar.lower import batch_norm, data_parallel, pipeline_parallel, tensor_parallel, what_runs
from autopar.lower.model_io import forward_kwargs, on_model_device, probe_forward
from autopar.lower.model_layers import ModelLayout
from autopar.lower.tp_styles import is_linear
from autopar.plan import Plan


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
        found.read_outside = read_outside(
            model, {p: model.get_submodule(p) for l in layout.layers for p in l.paths}, args, forward_kwargs(model))
    if tp > 1:
        split = [l for l in layout.layers if l.choice.tp_style != "replicate"]
        found.whole, uncalled = _read_by_weight(model, split, holders, args)
        found.unverified += [f"{p}: the model reads its weight instead of calling it, so it runs whole (tp "
                             f"splits only Linears that are called)" for p in uncalled]
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


def _read_by_weight(model, tp_layers, holders, args) -> tuple[frozenset, list[str]]:
    """(ids of modules to keep whole, paths of the head Linears that are never called).
    A vocab-split layer's Linear the model never calls (it reads the weight) stays
    whole, and so does every module holding a weight tied to it (its embedding)."""
    linears = {f"{p}.{n}" if n else p: m for l in tp_layers if l.position in ("pre", "post") for p in l.paths
               for n, m in model.get_submodule(p).named_modules() if is_linear(m)}
    if not linears:
        return frozenset(), []
    uncalled = sorted(never_called(model, linears, args, forward_kwargs(model)))
    whole = {id(linears[p]) for p in uncalled}
    for hs in holders.values():
        if any(id(m) in whole for m, _ in hs):
            whole.update(id(m) for m, _ in hs)
    return frozenset(whole), uncalled


class _ParamReads(TorchDispatchMode):
    """Which layers' parameters an op reads while that layer's forward is not
    running, and which layers' outputs an op writes in place afterwards."""

    def __init__(self, owner: dict[int, str]):
        super().__init__()
        self.owner, self.running, self.outside, self.outputs = owner, [], set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            path = self.owner.get(id(t)) if isinstance(t, torch.Tensor) else None
            if path is not None and path not in self.running:
                self.outside.add(path)
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            path = self.outputs.get(id(args[0]))
            if path is not None and path not in self.running:
                self.outside.add(path)  # `y = self.o(a); y += h`: FSDP2's hooks on y no longer fire
        return func(*args, **(kwargs or {}))


def _left(reads: _ParamReads, path: str, out) -> None:
    reads.running.remove(path)
    reads.outputs.update({id(t): path for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)})


def read_outside(model: nn.Module, layers: dict[str, nn.Module], example_args: tuple, model_kwargs: dict) -> set:
    """The paths of `layers` whose parameters the model reads outside their own
    forward (a root computing `h @ self.emb.weight.T`), or whose output it writes
    in place (`y = self.o(a); y += h`): FSDP2 unshards a unit's parameters only
    around its forward and hooks its outputs for the backward, so such a layer
    must stay in its parent's unit (a crash in the first step otherwise: an mm
    of a DTensor shard, or a freed storage in the backward)."""
    owner = {id(p): path for path, m in layers.items() for p in m.parameters()}
    reads = _ParamReads(owner)
    hooks = []
    for path, m in layers.items():
        hooks.append(m.register_forward_pre_hook(lambda mod, args, path=path: reads.running.append(path)))
        hooks.append(m.register_forward_hook(lambda mod, args, out, path=path: _left(reads, path, out),
                                             always_call=True))
    try:
        with probe_forward(model), reads:
            model(*on_model_device(model, example_args), **model_kwargs)
    except Exception:  # noqa: BLE001 - unknown: one unit per layer as before
        return set()
    finally:
        for h in hooks:
            h.remove()
    return reads.outside


def never_called(model: nn.Module, modules: dict[str, nn.Module], example_args: tuple, model_kwargs: dict) -> set:
    """The paths of `modules` whose forward one fake forward of the model never
    runs: a head that reads its Linear's weight (MobileBERT's
    `x.matmul(cat([decoder.weight.t(), dense.weight]))`) instead of calling it.
    Splitting such a Linear column-wise would hand the matmul a DTensor the
    user's code does not expect (a crash in the first backward)."""
    called, hooks = set(), []
    for path, m in modules.items():
        hooks.append(m.register_forward_hook(lambda mod, args, out, path=path: called.add(path)))
    try:
        with probe_forward(model):
            model(*on_model_device(model, example_args), **model_kwargs)
    except Exception:  # noqa: BLE001 - unknown: split as planned (the lowering's other checks judge the model)
        return set()
    finally:
        for h in hooks:
            h.remove()
    return set(modules) - called
