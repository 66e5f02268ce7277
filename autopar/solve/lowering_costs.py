"""Price tensor parallelism as the lowering runs it.

Capture infers a block's tensor-parallel communication from its dataflow
(`LayerSpec.tp_allreduces`, `tp_gather_bytes`: Megatron's two all-reduces,
plus a gather where the model cuts a sharded dim). The lowering check
(`autopar.lower.what_runs`) runs one block of each kind split over a fake
process group and counts what DTensor really issues, redistributions
included: GPT's fused-qkv block, for one, gathers q/k/v forward and issues
three all-gathers more in backward, not the single reduce-scatter the
dataflow suggests. `charge_tp_collectives` copies those counts onto the
layers (`LayerSpec.tp_collectives`), so the search prices what will run;
`keep_whole` prices the embedding / head layers the lowering leaves whole
as whole.
"""
from __future__ import annotations

import copy


def parse_collectives(text: str, phase: str) -> tuple:
    """"all_gather 3, all_reduce 1" -> (("all_gather", 3.0, phase), ("all_reduce", 1.0, phase))."""
    items = [item.split() for item in text.split(",") if item.strip()]
    return tuple((kind, float(ratio), phase) for kind, ratio in items)


def charge_tp_collectives(spec, lowering_limits: dict | None):
    """`spec` with each checked kind of block's collectives set on every layer of
    that kind (the same LayerSpec.signature as the block the check ran; copies,
    the input is not touched). Unchanged when the lowering was not checked."""
    found = (lowering_limits or {}).get("tp_collectives") if (lowering_limits or {}).get("checked") else None
    if not found:
        return spec
    by_key: dict = {}  # a layer's signature (or its path when it has none) -> {tp: {variant: collectives}}
    for tp, variants in found.items():
        for variant, groups in variants.items():
            for group in groups:
                rep = next((l for l in spec.layers if (l.module_paths or [l.name])[0] == group["block"]), None)
                if rep is None:
                    continue
                issued = parse_collectives(group["fwd"], "fwd") + parse_collectives(group["bwd"], "bwd")
                key = rep.signature or rep.name
                by_key.setdefault(key, {}).setdefault(str(tp), {})[variant] = issued
    layers = []
    for layer in spec.layers:
        issued = by_key.get(layer.signature or layer.name)
        if issued is None:
            layers.append(layer)
            continue
        charged = copy.copy(layer)
        charged.tp_collectives = issued
        layers.append(charged)
    out = copy.copy(spec)
    out.layers = layers
    return out


def keep_whole(spec, lowering_limits: dict | None):
    """`spec` with the layers the lowering leaves whole under tp
    (lowering_limits["runs_whole"]: a head read by weight, its tied embedding)
    priced whole: their tp degrees are (1,), so the search prices and the plan
    records them replicated, as they run. Copies; unchanged when unchecked."""
    whole = (lowering_limits or {}).get("runs_whole") if (lowering_limits or {}).get("checked") else None
    if not whole:
        return spec
    layers = []
    for layer in spec.layers:
        if layer.name in whole:
            layer = copy.copy(layer)
            layer.tp_degrees = (1,)
        layers.append(layer)
    out = copy.copy(spec)
    out.layers = layers
    return out
