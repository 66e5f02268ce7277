"""Build a Plan by hand for a model: a fixed layout, no search.

Used by tests and by `autopar compile --mesh ...` when the layout is pinned
(or the solver is unavailable). Layers come from the model's module tree:
parameter-holding children before the repeated block `nn.ModuleList` form
one `embedding` layer, each block is a layer, and the children after it form
one `head` layer. Stages get contiguous runs of layers; `stage_layers` gives
the layer count per stage in execution order (default: blocks split evenly,
the embedding on the first stage and the head on the last).
"""
from __future__ import annotations

import torch.nn as nn

from autopar.errors import PlanMismatchError
from autopar.lower.model_layers import model_signature
from autopar.plan import CHECKPOINTS, SCHEDULES, LayerChoice, Mesh, Plan, Stage


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def model_layers(model: nn.Module) -> list[LayerChoice]:
    children = list(model.named_children())
    lists = [(n, m) for n, m in children if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise PlanMismatchError(f"{type(model).__name__} has no nn.ModuleList of blocks to place layers from")
    blocks_name, blocks = max(lists, key=lambda nm: len(nm[1]))
    names = [n for n, _ in children]
    split = names.index(blocks_name)
    pre = [n for n, m in children[:split] if _has_params(m)]
    post = [n for n, m in children[split + 1:] if _has_params(m)]
    layers = []
    if pre:
        layers.append(LayerChoice(name="embedding", kind="embedding", module_paths=pre, tp_style="vocab"))
    layers += [LayerChoice(name=f"{blocks_name}.{i}", kind="block", module_paths=[f"{blocks_name}.{i}"],
                           tp_style="colwise_rowwise") for i in range(len(blocks))]
    if post:
        layers.append(LayerChoice(name="head", kind="head", module_paths=post, tp_style="vocab"))
    return layers


def plan_for_model(model: nn.Module, *, pp: int = 1, dp: int = 1, tp: int = 1, zero: int = 0,
                   checkpoint: str = "none", schedule: str = "1f1b", virtual_stages: int = 1,
                   micro_batch_size: int = 1, num_micro_batches: int = 1, sequence_parallel: bool = False,
                   stage_layers: list[int] | None = None, precision: str = "fp32", offload: str = "none",
                   seq_len: int | None = None, name: str | None = None) -> Plan:
    if schedule not in SCHEDULES:
        raise PlanMismatchError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
    if checkpoint not in CHECKPOINTS:
        raise PlanMismatchError(f"unknown checkpoint {checkpoint!r}; one of {', '.join(CHECKPOINTS)}")
    layers = model_layers(model)
    for c in layers:
        c.zero = zero
        c.reshard_after_forward = zero == 3
        c.offload = offload
        c.checkpoint = checkpoint if c.kind == "block" else "none"
        if sequence_parallel and c.kind == "block":
            c.tp_style = "sequence"
        if tp == 1:
            c.tp_style = "replicate"
    n_stages = pp * (virtual_stages if schedule == "interleaved" else 1)
    if stage_layers is None:
        blocks = [c for c in layers if c.kind == "block"]
        per, extra = divmod(len(blocks), n_stages)
        counts = [per + (1 if i < extra else 0) for i in range(n_stages)]
        if counts[-1] == 0:
            raise PlanMismatchError(f"{len(blocks)} blocks cannot fill {n_stages} pipeline stages")
        counts[0] += sum(1 for c in layers if c.kind == "embedding")
        counts[-1] += sum(1 for c in layers if c.kind == "head")
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
    return Plan(model=model_info, global_batch_size=dp * micro_batch_size * num_micro_batches, seq_len=seq_len,
                precision=precision, mesh=Mesh(pp=pp, dp=dp, tp=tp), sequence_parallel=sequence_parallel,
                schedule=schedule, virtual_stages=virtual_stages if schedule == "interleaved" else 1,
                micro_batch_size=micro_batch_size, num_micro_batches=num_micro_batches, stages=stages,
                solver={"status": "manual"})
