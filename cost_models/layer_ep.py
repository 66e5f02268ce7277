"""One MoE layer under a layout with expert parallelism (Layout.ep > 1): how its
states, data-parallel traffic, time and activations differ from the dense price.

The layer's parameters split in two (capture's `expert_param_bytes` and
`dense_param_bytes`, autopar/capture/moe.py):

* the experts: experts / ep of them on each rank, their states sharded by
  ZeRO over the efsdp group (ep_fold_ranks / ep ranks, stride tp x ep: the ep
  group is the inner part of dp), their gathers and reduce-scatters over
  efsdp only (torchtitan's moe_sharding: `fully_shard(experts, mesh=efsdp)`
  beside the block's `fully_shard(block, mesh=dp)`);
* the rest (attention, router, shared experts, norms): as without ep, over dp.

On top of the dense price (cost_models/expert_parallel.py, which cites GShard,
DeepSpeed-MoE and Switch Transformer): four all-to-alls per micro-batch
(dispatch and combine forward, their gradients backward), blocking on the
compute stream as torchtitan's AllToAllTokenDispatcher and autopar's lowering
run them (booked inside fwd_s / bwd_s and shown as `ep_comm_s`); the busiest
rank computes `imbalance` x the mean rows, so its expert time grows by
(imbalance - 1) x the experts' share of the layer's time; the rows it received
are saved for backward (one more buffer of them per micro-batch in flight),
unless the block is recomputed whole ("full" checkpointing: it keeps only its
input, and its forward, all-to-alls included, runs again in backward).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models import comm as C
from cost_models.compute import fast
from cost_models.expert_parallel import DEFAULT_IMBALANCE, MoeLayerShape, ep_layer_cost, ep_placement
from cost_models.layer_comm import DpComm, dp_comm
from cost_models.memory import ModelStates, layer_states


def moe_layer(layer) -> bool:
    """The layer routes tokens to experts (capture recorded its MoE facts)."""
    a = layer.attrs or {}
    return bool(layer.ep_routed_tokens) and a.get("experts", 0) > 1 and a.get("expert_param_bytes", 0) > 0


def expert_share(layer) -> float:
    """The experts' fraction of the layer's parameters (bytes as captured)."""
    a = layer.attrs
    total = a["expert_param_bytes"] + a["dense_param_bytes"]
    return a["expert_param_bytes"] / total if total else 0.0


def efsdp_layout(layout):
    """The layout the experts' states and gathers see: data parallelism of efsdp ranks."""
    return replace(layout, dp=layout.efsdp, dp_shard=None, ep=1)


def efsdp_placement(layout, cluster) -> C.GroupPlacement:
    """Rank 0's efsdp group: every ep-th dp rank (stride tp x ep), as HSDP's replica group
    of shard size ep lies."""
    place = C.group_placement("dp_replicate", layout.tp, layout.dp, layout.pp, cluster, layout.ep)
    return replace(place, axis="efsdp")


@dataclass
class EpParts:
    states: ModelStates
    dp: DpComm
    opt_params: float  # parameters this rank's optimizer steps
    held_params: float  # before ZeRO sharding: the dense part and experts / ep (what FSDP gathers)
    fwd_extra_s: float  # all-to-alls + the busiest rank's extra expert compute, per micro-batch
    bwd_extra_s: float
    comm_s: float  # the four all-to-alls, per micro-batch
    comm_bytes: float  # this rank's send buffers of the four, per micro-batch
    activation_bytes: float  # received rows saved for backward, per micro-batch
    tier: str


def ep_parts(layer, model, layout, cluster, zero, offload, params_local, fwd_s, bwd_s, bwd_window,
             byte_scale) -> EpParts:
    """States, dp traffic and ep time of an MoE layer under layout.ep > 1 (tp divides it
    as it divides the layer; dense part over dp, experts over efsdp)."""
    experts_local = params_local * expert_share(layer)
    dense_local = params_local - experts_local
    dense, sb = layer_states(dense_local, layout, zero, offload)
    efsdp = efsdp_layout(layout)
    expert, _ = layer_states(experts_local / layout.ep, efsdp, zero, offload)
    states = ModelStates(dense.params + expert.params, dense.grads + expert.grads,
                         dense.optimizer + expert.optimizer, dense.host + expert.host)
    traffic = dp_comm(layer, layout, cluster, zero, offload, dense_local, sb, fwd_s, bwd_window)
    e_traffic = dp_comm(replace(layer, attrs={}), efsdp, cluster, zero, offload, experts_local / layout.ep, sb,
                        fwd_s, bwd_window, place=efsdp_placement(layout, cluster))
    # the dense and expert units overlap with the same layer's compute: their exposures add
    # (at most what two back-to-back units would leave exposed)
    traffic.collectives = list(traffic.collectives) + [(k, n, t) for k, n, t in e_traffic.collectives]
    for f in ("fwd_exposed_s", "bwd_exposed_s", "step_exposed_s", "contention_s"):
        setattr(traffic, f, getattr(traffic, f) + getattr(e_traffic, f))
    sharded = lambda n, lay: n / (lay.shard_ranks if zero >= 1 else 1)  # noqa: E731
    opt_params = sharded(dense_local, layout) + sharded(experts_local / layout.ep, efsdp)
    shape = _shape(layer, layout, model, byte_scale)
    cost = ep_layer_cost(shape, layout.ep, cluster, tp=layout.tp, imbalance=DEFAULT_IMBALANCE,
                         place=ep_placement(layout.ep, layout.tp, cluster))
    hot = DEFAULT_IMBALANCE - 1.0
    b, s1 = layout.micro_batch_size, model.seq_len or 1
    fwd_share = _share(fast(layer.ep_expert_fwd_flops)(b, s1), fast(layer.fwd_flops)(b, s1))
    bwd_share = _share(fast(layer.ep_expert_bwd_flops)(b, s1), fast(layer.bwd_flops)(b, s1))
    return EpParts(states, traffic, opt_params, dense_local + experts_local / layout.ep, cost.fwd_comm_s + hot * fwd_share * fwd_s,
                   cost.bwd_comm_s + hot * bwd_share * bwd_s, cost.comm_s, 4 * cost.send_bytes,
                   cost.routed_bytes_per_rank, ep_placement(layout.ep, layout.tp, cluster).tier)


def _share(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0


def _shape(layer, layout, model, byte_scale) -> MoeLayerShape:
    a, b, s1 = layer.attrs, layout.micro_batch_size, model.seq_len or 1
    return MoeLayerShape(experts=a["experts"], top_k=a["top_k"], hidden=a["moe_hidden"],
                         tokens=fast(layer.ep_routed_tokens)(b, s1) / a["top_k"],
                         dtype_bytes=(model.dtype_bytes or 2) * byte_scale,
                         expert_param_bytes=a["expert_param_bytes"], dense_param_bytes=a["dense_param_bytes"],
                         expert_fwd_flops=fast(layer.ep_expert_fwd_flops)(b, s1),
                         expert_bwd_flops=fast(layer.ep_expert_bwd_flops)(b, s1))
