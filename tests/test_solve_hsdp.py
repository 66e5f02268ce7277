"""The planner and HSDP: on a slow inter-node fabric with many nodes it shards the ZeRO
states over node groups (HSDP) and says why; on one node it does not; a pinned
--dp-shard is searched like any pin and a bad one is refused before the search."""
import dataclasses

import pytest

from cost_models.analytic import gpt
from cost_models.hardware import ClusterSpec

from autopar.plan_file import plan_problem
from autopar.solve import plan
from autopar.solve.constraints import ConstraintError
from autopar.solve.layout import layout_of
from autopar.solve.search_space import dp_shard_choices


def _model():
    return gpt("gpt-6.7b", hidden=4096, heads=32, layers=32, seq_len=2048, vocab_size=51200)


def _cluster(nodes: int, link: str = "ib-edr"):
    return dataclasses.replace(ClusterSpec.preset("dgx-h100", nodes=nodes), inter_node_link=link)


def test_shard_sizes_fill_whole_nodes():
    assert dp_shard_choices(128, 1, 8) == [8, 16, 32, 64]
    assert dp_shard_choices(64, 2, 8) == [4, 8, 16, 32]
    assert dp_shard_choices(8, 1, 8) == []  # one node: nothing between a node and the whole dp
    assert dp_shard_choices(96, 8, 8) == [2, 4, 8, 16, 32]


@pytest.fixture(scope="module")
def slow_fabric_plan():
    return plan(_model(), _cluster(16), global_batch_size=512, top_k=3)


def test_many_nodes_on_a_slow_fabric_choose_hsdp_and_say_why(slow_fabric_plan):
    p = slow_fabric_plan
    m = p.mesh
    assert m.hsdp and m.dp % m.dp_shard == 0 and m.dp_shard >= 8, m
    assert all(c.zero >= 1 for c in p.layer_choices)
    assert plan_problem(p) is None  # the Plan it writes is one its own checks accept
    why = p.solver["hsdp"]
    assert f"dp {m.dp} = {m.replicas} replicas x {m.dp_shard} shards" in why and "faster than sharding over the " \
        "whole dp" in why, why
    assert p.solver["selected"].startswith("HSDP")
    assert {r["axis"] for r in p.predicted.comm} >= {"dp_shard", "dp_replicate"}
    # the Plan prices as it reads back: layout_of carries dp_shard into the estimate
    assert layout_of(p).dp_shard == m.dp_shard
    # deterministic: the same inputs, the same JSON (the HSDP step prices in a fixed order)
    assert plan(_model(), _cluster(16), global_batch_size=512, top_k=3).to_json() == p.to_json()


def test_terminal_report_and_json_show_the_split(slow_fabric_plan, tmp_path):
    import io

    from rich.console import Console

    from autopar.commands.plan import _print_layout
    from autopar.plan import Plan
    from autopar.report import render_html
    p = slow_fabric_plan
    m = p.mesh
    text = f"{m.dp} = {m.replicas} replicas x {m.dp_shard} shards"
    out = io.StringIO()
    _print_layout(p, Console(file=out, width=400))
    said = " ".join(out.getvalue().split())
    assert text in said and "faster than sharding over the whole dp" in said, said
    html = render_html(p)
    assert f"dp {m.dp} = {m.replicas} replicas \u00d7 {m.dp_shard} shards" in html
    assert "dp_replicate" in html and "dp_shard" in html  # the mesh section's group rows
    shards = [a["mesh"]["dp_shard"] for a in p.alternatives if a["mesh"].get("dp_shard")]
    assert not shards or f"dp{m.dp} ({m.dp // shards[0]} replicas \u00d7 {shards[0]} shards)" in html  # alternatives
    assert Plan.from_json(p.to_json()).mesh.dp_shard == m.dp_shard
    assert any(a["mesh"].get("dp_shard") for a in p.alternatives) or p.alternatives == []


def test_one_node_does_not_use_hsdp():
    p = plan(_model(), _cluster(1), global_batch_size=64, top_k=2)
    assert not p.mesh.hsdp and "hsdp" not in p.solver


def test_a_pinned_dp_shard_is_searched_and_a_bad_one_refused():
    p = plan(_model(), _cluster(4), global_batch_size=128, constraints={"dp": 32, "dp_shard": 8, "zero": 3})
    assert (p.mesh.dp, p.mesh.dp_shard) == (32, 8) and p.constraints["dp_shard"] == 8
    with pytest.raises(ConstraintError, match="--dp-shard 6 does not divide --dp 32"):
        plan(_model(), _cluster(4), global_batch_size=128, constraints={"dp": 32, "dp_shard": 6})
    with pytest.raises(ConstraintError, match="--dp-shard 8 contradicts --zero 0"):
        plan(_model(), _cluster(4), global_batch_size=128, constraints={"dp_shard": 8, "zero": 0})


def test_hsdp_the_lowering_cannot_run_is_not_offered():
    """what_runs answers "hsdp" only where this torch cannot run it; the planner then offers
    none, and a pinned --dp-shard is refused with that reason."""
    model = _model()
    model.lowering_limits = {"checked": True, "hsdp": "this torch has no DeviceMesh._unflatten"}
    p = plan(model, _cluster(16), global_batch_size=512, top_k=1)
    assert not p.mesh.hsdp and "hsdp" not in p.solver
    with pytest.raises(Exception, match="lowering cannot run HSDP"):
        plan(model, _cluster(4), global_batch_size=128, constraints={"dp": 32, "dp_shard": 8, "zero": 3})
