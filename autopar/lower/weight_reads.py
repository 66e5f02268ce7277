"""Which parameters the model reads where: found in one fake forward each,
before the lowering wraps anything, and asked by both the lowering
(preflight.py) and the planner's question of what runs (what_runs.py), so
what is priced is what runs.

* `read_by_weight`: embedding / head layers tp must leave whole: a Linear
  whose forward never runs because the model reads its weight (MobileBERT's
  head), a layer whose weight the root reads, and every module tied to them.
* `read_outside`: layers whose parameters are read outside their forward or
  whose output is written in place; FSDP2 keeps them in their parent's unit.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.lower.model_io import fake_attempts, forward_kwargs, on_model_device, probe_forward
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


def read_by_weight(model, tp_layers, holders, args) -> tuple[frozenset, dict[str, str]]:
    """(ids of modules tp keeps whole, {path: why}) for the embedding / head
    layers among `tp_layers`: a Linear the model never calls (it reads the
    weight: MobileBERT's head), a layer whose parameters the model reads outside
    its forward (a root computing `h @ self.emb.weight.T`), and every module
    holding a weight tied to either. Split, each would hand the user's own
    code a DTensor it does not expect (a crash in the first step)."""
    ends = {p: model.get_submodule(p) for l in tp_layers if l.position in ("pre", "post") for p in l.paths}
    linears = {f"{p}.{n}" if n else p: m for p, e in ends.items() for n, m in e.named_modules() if is_linear(m)}
    if not ends:
        return frozenset(), {}
    watched = {**ends, **linears}
    reads = _watch(model, watched, ends, args, forward_kwargs(model))
    if reads is None:  # unknown: split as planned (the lowering's other checks judge the model)
        return frozenset(), {}
    why = {p: "the model reads its weight instead of calling it" for p in sorted(set(linears) - reads.called)}
    why.update({p: "the model reads its parameters outside its forward" for p in sorted(reads.read)})
    whole = {id(m) for p in why for m in watched[p].modules()}
    for hs in holders.values():
        if any(id(m) in whole for m, _ in hs):
            whole.update(id(m) for m, _ in hs)
    return frozenset(whole), why


class _ParamReads(TorchDispatchMode):
    """Which modules' forwards ran, which layers' parameters an op reads while
    that layer's forward is not running, and which layers' outputs an op
    writes in place afterwards."""

    def __init__(self, owner: dict[int, tuple]):
        super().__init__()
        self.owner, self.running, self.outputs = owner, [], {}
        self.called, self.read, self.written = set(), set(), set()
        # The layers' outputs, kept alive: they are known by id, and a freed output's id
        # is reused by a later tensor (ResNet's in-place ReLU on it read as a write into
        # that layer's output, on some ranks and not others: FSDP2 units that differ by
        # rank, all-gathers that do not match)
        self.kept: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            paths = self.owner.get(id(t), ()) if isinstance(t, torch.Tensor) else ()
            if paths and not any(p in self.running for p in paths):  # a tied weight: read by any of its holders
                self.read.update(paths)
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            path = self.outputs.get(id(args[0]))
            if path is not None and path not in self.running:
                self.written.add(path)  # `y = self.o(a); y += h`: FSDP2's hooks on y no longer fire
        return func(*args, **(kwargs or {}))


def _entered(reads: _ParamReads, path: str) -> None:
    reads.running.append(path)
    reads.called.add(path)


def _left(reads: _ParamReads, path: str, out) -> None:
    reads.running.remove(path)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    reads.outputs.update({id(t): path for t in outs})
    reads.kept += outs


def _watch(model, modules: dict[str, nn.Module], owners: dict[str, nn.Module], example_args, model_kwargs):
    """One shape-only forward of the model with `modules` (path -> module) hooked and
    the parameters of `owners` tracked: the _ParamReads it filled, or None when
    the model cannot run on fake tensors. A meta-built model runs on meta tensors
    first (`fake_attempts`; GPT-3 175B: 2.2 s -> 1.0 s)."""
    owner: dict[int, tuple] = {}
    for path, m in owners.items():
        for p in m.parameters():
            owner[id(p)] = owner.get(id(p), ()) + (path,)
    for fake in fake_attempts(model):
        reads = _ParamReads(owner)
        hooks = []
        for path, m in modules.items():
            hooks.append(m.register_forward_pre_hook(lambda mod, args, path=path: _entered(reads, path)))
            hooks.append(m.register_forward_hook(lambda mod, args, out, path=path: _left(reads, path, out),
                                                 always_call=True))
        try:
            with probe_forward(model, fake=fake), reads:
                model(*on_model_device(model, example_args), **model_kwargs)
            return reads
        except Exception:  # noqa: BLE001 - the caller decides what unknown means
            continue
        finally:
            for h in hooks:
                h.remove()
    return None


def read_outside(model: nn.Module, layers: dict[str, nn.Module], example_args: tuple, model_kwargs: dict) -> set:
    """The paths of `layers` whose parameters the model reads outside their own
    forward (a root computing `h @ self.emb.weight.T`), or whose output it writes
    in place (`y = self.o(a); y += h`): FSDP2 unshards a unit's parameters only
    around its forward and hooks its outputs for the backward, so such a layer
    must stay in its parent's unit (a crash in the first step otherwise: an mm
    of a DTensor shard, or a freed storage in the backward). Unknown (the model
    does not run on fake tensors): none, one unit per layer as before."""
    reads = _watch(model, layers, layers, example_args, model_kwargs)
    return set() if reads is None else reads.read | reads.written

