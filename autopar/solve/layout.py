"""Plan <-> cost_models Layout.

The cost model prices a `Layout` (global values plus per-layer overrides);
the planner decides per layer. These two functions translate, so the numbers
a Plan carries are `estimate(model, layout_of(plan), cluster)` exactly.
"""
from __future__ import annotations

from collections import Counter

from cost_models.layout import Layout

from autopar.engine import AUTOPAR, Engine, plan_engine
from autopar.plan import ACCUMULATE
from autopar.solve.search_space import Candidate


def lowered_zero_levels(c: Candidate, zeros: list[int], offloads: list[str],
                        root_held: list[bool] | None = None, engine: Engine = AUTOPAR) -> list[int]:
    """The ZeRO level each layer runs at once lowered, which the plan states
    and the cost model prices (issue 12: every plan field runs as priced).

    ZeRO 0 and 1 keep whole gradients: the lowering runs them with DDP's
    `replicate` (+ ZeroRedundancyOptimizer for 1), but only on a pure
    data-parallel mesh where no layer uses FSDP2 (zero >= 2 or offload).
    Anywhere else data parallelism is FSDP2 (DDP takes no DTensor
    parameters nor a pipeline's per-micro-batch backward), which has no
    whole-gradient mode: those layers run as ZeRO 2, the same bytes on the
    wire and less memory. The rule mirrors
    `autopar.lower.data_parallel.uses_replicate` (tests check they agree).
    `root_held` (per layer, `root_held_layers`): layers FSDP2 runs in its root
    unit, where ZeRO 3 runs as ZeRO 2 (pp = 1: both tied ends in the one stage).
    Another engine being priced (`engine.zero_as_pinned`) runs the levels as given."""
    if c.dp * c.cp == 1 or engine.zero_as_pinned:  # cp ranks shard and reduce with dp (dp_shard_cp)
        return list(zeros)
    # HSDP (c.dp_shard) and ep (experts on their own efsdp units) are FSDP2 on every layer: no replicate
    replicate = (c.tp == 1 and c.pp == 1 and not c.dp_shard and not c.ep
                 and all(z <= 1 and o == "none" for z, o in zip(zeros, offloads)))
    levels = list(zeros) if replicate else [2 if z <= 1 and o == "none" else z for z, o in zip(zeros, offloads)]
    if root_held and c.pp == 1:
        # both ends of a tied weight live in FSDP2's root unit (one parameter, one unit),
        # which FSDP2 does not reshard after forward: ZeRO 3 runs there as ZeRO 2
        levels = [2 if r and z >= 3 and o == "none" else z for z, r, o in zip(levels, root_held, offloads)]
    return levels


def root_held_layers(model) -> list[bool]:
    """Layers the lowering leaves to FSDP2's root unit: those holding either end of a
    weight tied to another layer (`autopar.lower.data_parallel.apply_fsdp`: one
    parameter lives in one FSDP unit). FSDP2 keeps its root's parameters unsharded
    from forward to backward ("the root FSDP state has its value specially set to
    False", fully_shard's reshard_after_forward), so they run as ZeRO 2."""
    return model.tied_layers()


def checkpoint_that_runs(layer, checkpoint: str) -> str:
    """`checkpoint`, or "none" for a layer the lowering cannot recompute: it
    recomputes a layer by wrapping its one module, so a layer of several
    modules (a head: final norm + output Linear) runs without."""
    return checkpoint if len(getattr(layer, "module_paths", None) or []) <= 1 else "none"


def checkpoints_that_run(model, checkpoint: str) -> list[str]:
    return [checkpoint_that_runs(layer, checkpoint) for layer in model.layers]


def candidate_layout(c: Candidate, *, precision: str = "bf16", optimizer: str = "adam", zero: int = 0,
                     checkpoint: str = "none", offload: str = "none", root_held: list[bool] | None = None,
                     engine: Engine = AUTOPAR) -> Layout:
    """The Layout of a candidate with uniform per-layer choices (stages balanced by the cost model);
    with `root_held`, the per-layer levels the lowering runs (`lowered_zero_levels`); `engine`:
    who runs it (autopar's own program unless another engine is being priced)."""
    planned = zero
    zero = lowered_zero_levels(c, [zero], [offload], engine=engine)[0]
    layer_zero = None
    if root_held and any(root_held) and not engine.zero_as_pinned:
        layer_zero = lowered_zero_levels(c, [planned] * len(root_held), [offload] * len(root_held), root_held)
        if len(set(layer_zero)) == 1:
            layer_zero = None
    # The cost model names no schedule for pp = 1 (it runs one 1F1B stage whatever it is told).
    return Layout(layer_zero=layer_zero, tp=c.tp, pp=c.pp, dp=c.dp, dp_shard=c.dp_shard or None, ep=c.ep or 1, cp=c.cp,
                  micro_batch_size=c.micro_batch_size,
                  num_micro_batches=c.num_micro_batches, schedule="1f1b" if c.schedule == ACCUMULATE else c.schedule,
                  virtual_stages=c.virtual_stages, sequence_parallel=c.sequence_parallel, zero=zero,
                  checkpoint=checkpoint, offload=offload, precision=precision, optimizer=optimizer,
                  # as autopar lowers: FSDP2 mixed precision even on one rank for 16-bit
                  # training; the engine's optimizer, gradient dtype and TP overlap
                  fsdp_one_rank=c.dp * c.cp == 1 and precision != "fp32" and engine.is_autopar,
                  # FSDP2's gradient sync stays on for every micro-batch: ParallelModel._accumulate
                  # at pp = 1, pipeline_parallel.ReducingStage under torch's schedules
                  grads_reduced_per_micro_batch=engine.is_autopar and c.dp * c.cp > 1,
                  **engine.layout_fields())


def _mode(values):
    # Most common value; ties go to the first seen (deterministic).
    counts = Counter(values)
    best = max(counts.values())
    return next(v for v in values if counts[v] == best)


def assignment_layout(c: Candidate, stage_layers: list[int], choices: list[tuple], *, precision: str,
                      optimizer: str = "adam", root_held: list[bool] | None = None,
                      engine: Engine = AUTOPAR) -> Layout:
    """Layout for a candidate with explicit stages and per-layer (zero, checkpoint, offload)."""
    offs = [o for _, _, o in choices]
    zeros = lowered_zero_levels(c, [z for z, _, _ in choices], offs, root_held, engine=engine)
    ckpts = [k for _, k, _ in choices]
    layout = candidate_layout(c, precision=precision, optimizer=optimizer, zero=_mode(zeros),
                              checkpoint=_mode(ckpts), offload=_mode(offs), engine=engine)
    layout.stage_layers = list(stage_layers)
    layout.layer_zero = zeros
    layout.layer_checkpoint = ckpts
    layout.layer_offload = offs
    return layout


def layout_of(plan) -> Layout:
    """The cost model's Layout for a Plan (what `estimate` prices)."""
    choices = [(c.zero, c.checkpoint, c.offload) for c in plan.layer_choices]
    cand = Candidate(pp=plan.mesh.pp, dp=plan.mesh.dp, tp=plan.mesh.tp, micro_batch_size=plan.micro_batch_size,
                     num_micro_batches=plan.num_micro_batches, schedule=plan.schedule,
                     virtual_stages=plan.virtual_stages, sequence_parallel=plan.sequence_parallel,
                     dp_shard=plan.mesh.dp_shard if plan.mesh.hsdp else 0, ep=plan.mesh.ep or 0, cp=plan.mesh.cp or 1)
    optimizer = plan.assumptions.get("optimizer", "adam") if isinstance(plan.assumptions, dict) else "adam"
    engine = plan_engine(plan)
    if not choices:
        layout = candidate_layout(cand, precision=plan.precision, optimizer=optimizer, engine=engine)
    else:
        layout = assignment_layout(cand, [len(s.layers) for s in plan.stages], choices, precision=plan.precision,
                                   optimizer=optimizer, engine=engine)
        # which layers run float8 is the plan's (a hand-edited plan is priced as edited)
        layout.layer_float8 = [bool(c.float8) for c in plan.layer_choices]
    layout.grad_reduce_dtype = getattr(plan, "grad_reduce_dtype", None)
    return layout
