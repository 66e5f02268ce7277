"""The cluster file's `fabric` (cost_models/fabric.py): named fabrics and explicit figures."""
import pytest

from cost_models import comm as C
from cost_models.errors import ProfileError
from cost_models.hardware import ClusterSpec


def test_named_fabrics_set_the_network_tier():
    for name, link in (("ib-ndr", "ib-ndr"), ("ib-hdr", "ib-hdr"), ("roce-400", "roce-400"), ("efa-v2", "efa-v2"),
                       ("ethernet-100g", "ethernet-100g")):
        c = ClusterSpec.from_dict({"device": "h100-sxm", "nodes": 2, "fabric": name})
        assert c.inter_node_link == link
    # AWS p5: 3200 Gb/s EFAv2 per instance of 8 GPUs = 50 GB/s per GPU; p4d: 400 Gb/s = 6.25 GB/s
    assert ClusterSpec.preset("p5-h100").inter_link.bandwidth == pytest.approx(50e9)
    assert ClusterSpec.preset("p4d-a100").inter_link.bandwidth == pytest.approx(6.25e9)
    # one 100 GbE NIC per node of 8 GPUs: 12.5 Gb/s = 1.5625 GB/s per GPU
    assert ClusterSpec.from_dict({"device": "a100-80g", "fabric": "ethernet-100g"}).inter_link.bandwidth == \
        pytest.approx(1.5625e9)


def test_fabric_by_its_figures_prices_the_groups_that_cross_nodes():
    """200 Gb/s per GPU is half of NDR's 400: a large all-reduce over one GPU per node takes twice as long."""
    slow = ClusterSpec.from_dict({"preset": "dgx-h100", "nodes": 8,
                                  "fabric": {"bandwidth_gbps": 200, "bus_efficiency": 0.85}})
    ndr = ClusterSpec.preset("dgx-h100", nodes=8)
    place = C.group_placement("dp", 8, 8, 1, ndr)
    S = 4 * 2**30
    ratio = C.collective_time("all_reduce", S, place, slow) / C.collective_time("all_reduce", S, place, ndr)
    assert ratio == pytest.approx(2.0, rel=0.02)
    again = ClusterSpec.from_dict(slow.to_dict())  # a plan's copy of the cluster prices the same
    assert again.cache_key() == slow.cache_key()


def test_fabric_and_inter_node_link_must_agree():
    with pytest.raises(ProfileError, match="disagree"):
        ClusterSpec.from_dict({"device": "h100-sxm", "fabric": "ib-ndr", "inter_node_link": "roce-400"})
    with pytest.raises(ProfileError, match="bandwidth_gbps"):
        ClusterSpec.from_dict({"device": "h100-sxm", "fabric": {"latency_us": 3}})
    # a file's fabric replaces its preset's link
    assert ClusterSpec.from_dict({"preset": "p5-h100", "fabric": "ib-ndr"}).inter_node_link == "ib-ndr"
