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
    meta_buffers = [n for m in modules for n, b in m.named_buffers() if b.is_meta]
    if meta_buffers and init_fn is None:
        raise AutoparError(
            f"the model was built on the meta device and has buffers ({', '.join(sorted(set(meta_buffers))[:4])}) "
            "whose values cannot be recomputed from a meta model",
            hint="pass init_fn(module) that also fills these buffers, or build the model on the CPU "
                 "(real weights are kept as they are)")
    real_buffers = [(sub, n, b) for m in modules for sub in m.modules()
                     for n, b in sub.named_buffers(recurse=False) if not b.is_meta]
    real_buffers += [(sub, n, b.autopar_value) for m in modules for sub in m.modules()
                     for n, b in sub.named_buffers(recurse=False) if b.is_meta and hasattr(b, "autopar_value")]
    for m in modules:
        m.to_empty(device=device)
    for sub, n, b in real_buffers:  # computed by the constructor (parameters_on_meta): kept
        sub._buffers[n].copy_(b)
    # Meta buffers must be refilled by init_fn: a sentinel shows the ones it left empty.
    kept = {(id(sub), n) for sub, n, _ in real_buffers}
    unfilled = [(sub, n) for m in modules for sub in m.modules() for n, b in sub.named_buffers(recurse=False)
                if (id(sub), n) not in kept and _fill_sentinel(b)]
    names = None
    if model is not None:
        names = {}
        for n, m in model.named_modules(remove_duplicate=False):
            names.setdefault(id(m), n)
    init_module_tree(modules, init_fn, torch.initial_seed() if seed is None else seed, names)
    left = sorted({n for sub, n in unfilled if _still_sentinel(sub._buffers[n])})
    if left:
        raise AutoparError(
            f"init_fn left buffer(s) {', '.join(left[:4])} of the meta-built model unfilled",
            hint="build the model with its parameters only on meta (autopar.model_file.parameters_on_meta(): "
                 "buffers are then computed by the constructor), or make init_fn fill these buffers")
    return True


def keep_buffer_values(model: nn.Module) -> None:
    """Move a model's real buffers to meta, each carrying the value its constructor
    computed (`.autopar_value`): the model is then all meta for the lowering's probes
    (meta / fake tensors), and materialize puts the values back. The stage modules'
    shallow views of the model share these tensors."""
    for sub in model.modules():
        for n, b in list(sub.named_buffers(recurse=False)):
            if not b.is_meta:
                meta = b.to("meta")
                meta.autopar_value = b
                sub._buffers[n] = meta


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


def init_module_tree(roots: list[nn.Module], init_fn, seed: int, names: dict[int, str] | None = None) -> None:
    """The model's own init, module by module (children first), each on whole tensors
    under a seed from `seed` and its name in the user's model (`names`: id -> name;
    a module not in it, e.g. a pipeline stage's view of the root, by its path with the
    stage wrapper's `model.` dropped); sharded parameters keep their shard."""
    names = dict(names or {})
    for root in roots:
        for name, sub in _post_order(root, ""):
            names.setdefault(id(sub), name[len("model."):] if name.startswith("model.") else
                             "" if name == "model" else name)
    done, initialised = set(), set()
    with torch.no_grad():
        for root in roots:
            for _, sub in _post_order(root, ""):
                if id(sub) in done:
                    continue
                done.add(id(sub))
                _init_one(sub, init_fn, _module_seed(seed, names[id(sub)]), initialised)


def _post_order(module: nn.Module, prefix: str):
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _module_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_one(module: nn.Module, init_fn, seed: int, initialised: set) -> None:
    """A tied weight keeps the values of the first module holding it (the embedding,
    before the head that shares it): the same on a pipeline, where the head's rank
    receives the first stage's copy."""
    own = {n: p for n, p in module.named_parameters(recurse=False)}
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset) and init_fn is None:
        return
    whole = {n: torch.empty(p.shape, dtype=p.dtype, device=_device_of(p)) for n, p in own.items()}
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
    for n, p in own.items():
        if id(p) not in initialised:
            initialised.add(id(p))
            _keep_my_shard(p, whole[n])


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
