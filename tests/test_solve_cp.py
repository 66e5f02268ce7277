"""Context parallelism in the planner (solve/context_parallel.py): pinned with --cp, tried
unpinned only where it can pay (long sequences whose cp-1 plan idles in its pipeline or
binds on memory), never where the lowering cannot run it; the Plan's numbers are the
estimate of the cp layout it states."""
import copy
import json

import pytest

import autopar
from autopar.errors import InfeasibleError
from autopar.solve.constraints import ConstraintError
from autopar.solve.layout import layout_of
from cost_models.analytic import llama
from cost_models.estimate import estimate
from cost_models.hardware import ClusterSpec

CLUSTER = "h100-sxm:16"  # 16 nodes, 128 GPUs


def _llama(seq=131072):
    return llama("l8", hidden=4096, heads=32, kv_heads=8, layers=32, seq_len=seq, vocab_size=128256,
                 ffn_hidden=14336)


def _plan(model=None, **constraints):
    return autopar.plan(model or _llama(), CLUSTER, global_batch_size=8, fusion=False, constraints=constraints)


def test_long_sequences_cut_when_the_pipeline_idles():
    """8 sequences of 131,072 tokens on 128 GPUs: without cp only a pipeline with one
    micro-batch per replica fills the GPUs; cutting sequences is faster, and says why."""
    plan = _plan()
    assert (plan.mesh.cp or 1) > 1 and plan.mesh.pp == 1
    assert plan.mesh.world_size == 128 and plan.global_batch_size == 8
    assert plan.solver["cp"].startswith(f"cp {plan.mesh.cp}: every sequence cut over {plan.mesh.cp} ranks")
    assert "faster than the best layout without cp" in plan.solver["cp"]
    assert any("cp" not in a["mesh"] for a in plan.alternatives)  # the layout without cp is shown beside it
    # what is priced is what runs: the Plan's numbers are the estimate of its own cp layout
    layout = layout_of(plan)
    assert layout.cp == plan.mesh.cp
    est = estimate(_llama(), layout, ClusterSpec.resolve(CLUSTER))
    assert est.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert plan.to_json() == _plan().to_json()  # same model and cluster, same plan
    from autopar.report.html import render_html  # the report draws the dp x cp x tp ranks and names cp
    assert f"dp {plan.mesh.dp} \u00d7 cp {plan.mesh.cp} \u00d7 tp {plan.mesh.tp} = 128 GPUs" in render_html(plan)


def test_pin_and_its_contradictions():
    assert _plan(cp=2).mesh.cp == 2
    with pytest.raises(ConstraintError, match="--cp 2 contradicts --pp 2"):
        _plan(cp=2, pp=2)
    with pytest.raises(ConstraintError, match="--cp 2 contradicts --dp-shard 2"):
        _plan(cp=2, dp_shard=2)


def test_not_tried_for_short_sequences_nor_where_the_lowering_cannot_run_it():
    assert "cp" not in _plan(_llama(seq=8192)).solver and _plan(_llama(seq=8192)).mesh.cp is None
    refused = copy.copy(_llama())
    refused.lowering_limits = {"checked": True, "cp": "layer 'x' passes an attention mask tensor to SDPA"}
    plan = autopar.plan(refused, CLUSTER, global_batch_size=8, fusion=False)
    assert plan.mesh.cp is None and "cp" not in json.loads(plan.to_json())["mesh"]
    with pytest.raises(InfeasibleError, match="--cp 2: context parallelism cannot be planned: the lowering cannot"):
        autopar.plan(refused, CLUSTER, global_batch_size=8, fusion=False, constraints={"cp": 2})


def test_export_refuses_a_cp_plan_in_one_line():
    from autopar.errors import AutoparError
    from autopar.export_config import export
    with pytest.raises(AutoparError, match="cuts sequences over cp 2 ranks"):
        export(_plan(cp=2), "torchtitan")
