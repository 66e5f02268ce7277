"""Float8 training of a layer's nn.Linear GEMMs, as torchao runs it (Float8Linear,
tensorwise dynamic scaling: `convert_to_float8_training`, torchtitan's default
recipe) inside a compiled block.

What one converted Linear does per micro-batch (torchao/float8/float8_linear.py,
`matmul_with_hp_or_float8_args`): its three GEMMs (output, input gradient, weight
gradient) run as `torch._scaled_mm` on float8 operands at the device's float8 rate,
and each operand is cast from the high-precision tensor just before, with a scale
from the tensor's absolute maximum. Under torch.compile a cast is two kernels, the
amax reduction (reads the tensor) and the scaled cast (reads it again, writes one
byte per element in the layout `_scaled_mm` wants). The forward casts the input
(M x K) and the weight (K x N); the backward casts the output gradient twice (one
layout per GEMM) after one amax, and the saved input and weight again (torchao
saves them in high precision, so activation memory is as in bf16). Nothing is
fitted: bytes over the device's bandwidth, launches at its launch floor, the GEMMs
at its float8 peak with the bf16 GEMM's own size efficiency. On a calibrated device
the bf16 GEMM is measured and the float8 one is that time scaled by the physics
ratio of the two (the profile times no float8 GEMM).

Under tensor parallelism a tensorwise scale is one number for the whole tensor: the
amax of a sharded operand is all-reduced over the tp group (one 4-byte all-reduce,
latency-bound) before its cast: for a column-parallel Linear the weight in forward,
the output gradient twice and the weight in backward; for a row-parallel one the
input and the weight in forward, the weight and the input in backward.

Where FSDP2 shards the layer (ZeRO >= 2 over dp > 1, no tp), it all-gathers the converted
weights in float8 (torchao's float8 all-gather: one byte per element on the wire
instead of the training dtype's; `weight_elements`), their scales computed in one
all-reduce per step after the optimizer (not priced: one small collective). The
casts are still priced on the whole weight (the lowering casts each shard before the
all-gather: a little less).
"""
from __future__ import annotations

import dataclasses

from cost_models.compute import ITEMSIZE, fast, gemm_dims, op_times, splits_columns
from cost_models.workload import LayerSpec, OpSpec

FP8 = "fp8"
ALIGN = 16  # torch._scaled_mm: each operand's dims multiples of 16
CAST_KERNELS = (4, 7)  # forward: amax + cast of input and weight; backward: 1 + 2 for the gradient, 2 + 2


def device_runs_float8(device) -> bool:
    """Whether the device has float8 tensor cores (a float8 peak in its profile)."""
    return float(device.peak_flops.get(FP8, 0) or 0) > 0


def _aligned(x: float) -> bool:
    return abs(x - round(x)) < 1e-9 and round(x) % ALIGN == 0


def converts(op: OpSpec, batch: int, seq, gemm_split: int) -> bool:
    """Whether torchao can run this op in float8 on each rank: the forward GEMM of an
    nn.Linear, run by the Linear's own forward, whose local weight (after a tp split)
    has both dims multiples of 16."""
    if not op.linear or op.gemm is None or (gemm_split > 1 and op.tp_pieces > 1):
        return False  # (a piecewise split runs its own GEMM, not the Linear's forward)
    _, n, k, _ = gemm_dims(op, batch, seq if seq is not None else 1, gemm_split)
    return _aligned(n) and _aligned(k)


def converted_ops(layer: LayerSpec, batch: int, seq, tp: int) -> list[OpSpec]:
    """The ops of `layer` that run in float8 when the layer does (tp: its tp degree)."""
    return [op for op in layer.ops if converts(op, batch, seq, tp if op.tp_sharded else 1)]


def linear_paths(layer: LayerSpec, batch: int, seq, tp: int) -> list[str]:
    """Module paths (in the user's model) of the nn.Linears a float8 layer converts."""
    paths = []
    for op in converted_ops(layer, batch, seq, tp):
        rel = op.name.rpartition(":")[0] if ":" in op.name else op.name  # a hand-written model's op: its name
        prefix = layer.op_prefix
        path = prefix if rel == "." else f"{prefix}.{rel}" if prefix else rel
        if path not in paths:
            paths.append(path)
    return paths


_PHYSICS: dict = {}  # id(device) -> (device, the same device without its measured tables)


def _physics(device):
    hit = _PHYSICS.get(id(device))
    if hit is None or hit[0] is not device:
        if len(_PHYSICS) > 64:
            _PHYSICS.clear()
        hit = _PHYSICS[id(device)] = (device, dataclasses.replace(device, measured=None))
    return hit[1]


def linear_times(op: OpSpec, batch: int, seq, device, *, hp: str, work_divisor: float, byte_scale: float,
                 gemm_split: int) -> tuple[float, float]:
    """(forward s, backward s) of one converted Linear op for one micro-batch: its GEMMs at
    the float8 rate plus the casts (module docstring)."""
    kw = dict(work_divisor=work_divisor, byte_scale=byte_scale, gemm_split=gemm_split)
    f8_f, f8_b = op_times(op, batch, seq, _physics(device), dtype=FP8, **kw)
    if device.measured is not None:
        hp_f, hp_b = op_times(op, batch, seq, _physics(device), dtype=hp, **kw)
        meas_f, meas_b = op_times(op, batch, seq, device, dtype=hp, **kw)
        f8_f, f8_b = meas_f * f8_f / hp_f, meas_b * f8_b / hp_b
    cast_f, cast_b = cast_times(op, batch, seq, device, hp=hp, work_divisor=work_divisor, gemm_split=gemm_split)
    return f8_f + cast_f, f8_b + cast_b


def cast_times(op: OpSpec, batch: int, seq, device, *, hp: str, work_divisor: float,
               gemm_split: int) -> tuple[float, float]:
    """(forward s, backward s) of the float8 casts one converted Linear op runs."""
    s1 = seq if seq is not None else 1
    m, n, k, nb = gemm_dims(op, batch, s1, gemm_split)
    tokens = nb * m
    # identical calls folded into the op: its FLOPs count them all, the dims one call
    calls = max(1.0, fast(op.fwd_flops)(batch, s1) / work_divisor / max(1.0, 2 * tokens * n * k))
    h = ITEMSIZE.get(hp, 2)
    fwd_bytes = (2 * h + 1) * (tokens * k + k * n)
    bwd_bytes = (3 * h + 2) * tokens * n + (2 * h + 1) * (tokens * k + k * n)
    hbm = device.memory_bandwidth * device.memory_efficiency
    launch = device.kernel_launch_s
    return (calls * max(fwd_bytes / hbm, CAST_KERNELS[0] * launch),
            calls * max(bwd_bytes / hbm, CAST_KERNELS[1] * launch))


def weight_elements(layer: LayerSpec, batch: int, seq, tp: int) -> float:
    """Elements of the converted Linears' weights one tp rank holds: what FSDP2 all-gathers
    in float8 when it shards them (one byte each instead of the training dtype's)."""
    s1 = seq if seq is not None else 1
    total = 0.0
    for op in converted_ops(layer, batch, seq, tp):
        _, n, k, _ = gemm_dims(op, batch, s1, tp if op.tp_sharded else 1)
        total += n * k
    return total


def amax_all_reduces(layer: LayerSpec, batch: int, seq, tp: int) -> list[tuple]:
    """The scalar all-reduces tensorwise scaling adds under tp > 1, as
    `layer_comm.tp_collectives` lists collectives: (kind, bytes, phase)."""
    if tp <= 1:
        return []
    out = []
    s1 = seq if seq is not None else 1
    for op in converted_ops(layer, batch, seq, tp):
        if not op.tp_sharded:
            continue  # a replicated weight and input: every amax is local
        _, n, k, _ = gemm_dims(op, batch, s1, 1)
        fwd, bwd = (1, 3) if splits_columns(op, n, k) else (2, 2)
        calls = max(1, op.count)
        out += [("all_reduce", 4, "fwd")] * (fwd * calls) + [("all_reduce", 4, "bwd")] * (bwd * calls)
    return out
