"""One layer under one layout: `layer_cost`, the per-layer phases put together.

    compute        cost_models/layer_compute.py  forward, backward, recomputation, optimizer step
    communication  cost_models/layer_comm.py     tensor-parallel and data-parallel collectives
    overlap        cost_models/overlap.py        what of them hides behind the compute
    memory         cost_models/memory.py         model states, activations, transient buffers

The planner's per-layer tables and the final `estimate` (cost_models/estimate.py)
both read `layer_cost`, so they agree by construction. It is memoised on
everything it reads (cost_models/fingerprint.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cost_models.compute import fast
from cost_models.context_parallel import sharded_layer_cost
from cost_models.errors import CostModelError
from cost_models.fingerprint import layer_cost_key
from cost_models.float8 import converted_ops, device_runs_float8, weight_elements
from cost_models.hardware import ClusterSpec
from cost_models.layer_comm import dp_comm, tp_comm
from cost_models.layer_ep import ep_parts, moe_layer
from cost_models.layer_compute import layer_times, optimizer_step_s, recompute, tp_for
from cost_models.layout import Layout
from cost_models.memory import (activation_bytes, layer_states, loss_grad_bytes, optimizer_temp_bytes,
                                recompute_working_bytes)
from cost_models.workload import LayerSpec, ModelSpec

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass
class LayerCost:
    """One layer under one layout. Times are per micro-batch unless marked per step."""

    fwd_s: float
    bwd_s: float
    recompute_s: float  # extra forward work in backward (full: incl. its TP all-reduces)
    tp_comm_s: float  # forward + backward TP collectives, not overlapped
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # kept per micro-batch in flight
    dp_comm_s: float  # per step, all DP/FSDP collectives before overlap
    dp_comm_exposed_s: float  # per step, what compute does not hide
    # -- finer parts estimate() composes (same units as above) -------------
    tp_comm_fwd_s: float = 0.0
    tp_comm_bytes: float = 0.0  # per micro-batch, what this GPU sends in TP collectives (fwd + bwd)
    tp_calls: tuple = ()  # ((collective, calls per micro-batch), ...): what `tp_comm_s` prices
    dp_fwd_exposed_s: float = 0.0  # per micro-batch, FSDP all-gather not hidden by forward
    dp_bwd_exposed_s: float = 0.0  # per micro-batch, FSDP all-gather not hidden by backward
    dp_step_exposed_s: float = 0.0  # per step, gradient reduction etc. at the end of the step
    # per step, included in the exposed times above: compute slowed while hidden collectives
    # hold SMs (cost_models.comm.contention_s)
    nccl_contention_s: float = 0.0
    optimizer_s: float = 0.0  # per step
    working_bytes: float = 0.0  # transient: recomputed activations of this one layer in backward
    host_bytes: float = 0.0  # offloaded to CPU memory
    # DDP's buckets: a second copy of the gradients (torch DDP, gradient_as_bucket_view=False,
    # the default: "the saved memory size will be equal to the total gradients size")
    bucket_bytes: float = 0.0
    # alive only during the optimizer step: foreach Adam's temporary (section 4's second peak)
    optimizer_temp_bytes: float = 0.0
    # alive at the loss's first backward op: two logits-sized gradients (the layer with the loss)
    loss_grad_bytes: float = 0.0
    params_local: float = 0.0  # parameters this GPU holds before ZeRO sharding
    model_flops: float = 0.0  # per micro-batch per GPU, fwd + bwd, no recomputation
    recompute_flops: float = 0.0  # per micro-batch per GPU
    dp_collectives: tuple = ()  # ((collective, bytes per step, time per step), ...)
    dp_last_reduce_s: float = 0.0  # the gradient reduction issued after the last backward (issue_order.py)
    dp_bwd_gather_s: float = 0.0  # the all-gather each backward waits for (FSDP2)
    tier: dict = field(default_factory=dict)  # axis -> 'intra_node' | 'inter_node'
    float8: bool = False  # its nn.Linear GEMMs priced in float8 (cost_models/float8.py)
    # expert parallelism (layer_ep.py), per micro-batch: the four all-to-alls (inside fwd_s /
    # bwd_s, which they block) and what this rank sends in them
    ep_comm_s: float = 0.0
    ep_comm_bytes: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_s

    def to_dict(self) -> dict:
        return asdict(self)


_LAYER_CACHE: dict = {}


def layer_cost(layer: LayerSpec, model: ModelSpec, layout: Layout, cluster: ClusterSpec, *, zero: int | None = None,
               checkpoint: str | None = None, offload: str | None = None, float8: bool | None = None) -> LayerCost:
    """Cost of `layer` under `layout` on `cluster` (see LayerCost for units). `float8`:
    whether its Linears run in float8; None: as `layout.float8` decides (the faster)."""
    zero = layout.zero if zero is None else zero
    checkpoint = layout.checkpoint if checkpoint is None else checkpoint
    offload = layout.offload if offload is None else offload
    key = layer_cost_key(layer, model, layout, cluster, zero, checkpoint, offload, float8)
    hit = _LAYER_CACHE.get(key)
    if hit is not None:
        return hit
    if layout.cp > 1:  # one cp rank's share of the sequence, its attention over the ring
        cost = sharded_layer_cost(layer, model, layout, cluster, checkpoint=checkpoint, price=lambda m, l: layer_cost(
            layer, m, l, cluster, zero=zero, checkpoint=checkpoint, offload=offload, float8=float8))
    elif float8 is None and layout.float8 and _converts_any(layer, layout, model, cluster):
        # float8 changes the Linears' time, not what is held: the faster of the two
        cost = min((_layer_cost(layer, model, layout, cluster, zero, checkpoint, offload, f8) for f8 in (False, True)),
                   key=lambda c: c.fwd_s + c.bwd_s + c.recompute_s + c.tp_comm_s)
    else:
        cost = _layer_cost(layer, model, layout, cluster, zero, checkpoint, offload, bool(float8))
    if len(_LAYER_CACHE) > 200_000:
        _LAYER_CACHE.clear()
    _LAYER_CACHE[key] = cost
    return cost


def _converts_any(layer, layout, model, cluster) -> bool:
    return (device_runs_float8(cluster.device_profile)
            and bool(converted_ops(layer, layout.micro_batch_size, model.seq_len, tp_for(layer, layout.tp))))


def _layer_cost(layer, model, layout, cluster, zero, checkpoint, offload, float8) -> LayerCost:
    if zero not in (0, 1, 2, 3):
        raise CostModelError(f"zero must be 0-3, got {zero!r} for layer '{layer.name}'")
    device = cluster.device_profile
    byte_scale = DTYPE_BYTES[layout.precision] / (model.dtype_bytes or 2)
    b, seq = layout.micro_batch_size, model.seq_len
    s1 = seq or 1
    tp = tp_for(layer, layout.tp)
    sp = layout.sequence_parallel and tp > 1

    float8 = float8 and device_runs_float8(device)
    fwd_s, bwd_s, parts = layer_times(layer, layout, device, seq, zero, tp, sp, byte_scale, float8)
    tpc = tp_comm(layer, layout, cluster, tp, b, s1, byte_scale, sp, parts["gemm_fwd"], float8)
    recompute_s, recompute_flops = recompute(layer, checkpoint, fwd_s, tpc.fwd_s, parts, b, s1, tp)

    # Parameters of a layer tensor parallelism splits are divided by tp
    # (norm weights, replicated, are a rounding error of a block).
    params_local = layer.params / tp
    states, state_bytes = layer_states(params_local, layout, zero, offload)
    act = activation_bytes(layer, b, seq, tp=tp, sequence_parallel=sp, checkpoint=checkpoint, byte_scale=byte_scale)
    working = recompute_working_bytes(layer, b, seq, tp=tp, sequence_parallel=sp, checkpoint=checkpoint,
                                      byte_scale=byte_scale)
    # FSDP2 all-gathers float8 weights in float8 without tp (autopar/lower/float8.py: gathers_in_float8)
    float8_params = weight_elements(layer, b, seq, tp) if float8 and layout.tp == 1 else 0.0
    dp = dp_comm(layer, layout, cluster, zero, offload, params_local, state_bytes, fwd_s, bwd_s + recompute_s,
                 float8_params)
    opt_params = params_local / (layout.shard_ranks if zero >= 1 else 1)
    ep = ep_parts(layer, model, layout, cluster, zero, offload, params_local, fwd_s, bwd_s, bwd_s + recompute_s,
                  byte_scale) if layout.ep > 1 and moe_layer(layer) else None
    if ep is not None:  # experts / ep on this rank, sharded over efsdp; four all-to-alls
        states, dp, opt_params, params_local = ep.states, ep.dp, ep.opt_params, ep.held_params
        fwd_s, bwd_s = fwd_s + ep.fwd_extra_s, bwd_s + ep.bwd_extra_s
        if checkpoint == "full":  # the block's forward runs again in backward, its all-to-alls too
            recompute_s += ep.fwd_extra_s
        else:  # the received rows are the expert GEMMs' saved input
            act += ep.activation_bytes
    m = layout.num_micro_batches
    return LayerCost(
        fwd_s=fwd_s, bwd_s=bwd_s, recompute_s=recompute_s, tp_comm_s=tpc.fwd_s + tpc.bwd_s,
        param_bytes=states.params, grad_bytes=states.grads, optimizer_bytes=states.optimizer,
        activation_bytes=act, dp_comm_s=sum(t for _, _, t in dp.collectives),
        dp_comm_exposed_s=m * (dp.fwd_exposed_s + dp.bwd_exposed_s) + dp.step_exposed_s,
        tp_comm_fwd_s=tpc.fwd_s, tp_comm_bytes=tpc.bytes, tp_calls=tpc.calls,
        dp_fwd_exposed_s=dp.fwd_exposed_s, dp_bwd_exposed_s=dp.bwd_exposed_s, dp_step_exposed_s=dp.step_exposed_s,
        nccl_contention_s=dp.contention_s,
        optimizer_s=optimizer_step_s(layer, layout, cluster, zero, offload, tp, opt_params, state_bytes),
        working_bytes=working, host_bytes=states.host, params_local=params_local,
        bucket_bytes=states.grads if zero == 0 and layout.dp > 1 else 0.0,
        optimizer_temp_bytes=optimizer_temp_bytes(layout, device, opt_params, offload),
        loss_grad_bytes=loss_grad_bytes(layer, b, s1, byte_scale, tp),
        model_flops=3 * fast(layer.fwd_flops)(b, s1) / tp, recompute_flops=recompute_flops,
        dp_collectives=tuple(dp.collectives), dp_last_reduce_s=dp.last_reduce_s, dp_bwd_gather_s=dp.bwd_gather_s,
        tier={"tp": tpc.place.tier, "dp": dp.place.tier,
                                                      **({"dp_replicate": dp.replica_place.tier}
                                                         if dp.replica_place else {}),
                                                      **({"ep": ep.tier} if ep else {})}, float8=float8,
        ep_comm_s=ep.comm_s if ep else 0.0, ep_comm_bytes=ep.comm_bytes if ep else 0.0,
    )
