"""Congestion (cost_models/congestion.py): groups past a leaf share its uplinks."""
import pytest

from cost_models import comm as C
from cost_models.congestion import LEAF_PORTS, Topology, network_share
from cost_models.errors import ProfileError
from cost_models.hardware import ClusterSpec

S = 4 * 2**30


def _cluster(nodes, **topology):
    return ClusterSpec.from_dict({"preset": "hgx-h100-roce", "nodes": nodes, "topology": topology})


def test_leaf_sizes_follow_the_switch():
    """A 64-port leaf (Quantum-2 QM9700) at 1:1 has 32 ports down: 32 nodes on a rail-optimized
    leaf (DGX H100 SuperPOD's scalable unit is 32 nodes), 4 nodes of 8 GPUs on a top-of-rack one;
    at 2:1, 42 ports down."""
    assert LEAF_PORTS == 64
    assert Topology().nodes_per_leaf(8) == 32
    assert Topology(rail_optimized=False).nodes_per_leaf(8) == 4
    assert Topology(oversubscription=2.0).nodes_per_leaf(8) == 42
    assert network_share(33, 8, Topology(oversubscription=2.0)) == 1.0  # 33 nodes still under 42
    assert network_share(43, 8, Topology(oversubscription=2.0)) == 0.5


def test_dp_across_leaves_shares_the_uplinks():
    """64 nodes of one GPU per dp group (tp 8): on a 2:1 fabric every NIC sends at once and
    the spine gives each half its bandwidth, so a large all-reduce takes about twice as long;
    on a non-blocking fabric (no topology: the default) nothing changes."""
    place = C.group_placement("dp", 8, 64, 1, ClusterSpec.preset("hgx-h100-roce", nodes=64))
    open_ = C.collective_time("all_reduce", S, place, ClusterSpec.preset("hgx-h100-roce", nodes=64))
    assert C.collective_time("all_reduce", S, place, _cluster(64)) == pytest.approx(open_)
    two = C.collective_time("all_reduce", S, place, _cluster(64, oversubscription=2.0))
    assert two == pytest.approx(2 * open_, rel=0.02)


def test_rails_keep_a_group_under_its_leaf():
    """8 nodes, 2:1: rail-optimized, the group stays on its rail's leaf (full bandwidth); on
    top-of-rack leaves of 5 nodes it crosses the spine and halves."""
    place = C.group_placement("dp", 8, 8, 1, ClusterSpec.preset("hgx-h100-roce", nodes=8))
    rails = C.collective_time("all_reduce", S, place, _cluster(8, oversubscription=2.0))
    racks = C.collective_time("all_reduce", S, place, _cluster(8, oversubscription=2.0, rail_optimized=False))
    assert racks == pytest.approx(2 * rails, rel=0.02)


def test_topology_is_checked_and_kept_in_the_plans_cluster():
    c = _cluster(16, oversubscription=3.0, rail_optimized=False)
    again = ClusterSpec.from_dict(c.to_dict())
    assert again.topology == c.topology and again.cache_key() == c.cache_key()
    assert "topology" not in ClusterSpec.preset("dgx-h100").to_dict()  # absent when unset: old plans read unchanged
    for bad in ({"oversubscription": 0.5}, {"rail_optimized": "yes"}, {"spine": 2}):
        with pytest.raises(ProfileError, match="topology"):
            _cluster(2, **bad)
