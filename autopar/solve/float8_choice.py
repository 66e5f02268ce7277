"""Float8 Linears (`autopar plan --compile --float8`): refused where the device has no
float8 tensor cores, and the plan's account of which layers run them and why the
others do not.

Which layers run float8 is the cost model's decision (cost_models/float8.py,
`layer_cost` with `Layout.float8`: the faster of the two for each layer at the
candidate's shapes), so the search weighs it with everything else; the Plan keeps
the converted Linears per layer (`LayerChoice.float8`) and this says why a layer
holding Linears kept bf16.
"""
from __future__ import annotations

from cost_models.float8 import converted_ops, device_runs_float8
from cost_models.layer_compute import tp_for

from autopar.errors import AutoparError


def check_device(engine, cluster) -> None:
    """Refuse float8 before searching on a device without float8 tensor cores."""
    device = cluster.device_profile
    if engine.float8 and not device_runs_float8(device):
        raise AutoparError(
            f"--float8: {device.name} has no float8 tensor cores (its profile lists no fp8 peak), so float8 "
            f"GEMMs would run no faster than bf16 ones, or not at all",
            hint="drop --float8, or plan for an H100, H200, B200 or L40S (--device)")


def account(spec, plan) -> dict:
    """What `Plan.assumptions["float8"]` says: the layers and Linears in float8, and for
    each layer with Linears that kept bf16, why."""
    b, seq, tp = plan.micro_batch_size, spec.seq_len, plan.mesh.tp
    kept = {}
    for layer, choice in zip(spec.layers, plan.layer_choices):
        linears = [op for op in layer.ops if op.linear]
        if choice.float8 or not linears:
            continue
        layer_tp = tp_for(layer, tp)
        if not converted_ops(layer, b, seq, layer_tp):
            kept[layer.name] = (
                "its Linears' local weights are not multiples of 16 in both dims (torch._scaled_mm)"
                if all(op.tp_pieces <= 1 or layer_tp == 1 for op in linears)
                else "its fused projection is split piecewise under tp and runs its own GEMM")
        else:
            kept[layer.name] = "slower in float8 at its shapes: the casts (and under tp, the scales' all-reduces) " \
                               "cost more than the float8 GEMMs save"
    return {"layers": sum(1 for c in plan.layer_choices if c.float8),
            "linears": sum(len(c.float8) for c in plan.layer_choices),
            "recipe": "torchao Float8Linear, tensorwise dynamic scaling, compiled blocks",
            **({"kept_bf16": kept} if kept else {})}
