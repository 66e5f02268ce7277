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
Both substitutions are said, not silent: `zero_substitutions(plan)` names
the layers, compile warns (LoweringWarning) and keeps the sentences in
`ParallelModel.notes`.
Each layer is one FSDP unit (one all-gather / reduce-scatter per layer,
overlapped with the neighbour's compute; a layer of several modules, such as
a head's final norm and output Linear, is one unit over all of them); the stage module is the root unit
and collects what no layer owns (tied weights). The dp axis of the mesh is
used; with tp > 1 FSDP2 composes with the TP DTensors (2-D sharding).
Gradient averaging over dp matches a mean loss over the global batch.

HSDP (`plan.mesh.dp_shard` < dp): `fully_shard` on the 2-D ("dp_replicate",
"dp_shard") submesh (`fsdp_mesh`), which FSDP2 runs as hybrid sharding: the
states sharded inside a shard group, the gradients reduce-scattered there and
the shards all-reduced across the replicas. Every layer is an FSDP2 unit then
(no `replicate`: ZeRO 0/1 layers run as ZeRO 2, said by `zero_substitutions`).

Modules that must keep fp32 parameters under bf16 / fp16 plans get an FSDP
unit of their own with an fp32 MixedPrecisionPolicy (`fp32_modules`):
BatchNorm (its running statistics are fp32; torch's batch_norm takes a bf16
input with fp32 weight and statistics, not bf16 weight with fp32 statistics:
"expected scalar type BFloat16 but found Float"), and the modules a Hugging
Face model lists in `_keep_in_fp32_modules` (fed fp32 inputs, as it expects).

BatchNorm normalises over the global batch (batch_norm.py synchronises it
over dp before this file shards anything), so every rank holds the same
running statistics.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from autopar.lower import compression
from autopar.lower.mesh import data_mesh, hsdp_mesh
from autopar.lower.model_layers import ModelLayout
from autopar.precision import DTYPES as _DTYPES


def main_grads(plan) -> str:
    """The plan's gradient dtype choice (cost_models.layout.Layout.main_grads):
    "same" = reduce in the training dtype, "fp32" / "fp32-unfused" = fp32
    main gradients. A hand plan records it in `assumptions["main_grads"]`, a
    planned one under `assumptions["cost_model"]`; a plan that says nothing
    gets fp32 reductions (what Megatron and torchtitan do)."""
    a = plan.assumptions if isinstance(plan.assumptions, dict) else {}
    cost = a.get("cost_model") if isinstance(a.get("cost_model"), dict) else {}
    return a.get("main_grads") or cost.get("main_grads") or "fp32"


def mixed_precision(precision: str, grads: str = "fp32", compressed: torch.dtype | None = None
                    ) -> MixedPrecisionPolicy | None:
    """`compressed`: the plan's narrower reduction dtype (lower/compression.py), which
    wins over `grads`; under fp32 training it is the policy's only change."""
    if precision == "fp32":
        return None if compressed is None else MixedPrecisionPolicy(reduce_dtype=compressed)
    # Compute in low precision; reduce gradients in fp32 unless the plan priced
    # reductions in the training dtype (main_grads "same": half the bytes).
    reduce = None if grads == "same" else torch.float32  # None: FSDP2 reduces in param_dtype
    return MixedPrecisionPolicy(param_dtype=_DTYPES[precision], reduce_dtype=compressed or reduce)


def zero_substitutions(plan) -> list[str]:
    """What runs differently from the plan's ZeRO levels, one sentence per
    substitution, naming the layers. Under tensor or pipeline parallelism
    FSDP2 is the only data-parallel wrapper (DDP takes no DTensor parameters
    and not the schedules' per-micro-batch backward), and FSDP2 has no
    "whole gradients, sharded optimizer" mode: zero 0 and 1 run as zero 2
    (same bytes on the wire: reduce-scatter + all-gather = one all-reduce;
    less memory than planned: gradients and optimizer state sharded)."""
    if plan.mesh.dp == 1 or uses_replicate(plan):
        return []
    hsdp = plan.mesh.hsdp
    out = []
    for level in (0, 1):
        names = [c.name for c in plan.layer_choices if c.zero == level and c.offload == "none"]
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            why = ("HSDP (FSDP2 on the dp_replicate x dp_shard mesh)" if hsdp else
                   f"expert parallelism (ep {plan.mesh.ep}: FSDP2 on every layer)" if (plan.mesh.ep or 1) > 1 else
                   "tensor/pipeline parallelism" if plan.mesh.tp > 1 or plan.mesh.pp > 1 else
                   "other layers' FSDP2 sharding (zero 2/3 or offload)")
            out.append(f"zero {level} lowered as zero 2 for layer(s) {shown}: under {why} data parallelism is "
                       f"FSDP2, which has no mode that keeps whole gradients; it moves the same bytes and holds "
                       f"less memory (gradients{' and optimizer state' if level == 0 else ''} sharded over dp)")
    return out


def offload_policy(offload: str):
    if offload == "none":
        return None
    # pin_memory needs an accelerator; on a CPU-only host it must be off.
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def wraps(plan) -> bool:
    """Whether the plan needs a data-parallel wrapper (replicate or FSDP2): dp > 1, or
    ZeRO, offload or mixed precision on one rank."""
    return (plan.mesh.dp * (plan.mesh.cp or 1) > 1 or any(c.zero > 0 or c.offload != "none" for c in plan.layer_choices)
            or plan.precision != "fp32")


def uses_replicate(plan) -> bool:
    # HSDP and ep (experts sharded over their own efsdp mesh) are FSDP2 on every layer
    return (plan.mesh.dp * (plan.mesh.cp or 1) > 1 and plan.mesh.tp == 1 and plan.mesh.pp == 1 and not plan.mesh.hsdp
            and (plan.mesh.ep or 1) == 1
            and all(c.zero <= 1 and c.offload == "none" for c in plan.layer_choices))


def hsdp_refusal() -> str | None:
    """Why this torch cannot run HSDP as autopar lowers it (None: it can). The 2-D mesh
    is unflattened from dp (DeviceMesh._unflatten) and the replica all-reduce deferred
    to the last micro-batch (FSDPModule.set_requires_all_reduce), as priced."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    missing = [f"{owner.__name__}.{name}" for owner, name in ((DeviceMesh, "_unflatten"),
                                                              (FSDPModule, "set_requires_all_reduce"))
               if not hasattr(owner, name)]
    return f"this torch ({torch.__version__}) has no {' or '.join(missing)}" if missing else None


def fsdp_mesh(plan, mesh):
    """The mesh fully_shard shards over: the dp axis, or under HSDP the 2-D
    (dp_replicate, dp_shard) submesh, which FSDP2 takes as (replicate, shard); under
    context parallelism dp x cp (`mesh.data_mesh`)."""
    return hsdp_mesh(plan, mesh) if plan.mesh.hsdp else data_mesh(plan, mesh)


def zero_redundancy_optimizer(params, optimizer_cls, kwargs, dp_mesh):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, process_group=dp_mesh.get_group(),
                                   **kwargs)


def apply_replicate(module: nn.Module, dp_mesh, compressed: torch.dtype | None = None) -> nn.Module:
    from torch.distributed._composable.replicate import replicate
    module = replicate(module, device_mesh=dp_mesh)
    if compressed is not None:  # the plan's bf16 reduction: DDP's own compression hook
        compression.register_hook(module, dp_mesh)
    return module


def fp32_modules(model: nn.Module, keep: list[str] | None = None) -> dict[str, bool]:
    """{module path: cast its inputs to fp32} for the modules under `model` that keep fp32
    parameters; `keep`: the Hugging Face model's _keep_in_fp32_modules (default: model's own)."""
    keep = (getattr(model, "_keep_in_fp32_modules", None) if keep is None else keep) or []
    pattern = re.compile(rf"(^|\.)({'|'.join(map(re.escape, keep))})($|\.)") if keep else None
    out = {}
    for name, m in model.named_modules():
        if not any(True for _ in m.parameters(recurse=False)):
            continue
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            out[name] = False  # a bf16 input is what its kernel takes with fp32 weights
        elif pattern is not None and pattern.search(name):
            out[name] = True
    return out


def _callable_modules(modules) -> list[nn.Module]:
    """The modules holding parameters, a container that is never called (an
    nn.ModuleList layer, as x-transformers holds [norm, attention, residual])
    replaced by its children: FSDP2 hooks forwards, and refuses such containers."""
    out = []
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            out += _callable_modules(m.children())
        elif any(True for _ in m.parameters()):
            out.append(m)
    return out


def apply_fsdp(stage: nn.Module, layout: ModelLayout, stage_index: int, dp_mesh, precision: str,
               tied_local: set[str], grads: str = "fp32", compressed: torch.dtype | None = None) -> None:
    """Shard one stage module: one FSDP unit per layer, the stage as root unit. `compressed`:
    the plan's narrower gradient reduction dtype (lower/compression.py)."""
    mp = mixed_precision(precision, grads, compressed)
    kwargs = {"mesh": dp_mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    mine = layout.layers_of_stage(stage_index)
    model = stage.model
    own_units = set()
    # the units that stay gathered from forward to backward (ZeRO-2, fp32 islands): a
    # pipeline keeps them gathered across micro-batches too (pipeline_parallel.ReducingStage)
    stage.kept_gathered = []
    if precision != "fp32":  # innermost first: these units keep fp32 parameters inside bf16 / fp16 layers
        keep = getattr(model, "_keep_in_fp32_modules", None)
        for path in (p for l in mine for p in l.paths):
            layer = model.get_submodule(path)
            for sub, cast in fp32_modules(layer, keep).items():
                unit = layer.get_submodule(sub) if sub else layer
                fully_shard(unit, mesh=dp_mesh, reshard_after_forward=False,
                            mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                           reduce_dtype=compressed or torch.float32,
                                                           cast_forward_inputs=cast))
                stage.kept_gathered.append(unit)
                own_units.add(f"{path}.{sub}" if sub else path)
    for l in mine:
        # A layer holding one end of a weight tied to another local layer is
        # left to the root unit: one parameter must live in one FSDP unit.
        if any(t == p or t.startswith(p + ".") for p in l.paths for t in tied_local):
            continue
        off = offload_policy(l.choice.offload)
        # One unit per layer, also when the layer is several modules (a head's final norm
        # and output Linear): one all-gather for them, as torchtitan groups [norm, output].
        modules = _callable_modules(model.get_submodule(p) for p in l.paths if p not in own_units)
        if modules:
            unit = fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=l.choice.zero >= 3,
                               **kwargs, **({"offload_policy": off} if off else {}))
            if l.choice.zero < 3:
                stage.kept_gathered += unit if isinstance(unit, list) else [unit]
    off = offload_policy(mine[0].choice.offload if mine else "none")
    root_gathered = not any(l.choice.zero >= 3 for l in mine)
    fully_shard(stage, reshard_after_forward=not root_gathered, **kwargs, **({"offload_policy": off} if off else {}))
    if root_gathered:
        stage.kept_gathered.append(stage)
