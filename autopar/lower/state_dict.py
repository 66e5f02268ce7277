"""This rank's training state as one flat dict of tensors, named as the user's model names them.

A snapshot must load under any other plan: dp 4 saved, pp 2 x tp 2 resumed. So
names never mention the layout (no stage views' "model." prefix, no FSDP
wrapper, a tied weight under its first name on every pipeline end), and every
tensor is what torch.distributed.checkpoint reshards by itself: a DTensor
(FSDP / TP shards carry their global shape and placements) or a plain tensor
every rank holding it holds whole.

  model.<name>          parameters and persistent buffers (BatchNorm statistics...)
  optim.<name>.<key>    the optimizer's per-parameter state (AdamW: step, exp_avg,
                        exp_avg_sq), sharded as its parameter is

Buffers a data-parallel rank updates on its own batch (BatchNorm running
statistics) are averaged over dp after every step (data_parallel), so every
rank saves the same values.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.errors import AutoparError

MODEL, OPTIM = "model.", "optim."


def buffer_holders(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Persistent buffers by their first name -> every (module, attribute) holding them."""
    first: dict[int, str] = {}
    holders: dict[str, list] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, buf in module._buffers.items():
            if buf is None or attr in module._non_persistent_buffers_set:
                continue
            name = first.setdefault(id(buf), f"{mod_name}.{attr}" if mod_name else attr)
            if (module, attr) not in holders.setdefault(name, []):
                holders[name].append((module, attr))
    return holders


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{name: the name it is tied to} for every state_dict entry of `model` that is another
    name of a tensor held earlier (a head tied to the embedding): `full_state_dict` holds
    each tensor once, under its first name, and an export writes it under both, so
    `model.load_state_dict(load_file(...))` finds every key. Read before lowering."""
    first: dict[int, str] = {}
    aliases = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    return aliases


def local_tensors(pm, holders: dict) -> dict[str, torch.Tensor]:
    """name -> this rank's tensor, for the names whose holder module is on this rank."""
    local_modules = {id(m) for s in pm.stages for m in s.modules()}
    out = {}
    for name in sorted(holders):
        for module, attr in holders[name]:
            if id(module) in local_modules:
                out[name] = getattr(module, attr)
                break
    return out


def model_tensors(pm) -> dict[str, torch.Tensor]:
    out = {MODEL + n: p for n, p in local_tensors(pm, pm._holders).items()}
    out.update({MODEL + n: b for n, b in local_tensors(pm, pm._buffers).items()})
    return out


def all_model_names(pm) -> set[str]:
    """Every model.* name of the whole model (all ranks together)."""
    return {MODEL + n for n in list(pm._holders) + list(pm._buffers)}


def _plain_placements(t) -> list | None:
    """Placements DCP can write for `t`, or None when its own are fine. DCP writes one
    contiguous chunk per rank; a `_StridedShard` innermost on its dim (MoE experts'
    gate_up and fused qkv projections under tp, lower/tp_experts.py and
    tp_styles.PiecewiseColwiseParallel: each rank holds its slice of every piece)
    leaves a rank several pieces, which DCP refuses as overlapping chunks (or,
    under FSDP2 as well, would write at the wrong offsets). Such a dim is made
    plain: `Shard(dim)` on that mesh dim, replicated on the outer ones that
    also split it. FSDP2's own strided shards over a plain tp `Shard` are one
    chunk: kept."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    if not isinstance(t, DTensor):
        return None
    out, changed = list(t.placements), False
    for i, p in enumerate(t.placements):
        if type(p).__name__ != "_StridedShard":  # HSDP's Replicate on dp_replicate has no dim
            continue
        if not any(getattr(q, "dim", None) == p.dim for q in t.placements[i + 1:]):
            out = [Replicate() if j < i and getattr(q, "dim", None) == p.dim else q for j, q in enumerate(out)]
            out[i], changed = Shard(p.dim), True
    return out if changed else None


def _stepwise(t, placements: list):
    """`t` redistributed to `placements` one mesh dim at a time: outer dims gathered
    first, inner ones changed first when scattering back. DTensor redistributes
    several strided shards of one dim at once wrongly (torch 2.13); one at a
    time, each step is its 1-D case."""
    current = list(t.placements)
    gather = [i for i, (a, b) in enumerate(zip(current, placements)) if a != b and b.is_replicate()]
    scatter = [i for i, (a, b) in enumerate(zip(current, placements)) if a != b and not b.is_replicate()]
    for i in gather + scatter[::-1]:
        current[i] = placements[i]
        t = t.redistribute(t.device_mesh, current)
    return t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective), gathered one mesh dim at a time
    (see `_stepwise`); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor, Replicate
    if not isinstance(t, DTensor):
        return t
    return _stepwise(t, [Replicate()] * len(t.placements)).to_local()


def for_dcp(state: dict) -> tuple[dict, object]:
    """`state` as DCP saves and loads it (see `_plain_placements`): such tensors
    resharded plainly (one redistribution per mesh dim), and a function that
    copies stand-ins DCP loaded into back into the tensors of `state`."""
    out, back = dict(state), []
    for name, t in state.items():
        plain = _plain_placements(t)
        if plain is not None:
            out[name] = _stepwise(t.detach(), plain)
            back.append((t, out[name]))

    def restore():
        with torch.no_grad():
            for t, stand_in in back:
                t.to_local().copy_(local_of(stand_in, list(t.placements)))
    return out, restore


def local_of(t, placements: list) -> torch.Tensor:
    """This rank's tensor of `t` in `placements`. An outer strided shard of a dim
    that an inner placement splits too (FSDP2 over a strided tp shard) is
    taken as FSDP2 takes it, a torch.chunk of the inner local tensor: DTensor
    would slice by its own reading of the nesting, which differs."""
    from torch.distributed.tensor import Replicate
    outer = [i for i, p in enumerate(placements) if type(p).__name__ == "_StridedShard"
             and any(getattr(q, "dim", None) == p.dim for q in placements[i + 1:])]
    local = _stepwise(t, [Replicate() if i in outer else p for i, p in enumerate(placements)]).to_local()
    coord = t.device_mesh.get_coordinate()
    for i in outer:
        pieces = torch.chunk(local, t.device_mesh.size(i), dim=placements[i].dim)
        local = pieces[coord[i]] if coord[i] < len(pieces) else local.narrow(placements[i].dim, 0, 0)
    return local


def _stepping_optimizer(opt):
    """The optimizer that holds state: ZeroRedundancyOptimizer keeps its rank's in `.optim`."""
    return getattr(opt, "optim", opt) if type(opt).__name__ == "ZeroRedundancyOptimizer" else opt


def _stepped_params(pm) -> dict[str, torch.Tensor]:
    """name -> parameter, for the parameters this rank's optimizer updates."""
    mine = {id(p) for g in _stepping_optimizer(pm.optimizer).param_groups for p in g["params"]}
    return {n: p for n, p in local_tensors(pm, pm._holders).items() if id(p) in mine}


def optimizer_tensors(pm) -> dict[str, torch.Tensor]:
    state = _stepping_optimizer(pm.optimizer).state
    out = {}
    for name, p in _stepped_params(pm).items():
        for key, value in state.get(p, {}).items():
            if not isinstance(value, torch.Tensor):
                raise AutoparError(f"optimizer state {name}.{key} is a {type(value).__name__}, not a tensor: "
                                   "a snapshot holds tensors only",
                                   hint="use an optimizer whose per-parameter state is tensors (torch.optim's are)")
            out[f"{OPTIM}{name}.{key}"] = value
    return out


def optimizer_targets(pm, saved: dict) -> tuple[dict[str, torch.Tensor], object]:
    """Empty tensors to load a snapshot's optimizer state into, and a function that
    installs them as the optimizer's state once loaded.

    An optimizer has no state before its first step, so the snapshot's own
    metadata (`saved`: name -> (shape, dtype)) says what to allocate: a tensor of
    the parameter's global shape is sharded like the parameter on this plan
    (DTensor), anything else (AdamW's step count) is a plain tensor on the CPU,
    where torch.optim keeps it."""
    targets, installs = {}, []
    for name, p in _stepped_params(pm).items():
        prefix = f"{OPTIM}{name}."
        state = {}
        for key, (shape, dtype) in saved.items():
            if not key.startswith(prefix) or "." in key[len(prefix):]:
                continue
            if tuple(shape) == tuple(p.shape):
                t = torch.zeros_like(p, dtype=dtype, requires_grad=False)
            else:
                t = torch.zeros(shape, dtype=dtype)
            state[key[len(prefix):]] = t
            targets[key] = t
        if state:
            installs.append((p, state))

    def install():
        opt_state = _stepping_optimizer(pm.optimizer).state
        for p, state in installs:
            opt_state[p] = state

    return targets, install
