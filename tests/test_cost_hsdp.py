"""HSDP (Layout.dp_shard): the shard group's gathers stay inside a node, the gradient
shards cross nodes once per step, states are divided by dp_shard, and the field
enters the cost memo (a layout differing only in it is priced again)."""
import dataclasses

import pytest

from cost_models import comm as C
from cost_models.analytic import gpt
from cost_models.errors import CostModelError
from cost_models.estimate import estimate, layer_cost
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout


def _model():
    return gpt("g", hidden=4096, heads=32, layers=4, seq_len=2048, vocab_size=51200)


def _inter_node_bytes(est) -> float:
    return sum(r["bytes"] for r in est.comm if r["axis"].startswith("dp") and r["tier"] == "inter_node")


def test_groups_are_placed_shard_inner():
    c = ClusterSpec.preset("dgx-h100", nodes=16)
    shard = C.group_placement("dp_shard", 2, 64, 1, c, dp_shard=4)  # 4 x tp 2 = one node
    rep = C.group_placement("dp_replicate", 2, 64, 1, c, dp_shard=4)
    assert (shard.size, shard.tier) == (4, "intra_node")
    assert (rep.size, rep.nodes_spanned, rep.ranks_per_node, rep.tier) == (16, 16, 1, "inter_node")
    # a shard group larger than a node crosses nodes
    assert C.group_placement("dp_shard", 2, 64, 1, c, dp_shard=8).tier == "inter_node"


def test_hsdp_moves_fewer_inter_node_bytes_than_full_dp_fsdp():
    model, c = _model(), ClusterSpec.preset("dgx-h100", nodes=8)
    full = Layout(dp=64, micro_batch_size=1, num_micro_batches=4, schedule="gpipe", zero=3)
    hsdp = dataclasses.replace(full, dp_shard=8)
    e_full, e_hsdp = estimate(model, full, c), estimate(model, hsdp, c)
    assert {r["axis"] for r in e_hsdp.comm} == {"dp_shard", "dp_replicate"}
    assert all(r["tier"] == "intra_node" for r in e_hsdp.comm if r["axis"] == "dp_shard")
    # full-dp FSDP gathers every micro-batch across nodes (2m gathers + the reduce-scatter);
    # HSDP sends only the all-reduce of one 1/8 gradient shard across nodes
    assert _inter_node_bytes(e_hsdp) < 0.1 * _inter_node_bytes(e_full)
    layer = model.layers[1]
    assert layer_cost(layer, model, hsdp, c, zero=3).dp_comm_s < layer_cost(layer, model, full, c, zero=3).dp_comm_s


def test_states_are_divided_by_dp_shard_not_dp():
    model, c = _model(), ClusterSpec.preset("dgx-h100", nodes=8)
    layer = model.layers[1]
    for zero in (1, 2, 3):
        full = layer_cost(layer, model, Layout(dp=64, zero=zero), c, zero=zero)
        hsdp = layer_cost(layer, model, Layout(dp=64, zero=zero, dp_shard=8), c, zero=zero)
        assert hsdp.optimizer_bytes == pytest.approx(8 * full.optimizer_bytes)
        if zero >= 2:
            assert hsdp.grad_bytes == pytest.approx(8 * full.grad_bytes)
        if zero == 3:
            assert hsdp.param_bytes == pytest.approx(8 * full.param_bytes)
    # ZeRO 0 keeps whole states either way
    z0 = [layer_cost(layer, model, Layout(dp=64, dp_shard=s), c, zero=0).optimizer_bytes for s in (None, 8)]
    assert z0[0] == z0[1]


def test_the_field_changes_the_price_and_the_memo_key():
    model, c = _model(), ClusterSpec.preset("dgx-h100", nodes=8)
    base = Layout(dp=64, micro_batch_size=1, num_micro_batches=2, schedule="gpipe", zero=3)
    prices = {s: estimate(model, dataclasses.replace(base, dp_shard=s), c) for s in (None, 64, 8, 16)}
    assert prices[None].step_time_s == prices[64].step_time_s  # dp_shard = dp is plain FSDP
    assert prices[8].step_time_s != prices[None].step_time_s
    assert prices[8].peak_memory_bytes != prices[16].peak_memory_bytes


def test_a_dp_shard_that_does_not_divide_dp_is_refused():
    with pytest.raises(CostModelError, match="dp_shard must be a positive divisor of dp 64"):
        estimate(_model(), Layout(dp=64, dp_shard=6), ClusterSpec.preset("dgx-h100", nodes=8))


def test_the_replica_all_reduce_runs_once_per_step():
    """Reduce-scatters every micro-batch (pp 1 and pipelines), the shards' all-reduce once:
    the lowering defers it to the last micro-batch (set_requires_all_reduce)."""
    model, c = _model(), ClusterSpec.preset("dgx-h100", nodes=8)
    layer = model.layers[1]
    for pp in (1, 2):
        base = Layout(dp=32, pp=pp, micro_batch_size=1, schedule="gpipe", zero=2, dp_shard=8,
                      grads_reduced_per_micro_batch=True)
        cost = {m: dict((k, b) for k, b, _ in layer_cost(layer, model, dataclasses.replace(base, num_micro_batches=m),
                                                           c, zero=2).dp_collectives) for m in (1, 4)}
        assert cost[4]["reduce_scatter"] == pytest.approx(4 * cost[1]["reduce_scatter"])
        assert cost[4]["all_reduce"] == pytest.approx(cost[1]["all_reduce"])
