"""Which parameters the model reads where: found in one fake forward each,
before the lowering wraps anything, and asked by both the lowering
(preflight.py) and the planner's question of what runs (what_runs.py), so
what is priced is what runs.

* `never_called`: Linears whose forward never runs because the model reads
  their weight (MobileBERT's head); tp leaves them whole, and every module
  tied to them (`read_by_weight`).
* `read_outside`: layers whose parameters are read outside their forward or
  whose output is written in place; FSDP2 keeps them in their parent's unit.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.lower.model_io import forward_kwargs, on_model_device, probe_forward
from autopar.lower.tp_styles import is_linear


def param_holders(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """{a parameter's first name: every (module, attribute) holding it}: tied weights have several."""
    canonical: dict[int, str] = {}
    holders: dict[str, list] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = canonical.setdefault(id(p), name)
        path, _, attr = name.rpartition(".")
        holders.setdefault(key, []).append((model.get_submodule(path) if path else model, attr))
    return holders


def read_by_weight(model, tp_layers, holders, args) -> tuple[frozenset, list[str]]:
    """(ids of modules to keep whole, paths of the head Linears that are never called).
    A vocab-split layer's Linear the model never calls (it reads the weight) stays
    whole, and so does every module holding a weight tied to it (its embedding)."""
    linears = {f"{p}.{n}" if n else p: m for l in tp_layers if l.position in ("pre", "post") for p in l.paths
               for n, m in model.get_submodule(p).named_modules() if is_linear(m)}
    if not linears:
        return frozenset(), []
    uncalled = sorted(never_called(model, linears, args, forward_kwargs(model)))
    whole = {id(linears[p]) for p in uncalled}
    for hs in holders.values():
        if any(id(m) in whole for m, _ in hs):
            whole.update(id(m) for m, _ in hs)
    return frozenset(whole), uncalled


class _ParamReads(TorchDispatchMode):
    """Which layers' parameters an op reads while that layer's forward is not
    running, and which layers' outputs an op writes in place afterwards."""

    def __init__(self, owner: dict[int, str]):
        super().__init__()
        self.owner, self.running, self.outside, self.outputs = owner, [], set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            path = self.owner.get(id(t)) if isinstance(t, torch.Tensor) else None
            if path is not None and path not in self.running:
                self.outside.add(path)
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            path = self.outputs.get(id(args[0]))
            if path is not None and path not in self.running:
                self.outside.add(path)  # `y = self.o(a); y += h`: FSDP2's hooks on y no longer fire
        return func(*args, **(kwargs or {}))


def _left(reads: _ParamReads, path: str, out) -> None:
    reads.running.remove(path)
    reads.outputs.update({id(t): path for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)})


def read_outside(model: nn.Module, layers: dict[str, nn.Module], example_args: tuple, model_kwargs: dict) -> set:
    """The paths of `layers` whose parameters the model reads outside their own
    forward (a root computing `h @ self.emb.weight.T`), or whose output it writes
    in place (`y = self.o(a); y += h`): FSDP2 unshards a unit's parameters only
    around its forward and hooks its outputs for the backward, so such a layer
    must stay in its parent's unit (a crash in the first step otherwise: an mm
    of a DTensor shard, or a freed storage in the backward)."""
    owner = {id(p): path for path, m in layers.items() for p in m.parameters()}
    reads = _ParamReads(owner)
    hooks = []
    for path, m in layers.items():
        hooks.append(m.register_forward_pre_hook(lambda mod, args, path=path: reads.running.append(path)))
        hooks.append(m.register_forward_hook(lambda mod, args, out, path=path: _left(reads, path, out),
                                             always_call=True))
    try:
        with probe_forward(model), reads:
            model(*on_model_device(model, example_args), **model_kwargs)
    except Exception:  # noqa: BLE001 - unknown: one unit per layer as before
        return set()
    finally:
        for h in hooks:
            h.remove()
    return reads.outside


def never_called(model: nn.Module, modules: dict[str, nn.Module], example_args: tuple, model_kwargs: dict) -> set:
    """The paths of `modules` whose forward one fake forward of the model never
    runs: a head that reads its Linear's weight (MobileBERT's
    `x.matmul(cat([decoder.weight.t(), dense.weight]))`) instead of calling it.
    Splitting such a Linear column-wise would hand the matmul a DTensor the
    user's code does not expect (a crash in the first backward)."""
    called, hooks = set(), []
    for path, m in modules.items():
        hooks.append(m.register_forward_hook(lambda mod, args, out, path=path: called.add(path)))
    try:
        with probe_forward(model):
            model(*on_model_device(model, example_args), **model_kwargs)
    except Exception:  # noqa: BLE001 - unknown: split as planned (the lowering's other checks judge the model)
        return set()
    finally:
        for h in hooks:
            h.remove()
    return set(modules) - called
