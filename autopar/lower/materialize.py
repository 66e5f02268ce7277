"""Meta-device models become real one shard at a time.

Parallelisation (TP, FSDP) runs on meta parameters, so each rank only ever
allocates its own shards: `to_empty` gives every local shard storage, then
the model's own initialisation runs on the sharded DTensors: every module's
`reset_parameters` (the defaults its constructor applied), then a user
`init_fn` applied to every module like `nn.Module.apply` (the model's custom
init, e.g. GPT's normal(0.02); it also refills buffers such as RoPE tables). DTensor's random ops keep the sharded draws consistent
across ranks. A model built with real weights is never re-initialised: TP
and FSDP carve the local shards out of the weights every rank holds.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.errors import AutoparError


def has_meta(modules: list[nn.Module]) -> bool:
    return any(t.is_meta for m in modules for t in list(m.parameters()) + list(m.buffers()))


def materialize(modules: list[nn.Module], device: torch.device, init_fn=None) -> bool:
    """Returns True when the modules were on meta and have been initialised."""
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
    for m in modules:
        m.to_empty(device=device)
    seen = set()
    with torch.no_grad():
        for m in modules:
            for sub in m.modules():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                # As construction does: each module's own defaults first
                # (LayerNorm ones/zeros...), then the model's custom init.
                if callable(getattr(sub, "reset_parameters", None)):
                    sub.reset_parameters()
                if init_fn is not None:
                    init_fn(sub)
    return True
