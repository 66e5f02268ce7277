"""Weights shared between modules (a tied embedding and head, T5's shared
vocabulary), after the plan has split and placed them.

On one rank, parallelize_module swaps in new Parameters, so the ends are
pointed back at one tensor (retie_local). Ends on different pipeline ranks
each keep a copy, as Megatron does for the word embedding: one process group
per tied weight over the ranks holding an end (groups), whose gradients are
all-reduced after backward (sync_grads).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from autopar.errors import PlanMismatchError
from autopar.lower import tensor_parallel
from autopar.lower.tp_styles import is_linear


def retie_local(model, holders, local_modules, tp_mesh) -> tuple[set, list]:
    """Re-tie tied weights whose ends are on this rank; (their names, every tied group)."""
    tied_local, tied_remote = set(), []
    for name, hs in holders.items():
        if len(hs) < 2:
            continue
        here = [(m, a) for m, a in hs if id(m) in local_modules]
        if len(here) > 1:
            _retie(name, here, tp_mesh)
            tied_local.update(_names_of(model, hs))
        tied_remote.append((name, hs))
    return tied_local, tied_remote


def _retie(name: str, ends: list, tp_mesh=None) -> None:
    """Point every holder of a tied weight at one Parameter after
    parallelize_module swapped in new ones. A sharded end wins over a plain
    one held by a module that has no tensor-parallel style of its own
    (BertLMPredictionHead.bias, the other end of its decoder Linear's bias):
    such a holder only keeps the reference. An nn.Embedding no planned layer
    names (T5's decoder.embed_tokens, sharing `shared` with the encoder's)
    is split like the vocab-split embedding it shares with. Two ends sharded
    differently, or another split module's plain end, cannot share one tensor."""
    sharded = [(m, a) for m, a in ends if isinstance(getattr(m, a), DTensor)]
    p = getattr(*(sharded[0] if sharded else ends[0]))
    for m, a in ends:
        other = getattr(m, a)
        if other is p:
            continue
        if (isinstance(p, DTensor) and not isinstance(other, DTensor) and type(m) is nn.Embedding
                and a == "weight" and tp_mesh is not None and tuple(p.placements) == (Shard(0),)):
            tensor_parallel.parallelize_vocab(m, tp_mesh, position="pre")
            other = getattr(m, a)
        if isinstance(other, DTensor) and other.placements != p.placements or (
                not isinstance(other, DTensor) and (isinstance(m, nn.Embedding) or is_linear(m))):
            raise PlanMismatchError(
                f"tied parameter {name!r} has differently sharded ends under this plan "
                f"({type(m).__name__}.{a} is {'split' if isinstance(other, DTensor) else 'whole'})",
                hint="give the layers holding both ends the same tensor-parallel style (both 'vocab' or both "
                     "'replicate'), or plan with tp=1")
        setattr(m, a, p)


def _names_of(model, hs):
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(m)]}.{a}" if names[id(m)] else a for m, a in hs}


def groups(mesh, plan, layout, model, tied_remote, local_modules, was_meta):
    """One process group per tied weight and (dp, tp) coordinate, over the pp
    ranks holding an end. Every rank creates every group (new_group is collective)."""
    groups = []
    if plan.mesh.pp == 1:
        return groups
    stage_of_module = {}
    for l in layout.layers:
        for p in l.paths:
            for n, m in model.get_submodule(p).named_modules():
                stage_of_module[id(m)] = l.stage
    ranks = mesh.mesh  # tensor (pp, dp, tp) of global ranks
    me = dist.get_rank()
    for name, hs in tied_remote:
        pp_coords = sorted({stage_of_module[id(m)] % plan.mesh.pp for m, _ in hs if id(m) in stage_of_module})
        if len(pp_coords) < 2:
            continue
        here = [(m, a) for m, a in hs if id(m) in local_modules]
        for d in range(plan.mesh.dp):
            for t in range(plan.mesh.tp):
                members = [int(ranks[c, d, t]) for c in pp_coords]
                group = dist.new_group(members)
                if me in members:
                    m, a = here[0]
                    if was_meta:  # one initialisation for both ends: the first stage's
                        p = getattr(m, a)
                        local = p._local_tensor if isinstance(p, DTensor) else p
                        with torch.no_grad():
                            dist.broadcast(local, src=members[0], group=group)
                    groups.append((lambda m=m, a=a: getattr(m, a), group))
    return groups


def sync_grads(tied_groups) -> None:
    """All-reduce each tied weight's gradient over the pipeline ranks holding an end."""
    for param_of, group in tied_groups:
        p = param_of()
        if p.grad is None:  # an end this step did not reach still joins the all-reduce
            p.grad = torch.zeros_like(p)
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            # DTensor's backward may leave a gradient in another layout than
            # its parameter (a vocab-split embedding's comes back Replicate):
            # the ends must post the same local shard to the all-reduce.
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        g = p.grad
        local = g._local_tensor if isinstance(g, DTensor) else g
        dist.all_reduce(local, group=group)
