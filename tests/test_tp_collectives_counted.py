"""Tensor parallelism priced as the lowering runs it: the lowering check
counts the collectives DTensor issues for each kind of block split over a
fake process group (autopar.lower.what_runs), the planner copies them onto
the layers (autopar.solve.lowering_costs) and the cost model prices those
(cost_models.layer_comm.tp_collectives). GPT's fused-qkv block issues an
all-gather forward and three backward where capture's dataflow inferred one
each way; Llama's block issues Megatron's two all-reduces each way."""
from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

import autopar
from autopar.lower import what_runs
from autopar.lower.manual_plan import plan_for_model
from autopar.lower.model_layers import resolve
from autopar.solve.lowering_costs import charge_tp_collectives, parse_collectives
from cost_models import comm as C
from cost_models.estimate import estimate, layer_cost
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout
from cost_models.workload import evaluate

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import gpt  # noqa: E402
import llama  # noqa: E402


def _checked(factory):
    model, example = factory()
    graph = autopar.capture(model, example)
    return model, example, graph, what_runs.limits(model, graph, example, tp_degrees=[2])


def _issued(group) -> list:
    return list(parse_collectives(group["fwd"], "fwd") + parse_collectives(group["bwd"], "bwd"))


def _kinds(issued, phase):
    return collections.Counter(kind for kind, _, when in issued if when == phase)


def test_gpt_and_llama_blocks_issue_what_dtensor_issues():
    """What each architecture's split block issues, kinds and sizes (that the
    real step issues the same is the slow test below, counted by torch's profiler)."""
    for factory, fwd, bwd in ((gpt.gpt_tiny, {"all_gather": 1, "all_reduce": 2}, {"all_gather": 3, "all_reduce": 2}),
                              (llama.llama_tiny, {"all_reduce": 2}, {"all_reduce": 2})):
        model, example, graph, lim = _checked(factory)
        groups = lim["tp_collectives"]["2"]["plain"]
        assert len(groups) == 1  # identical blocks, one kind
        issued = _issued(groups[0])
        assert _kinds(issued, "fwd") == fwd and _kinds(issued, "bwd") == bwd, factory.__name__
        layout = resolve(model, plan_for_model(model, example_inputs=example, graph=graph))
        assert groups[0]["block"] == next(l.paths[0] for l in layout.layers if l.position == "block")
        # sizes: GPT gathers the qkv output (3 x hidden) forward and each of q, k, v's gradients backward
        if factory is gpt.gpt_tiny:
            assert sorted(r for k, r, w in issued if k == "all_gather") == [1.0, 1.0, 1.0, 3.0]
        assert all(r == 1.0 for k, r, _ in issued if k == "all_reduce")  # the block's output size


def test_sequence_parallel_blocks_issue_gathers_and_reduce_scatters():
    *_, lim = _checked(llama.llama_tiny)
    issued = _issued(lim["tp_collectives"]["2"]["sp"][0])
    for phase in ("fwd", "bwd"):
        assert _kinds(issued, phase) == {"all_gather": 2, "reduce_scatter": 2}


def test_the_cost_model_prices_the_counted_collectives():
    cluster = ClusterSpec.preset("dgx-h100")
    model, example, graph, lim = _checked(gpt.gpt_tiny)
    charged = charge_tp_collectives(graph, lim)
    assert charged is not graph and graph.layers[1].tp_collectives == {}  # the captured graph is not touched
    block = charged.layers[1]
    assert all(l.tp_collectives == block.tp_collectives for l in charged.layers[1:-1])  # every block of its kind
    assert block.tp_collectives["2"]["plain"]
    assert charged.layers[0].tp_collectives == {}  # the embedding is not a block: capture's inference prices it
    layout = Layout(tp=2, dp=1, micro_batch_size=4, num_micro_batches=1, precision="bf16")
    cost = layer_cost(block, charged, layout, cluster)
    place = C.group_placement("tp", 2, 1, 1, cluster)
    out = evaluate(block.output_bytes, 4, charged.seq_len)  # captured at 4 bytes: bf16 halves it
    scale = 2 / charged.dtype_bytes
    want = {ph: sum(C.collective_time(k, r * out * scale, place, cluster)
                    for k, r, w in block.tp_collectives["2"]["plain"] if w == ph) for ph in ("fwd", "bwd")}
    assert cost.tp_comm_fwd_s == pytest.approx(want["fwd"])
    assert cost.tp_comm_s == pytest.approx(want["fwd"] + want["bwd"])
    # more than capture's inference (one gather each way): three all-gathers backward
    inferred = layer_cost(graph.layers[1], graph, layout, cluster)
    assert cost.tp_comm_s > inferred.tp_comm_s
    assert cost.tp_comm_fwd_s == pytest.approx(inferred.tp_comm_fwd_s, rel=0.05)
    # the same bytes (q, k and v's gradients gathered apart hold what one reduce-scatter would),
    # in two collectives more: more latency
    rows = [next(c for c in estimate(g, layout, cluster).comm if c["axis"] == "tp") for g in (charged, graph)]
    assert rows[0]["bytes"] == pytest.approx(rows[1]["bytes"]) and rows[0]["time_s"] > rows[1]["time_s"]
    # the report names the calls it priced, per step: four all-gathers a block (one micro-batch)
    blocks = sum(1 for l in charged.layers if l.tp_collectives)
    assert f"all_gather x{4 * blocks}" in rows[0]["collective"]
    assert f"all_gather x{blocks}," in rows[1]["collective"]  # the inference: one a block forward


def test_plans_carry_the_counted_collectives():
    model, example = gpt.gpt_tiny()
    plan = autopar.plan(model, ClusterSpec(gpus=2, device="h100-sxm", gpus_per_node=2), example_inputs=example,
                        global_batch_size=8, constraints={"tp": 2, "dp": 1})
    counted = plan.solver["lowering_limits"]["tp_collectives"]["2"]
    assert {"plain", "sp"} <= set(counted)


@pytest.mark.slow
def test_a_real_tp_step_issues_what_was_counted():
    """On 2 gloo ranks, one training step of GPT tp2 all-gathers exactly what the
    fake-process-group count says its blocks do (nothing else in the step gathers)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_utils import run_world
    from lower_worlds import issued_collectives_world

    *_, lim = _checked(gpt.gpt_tiny)
    per_block = sum(1 for k, _, _ in _issued(lim["tp_collectives"]["2"]["plain"][0]) if k == "all_gather")
    counts = run_world(issued_collectives_world, 2, "gpt", timeout=240)[0]
    gathers = sum(n for name, n in counts.items() if name.startswith("c10d::allgather"))
    blocks = sum(1 for l in autopar.capture(*gpt.gpt_tiny()).layers if l.kind not in ("embedding", "head"))
    assert per_block == 4 and gathers == per_block * blocks
