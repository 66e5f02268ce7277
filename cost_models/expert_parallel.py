"""Expert parallelism (ep): the price of one MoE layer with its experts split over ep ranks.

What moves. Each rank routes its own tokens; every (token, choice) row goes to
the rank holding the chosen expert and its output comes back (GShard,
Lepikhin et al. 2020, arXiv:2006.16668, section 2.2: "dispatch" and "combine"
all-to-alls; DeepSpeed-MoE, Rajbhandari et al. 2022, arXiv:2201.05596,
section 5: one all-to-all before and one after the experts; torchtitan's
AllToAllTokenDispatcher, torchtitan/models/common/token_dispatcher.py, and
autopar/lower/expert_parallel.py, which runs it). One rank's send buffer per
all-to-all is

    tokens x top_k x hidden x bytes per element

(the issue's "2 x tokens x top-k x hidden per direction": 2 bytes in bf16),
in each direction: dispatch and combine forward, their gradients backward,
four all-to-alls per layer per micro-batch. comm.py prices an all-to-all of
that send buffer over the ep group (the (n-1)/n of the rows that leave the
rank; a group across nodes drives one NIC per GPU).

Routing imbalance. Routers do not spread tokens evenly: the busiest rank
receives `imbalance` x the mean (max load / mean load, >= 1; Switch
Transformer, Fedus et al. 2021, arXiv:2101.03961, section 2.2, caps it with a
capacity factor of 1.0-1.25). The all-to-all ends when the busiest rank has
its rows, and that rank's experts compute imbalance x the mean rows, so both
the exchange and the expert compute of the step scale by it.

What ep divides. Each rank keeps experts / ep of the experts' weights (and
their gradients and optimizer states); the router and shared experts stay
whole. The expert FLOPs per rank do not shrink: ep is data parallelism for
everything else, and each rank's experts see, on average, as many rows as
its own tokens made (tokens x top_k).

Where the group lies: ep ranks sit just outside tp, the innermost part of dp
(torchtitan borrows ep from dp_shard x cp: `dp_shard x cp = efsdp x ep`), so
an ep group strides tp ranks, as a dp group of size ep does.

Layout.ep prices it in every MoE layer's cost (cost_models/layer_ep.py), which the
planner's tables and `estimate` both read.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.comm import GroupPlacement, collective_time, group_placement
from cost_models.errors import CostModelError
from cost_models.hardware import ClusterSpec

ALL_TO_ALLS_PER_DIRECTION = 2  # dispatch and combine
# Busiest rank's rows / the mean when a layout does not say: the top of the capacity
# factors Switch Transformer trains with (Fedus et al. 2021, arXiv:2101.03961, section 2.2
# and Table 1: 1.0-1.25, its load-balancing loss keeping routing within them). An
# assumption, not a measurement of any run this project prices.
DEFAULT_IMBALANCE = 1.25


@dataclass(frozen=True)
class MoeLayerShape:
    """One MoE layer as capture records it (autopar/capture/moe.py): per micro-batch
    `tokens` on one rank, the expert GEMMs' FLOPs of those tokens (forward,
    backward), and the parameter bytes of the experts and of the rest."""

    experts: int
    top_k: int
    hidden: int
    tokens: float
    dtype_bytes: int
    expert_param_bytes: float
    dense_param_bytes: float
    expert_fwd_flops: float = 0.0
    expert_bwd_flops: float = 0.0

    @classmethod
    def from_layer(cls, layer, batch: int, seq: int | None, dtype_bytes: int) -> "MoeLayerShape":
        """A captured (or hand-written) LayerSpec at a micro-batch of `batch` samples."""
        a = layer.attrs
        missing = [k for k in ("experts", "top_k", "moe_hidden", "expert_param_bytes", "dense_param_bytes")
                   if k not in a]
        if missing or not layer.ep_routed_tokens:
            raise CostModelError(f"layer {layer.name} carries no MoE facts ({', '.join(missing) or 'ep_routed_tokens'})"
                                 f": capture records them for layers that route with top-k")
        return cls(experts=a["experts"], top_k=a["top_k"], hidden=a["moe_hidden"],
                   tokens=layer.eval("ep_routed_tokens", batch, seq) / a["top_k"], dtype_bytes=dtype_bytes,
                   expert_param_bytes=a["expert_param_bytes"], dense_param_bytes=a["dense_param_bytes"],
                   expert_fwd_flops=layer.eval("ep_expert_fwd_flops", batch, seq),
                   expert_bwd_flops=layer.eval("ep_expert_bwd_flops", batch, seq))


@dataclass(frozen=True)
class ExpertParallelCost:
    send_bytes: float  # one rank's send buffer of one all-to-all
    fwd_comm_s: float  # dispatch + combine
    bwd_comm_s: float  # their gradients
    param_bytes_per_rank: float  # this rank's experts and the whole dense part
    routed_bytes_per_rank: float  # rows received for the local experts (busiest rank), saved for backward
    expert_flops_per_rank: float  # forward + backward, busiest rank

    @property
    def comm_s(self) -> float:
        return self.fwd_comm_s + self.bwd_comm_s


def ep_placement(ep: int, tp: int, cluster: ClusterSpec) -> GroupPlacement:
    """The ep group of rank 0: ep ranks with stride tp (ep is the innermost part of dp)."""
    return replace(group_placement("dp", tp, ep, 1, cluster), axis="ep")


def dispatch_bytes(layer: MoeLayerShape) -> float:
    """One rank's send buffer of one all-to-all (GShard's dispatch): every token's
    hidden vector once per chosen expert."""
    return layer.tokens * layer.top_k * layer.hidden * layer.dtype_bytes


def ep_layer_cost(layer: MoeLayerShape, ep: int, cluster: ClusterSpec, *, tp: int = 1,
                  imbalance: float = 1.0, place: GroupPlacement | None = None) -> ExpertParallelCost:
    """One MoE layer's ep price for one micro-batch on one rank (the busiest)."""
    if ep < 1 or layer.experts % ep:
        raise CostModelError(f"ep={ep} must divide the layer's {layer.experts} experts")
    if imbalance < 1.0:
        raise CostModelError(f"routing imbalance {imbalance} is max load / mean load: at least 1")
    place = place or ep_placement(ep, tp, cluster)
    send = dispatch_bytes(layer)
    one = collective_time("all_to_all", send * imbalance, place, cluster) if ep > 1 else 0.0
    per_direction = ALL_TO_ALLS_PER_DIRECTION * one
    return ExpertParallelCost(
        send_bytes=send, fwd_comm_s=per_direction, bwd_comm_s=per_direction,
        param_bytes_per_rank=layer.expert_param_bytes / ep + layer.dense_param_bytes,
        routed_bytes_per_rank=send * imbalance if ep > 1 else 0.0,
        # with ep=1 every rank holds every expert: its own rows, no hot expert to wait for
        expert_flops_per_rank=(layer.expert_fwd_flops + layer.expert_bwd_flops) * (imbalance if ep > 1 else 1.0))
