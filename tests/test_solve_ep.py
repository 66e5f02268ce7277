"""ep in the planner: searched for a model with MoE layers on meshes of data parallelism
alone (each degree priced by its own per-layer table), pinned with --ep, explained in
Plan.solver["ep"]; refused where it cannot run (no MoE layer, beside tp / pp, a model
what_runs says cannot split its experts)."""
from __future__ import annotations

import logging

import pytest
import torch

from autopar.errors import AutoparError
from autopar.solve.constraints import ConstraintError, parse_constraints
from autopar.solve.search_space import enumerate_candidates
from cost_models.hardware import ClusterSpec


@pytest.fixture(scope="module")
def mixtral():
    import autopar
    from test_lower_ep_plan import build
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    model = build("mixtral")
    return autopar.capture(model, (torch.zeros(2, 16, dtype=torch.long),))


def _plan(graph, constraints=None):
    import autopar
    return autopar.plan(graph, ClusterSpec.preset("dgx-h100", nodes=1), global_batch_size=64, precision="bf16",
                        fusion=False, constraints=constraints)


def test_ep_is_searched_and_explained(mixtral):
    p = _plan(mixtral)
    meshes = [a["mesh"] for a in p.alternatives] + [{"ep": p.mesh.ep}]
    assert any(m.get("ep") for m in meshes), meshes  # ep layouts were priced
    assert p.solver["ep"].startswith("ep 1:" if not p.mesh.ep else f"ep {p.mesh.ep}:"), p.solver["ep"]


def test_a_pinned_ep_is_planned_priced_and_saved(mixtral):
    from autopar.plan import Plan
    p = _plan(mixtral, {"ep": 2, "pp": 1})
    assert (p.mesh.ep, p.mesh.tp) == (2, 1)
    assert p.constraints["ep"] == 2 and "ep 2:" in p.solver["ep"]
    row = next(r for r in p.predicted.comm if r["axis"] == "ep")
    assert row["collective"].startswith("all_to_all") and p.predicted.time_breakdown["ep_comm_s"] > 0
    assert Plan.from_json(p.to_json()).mesh.ep == 2


def test_ep_pins_that_cannot_run_are_refused():
    with pytest.raises(ConstraintError, match="does not divide --dp 4"):
        parse_constraints({"dp": 4, "ep": 3})
    with pytest.raises(ConstraintError, match="runs beside data and pipeline parallelism only"):
        parse_constraints({"tp": 2, "ep": 2})
    pins = parse_constraints({"ep": 2})
    # a model whose experts cannot split (what_runs' "ep", DBRX): no candidate, the reason said
    cands, report = enumerate_candidates(8, 64, 4, [1, 2], pins, experts=4,
                                         lowering_limits={"checked": True, "ep": "DBRX: 2-D experts"})
    assert not cands and "lowering cannot run ep (DBRX: 2-D experts)" in report.summary()
    cands, report = enumerate_candidates(8, 64, 4, [1, 2], pins, experts=0)
    assert not cands and "no MoE layer" in report.summary()
    # unpinned: ep only on meshes without tp, degrees dividing both dp and the experts
    cands, _ = enumerate_candidates(8, 64, 4, [1, 2], parse_constraints({}), experts=4)
    assert {c.ep for c in cands if c.pp == 1 and c.tp == 1} == {0, 2, 4}
    assert {c.ep for c in cands if c.pp == 2 and c.tp == 1} == {0, 2, 4}
    assert {c.ep for c in cands if c.tp > 1} == {0}


def test_pinning_ep_on_a_dense_model_is_refused():
    import autopar
    from autopar.zoo.gpt import GPT, GPTConfig
    graph = autopar.capture(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, layers=2, heads=2)),
                            (torch.zeros(2, 16, dtype=torch.long),))
    with pytest.raises(AutoparError, match="no MoE layer"):
        _plan(graph, {"ep": 2})
