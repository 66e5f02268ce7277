"""Layout.ep in the estimate (cost_models/layer_ep.py): a captured tiny Mixtral on 8 H100s.

With ep the experts' states shrink by ep (and by efsdp under ZeRO), a gathered unit
holds only this rank's experts, the four
all-to-alls per MoE layer and micro-batch appear as an `ep` comm row and an
ep_comm_s time, the dense layers' price does not move, and a layout whose ep
does not divide dp is refused.
"""
from __future__ import annotations

import logging

import pytest
import torch

from cost_models.errors import CostModelError
from cost_models.estimate import estimate, layer_cost
from cost_models.hardware import ClusterSpec
from cost_models.layer_ep import moe_layer
from cost_models.layout import Layout


@pytest.fixture(scope="module")
def graph():
    import autopar
    from test_lower_expert_parallel import build
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    return autopar.capture(build("mixtral"), (torch.zeros(2, 8, dtype=torch.long),))


@pytest.fixture(scope="module")
def cluster():
    return ClusterSpec.preset("dgx-h100", nodes=1)


def _layout(ep, zero=3, dp=8):
    return Layout(dp=dp, ep=ep, zero=zero, precision="bf16", micro_batch_size=2, num_micro_batches=1)


def test_expert_states_divide_by_ep_and_efsdp(graph, cluster):
    moe = next(layer for layer in graph.layers if moe_layer(layer))
    dense = next(layer for layer in graph.layers if not moe_layer(layer))
    for zero in (0, 3):
        one, four = (layer_cost(moe, graph, _layout(ep, zero), cluster) for ep in (1, 4))
        share = moe.attrs["expert_param_bytes"] / (moe.attrs["expert_param_bytes"] + moe.attrs["dense_param_bytes"])
        # ZeRO 3: dense over dp 8, experts / 4 over efsdp 2 -> (1 - share)/8 + share/8 = 1/8 as before
        # ZeRO 0: dense whole, experts / 4
        want = (1 - share) + share / 4 if zero == 0 else 1.0
        assert four.param_bytes == pytest.approx(one.param_bytes * want), zero
        assert four.optimizer_bytes == pytest.approx(one.optimizer_bytes * want), zero
        # what FSDP gathers into one unit (peak_memory's buffers): the dense part and experts / ep
        assert four.params_local == pytest.approx(one.params_local * ((1 - share) + share / 4)), zero
        assert four.ep_comm_s > 0 and one.ep_comm_s == 0
        assert four.fwd_s > one.fwd_s and four.bwd_s > one.bwd_s  # all-to-alls + the busiest rank's rows
        assert layer_cost(dense, graph, _layout(4, zero), cluster) == layer_cost(dense, graph, _layout(1, zero), cluster)
    # ZeRO 3, dp 4 = ep 4: efsdp 1, a quarter of the experts whole on each rank -> the same
    # bytes as sharding all of them over 4; the experts' gathers vanish
    whole, plain = layer_cost(moe, graph, _layout(4, dp=4), cluster), layer_cost(moe, graph, _layout(1, dp=4), cluster)
    held = lambda c: c.param_bytes + c.grad_bytes + c.optimizer_bytes  # noqa: E731
    assert held(whole) <= held(plain) * 1.0001
    assert whole.dp_comm_s < plain.dp_comm_s


def test_estimate_shows_the_all_to_alls(graph, cluster):
    est, plain = estimate(graph, _layout(4), cluster), estimate(graph, _layout(1), cluster)
    row = next(r for r in est.comm if r["axis"] == "ep")
    moe_layers = sum(1 for layer in graph.layers if moe_layer(layer))
    assert row["collective"] == f"all_to_all x{4 * moe_layers}"
    # per all-to-all: 2 x 8 tokens x top-2 x hidden 32 x 2 bytes (bf16)
    assert row["bytes"] == 4 * moe_layers * 2 * 8 * 2 * 32 * 2
    assert est.time_breakdown["ep_comm_s"] == pytest.approx(row["time_s"])
    assert "ep_comm_s" not in plain.time_breakdown and not any(r["axis"] == "ep" for r in plain.comm)
    assert any("ep_comm_s" in s for s in est.per_stage)


def test_ep_must_divide_dp(graph, cluster):
    with pytest.raises(CostModelError, match="ep must be a positive divisor of dp 8"):
        estimate(graph, _layout(3), cluster)
