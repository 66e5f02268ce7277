"""BatchNorm under data parallelism: statistics over the global batch, as one process has them.

In training, BatchNorm normalises with the mean and variance of the batch its
forward sees, and its gradient flows through those statistics. One process
training the global batch sees all of it; a dp rank sees 1/dp of it. Per-rank
statistics are therefore another function (a ResNet's loss was 4-7e-3 off one
process after three steps, issue 29), not a rounding difference.

So under dp > 1 every BatchNorm computes its statistics over the dp group:
  * on CUDA, torch's own `nn.SyncBatchNorm` (its fused kernels);
  * elsewhere (gloo CPU ranks, where SyncBatchNorm refuses to run), the same
    arithmetic over `torch.distributed.nn.functional.all_reduce`, whose
    backward all-reduces the gradient: per channel, the sum and count, then
    the sum of squared deviations (two passes, as precise as one process's
    kernel), each rank normalising its own samples by the global statistics.
Running statistics are then updated from the global batch on every rank
alike (the unbiased variance over all dp x micro-batch samples), which is
what one process keeps.

What cannot be made equal is micro-batching: with several micro-batches per
step (gradient accumulation, or any pipeline), each forward sees a slice of
the replica's batch and normalises by that slice alone. Such plans are
refused here (`whole_batch_refusal`) and never offered by the planner
(`autopar/solve/search_space.py`, from the layers' `batch_norm_channels`).
The synchronisation is priced by the cost model (two all-reduces of a few
channels per BatchNorm in forward, two in backward, latency-bound and exposed).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import PlanMismatchError

_BatchNorm = nn.modules.batchnorm._BatchNorm
# torch 2.13 marks torch.distributed.nn's all_reduce deprecated in favour of the functional
# collectives, which have no differentiable all_reduce: it is the one whose backward we need.
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_reduce is deprecated",
                        category=FutureWarning)


def batch_norms(model: nn.Module) -> list[str]:
    """Paths of the modules whose training forward normalises by batch statistics."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def whole_batch_refusal(model: nn.Module, plan) -> None:
    """Refuse, on every rank before any collective, a plan whose forwards see
    part of a replica's batch while the model has BatchNorm."""
    names = batch_norms(model)
    if not names or (plan.num_micro_batches == 1 and plan.mesh.pp == 1):
        return
    how = (f"pipeline parallelism (pp={plan.mesh.pp}) runs micro-batches" if plan.mesh.pp > 1
           else f"the plan runs {plan.num_micro_batches} micro-batches of {plan.micro_batch_size} per step")
    raise PlanMismatchError(
        f"the model normalises by batch statistics ({len(names)} BatchNorm module(s), e.g. {names[0]!r}) and "
        f"{how}: each forward would normalise by its micro-batch alone, not by the batch one process trains on",
        hint="plan with one micro-batch per data-parallel rank and no pipeline (`autopar plan` offers only "
             "those for BatchNorm models), or replace BatchNorm by GroupNorm / LayerNorm")


def synchronise(model: nn.Module, dp_group, device: torch.device) -> int:
    """Make every BatchNorm of `model` normalise over the dp group; returns how many.
    Done before pipeline cuts, tensor parallelism and FSDP see the modules."""
    names = batch_norms(model)
    if not names:
        return 0
    if device.type == "cuda":
        # torch's own where it runs; it swaps the children in place (a model that
        # is itself one BatchNorm has no parent to swap it in: the mixin below)
        if not isinstance(model, _BatchNorm):
            nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=dp_group)
            return len(names)
    for name in names:
        m = model.get_submodule(name)
        m.__class__ = _global_class(type(m))
        m.dp_group = dp_group
    return len(names)


_CLASSES: dict[type, type] = {}


def _global_class(cls: type) -> type:
    """`cls` with a forward over the dp group; keeps `_check_input_dim`,
    isinstance checks (FSDP's fp32 units) and the state-dict names."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"GlobalBatch{cls.__name__}", (_GlobalBatchNorm, cls), {})
    return _CLASSES[cls]


class _GlobalBatchNorm:
    """Mixin: the forward of a BatchNorm whose statistics span the dp group."""

    dp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.track_running_stats:
            return super().forward(x)  # eval: the running statistics, no batch statistics
        self._check_input_dim(x)
        return _global_batch_norm(self, x)


def _global_batch_norm(bn, x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.nn.functional import all_reduce

    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    # Statistics in fp32 at least (bf16 / fp16 activations), never below the input (fp64 stays fp64).
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    count = torch.full((1,), x.numel() / x.shape[1], dtype=acc, device=x.device)
    summed = all_reduce(torch.cat([xf.sum(dims), count]), op=dist.ReduceOp.SUM, group=bn.dp_group)
    n = summed[-1]
    mean = summed[:-1] / n
    centred = xf - mean.view(shape)
    var = all_reduce(centred.square().sum(dims), op=dist.ReduceOp.SUM, group=bn.dp_group) / n
    y = centred * torch.rsqrt(var + bn.eps).view(shape)
    if bn.affine:
        y = y * bn.weight.to(acc).view(shape) + bn.bias.to(acc).view(shape)
    if bn.track_running_stats:
        _update_running(bn, mean.detach(), var.detach(), float(n.detach()))
    return y.to(x.dtype)


@torch.no_grad()
def _update_running(bn, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
    """torch's rule (`_BatchNorm.forward`): momentum, or a cumulative average when it is None."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            factor = 1.0 / float(bn.num_batches_tracked)
    unbiased = var * (n / max(n - 1.0, 1.0))
    bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
    bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)
