"""The global gradient norm of a ParallelModel, and clipping by it.

One number for the whole model, whatever the layout: what one process would
compute over all of its gradients. The pieces a rank holds:

  DTensor gradients  (FSDP shards over dp, tensor-parallel shards over tp, or
                     both): grouped by mesh and placements, each group's norm
                     taken by DTensor (`get_total_norm`) and `full_tensor()`
                     reduces it over exactly the ranks that split it
  plain gradients    (DDP replicas, layers neither sharded nor split): whole on
                     this rank, counted as they are
  pipeline           each pp rank holds other layers: the squares are summed
                     over the pp group
  tied copies        a weight tied across pipeline ranks (embedding and head)
                     has one copy per end, their gradients already summed:
                     each end counts 1 / (number of ends) of it

torchtitan's `clip_grad_norm_` (torchtitan/distributed/utils.py) does the same
for its layouts; this one also covers replicated plain tensors and tied ends.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _groups(grads):
    """DTensor gradients by (mesh, placements): one norm, one reduction per group."""
    by_key: dict = {}
    for g in grads:
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
        by_key.setdefault(key, []).append(g)
    return by_key


def _sum_of_squares(grads) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for group in _groups(grads).values():
        part = torch.nn.utils.get_total_norm([g.detach() for g in group], 2.0, foreach=False)
        if isinstance(part, DTensor):  # reduced over the ranks that split this group
            part = part.full_tensor()
        total = total + part.double().cpu() ** 2
    return total


def global_grad_norm(pm) -> float:
    """The L2 norm of every gradient of the model (as one process would see it).
    Collective over the pipeline group: call it on every rank."""
    tied = {id(param_of()): group for param_of, group in pm._tied_groups}
    grads = [p.grad for p in pm.parameters() if p.grad is not None and id(p) not in tied]
    sq = _sum_of_squares(grads)
    for param_of, group in pm._tied_groups:  # one copy per pipeline end: each counts its share
        p = param_of()
        if p.grad is not None:
            sq = sq + _sum_of_squares([p.grad]) / dist.get_world_size(group)
    if pm.plan.mesh.pp > 1:
        t = sq.to(pm.device).reshape(1)
        dist.all_reduce(t, group=pm.mesh["pp"].get_group())
        sq = t.cpu()[0]
    return math.sqrt(float(sq))


def clip_grads_(pm, max_norm: float, total_norm: float) -> float:
    """Scale every gradient by min(1, max_norm / total_norm) (torch's rule,
    `clip_grads_with_norm_`); returns the factor applied."""
    coef = min(1.0, max_norm / (total_norm + 1e-6))
    if coef < 1.0:
        for p in pm.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return coef
