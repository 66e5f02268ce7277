"""Build a Plan by hand for a model: a fixed layout, no search.

Used by tests and for hand-written layouts (`autopar.compile(...,
plan=plan_for_model(model, tp=8, pp=4, ...))`). The layers are capture's
(`autopar.capture`): the same names, kinds and module paths the planner
would place, found by the same rule (the repeated blocks of the outermost
block container, wherever it sits: `blocks`, Hugging Face's `model.layers`
or `transformer.h`; what runs before them is the embedding layer, what runs
after them the head layer).
Stages get contiguous runs of layers; `stage_layers` gives the layer count
per stage in execution order (default: blocks split evenly, the embedding on
the first stage and the head on the last).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.compression import problem as compression_problem
from autopar.errors import PlanMismatchError
from autopar.lower.expert_parallel import ep_refusal
from autopar.lower.model_layers import block_stacks, model_signature
from autopar.lower.pipeline_parallel import check_schedule
from autopar.plan import CHECKPOINTS, SCHEDULES, LayerChoice, Mesh, Plan, Stage
from autopar.plan_file import cp_problem, ep_problem, hsdp_problem

MAIN_GRADS = ("same", "fp32", "fp32-unfused")  # cost_models.layout's values
_DEFAULT_SEQ = 8  # token-id models without example inputs: short enough for any position table
_captured: dict = {}  # (model signature, input shapes) -> layer facts; capture costs ~0.5 s


def _default_example_inputs(model: nn.Module, seq_len: int | None):
    """Token ids for a model whose first weight is an embedding table (language
    models); anything else must say what it eats."""
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Embedding):
        seq = seq_len or _DEFAULT_SEQ
        return lambda b: (torch.zeros(b, seq, dtype=torch.long),)
    raise PlanMismatchError(
        f"plan_for_model needs example_inputs for {type(model).__name__}: its first weight is not a token "
        f"embedding, so autopar cannot guess its inputs",
        hint="pass example_inputs=(tensor, ...) for one micro-batch, or a callable batch_size -> tuple")


def _layer_facts(model: nn.Module, example_inputs) -> list[tuple]:
    """(name, kind, module_paths, tp_degrees) of each layer, from capture."""
    from autopar.capture import capture

    args = example_inputs(2) if callable(example_inputs) else example_inputs
    args = args if isinstance(args, (tuple, list)) else (args,)
    shapes = tuple((tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a) for a in args)
    sig = model_signature(model)
    key = (type(model).__module__, type(model).__qualname__, sig["total_params"],
           tuple((n, tuple(s)) for n, s in sig["param_shapes"].items()), shapes, callable(example_inputs))
    if key not in _captured:
        # Only the layer structure is read: fit in batch only (fewest traces).
        graph = capture(model, example_inputs, dtype=torch.float32, seq_dim=None)
        _captured[key] = [(l.name, l.kind, list(l.module_paths or [l.name]), tuple(l.tp_degrees or (1,)))
                          for l in graph.layers]
    return _captured[key]


def model_layers(model: nn.Module, example_inputs=None, *, tp: int = 1, sequence_parallel: bool = False,
                 seq_len: int | None = None) -> list[LayerChoice]:
    """The model's layers as capture sees them, with the tensor-parallel style
    each takes at this tp degree. A tp degree a layer cannot be split into
    (heads, kv heads, ffn or vocab not divisible) is an error here, not a
    silently replicated layer."""
    return _layers_and_blocks(model, example_inputs, tp, sequence_parallel, seq_len)[0]


def _layers_and_blocks(model, example_inputs, tp, sequence_parallel, seq_len, graph=None):
    if graph is not None:  # already captured (the planner's ModelGraph): the same facts, no second trace
        facts = [(l.name, l.kind, list(l.module_paths or [l.name]), tuple(l.tp_degrees or (1,)))
                 for l in graph.layers]
    else:
        if example_inputs is None:
            example_inputs = _default_example_inputs(model, seq_len)
        facts = _layer_facts(model, example_inputs)
    modules = dict(model.named_modules())
    stacks = block_stacks([paths for _, _, paths, _ in facts], modules)
    is_block = []
    for _, _, paths, _ in facts:
        mods = [p for p in paths if p in modules]  # capture may fold loose parameters into a block
        is_block.append(len(mods) == 1 and mods[0].rpartition(".")[0] in stacks)
    if not any(is_block) and tp > 1:
        # Data parallelism needs no blocks (ALBERT applies one shared layer N times);
        # tensor parallelism splits the blocks of a stack.
        raise PlanMismatchError(f"{type(model).__name__} has no repeated blocks (an nn.ModuleList or nn.Sequential of layers) for "
                                f"tensor parallelism to split",
                                hint="plan with tp=1, or hold the repeated blocks in an nn.ModuleList or nn.Sequential")
    first, last = ((is_block.index(True), len(is_block) - 1 - is_block[::-1].index(True)) if any(is_block)
                   else (len(is_block), -1))
    layers = []
    for i, ((name, kind, paths, degrees), block) in enumerate(zip(facts, is_block)):
        if block and tp > 1 and tp not in degrees:
            why = (f"its heads, kv heads or ffn size do not divide: it allows tp in {', '.join(map(str, degrees))}"
                   if set(degrees) - {1} else
                   f"capture found nothing in it tensor parallelism splits (no attention heads, no column / row "
                   f"Linear pair; kind {kind!r})")
            raise PlanMismatchError(f"layer {name!r} cannot be split over tp={tp}: {why}",
                                    hint="choose a tp degree every block allows, or let `autopar plan` choose")
        if block:
            style = ("sequence" if sequence_parallel else "colwise_rowwise") if tp > 1 else "replicate"
        elif first < i < last:
            raise PlanMismatchError(f"layer {name!r} sits between blocks but is not one of them",
                                    hint="hand-made plans place models whose layers are embedding, blocks, head")
        else:
            # A vocabulary tp does not divide (GPT-2's 50257) stays whole on
            # every tp rank, as the planner does: correct, only more memory.
            style = "vocab" if tp > 1 and tp in degrees else "replicate"
        layers.append(LayerChoice(name=name, kind=kind, module_paths=list(paths), tp_style=style))
    return layers, [c for c, b in zip(layers, is_block) if b]


def _example_seq_len(example_inputs) -> int | None:
    args = example_inputs(1) if callable(example_inputs) else example_inputs
    first = (args[0] if isinstance(args, (tuple, list)) and args else args)
    return int(first.shape[1]) if isinstance(first, torch.Tensor) and first.dim() >= 2 else None


def plan_for_model(model: nn.Module, *, pp: int = 1, dp: int = 1, tp: int = 1, zero: int = 0,
                   checkpoint: str = "none", schedule: str = "1f1b", virtual_stages: int = 1,
                   micro_batch_size: int = 1, num_micro_batches: int = 1, sequence_parallel: bool = False,
                   stage_layers: list[int] | None = None, precision: str = "fp32", offload: str = "none",
                   main_grads: str = "fp32", seq_len: int | None = None, name: str | None = None,
                   example_inputs=None, graph=None, dp_shard: int | None = None,
                   grad_reduce_dtype: str | None = None, ep: int | None = None, cp: int | None = None) -> Plan:
    """A Plan with this fixed layout for `model`.

    `example_inputs` (a tuple for one micro-batch, or batch_size -> tuple) is
    only traced on the meta device to find the layers; token-id models may
    leave it out. `main_grads` ("same" | "fp32" | "fp32-unfused", as in
    cost_models.layout) says in which dtype gradients are reduced when
    precision is bf16/fp16. `graph`: the model's ModelGraph when it was
    captured already (its layers are used instead of a new trace). `dp_shard`: HSDP, the
    ZeRO states sharded over groups of dp_shard dp ranks (None: over the whole dp).
    `grad_reduce_dtype`: gradients reduced in this narrower dtype (autopar/compression.py). `ep`: expert
    parallelism, each MoE layer's experts split over groups of ep dp ranks (None: not split). `cp`:
    context parallelism, every sequence (of `seq_len`) cut over cp ranks."""
    if schedule not in SCHEDULES:
        raise PlanMismatchError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
    if checkpoint not in CHECKPOINTS:
        raise PlanMismatchError(f"unknown checkpoint {checkpoint!r}; one of {', '.join(CHECKPOINTS)}")
    if offload == "optimizer":
        raise PlanMismatchError(
            "offload='optimizer' cannot run: FSDP2's CPUOffloadPolicy offloads parameters, gradients and "
            "optimizer state together", hint="use offload='params' with zero=3")
    if main_grads not in MAIN_GRADS:
        raise PlanMismatchError(f"unknown main_grads {main_grads!r}; one of {', '.join(MAIN_GRADS)}")
    if cp and cp > 1 and seq_len is None:  # the cut needs the sequence: the example's, as traced
        seq_len = _example_seq_len(example_inputs)
    layers, blocks = _layers_and_blocks(model, example_inputs, tp, sequence_parallel, seq_len, graph)
    block_ids = {id(c) for c in blocks}
    for c in layers:
        c.zero = zero
        c.reshard_after_forward = zero == 3
        c.offload = offload
        c.checkpoint = checkpoint if id(c) in block_ids else "none"
    n_stages = pp * (virtual_stages if schedule == "interleaved" else 1)
    if stage_layers is None and not blocks and n_stages == 1:
        counts = [len(layers)]  # no block stack: one stage holds every layer
    elif stage_layers is None:
        per, extra = divmod(len(blocks), n_stages)
        counts = [per + (1 if i < extra else 0) for i in range(n_stages)]
        if counts[-1] == 0:
            raise PlanMismatchError(
                f"{len(blocks)} blocks cannot fill {n_stages} pipeline stages" if blocks else
                f"{type(model).__name__} has no repeated blocks (an nn.ModuleList or nn.Sequential of layers) to cut pipeline "
                f"stages between", hint="plan with pp=1, or hold the repeated blocks in an nn.ModuleList or nn.Sequential")
        first = layers.index(blocks[0])
        counts[0] += first
        counts[-1] += len(layers) - first - len(blocks)
    else:
        counts = list(stage_layers)
    if len(counts) != n_stages or sum(counts) != len(layers):
        raise PlanMismatchError(f"stage_layers {counts} must have {n_stages} entries summing to {len(layers)} layers")
    stages, at = [], 0
    for i, n in enumerate(counts):
        stages.append(Stage(index=i, pp_rank=i % pp, layers=layers[at:at + n]))
        at += n
    model_info = {"name": name or type(model).__name__, **model_signature(model),
                  "num_layers": len(layers)}
    plan = Plan(model=model_info, global_batch_size=dp * micro_batch_size * num_micro_batches, seq_len=seq_len,
                precision=precision, mesh=Mesh(pp=pp, dp=dp, tp=tp, dp_shard=dp_shard, ep=ep, cp=cp),
                sequence_parallel=sequence_parallel,
                schedule=schedule, virtual_stages=virtual_stages if schedule == "interleaved" else 1,
                micro_batch_size=micro_batch_size, num_micro_batches=num_micro_batches, stages=stages,
                grad_reduce_dtype=grad_reduce_dtype, solver={"status": "manual"}, assumptions={"main_grads": main_grads})
    check_schedule(plan)  # the same check lowering makes: a hand plan that cannot run fails here
    problem = (hsdp_problem(plan) or compression_problem(grad_reduce_dtype, precision, dp * (cp or 1)) or ep_problem(plan)
               or ep_refusal(model, ep) or cp_problem(plan))
    if problem:
        raise PlanMismatchError(problem)
    return plan
