"""Collective communication: alpha-beta times on a two-tier topology.

Sizes follow nccl-tests (PERFORMANCE.md): `nbytes` is the full buffer (the
all-reduce buffer, the gathered output of an all-gather, the input of a
reduce-scatter, one rank's send buffer of an all-to-all). With bus bandwidth
B and n ranks, the ring formulas are

    all-reduce            t = 2 (n-1)/n * S / B + 2 (n-1) alpha
    all-gather, reduce-scatter, all-to-all
                          t =   (n-1)/n * S / B +   (n-1) alpha
    broadcast             t = S / B + (n-1) alpha      (pipelined chain)
    point-to-point        t = S / B_link + alpha

and, for groups that span nodes, a double-binary tree all-reduce, t = 2 S / B +
2 ceil(log2 n) alpha, wins for small messages on many ranks; NCCL picks the
faster, so do we. Inside one node NCCL runs rings (trees span nodes).

Placement: mesh axes are laid out tp innermost, then dp, then pp, and ranks
are numbered node-major (ranks 0..g-1 on node 0). Under HSDP the dp axis is
dp_replicate x dp_shard with the shard group inner: a shard group is dp_shard
neighbouring tp slabs (one node when dp_shard x tp <= GPUs per node), a
replicate group strides over them (one member per shard group, across nodes). A group inside one node
runs at the intra-node link's bus bandwidth. A group that spans nodes pays
the network: each GPU has its own NIC (one rail per GPU, as in DGX / HGX
nodes), so a group with r members per node drives r rails at once and its
bus bandwidth is min(intra-node busbw, r x per-GPU network busbw).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from cost_models import nccl
from cost_models.congestion import network_share
from cost_models.errors import CostModelError
from cost_models.hardware import ClusterSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")


@dataclass(frozen=True)
class GroupPlacement:
    """Where one process group of a mesh axis lands on the cluster."""

    axis: str
    size: int
    nodes_spanned: int
    ranks_per_node: int  # members of the group on each node it touches

    @property
    def tier(self) -> str:
        return "intra_node" if self.nodes_spanned <= 1 else "inter_node"


AXES = ("tp", "dp", "pp", "dp_shard", "dp_replicate")


@lru_cache(maxsize=4096)
def _placement(axis: str, tp: int, dp: int, pp: int, gpus_per_node: int, shard: int) -> GroupPlacement:
    stride = {"tp": 1, "dp": tp, "pp": tp * dp, "dp_shard": tp, "dp_replicate": tp * shard}[axis]
    size = {"tp": tp, "dp": dp, "pp": pp, "dp_shard": shard, "dp_replicate": dp // shard}[axis]
    ranks = [i * stride for i in range(size)]  # the group of rank 0; others are translates
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
    return GroupPlacement(axis, size, len(nodes), max(nodes.values()))


def group_placement(axis: str, tp: int, dp: int, pp: int, cluster: ClusterSpec,
                    dp_shard: int | None = None) -> GroupPlacement:
    """Where rank 0's group of `axis` lands; `dp_shard` (HSDP's shard group size, None:
    the whole dp) places the dp_shard and dp_replicate groups."""
    if axis not in AXES:
        raise CostModelError(f"unknown mesh axis '{axis}' ({', '.join(AXES)})")
    return _placement(axis, tp, dp, pp, cluster.gpus_per_node, dp_shard or dp)


def bus_bandwidth(place: GroupPlacement, cluster: ClusterSpec) -> tuple[float, float]:
    """(bus bandwidth B/s, per-step latency s) a ring over this group reaches."""
    intra = cluster.intra_link
    if place.nodes_spanned <= 1:
        return intra.bus_bandwidth, intra.latency_s
    inter = cluster.inter_link
    # every group of the axis at once: past a leaf, its uplinks' share (cost_models/congestion.py)
    share = 1.0 if cluster.topology is None else network_share(place.nodes_spanned, cluster.gpus_per_node,
                                                                 cluster.topology)
    return min(intra.bus_bandwidth, place.ranks_per_node * inter.bus_bandwidth * share), inter.latency_s


def collective_time(kind: str, nbytes: float, place: GroupPlacement, cluster: ClusterSpec) -> float:
    """Seconds for one collective of `nbytes` (nccl-tests size convention) over `place`."""
    n = place.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = cluster.intra_link if place.nodes_spanned <= 1 else cluster.inter_link
    if link.measured is not None:  # timed on this machine by autopar calibrate
        measured = link.measured.time(kind, n, nbytes)
        if measured is not None:
            return measured
    bw, alpha = bus_bandwidth(place, cluster)
    if place.nodes_spanned > 1 and kind in ("all_reduce", "all_gather", "reduce_scatter"):
        gpu = _nccl_setup(cluster)
        if gpu is not None:  # across nodes: NCCL's own model picks ring / tree / PAT and LL / LL128 / Simple
            return nccl.choose(kind, float(nbytes), n, place.nodes_spanned, bw, *gpu)[0]
    if kind == "all_reduce":
        # Inside a node NCCL runs rings (or NVLS), not trees: its double binary tree
        # spans nodes, with a chain inside each. Measured: 8 x H200, torch all_reduce
        # takes 40 us at 32 KiB and 46 us at 1 MiB (stas00/ml-engineering
        # network/benchmarks/results/all-reduce-8xH200.md), as the ring's 14 steps of
        # 3 us give; a tree's 6 steps would say 18 us. NCCL's own model (cost_models/
        # nccl.py) says 15 us at 32 KiB: it leaves out the launch and torch's dispatch,
        # which that measurement holds, so inside a node the measured step stays.
        ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
        if place.nodes_spanned <= 1:
            return ring
        tree = 2 * nbytes / bw + 2 * math.ceil(math.log2(n)) * alpha
        return min(ring, tree)
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha
    if kind == "all_to_all":
        if place.nodes_spanned > 1:
            # The share bound for other nodes leaves through this GPU's own NIC.
            r = place.ranks_per_node
            share = network_share(place.nodes_spanned, cluster.gpus_per_node, cluster.topology)
            cross = (n - r) / n * nbytes / (cluster.inter_link.bus_bandwidth * share)
            local = (r - 1) / n * nbytes / cluster.intra_link.bus_bandwidth
            return max(cross, local) + (n - 1) * alpha
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha
    if kind == "broadcast":
        return nbytes / bw + (n - 1) * alpha
    if kind == "p2p":
        return p2p_time(nbytes, place.nodes_spanned <= 1, cluster)
    raise CostModelError(f"unknown collective '{kind}' (known: {', '.join(COLLECTIVES)})")


def p2p_time(nbytes: float, same_node: bool, cluster: ClusterSpec) -> float:
    """One point-to-point send of `nbytes` between two GPUs."""
    if nbytes <= 0:
        return 0.0
    link = cluster.intra_link if same_node else cluster.inter_link
    if link.measured is not None:
        measured = link.measured.time("p2p", 2, nbytes)
        if measured is not None:
            return measured
    gpu = None if same_node else _nccl_setup(cluster)
    if gpu is not None:
        # NCCL's LL protocol below its P2P LL threshold (half the link's bandwidth), Simple above
        proto = nccl.LL if nbytes <= nccl.P2P_LL_THRESHOLD else nccl.SIMPLE
        bw = link.bus_bandwidth * (.5 if proto == nccl.LL else 1.0)
        return nbytes / bw + nccl.p2p_us(proto, gpu[2]) * 1e-6
    return nbytes / link.bus_bandwidth + link.latency_s


def _nccl_setup(cluster: ClusterSpec) -> tuple[str, bool, float] | None:
    """(NCCL's intra-node tier, compute capability >= 8.0, the fabric's latency beyond
    InfiniBand's in us) for pricing groups across nodes
    with NCCL's model (cost_models/nccl.py); None on gloo (the cpu profile), which keeps the
    link's alpha-beta. The tier is tuning.cc's intraHw: NVLink (AMD's xGMI alike) or PCI.
    Memoised on the cluster by what it depends on (the pricing's hot path)."""
    key = (cluster.device, cluster.intra_node_link, cluster.inter_node_link, len(cluster.links))
    memo = cluster.__dict__.get("_nccl_memo")
    if memo is None or memo[0] != key:
        gpu = cluster.device_profile.vendor != "cpu"
        tier = "pci" if cluster.intra_node_link.startswith("pcie") else "nvlink"
        memo = (key, (tier, nccl.generation_at_least_ampere(cluster.device),
                      nccl.fabric_extra_us(cluster.inter_link.latency_s)) if gpu else None)
        cluster.__dict__["_nccl_memo"] = memo
    return memo[1]


def pp_neighbours_same_node(tp: int, dp: int, cluster: ClusterSpec) -> bool:
    """Adjacent pipeline ranks are tp*dp ranks apart: same node only if that fits."""
    return tp * dp < cluster.gpus_per_node and cluster.gpus_per_node % (tp * dp) == 0


# How much of each collective hides behind compute (see docs/cost_model.md).
# TP all-reduces sit on the critical path between dependent GEMMs: none hidden.
TP_OVERLAP = 0.0
# DDP / ZeRO-1/2 gradient buckets reduce while backward continues on earlier
# layers; the last bucket (the first layers' gradients, computed last) cannot
# hide, so 80% of the backward window is usable.
GRAD_REDUCE_OVERLAP = 0.8
# FSDP prefetches the next layer's all-gather during this layer's compute;
# the first layer's gather is exposed (added separately).
FSDP_PREFETCH_OVERLAP = 0.9


# What a hidden collective still costs: NCCL runs one thread block (CTA) per
# channel, and a channel's CTA holds its SM for the whole collective, never
# sharing it with compute kernels (NCCL maintainers, NVIDIA/nccl#689). NCCL
# opens the fewest channels that reach the platform's bandwidth: 2 per NIC
# (NVIDIA/nccl#438), 16 SMs on a DGX with 8 NICs at ~190 GB/s (#689), i.e.
# about one SM per 12 GB/s of bus bandwidth, and never more than 32
# (NCCL_MAX_NCHANNELS' default). Compute that overlaps the collective runs on
# the remaining SMs. Gloo (the cpu profile) runs on host threads: no SMs taken.
NCCL_BUS_BYTES_PER_SM = 12e9
NCCL_MIN_CHANNELS = 2
NCCL_MAX_CHANNELS = 32


def nccl_sm_fraction(place: GroupPlacement, cluster: ClusterSpec) -> float:
    """Share of a GPU's SMs NCCL holds while a collective over `place` runs."""
    device = cluster.device_profile
    if place.size <= 1 or device.vendor == "cpu" or device.num_sms <= 0:
        return 0.0
    bw, _ = bus_bandwidth(place, cluster)
    channels = min(NCCL_MAX_CHANNELS, max(NCCL_MIN_CHANNELS, math.ceil(bw / NCCL_BUS_BYTES_PER_SM)))
    return min(channels / device.num_sms, 0.5)


def contention_s(hidden_s: float, place: GroupPlacement, cluster: ClusterSpec) -> float:
    """Extra compute time caused by `hidden_s` seconds of collective running under
    compute: for that long, compute-bound kernels have (1 - f) of the SMs, so
    the compute it overlaps finishes f x hidden_s later (first order in f)."""
    return max(0.0, hidden_s) * nccl_sm_fraction(place, cluster)
