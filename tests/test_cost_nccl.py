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


def test_ring_simple_latency_and_its_plateau():
    """A large all-reduce over 64 ranks on 8 nodes runs the ring with Simple: 8.4 us + 126 - 14
    = 112 steps inside nodes at NVLink's 3.4 us (above the 3 us network post overhead) + 14
    network steps of 14 us, x 1.4 on a large buffer (the ring's plateau, compute capability >= 8)."""
    S, n, bw = 16.0 * 2**30, 64, 340e9
    t, algo, proto = nccl.choose("all_reduce", S, n, 8, bw, "nvlink", True)
    assert (algo, proto) == ("ring", nccl.SIMPLE)
    assert nccl.latency_us("all_reduce", "ring", nccl.SIMPLE, n, 8, "nvlink") == pytest.approx(8.4 + 112 * 3.4 + 14 * 14)
    bytes_s = S / (bw * n / (2 * (n - 1)))
    assert (t - bytes_s) / US == pytest.approx((8.4 + 112 * 3.4 + 14 * 14) * 1.4, rel=1e-6)


def test_ll_bandwidth_is_capped_past_two_nodes():
    """128 KiB all-gathered over 1024 ranks on 128 nodes: the ring with LL, whose bus bandwidth
    NCCL caps at 20.4 GB/s past two nodes (llMaxBws, Intel hosts), far under half the rails."""
    S, n, bw = 131072.0, 1024, 170e9
    t, algo, proto = nccl.choose("all_gather", S, n, 128, bw, "nvlink", True)
    assert (algo, proto) == ("ring", nccl.LL)
    lat = nccl.latency_us("all_gather", "ring", nccl.LL, n, 128, "nvlink") * US
    assert t - lat == pytest.approx(S / (20.4e9 * n / (n - 1)), rel=1e-6)


def test_pcie_nodes_pay_ncclS_pci_hops():
    """Two nodes of 8 PCIe H100s on RoCE (intra-node tier PCI in NCCL's table; RoCE's 8 us a hop
    is 2 us over InfiniBand's, added to each network hop, twice with Simple): 8 bytes take the
    tree with LL, 6.8 + 2 x (7 PCI hops of 1.0 us + 1 network hop of 5.0 + 2 us) = 34.8 us;
    4 GiB take the ring with Simple, whose 28 steps inside nodes cost PCI's 5.7 us (x 1.4, the
    plateau) beside 2 network steps of 14 + 4 us, and whose bytes go at PCIe 5's 48 GB/s."""
    c = ClusterSpec.preset("h100-pcie-node", nodes=2)
    place = C.group_placement("dp", 1, 16, 1, c)
    assert C.collective_time("all_reduce", 8, place, c) == pytest.approx(34.8 * US, rel=0.01)
    S = 4.0 * 2**30
    t = C.collective_time("all_reduce", S, place, c)
    assert t - 2 * 15 / 16 * S / 48e9 == pytest.approx((8.4 + 28 * 5.7 + 2 * 18.0) * 1.4 * US, rel=1e-3)


def test_a_slower_fabric_adds_its_latency_to_every_network_hop():
    """NCCL's hop latencies were set on InfiniBand (its transport reports no latency of its own).
    Ethernet over TCP sockets (links.yaml: 25 us a hop against InfiniBand's 6) adds 19 us to each
    network hop, as tuning.cc adds latencyInter: the tree's 8 B all-reduce over 128 nodes pays
    7 network hops twice, 2 x 7 x 19 us more than on InfiniBand; a small send pays it once."""
    ib = ClusterSpec.preset("dgx-a100", nodes=128)
    eth = ClusterSpec.from_dict({"preset": "dgx-a100", "nodes": 128, "inter_node_link": "ethernet"})
    place = C.group_placement("dp", 1, 1024, 1, ib)
    assert nccl.fabric_extra_us(ib.inter_link.latency_s) == 0.0
    extra = C.collective_time("all_reduce", 8, place, eth) - C.collective_time("all_reduce", 8, place, ib)
    assert extra == pytest.approx(2 * 7 * 19.0 * US, rel=0.01)
    send_extra = C.p2p_time(1024, False, eth) - C.p2p_time(1024, False, ib)
    assert send_extra - 1024 / (0.5 * eth.inter_link.bus_bandwidth) + 1024 / (0.5 * ib.inter_link.bus_bandwidth) \
        == pytest.approx(19.0 * US, rel=0.01)
