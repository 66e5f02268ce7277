"""Plan.mesh.ep: absent from the JSON unless set (old plans read unchanged), round-trips,
and a hand plan whose ep cannot run is refused in one line: ep not dividing dp, ep beside
tp / pp, ep on a model without MoE layers, experts not a multiple of ep."""
from __future__ import annotations

import json

import pytest
import torch

from autopar.errors import PlanMismatchError
from autopar.plan import Mesh, Plan
from autopar.plan_file import ep_problem


def _plan(**mesh):
    return Plan(mesh=Mesh(**mesh), global_batch_size=8)


def test_ep_is_absent_from_the_json_unless_set_and_round_trips():
    assert "ep" not in json.loads(_plan(dp=4).to_json())["mesh"]
    text = _plan(dp=4, ep=2).to_json()
    assert json.loads(text)["mesh"]["ep"] == 2
    back = Plan.from_json(text)
    assert back.mesh.ep == 2 and back.mesh.efsdp == 2 and back.to_json() == text


@pytest.mark.parametrize("mesh, words", [
    (dict(dp=4, ep=3), "mesh.ep 3 must divide mesh.dp 4"),
    (dict(dp=4, tp=2, ep=2), "runs beside data and pipeline parallelism only"),
    (dict(dp=4, dp_shard=2, ep=2), "runs beside data and pipeline parallelism only"),
    (dict(dp=4, cp=2, ep=2), "does not run beside context parallelism"),
])
def test_a_hand_mesh_ep_that_cannot_run_is_refused(mesh, words):
    problem = ep_problem(_plan(**mesh))
    assert words in problem and "\n" not in problem
    assert ep_problem(_plan(dp=4, ep=2)) is None and ep_problem(_plan(dp=4, ep=1)) is None
    assert ep_problem(_plan(dp=4, pp=2, ep=2)) is None  # beside a pipeline: each stage's experts


def _example(b):
    return (torch.zeros(b, 8, dtype=torch.long),)


def test_plan_for_model_refuses_ep_without_moe_layers_or_with_experts_it_cannot_split():
    from test_lower_expert_parallel import build

    from autopar.lower.manual_plan import plan_for_model
    from autopar.zoo.gpt import GPT, GPTConfig
    dense = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=32, layers=2, heads=2))
    with pytest.raises(PlanMismatchError, match="has no MoE layer"):
        plan_for_model(dense, dp=2, ep=2, example_inputs=_example)
    with pytest.raises(PlanMismatchError, match="4 experts, which do not split over 3"):
        plan_for_model(build("mixtral"), dp=3, ep=3, example_inputs=_example)
    with pytest.raises(PlanMismatchError, match="must divide mesh.dp 2"):
        plan_for_model(build("mixtral"), dp=2, ep=4, example_inputs=_example)
    plan = plan_for_model(build("mixtral"), dp=4, ep=2, zero=3, example_inputs=_example)
    assert plan.mesh.ep == 2


def test_ep_and_cp_pins_contradict_and_the_cp_search_keeps_ep_1():
    """ep beside cp is not lowered (plan_file.ep_problem): pinning both is refused in one
    line, a pinned ep keeps cp out of the search, and the cp search's share pins ep 1."""
    import dataclasses
    from types import SimpleNamespace

    from autopar.solve import context_parallel as cp_search
    from autopar.solve.constraints import ConstraintError, parse_constraints
    with pytest.raises(ConstraintError, match="--ep 2 does not run beside context parallelism"):
        parse_constraints({"ep": 2, "cp": 2})
    spec = SimpleNamespace(seq_len=131072, tokens_per_sample=131072, lowering_limits=None)
    assert cp_search.sizes_to_try(spec, None, parse_constraints({"ep": 2}), 8, None) == []
    request = dataclasses.make_dataclass("Request", ["spec", "pins", "global_batch_size"])  # planner._Request's fields read
    share = cp_search.share_request(request(spec, parse_constraints(None), 8), 4)
    assert share.pins.ep == 1 and share.pins.cp == 4 and share.spec.seq_len == 32768
