"""Start from pretrained weights (`train.py --init-from`): a safetensors file, or a
Hugging Face checkpoint folder (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`), loaded into this rank's shards under any plan.

Tensor by tensor: each is read from the memory-mapped file (safetensors), made this
rank's local piece of the parameter's layout (a slice for tp / FSDP2 shards, the
whole for a replica) and copied in, so no host ever holds more than one tensor of
the model at a time. Names are the model's own (`state_dict()`); a tensor the file
holds under another name of a tied pair is found under either. A parameter the file
lacks, or of another shape, is refused by name before anything is copied.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch

from autopar.errors import AutoparError


def _sources(spec: str) -> dict[str, str]:
    """{tensor name: safetensors file} of `spec`: "safetensors:FILE", "hf:DIR", or a path."""
    kind, _, path = spec.partition(":") if spec.split(":", 1)[0] in ("hf", "safetensors") else ("", "", spec)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            return {name: os.path.join(path, file) for name, file in weight_map.items()}
        path = os.path.join(path, "model.safetensors")
    if not os.path.isfile(path):
        raise AutoparError(f"--init-from {spec}: no safetensors file there",
                           hint="a .safetensors file, or a Hugging Face folder holding model.safetensors "
                                "(or its shards and model.safetensors.index.json)")
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        return {name: path for name in f.keys()}


def load_pretrained(pm, spec: str) -> int:
    """Copy the weights of `spec` into this rank's parameters and persistent buffers
    (every rank calls it; no collective). Returns how many tensors were loaded."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Replicate

    from autopar.lower import state_dict as lsd

    sources = _sources(spec)
    by_alias = {**pm.tied_aliases, **{to: a for a, to in pm.tied_aliases.items()}}
    missing = [n for n in sorted(pm._holders) if n not in sources and by_alias.get(n) not in sources]
    if missing:
        raise AutoparError(f"--init-from {spec} lacks {len(missing)} of the model's parameters: "
                           f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}",
                           hint="is it a checkpoint of this model? its names must be the model's state_dict() names")
    local = lsd.local_tensors(pm, pm._holders)
    local.update(lsd.local_tensors(pm, pm._buffers))
    handles: dict[str, object] = {}
    loaded = 0
    with contextlib.ExitStack() as stack:
        for name, target in local.items():
            key = name if name in sources else by_alias.get(name)
            if key not in sources:
                continue  # a buffer the file does not hold: the model's own value stays
            file = sources[key]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            whole = handles[file].get_tensor(key)
            if tuple(whole.shape) != tuple(target.shape):
                raise AutoparError(f"--init-from {spec}: {key} is {list(whole.shape)}, this model's "
                                   f"{name} is {list(target.shape)}",
                                   hint="pretrained weights of the same model configuration")
            with torch.no_grad():
                if isinstance(target, DTensor):
                    replica = DTensor.from_local(whole.to(target.device), target.device_mesh,
                                                 [Replicate()] * target.device_mesh.ndim, run_check=False)
                    target.to_local().copy_(lsd.local_of(replica, list(target.placements)))
                else:
                    target.copy_(whole)
            loaded += 1
    return loaded
