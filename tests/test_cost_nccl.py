"""Collectives across nodes follow NCCL's own tuning model (cost_models/nccl.py, from
NVIDIA/nccl src/graph/tuning.cc). Every expected figure is written out from NCCL's
constants and the link datasheets, so halving any one of them fails a test here."""
import pytest

from cost_models import comm as C
from cost_models import nccl
from cost_models.hardware import ClusterSpec

US = 1e-6


def test_tiny_all_reduce_at_scale_is_latency_bound_at_the_trees_latency():
    """8 bytes over 1024 ranks on 128 nodes: NCCL's tree with LL, base 6.8 us plus two passes
    of (7 NVLink hops of 0.6 us + log2(128) = 7 network hops of 5.0 us) = 85.2 us; the ring's
    2046 steps would take over a millisecond. A kilobyte costs the same: latency-bound."""
    c = ClusterSpec.preset("dgx-a100", nodes=128)
    place = C.group_placement("dp", 1, 1024, 1, c)
    t8 = C.collective_time("all_reduce", 8, place, c)
    assert t8 == pytest.approx((6.8 + 2 * (7 * 0.6 + 7 * 5.0)) * US, rel=0.01)
    assert C.collective_time("all_reduce", 1024, place, c) == pytest.approx(t8, rel=0.01)
    bw, _ = C.bus_bandwidth(place, c)
    assert nccl.choose("all_reduce", 8.0, 1024, 128, bw, "nvlink", True)[1:] == ("tree", nccl.LL)


def test_ring_all_reduce_reaches_the_rails_bus_bandwidth_at_large_sizes():
    """16 GiB over 64 ranks on 8 DGX H100 nodes: NCCL runs the ring (Simple) and its bus
    bandwidth, S / t x 2(n-1)/n, approaches 8 rails x 50 GB/s (NDR 400 Gb/s per GPU) x 0.85
    (links.yaml ib-ndr) = 340 GB/s, under NVLink 4's 367 GB/s."""
    c = ClusterSpec.preset("dgx-h100", nodes=8)
    place = C.group_placement("dp", 1, 64, 1, c)
    S, n = 16 * 2**30, 64
    t = C.collective_time("all_reduce", S, place, c)
    assert S / t * 2 * (n - 1) / n == pytest.approx(340e9, rel=0.02)
    bw, _ = C.bus_bandwidth(place, c)
    assert nccl.choose("all_reduce", float(S), n, 8, bw, "nvlink", True)[1:] == ("ring", nccl.SIMPLE)


def test_ring_all_gather_pays_every_hop():
    """All-gather has no tree: 1 KiB over 1024 ranks on 128 nodes runs the ring with LL,
    6.6 us + 896 steps inside nodes at max(0.6 us NVLink, 1 us network post overhead) +
    127 network steps of 2.7 us = 1245.5 us."""
    c = ClusterSpec.preset("dgx-a100", nodes=128)
    place = C.group_placement("dp", 1, 1024, 1, c)
    expected = (6.6 + 896 * 1.0 + 127 * 2.7) * US
    assert C.collective_time("all_gather", 1024, place, c) == pytest.approx(expected, rel=0.01)
    assert C.collective_time("reduce_scatter", 1024, place, c) == pytest.approx(expected, rel=0.01)


def test_one_gpu_per_node_all_gather_takes_pat():
    """With one GPU per node (tp 8 fills each node, dp 128 across them) NCCL enables PAT for
    all-gather: 8 us + log2(128) x 14 us / 3.5 + 128 x 2.8 us = 394.4 us on a small buffer,
    below the ring's 8.4 + 127 x 14 (the tree's network latency at one GPU per node)."""
    c = ClusterSpec.preset("dgx-a100", nodes=128)
    place = C.group_placement("dp", 8, 128, 1, c)
    assert (place.size, place.nodes_spanned) == (128, 128)
    t = C.collective_time("all_gather", 64, place, c)
    assert t == pytest.approx((8.0 + 7 * 14.0 / 3.5 + 128 * 2.8) * US, rel=0.01)


def test_tp_spanning_two_nodes_pays_the_network():
    """tp 16 on 8-GPU nodes spans two: its 64 MiB all-reduce runs over 8 HDR rails per node
    (8 x 25 GB/s x 0.85 = 170 GB/s, links.yaml ib-hdr), not NVLink 3's 235 GB/s: at least
    2 (n-1)/n x S / 170 GB/s, and over twice what tp 8 inside a node takes."""
    c = ClusterSpec.preset("dgx-a100", nodes=2)
    across = C.group_placement("tp", 16, 1, 1, c)
    inside = C.group_placement("tp", 8, 2, 1, c)
    assert (across.tier, inside.tier) == ("inter_node", "intra_node")
    S = 64 * 2**20
    t = C.collective_time("all_reduce", S, across, c)
    assert t >= 2 * 15 / 16 * S / 170e9
    assert t <= 1.25 * 2 * 15 / 16 * S / 170e9  # LL128's 0.92 of the rails plus 75 us of hops
    assert t > 1.2 * C.collective_time("all_reduce", S, inside, c)


def test_send_across_nodes_is_ncclS_p2p_latency():
    """A pipeline send of 4 KiB between nodes: LL (below NCCL_P2P_LL_THRESHOLD, 16 KiB),
    the ring's base 6.6 us plus one network hop of 2.7 us, bytes at half the rail."""
    c = ClusterSpec.preset("dgx-h100", nodes=2)
    t = C.p2p_time(4096, False, c)
    assert t == pytest.approx((6.6 + 2.7) * US + 4096 / (0.5 * 50e9 * 0.85), rel=0.01)
    big = C.p2p_time(64 * 2**20, False, c)  # Simple: 8.4 + 14 us
    assert big == pytest.approx((8.4 + 14.0) * US + 64 * 2**20 / (50e9 * 0.85), rel=0.01)


def test_inside_a_node_the_measured_ring_stays():
    """One node keeps the measured ring (3 us a step, tests/test_cost_comm.py's H200 sweep),
    not NCCL's kernel-only latencies, which leave out launch and dispatch."""
    c = ClusterSpec.preset("dgx-h200")
    place = C.group_placement("dp", 1, 8, 1, c)
    bw, alpha = C.bus_bandwidth(place, c)
    assert C.collective_time("all_reduce", 8, place, c) == pytest.approx(14 * alpha, rel=0.01)
