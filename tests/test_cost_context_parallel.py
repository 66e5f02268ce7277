"""The cp price of one attention layer (cost_models/context_parallel.py), by hand.

A Llama-3-8B-shaped layer (8 KV heads of 128, K and V kept grouped: 2 x 8 x 128
= 2048 elements a token, bf16) on DGX H100 nodes (NVLink: 367.65 GB/s, 3 us a
transfer; across nodes 42.5 GB/s, 6 us per GPU).
"""
import pytest

from cost_models.context_parallel import AttentionLayerShape, cp_layer_cost, kv_shard_bytes
from cost_models.errors import CostModelError
from cost_models.hardware import ClusterSpec

KV = 2 * 8 * 128


@pytest.fixture(scope="module")
def cluster():
    return ClusterSpec.preset("dgx-h100", nodes=2)


def _layer(**kw):
    base = dict(batch=1, seq=8192, kv_elems_per_token=KV, dtype_bytes=2, attn_fwd_s=0.5e-3, attn_bwd_s=1.25e-3,
                other_fwd_s=2e-3, other_bwd_s=4e-3, activation_bytes=800e6)
    return AttentionLayerShape(**{**base, **kw})


def test_short_sequence_exposes_the_ring_by_hand(cluster):
    cost = cp_layer_cost(_layer(), 8, cluster)
    assert cost.kv_shard_bytes == 4_194_304  # 1 x 1024 tokens x 2048 x 2 bytes
    fwd_one = 4_194_304 / 367.65e9 + 3e-6  # 14.408 us
    bwd_one = 8_388_608 / 367.65e9 + 3e-6  # 25.817 us: K, V and dK, dV
    assert cost.fwd_comm_s == pytest.approx(7 * fwd_one) and cost.bwd_comm_s == pytest.approx(7 * bwd_one)
    # a step computes the causal attention / cp^2: 0.5 ms / 64 = 7.8125 us forward, 19.53 us backward
    assert cost.fwd_exposed_s == pytest.approx(7 * (fwd_one - 7.8125e-6))  # 46.2 us
    assert cost.bwd_exposed_s == pytest.approx(7 * (bwd_one - 19.53125e-6))  # 44.0 us
    assert cost.fwd_exposed_s == pytest.approx(46.17e-6, rel=1e-3)
    assert cost.fwd_compute_s == pytest.approx(2.5e-3 / 8) and cost.bwd_compute_s == pytest.approx(5.25e-3 / 8)
    assert cost.activation_bytes_per_rank == 100e6 and cost.ring_buffer_bytes == 2 * 4_194_304
    assert cost.time_s == pytest.approx(2.5e-3 / 8 + 5.25e-3 / 8 + cost.fwd_exposed_s + cost.bwd_exposed_s)


def test_long_sequence_hides_it(cluster):
    # 128k tokens over cp 8: 67 MB a step (186 us) behind 4 s / 64 = 62.5 ms of attention
    cost = cp_layer_cost(_layer(seq=131072, attn_fwd_s=4.0, attn_bwd_s=10.0), 8, cluster)
    assert cost.kv_shard_bytes == 67_108_864
    assert cost.fwd_comm_s == pytest.approx(7 * (67_108_864 / 367.65e9 + 3e-6))
    assert cost.fwd_exposed_s == 0 and cost.bwd_exposed_s == 0


def test_across_nodes_the_nic_carries_it(cluster):
    cost = cp_layer_cost(_layer(), 8, cluster, same_node=False)
    one = 4_194_304 / 42.5e9 + (8.4 + 14.0) * 1e-6  # 121.1 us: NCCL's Simple p2p latency across nodes (cost_models/nccl.py)
    assert cost.fwd_comm_s == pytest.approx(7 * one)
    assert cost.fwd_exposed_s == pytest.approx(7 * (one - 7.8125e-6))


def test_cp1_is_the_layer_alone_and_bad_degrees_refused(cluster):
    alone = cp_layer_cost(_layer(), 1, cluster)
    assert alone.fwd_comm_s == alone.bwd_comm_s == alone.fwd_exposed_s == alone.ring_buffer_bytes == 0
    assert alone.fwd_compute_s == pytest.approx(2.5e-3) and alone.activation_bytes_per_rank == 800e6
    with pytest.raises(CostModelError, match="2 x cp equal chunks"):
        cp_layer_cost(_layer(seq=8200), 8, cluster)


def test_exchange_scales_with_what_it_moves(cluster):
    """Mutation check: the shard is linear in batch, seq, K/V width and bytes, and / cp;
    backward moves twice forward's bytes; the exposed part never exceeds the transfer."""
    base = kv_shard_bytes(_layer(), 8)
    for field, times in (("batch", 3), ("seq", 2), ("kv_elems_per_token", 4), ("dtype_bytes", 2)):
        assert kv_shard_bytes(_layer(**{field: getattr(_layer(), field) * times}), 8) == pytest.approx(times * base)
    assert kv_shard_bytes(_layer(), 4) == 2 * base
    cost = cp_layer_cost(_layer(), 8, cluster)
    fixed = 7 * 3e-6  # latency does not double
    assert cost.bwd_comm_s - fixed == pytest.approx(2 * (cost.fwd_comm_s - fixed))
    assert 0 <= cost.fwd_exposed_s <= cost.fwd_comm_s and 0 <= cost.bwd_exposed_s <= cost.bwd_comm_s
    slower = cp_layer_cost(_layer(attn_fwd_s=1e-3), 8, cluster)  # more compute to hide behind
    assert slower.fwd_exposed_s < cost.fwd_exposed_s
