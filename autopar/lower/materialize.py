"""Meta-device models become real one shard at a time.

Parallelisation (TP, FSDP) runs on meta parameters, so each rank only ever
allocates its own shards: `to_empty` gives every local shard storage, then
the model's own initialisation runs module by module, children before their
parent as construction and `nn.Module.apply` run it: each module's
`reset_parameters` (the defaults its constructor applied), then a user
`init_fn(module)` (the model's custom init, e.g. GPT's normal(0.02); it also
refills buffers such as RoPE tables).

Why one module at a time on whole tensors: random init on sharded DTensors is
not the same as on the whole tensor everywhere. On CPU, DTensor draws every
shard from the same generator state (measured, torch 2.13: the two halves of
a dp 2 weight came out equal, row for row); on GPUs the offset tracker keeps
shards apart, but the values still depend on the layout. So each module's own
parameters are made whole (one module's worth of memory, never the model's),
initialised under a seed derived from the run's seed and the module's name,
and each rank keeps its shard of them. The weights are then the same on every
plan and world size, and equal to `init_module_tree` on one process.

A model built with real weights is never re-initialised: TP and FSDP carve
the local shards out of the weights every rank holds.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.errors import AutoparError
from autopar.model_file import CONSTRUCTOR_VALUES


def has_meta(modules: list[nn.Module]) -> bool:
    return any(t.is_meta for m in modules for t in list(m.parameters()) + list(m.buffers()))


def materialize(modules: list[nn.Module], device: torch.device, init_fn=None, seed: int | None = None,
                model: nn.Module | None = None) -> bool:
    """Returns True when the modules were on meta and have been initialised.
    `seed`: the base of the per-module seeds (default: torch's initial seed, i.e. what
    torch.manual_seed set). `model`: the user's model the modules are (views of), whose
    module names seed each module whatever stage holds it."""
    if not has_meta(modules):
        for m in modules:
            m.to(device)
        return False
    # Buffers keep what the constructor computed (a real tensor, or the value
    # model_file.keep_buffer_values hung on a meta one); the others init_fn must refill.
    kept, refill = [], []
    for m in modules:
        for sub in m.modules():
            for n, b in sub.named_buffers(recurse=False):
                if not b.is_meta or hasattr(b, "autopar_value"):
                    kept.append((sub, n, getattr(b, "autopar_value", b)))
                else:
                    refill.append((sub, n))
    if refill and init_fn is None:
        raise AutoparError(
            f"the model was built on the meta device and has buffers ({', '.join(sorted({n for _, n in refill})[:4])}) "
            "whose values cannot be recomputed from a meta model",
            hint="pass init_fn(module) that also fills these buffers, or build the model on the CPU "
                 "(real weights are kept as they are)")
    for m in modules:
        m.to_empty(device=device)
    for sub, n, b in kept:
        sub._buffers[n].copy_(b)
    # A sentinel shows the buffers init_fn left empty.
    unfilled = [(sub, n) for sub, n in refill if _fill_sentinel(sub._buffers[n])]
    names = None
    if model is not None:
        names = {}
        for n, m in model.named_modules(remove_duplicate=False):
            names.setdefault(id(m), n)
    left = init_module_tree(modules, init_fn, torch.initial_seed() if seed is None else seed, names)
    left += sorted({n for sub, n in unfilled if _still_sentinel(sub._buffers[n])})
    if left:
        raise AutoparError(
            f"the meta-built model's init left {', '.join(left[:4])}{' and more' if len(left) > 4 else ''} "
            "unfilled (a module without reset_parameters that init_fn does not initialise either)",
            hint="pass init_fn(module) that initialises them (a model file's init_fn), or build the model on "
                 "the CPU (train.py --init cpu): its constructor's values are kept")
    return True


def _fill_sentinel(b: torch.Tensor) -> bool:
    if b.dtype.is_floating_point:
        b.fill_(float("nan"))
    elif b.dtype != torch.bool and not b.dtype.is_complex:
        b.fill_(torch.iinfo(b.dtype).max)
    else:
        return False  # no value a real buffer could not hold
    return True


def _still_sentinel(b: torch.Tensor) -> bool:
    if b.numel() == 0:
        return False
    if b.dtype.is_floating_point:
        return bool(torch.isnan(b).all())
    return bool((b == torch.iinfo(b.dtype).max).all())


def init_module_tree(roots: list[nn.Module], init_fn, seed: int, names: dict[int, str] | None = None) -> list[str]:
    """The model's own init, module by module (children first), each on whole tensors
    under a seed from `seed` and its name in the user's model (`names`: id -> name;
    a module not in it, e.g. a pipeline stage's view of the root, by its path with the
    stage wrapper's `model.` dropped); sharded parameters keep their shard. Returns
    the floating-point parameters nothing initialised (still the NaN they started as)."""
    names = dict(names or {})
    for root in roots:
        for name, sub in _post_order(root, ""):
            names.setdefault(id(sub), name[len("model."):] if name.startswith("model.") else
                             "" if name == "model" else name)
    done, initialised, left = set(), set(), []
    with torch.no_grad():
        for root in roots:
            for _, sub in _post_order(root, ""):
                if id(sub) in done:
                    continue
                done.add(id(sub))
                prefix = f"{names[id(sub)]}." if names[id(sub)] else ""
                left += [prefix + n for n in _init_one(sub, init_fn, _module_seed(seed, names[id(sub)]), initialised)]
    return left


def _post_order(module: nn.Module, prefix: str):
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _module_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_one(module: nn.Module, init_fn, seed: int, initialised: set) -> list[str]:
    """A tied weight keeps the values of the first module holding it (the embedding,
    before the head that shares it): the same on a pipeline, where the head's rank
    receives the first stage's copy. Returns the names of the module's own
    floating-point parameters nothing wrote (a NaN sentinel shows them)."""
    own = {n: p for n, p in module.named_parameters(recurse=False)}
    reset = getattr(module, "reset_parameters", None)
    # What the constructor set, where nothing else would (model_file.parameters_on_meta).
    built = module.__dict__.pop(CONSTRUCTOR_VALUES, {})
    whole = {n: built[n].to(_device_of(p), p.dtype, copy=True) if n in built else
             torch.full(p.shape, float("nan"), dtype=p.dtype, device=_device_of(p)) if p.dtype.is_floating_point
             else torch.empty(p.shape, dtype=p.dtype, device=_device_of(p)) for n, p in own.items()}
    for n, t in whole.items():  # the module sees whole plain tensors while it initialises itself
        module._parameters[n] = nn.Parameter(t, requires_grad=own[n].requires_grad)
    devices = sorted({t.device for t in whole.values() if t.device.type == "cuda"}, key=str)
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            if callable(reset):
                reset()
            if init_fn is not None:
                init_fn(module)
    finally:
        for n, p in own.items():
            module._parameters[n] = p
    fresh = [n for n, p in own.items() if id(p) not in initialised]
    for n in fresh:
        initialised.add(id(own[n]))
        _keep_my_shard(own[n], whole[n])
    return [n for n in fresh if whole[n].dtype.is_floating_point and _still_sentinel(whole[n])]


def _device_of(p: torch.Tensor) -> torch.device:
    return p._local_tensor.device if isinstance(p, DTensor) else p.device


def _keep_my_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same whole tensor, so each cuts its
        # shard locally (no scatter).
        mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param._local_tensor.copy_(mine)
    else:
        param.copy_(full)
