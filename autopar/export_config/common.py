"""What every export shares: the result (`Export`), the plan's choices read the way a
target reads them, and the edits that turn a Plan into the nearest layout a target
can express.

A target takes one value where autopar decides per layer (ZeRO level, checkpointing,
offload). The nearest layout gives every layer the most memory-saving choice any of
the plan's layers has, so it fits wherever the plan fits; it may be slower, and the
command prices it with the cost model where the model can be captured
(autopar/commands/export_config.py). Every change is said in `Export.notes`, which
the target's file carries as comments and the terminal prints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from autopar.engine import plan_engine
from autopar.plan import Mesh, Plan, Stage

DEFAULT_CLIP = 1.0  # gradient clipping by the global norm: what DeepSpeed's and torchtitan's examples use
CHECKPOINT_STRENGTH = ("none", "selective", "full")  # least to most recomputation (least memory)
OFFLOAD_STRENGTH = ("none", "optimizer", "params")


@dataclass
class Export:
    """One target's file for a Plan: its text, the layout it expresses (`nearest`, a Plan:
    the plan itself where nothing had to change) and what could not be expressed."""

    target: str
    text: str
    nearest: Plan
    notes: list[str] = field(default_factory=list)
    summary: str = ""  # one line: what the file sets

    @property
    def exact(self) -> bool:
        return not self.notes


def copy_plan(plan: Plan) -> Plan:
    """An independent Plan with the same fields (edited into the nearest layout)."""
    return Plan.from_dict(plan.to_dict())


def describe(plan: Plan) -> str:
    """pp x dp x tp, schedule, micro-batching, ZeRO, checkpointing, offload of a plan in one line."""
    m = plan.mesh
    parts = [f"pp {m.pp} x dp {m.dp} x tp {m.tp}"]
    if m.pp > 1:
        parts.append(f"{plan.schedule}" + (f":{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
                     + f", stages of {'/'.join(str(n) for n in stage_sizes(plan))} layers")
    parts.append(f"{plan.num_micro_batches} x {plan.micro_batch_size} samples per dp rank")
    for what, values in (("ZeRO", sorted({c.zero for c in plan.layer_choices})),
                         ("checkpoint", distinct(c.checkpoint for c in plan.layer_choices)),
                         ("offload", distinct(c.offload for c in plan.layer_choices))):
        parts.append(f"{what} {'/'.join(str(v) for v in values)}")
    if plan.sequence_parallel:
        parts.append("sequence parallel")
    if has_float8(plan):
        parts.append("float8")
    return ", ".join(parts)


def distinct(values) -> list:
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


# -- the plan's choices, as one value -------------------------------------------------------------
def zero_level(plan: Plan) -> int:
    """The highest ZeRO level any layer uses (the one a target applying one level to all takes)."""
    return max((c.zero for c in plan.layer_choices), default=0)


def checkpoint_mode(plan: Plan) -> str:
    """The most recomputing checkpoint mode any layer uses."""
    return max((c.checkpoint for c in plan.layer_choices), key=CHECKPOINT_STRENGTH.index, default="none")


def offload_mode(plan: Plan) -> str:
    return max((c.offload for c in plan.layer_choices), key=OFFLOAD_STRENGTH.index, default="none")


def stage_sizes(plan: Plan) -> list[int]:
    return [len(s.layers) for s in plan.stages]


def even_sizes(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage split as evenly as counts allow, the extra ones on the first stages
    (DeepSpeed's `partition_uniform`; torchtitan's and Megatron's even splits)."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def has_float8(plan: Plan) -> bool:
    return any(c.float8 for c in plan.layer_choices)


def compiled(plan: Plan) -> bool:
    return bool(plan_engine(plan).compiled_blocks)


# -- edits into the nearest layout ------------------------------------------------------------------
def set_uniform(plan: Plan, notes: list[str], *, zero: int | None = None, checkpoint: str | None = None,
                offload: str | None = None, why: str = "") -> None:
    """Every layer takes `zero` / `checkpoint` / `offload` (those given); a note says what changed."""
    for what, value in (("zero", zero), ("checkpoint", checkpoint), ("offload", offload)):
        if value is None:
            continue
        before = distinct(getattr(c, what) for c in plan.layer_choices)
        if before != [value]:
            name = {"zero": "ZeRO level", "checkpoint": "activation checkpointing", "offload": "CPU offload"}[what]
            per_layer = "per-layer " if len(before) > 1 else ""
            notes.append(f"{per_layer}{name} {'/'.join(str(b) for b in before)}: {value} for every layer"
                         + (f" ({why})" if why else ""))
        for c in plan.layer_choices:
            setattr(c, what, value)
            if what == "zero":
                c.reshard_after_forward = value >= 3


def whole_block_choices(plan: Plan, notes: list[str], checkpoint: str | None, *, checkpoint_why: str,
                        offload_why: str) -> None:
    """A target (FSDP2 plugins) that checkpoints whole blocks or nothing, and offloads parameters,
    gradients and optimizer together or nothing: `checkpoint` (default: the strongest any layer
    uses) as full or none, any offload as "params"."""
    ckpt = checkpoint or checkpoint_mode(plan)
    set_uniform(plan, notes, checkpoint="full" if ckpt != "none" else "none", why=checkpoint_why)
    offload = offload_mode(plan)
    set_uniform(plan, notes, offload="params" if offload != "none" else "none", why=offload_why)


def restage(plan: Plan, sizes: list[int]) -> None:
    """Cut the plan's layers into stages of `sizes` layers (stage i on pp rank i % pp)."""
    layers = plan.layer_choices
    assert sum(sizes) == len(layers), (sizes, len(layers))
    stages, start = [], 0
    for i, n in enumerate(sizes):
        stages.append(Stage(index=i, pp_rank=i % plan.mesh.pp, layers=layers[start:start + n]))
        start += n
    plan.stages = stages


def even_stages(plan: Plan, notes: list[str], how: str) -> None:
    """Stages of as equal layer counts as the pipeline allows, where the target cannot cut unevenly."""
    sizes = stage_sizes(plan)
    even = even_sizes(len(plan.layer_choices), len(sizes))
    if sizes != even:
        notes.append(f"uneven pipeline stages ({'/'.join(map(str, sizes))} layers): "
                     f"{'/'.join(map(str, even))} ({how})")
        restage(plan, even)


def single_schedule(plan: Plan, notes: list[str], schedule: str, target: str) -> None:
    """A target with one pipeline schedule (and no virtual stages) runs `schedule`."""
    if plan.mesh.pp > 1 and (plan.schedule != schedule or plan.virtual_stages > 1):
        was = plan.schedule + (f":{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
        notes.append(f"pipeline schedule {was}: {schedule} ({target} runs no other)")
        plan.schedule, plan.virtual_stages = schedule, 1
        restage(plan, even_sizes(len(plan.layer_choices), plan.mesh.pp) if len(plan.stages) != plan.mesh.pp
                else stage_sizes(plan))


def fold_pipeline(plan: Plan, notes: list[str], target: str) -> None:
    """No pipeline in the target: the pp ranks become data-parallel ranks (same tp), ZeRO 3
    so the states still spread over as many GPUs, micro-batches re-cut for the new dp."""
    m = plan.mesh
    if m.pp == 1:
        return
    dp = m.dp * m.pp
    per_rank = plan.global_batch_size // dp
    if per_rank * dp != plan.global_batch_size or per_rank < 1:
        notes.append(f"no pipeline parallelism in {target}, and the global batch {plan.global_batch_size} does "
                     f"not divide over dp {dp}: kept pp {m.pp}, which {target} cannot run")
        return
    micro = math.gcd(plan.micro_batch_size, per_rank)
    notes.append(f"pipeline parallelism (pp {m.pp}): none in {target}; its ranks join data parallelism "
                 f"(pp 1 x dp {dp} x tp {m.tp}, {per_rank // micro} x {micro} samples per dp rank)")
    plan.mesh = Mesh(pp=1, dp=dp, tp=m.tp, dp_shard=m.dp_shard if m.hsdp else None)  # HSDP groups stay
    plan.schedule, plan.virtual_stages = "accumulate", 1
    plan.micro_batch_size, plan.num_micro_batches = micro, per_rank // micro
    restage(plan, [len(plan.layer_choices)])
    set_uniform(plan, notes, zero=3, why="the folded pipeline's states spread over the data-parallel ranks")


def no_hsdp(plan: Plan, notes: list[str], why: str) -> None:
    """The target cannot shard over groups of dp ranks: the states sharded over the whole dp."""
    m = plan.mesh
    if not m.hsdp:
        return
    notes.append(f"HSDP ({m.dp_text()}): {why}; the states are sharded over the whole dp {m.dp}")
    plan.mesh = Mesh(pp=m.pp, dp=m.dp, tp=m.tp)


def no_compression(plan: Plan, notes: list[str], why: str) -> None:
    """The target cannot reduce these gradients in bf16 (Plan.grad_reduce_dtype): reduced as held."""
    if plan.grad_reduce_dtype is None:
        return
    notes.append(f"gradients reduced in {plan.grad_reduce_dtype} (communication compression): {why}; reduced as held")
    plan.grad_reduce_dtype = None


def no_ep(plan: Plan, notes: list[str]) -> None:
    """Expert parallelism is not exported yet: the nearest layout holds every expert on every
    dp rank (sharded by its ZeRO level), said in the notes, never dropped silently."""
    m = plan.mesh
    if (m.ep or 1) == 1:
        return
    notes.append(f"expert parallelism (ep {m.ep}): not exported yet; the nearest layout keeps every expert on "
                 f"every dp rank, sharded by its ZeRO level")
    m.ep = None


def no_sequence_parallel(plan: Plan, notes: list[str], target: str) -> None:
    if plan.sequence_parallel:
        notes.append(f"sequence parallelism (Megatron-style, with tp {plan.mesh.tp}): not in {target}; off")
        plan.sequence_parallel = False
        for c in plan.layer_choices:
            if c.tp_style == "sequence":
                c.tp_style = "colwise_rowwise"


def no_float8(plan: Plan, notes: list[str], target: str) -> None:
    if has_float8(plan):
        n = sum(len(c.float8) for c in plan.layer_choices)
        notes.append(f"float8 GEMMs ({n} Linears): not expressible in {target}; bf16")
        for c in plan.layer_choices:
            c.float8 = []


def bf16_for_fp16(plan: Plan, notes: list[str], target: str) -> None:
    if plan.precision == "fp16":
        notes.append(f"fp16 with loss scaling: {target} trains in bf16 or fp32 only; bf16 (same speed, no "
                     "loss scale)")
        plan.precision = "bf16"


def header(plan: Plan, target: str) -> list[str]:
    """The lines every file opens with: which plan, what it predicted, which target version."""
    m = plan.model if isinstance(plan.model, dict) else {}
    cl = plan.cluster if isinstance(plan.cluster, dict) else {}
    return [f"autopar plan of {m.get('name') or 'the model'} ({m.get('source') or 'no model file recorded'}) "
            f"on {plan.mesh.world_size} x {cl.get('device') or 'GPU'}, exported for {target}",
            f"autopar's layout: {describe(plan)}; global batch {plan.global_batch_size}, {plan.precision}; "
            f"predicted {plan.predicted.step_time_s:.3f} s/step"]


def notes_lines(notes: list[str], nearest: Plan) -> list[str]:
    if not notes:
        return ["every choice of the plan is expressed exactly"]
    return (["not expressible here, and what this file sets instead:"] + [f"  - {n}" for n in notes]
            + [f"nearest expressible layout: {describe(nearest)}"])
