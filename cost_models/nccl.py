"""NCCL's own cost model for collectives whose group spans nodes.

Every constant below is NCCL's, from src/graph/tuning.cc (NVIDIA/nccl at
5067397, 2026-06-11): `ncclTunerConstantsDefaults` (base and per-hop
latencies by algorithm, protocol and hardware tier; the LL bandwidth caps),
`ncclTopoTuneModel` (steps per algorithm, bus-bandwidth refinements per
algorithm and protocol, the conversion from bus to algorithm bandwidth) and
`ncclTopoGetAlgoTime` (the tree's correction by size, the ring's plateau).
NCCL computes time = latency + bytes / algorithm bandwidth for every
(algorithm, protocol) it may run and takes the fastest: so do we.

What we do not have from NCCL's topology search: its channel count and
per-channel bandwidth. The product (its `busBw`) is the tier's measured or
datasheet ring bus bandwidth (cost_models/comm.bus_bandwidth), which the
refinements then scale; the per-channel caps are therefore left out.
NVLS (in-switch reduction) and NVLS-tree are not priced: their bandwidth
depends on NVLS channel counts we cannot derive, and NVLS needs CollNet to
span nodes (tuning.cc disables it otherwise). PAT runs only with one GPU per
node (`ncclPatEnable`), for all-gather and reduce-scatter.

Sizes are nccl-tests' (the full buffer), as NCCL's own nBytes for these
collectives (`ncclInfoSetDerived` multiplies an all-gather's count by nRanks).
"""
from __future__ import annotations

import math
from functools import lru_cache

LL, LL128, SIMPLE = 0, 1, 2
PROTOCOLS = (LL, LL128, SIMPLE)

# baseLatencies (us), per protocol (LL, LL128, Simple)
BASE_LAT_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "pat": (8.0, 8.0, 8.0)}
# hwLatencies (us) of one hop, by tier (NCCL_HW_NVLINK / PCI / NET), algorithm and protocol.
# PAT's own rows never apply: PAT runs only at one GPU per node, where there is no hop inside
# a node and tuning.cc takes the tree's network latency.
HW_LAT_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)},
}
# llMaxBws (GB/s): the LL protocol's bus-bandwidth cap. Multi-node rows are indexed by the
# host CPU (Intel row; AMD's is 22.5 / 19.0) and node count (2 nodes, more than 2).
LL_MAX_BW_GBS = {2: 39.0, 3: 20.4}
# getNetOverhead: an Intel x86 host posts a network operation in 1 us (AMD: 2 us); a
# ring step inside a node of a multi-node ring pays at least that (x3 for Simple).
NET_OVERHEAD_US = 1.0
# ncclTopoGetAlgoTime: ring Simple all-reduce across nodes on a large buffer ("plateau
# effect of ring"): latency x 1.4 (compute capability >= 8.0), x 1.9 before.
RING_PLATEAU = {True: 1.4, False: 1.9}
# treeCorrectionFactor[protocol][log2(bytes / 64)]: trees fall short of their model at
# medium sizes (64 B to 256 MiB in powers of two); 1.0 past the table.
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)


def _log2i(x: int) -> int:
    return max(0, int(x).bit_length() - 1)


def bus_bandwidths(kind: str, algo: str, bus_bw: float, nodes: int) -> tuple[float, float, float]:
    """(LL, LL128, Simple) bus bandwidth (B/s) NCCL's refinements give `algo` from the
    ring's Simple bus bandwidth `bus_bw` (tuning.cc "Various model refinements")."""
    ll_cap = LL_MAX_BW_GBS[min(nodes, 3)] * 1e9
    if algo == "ring":
        return min(ll_cap, bus_bw * .5), bus_bw * .92, bus_bw
    if algo == "tree":  # all-reduce only
        tree = bus_bw * .92
        return min(tree / 3.8, ll_cap), tree * 120.0 / 128.0, tree
    return 0.0, 0.0, bus_bw * .75  # pat: Simple only


def latency_us(kind: str, algo: str, proto: int, n: int, nodes: int, intra_tier: str, fabric_us: float = 0.0
               ) -> float:
    """NCCL's latency of one collective: the base plus every hop's (tuning.cc). `fabric_us`:
    the network's own latency beyond what NCCL's hop latencies hold (tuning.cc's latencyInter,
    added to every network hop, twice with Simple for its flush)."""
    ppn = n // nodes
    # with one GPU per node latencies are fully exposed: NCCL takes the tree's network latency
    inter = HW_LAT_US["net"]["tree" if ppn == 1 else algo][proto] + fabric_us * (2 if proto == SIMPLE else 1)
    lat = BASE_LAT_US[algo][proto]
    if algo == "pat":  # one GPU per node: log latency plus its linear part
        return lat + _log2i(nodes) * (inter / 3.5) + n * 2.8
    intra = HW_LAT_US[intra_tier][algo][proto]
    if algo == "ring":
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        inter_steps = 2 * (nodes - 1) if kind == "all_reduce" else nodes - 1
        intra = max(intra, NET_OVERHEAD_US * (3 if proto == SIMPLE else 1))
        return lat + (steps - inter_steps) * intra + inter_steps * inter
    return lat + 2 * ((ppn - 1) * intra + _log2i(nodes) * inter)  # tree


def algorithms(kind: str, n: int, nodes: int) -> tuple[str, ...]:
    """What NCCL may run for `kind` across nodes: ring always; the tree for all-reduce;
    PAT for all-gather / reduce-scatter with one GPU per node (ncclPatEnable)."""
    if kind == "all_reduce":
        return ("ring", "tree")
    return ("ring", "pat") if n == nodes else ("ring",)


@lru_cache(maxsize=65536)
def choose(kind: str, nbytes: float, n: int, nodes: int, bus_bw: float, intra_tier: str, ampere_or_later: bool,
           fabric_us: float = 0.0) -> tuple[float, str, int]:
    """(seconds, algorithm, protocol) of the fastest (algorithm, protocol) NCCL would pick
    for one `kind` of `nbytes` over n ranks on `nodes` nodes (n / nodes per node)."""
    best = (math.inf, "ring", SIMPLE)
    log_size = _log2i(int(nbytes) >> 6) if nbytes >= 64 else -1
    for algo in algorithms(kind, n, nodes):
        for proto, bus in zip(PROTOCOLS, bus_bandwidths(kind, algo, bus_bw, nodes)):
            if bus <= 0:
                continue
            steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
            # bus -> algorithm bandwidth: ring n / steps; tree 1/2; PAT as is (no conversion
            # for non-ring all-gather / reduce-scatter)
            alg_bw = bus * (n / steps if algo == "ring" else .5 if algo == "tree" else 1.0)
            lat = latency_us(kind, algo, proto, n, nodes, intra_tier, fabric_us)
            if algo == "tree" and 0 <= log_size < 23:
                alg_bw *= TREE_CORRECTION[proto][log_size]
            if algo == "ring" and proto == SIMPLE and kind == "all_reduce" and nbytes / (n * 2) >= 64:
                lat *= RING_PLATEAU[ampere_or_later]  # nChannels >= 2 (NCCL_MIN_CHANNELS in comm.py)
            t = lat * 1e-6 + nbytes / alg_bw
            if t < best[0]:
                best = (t, algo, proto)
    return best


def p2p_us(proto: int, fabric_us: float = 0.0) -> float:
    """One send across nodes: a ring's base latency plus one network hop (NCCL's p2p
    runs the ring's primitives; its LL protocol below NCCL_P2P_LL_THRESHOLD, 16 KiB)."""
    return BASE_LAT_US["ring"][proto] + HW_LAT_US["net"]["ring"][proto] + fabric_us


P2P_LL_THRESHOLD = 16384  # bytes: NCCL_P2P_LL_THRESHOLD's default (NCCL docs, env.html)


# NCCL's network hop latencies were set on InfiniBand, whose transport reports no latency of its
# own (net_ib/init.cc: props->latency = 0). A fabric slower per message than InfiniBand adds the
# difference of the links' per-hop latencies (links.yaml latency_us: InfiniBand 6 us, RoCE and
# EFA 8, Ethernet over TCP sockets 25) to every network hop, as tuning.cc adds latencyInter.
INFINIBAND_LATENCY_US = 6.0


def fabric_extra_us(link_latency_s: float) -> float:
    return max(0.0, link_latency_s * 1e6 - INFINIBAND_LATENCY_US)


def generation_at_least_ampere(device_name: str) -> bool:
    """Compute capability >= 8.0 (tuning.cc's plateau): everything but Volta."""
    return not device_name.lower().startswith("v100")
