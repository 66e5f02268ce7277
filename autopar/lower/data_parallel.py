"""Data parallelism and ZeRO with FSDP2 (`fully_shard`) or `replicate`.

zero 3  fully_shard(reshard_after_forward=True): parameters, gradients and
        optimizer state sharded; parameters re-gathered in backward.
zero 2  fully_shard(reshard_after_forward=False): parameters stay gathered
        between forward and backward; gradients and optimizer state sharded.
zero 1  on a pure data-parallel mesh: `replicate` (DDP all-reduce of
        whole gradients) + `ZeroRedundancyOptimizer` (optimizer state
        sharded, updated parameters broadcast). Under tensor or pipeline
        parallelism lowered as zero 2: FSDP2 has no "sharded optimizer, whole
        gradient" mode, and zero 2 moves the same bytes (reduce-scatter +
        all-gather = one all-reduce) holding strictly less memory.
zero 0  `replicate` (DDP) on a pure data-parallel mesh; under tensor or
        pipeline parallelism it falls back to fully_shard
        (reshard_after_forward=False): DDP does not take DTensor parameters,
        nor the pipeline schedules' per-micro-batch backward.
Each layer is one FSDP unit (one all-gather / reduce-scatter per layer,
overlapped with the neighbour's compute); the stage module is the root unit
and collects what no layer owns (tied weights). The dp axis of the mesh is
used; with tp > 1 FSDP2 composes with the TP DTensors (2-D sharding).
Gradient averaging over dp matches a mean loss over the global batch.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from autopar.lower.model_layers import ModelLayout

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def mixed_precision(precision: str) -> MixedPrecisionPolicy | None:
    if precision == "fp32":
        return None
    # Compute in low precision, reduce gradients in fp32 (as Megatron/torchtitan do).
    return MixedPrecisionPolicy(param_dtype=_DTYPES[precision], reduce_dtype=torch.float32)


def offload_policy(offload: str):
    if offload == "none":
        return None
    # pin_memory needs an accelerator; on a CPU-only host it must be off.
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def uses_replicate(plan) -> bool:
    return (plan.mesh.dp > 1 and plan.mesh.tp == 1 and plan.mesh.pp == 1
            and all(c.zero <= 1 and c.offload == "none" for c in plan.layer_choices))


def zero_redundancy_optimizer(params, optimizer_cls, kwargs, dp_mesh):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, process_group=dp_mesh.get_group(),
                                   **kwargs)


def apply_replicate(module: nn.Module, dp_mesh) -> nn.Module:
    from torch.distributed._composable.replicate import replicate
    return replicate(module, device_mesh=dp_mesh)


def apply_fsdp(stage: nn.Module, layout: ModelLayout, stage_index: int, dp_mesh, precision: str,
               tied_local: set[str]) -> None:
    """Shard one stage module: one FSDP unit per layer, the stage as root unit."""
    mp = mixed_precision(precision)
    kwargs = {"mesh": dp_mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    mine = layout.layers_of_stage(stage_index)
    model = stage.model
    for l in mine:
        # A layer holding one end of a weight tied to another local layer is
        # left to the root unit: one parameter must live in one FSDP unit.
        if any(t == p or t.startswith(p + ".") for p in l.paths for t in tied_local):
            continue
        off = offload_policy(l.choice.offload)
        for path in l.paths:
            module = model.get_submodule(path)
            if any(True for _ in module.parameters()):
                fully_shard(module, reshard_after_forward=l.choice.zero >= 3,
                            **kwargs, **({"offload_policy": off} if off else {}))
    off = offload_policy(mine[0].choice.offload if mine else "none")
    fully_shard(stage, reshard_after_forward=any(l.choice.zero >= 3 for l in mine),
                **kwargs, **({"offload_policy": off} if off else {}))
