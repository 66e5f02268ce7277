"""The ep price of one MoE layer (cost_models/expert_parallel.py), by hand.

A Mixtral-8x7B-sized layer on DGX H100 nodes (NVLink bus bandwidth 367.65 GB/s,
3 us a step; 42.5 GB/s and 6 us per GPU across nodes): 4096 tokens a rank,
top-2, hidden 4096, bf16.
"""
import pytest

from cost_models.errors import CostModelError
from cost_models.expert_parallel import MoeLayerShape, dispatch_bytes, ep_layer_cost, ep_placement
from cost_models.hardware import ClusterSpec

EXPERT = 3 * 4096 * 14336 * 2  # gate, up, down in bf16: 352,321,536 bytes
LAYER = MoeLayerShape(experts=8, top_k=2, hidden=4096, tokens=4096, dtype_bytes=2,
                      expert_param_bytes=8 * EXPERT, dense_param_bytes=100e6,
                      expert_fwd_flops=1e12, expert_bwd_flops=2e12)


@pytest.fixture(scope="module")
def cluster():
    return ClusterSpec.preset("dgx-h100", nodes=2)


def test_one_node_all_to_alls_by_hand(cluster):
    cost = ep_layer_cost(LAYER, 8, cluster)
    assert cost.send_bytes == 67_108_864  # 4096 x 2 x 4096 x 2
    one = 7 / 8 * 67_108_864 / 367.65e9 + 7 * 3e-6  # 159.7 us + 21 us
    assert cost.fwd_comm_s == pytest.approx(2 * one) and cost.bwd_comm_s == pytest.approx(2 * one)
    assert cost.comm_s == pytest.approx(4 * 180.72e-6, rel=1e-4)
    assert cost.param_bytes_per_rank == EXPERT + 100e6  # one expert each, the dense part whole
    assert cost.routed_bytes_per_rank == 67_108_864
    assert cost.expert_flops_per_rank == 3e12  # ep does not divide the expert FLOPs


def test_across_nodes_the_nic_bounds_it(cluster):
    layer = MoeLayerShape(**{**LAYER.__dict__, "experts": 16})
    place = ep_placement(16, 1, cluster)
    assert (place.nodes_spanned, place.ranks_per_node) == (2, 8)
    # half the rows leave the node through this GPU's NIC: 33.5 MB at 42.5 GB/s, 15 steps of 6 us
    one = 0.5 * 67_108_864 / 42.5e9 + 15 * 6e-6
    assert ep_layer_cost(layer, 16, cluster).fwd_comm_s == pytest.approx(2 * one)
    # tp=2 strides the ep group over both nodes: 4 ranks on each
    assert (ep_placement(8, 2, cluster).nodes_spanned, ep_placement(8, 2, cluster).ranks_per_node) == (2, 4)


def test_imbalance_scales_the_busiest_rank(cluster):
    even, hot = ep_layer_cost(LAYER, 8, cluster), ep_layer_cost(LAYER, 8, cluster, imbalance=1.25)
    one = 7 / 8 * 1.25 * 67_108_864 / 367.65e9 + 7 * 3e-6
    assert hot.fwd_comm_s == pytest.approx(2 * one) and hot.fwd_comm_s > even.fwd_comm_s
    assert hot.expert_flops_per_rank == 3.75e12 and hot.routed_bytes_per_rank == 1.25 * 67_108_864
    # ep=1: no exchange, every expert local, no hot expert to wait for
    alone = ep_layer_cost(LAYER, 1, cluster, imbalance=1.25)
    assert alone.comm_s == 0 and alone.expert_flops_per_rank == 3e12
    assert alone.param_bytes_per_rank == 8 * EXPERT + 100e6


def test_volume_scales_with_top_k_and_tokens(cluster):
    """Mutation check: the send buffer is linear in top-k and in tokens (and the time grows)."""
    base = dispatch_bytes(LAYER)
    for field in ("top_k", "tokens"):
        doubled = MoeLayerShape(**{**LAYER.__dict__, field: 2 * getattr(LAYER, field)})
        assert dispatch_bytes(doubled) == 2 * base, field
        assert ep_layer_cost(doubled, 8, cluster).comm_s > ep_layer_cost(LAYER, 8, cluster).comm_s


def test_bad_degrees_are_refused(cluster):
    with pytest.raises(CostModelError, match="must divide"):
        ep_layer_cost(LAYER, 3, cluster)
    with pytest.raises(CostModelError, match="at least 1"):
        ep_layer_cost(LAYER, 8, cluster, imbalance=0.5)
