"""Plan.mesh.dp_shard (HSDP) in the JSON: a round trip keeps it, a plan without it
writes the JSON of before, and a hand plan with a bad value is refused in one line."""
import json

import pytest

from autopar.errors import PlanMismatchError
from autopar.plan import Plan
from autopar.plan_file import load_plan_file
from conftest import hand_plan



def test_round_trip_and_the_json_of_before(tiny, tmp_path):
    plan = hand_plan(tiny, dp=4, dp_shard=2, zero=3)
    again = Plan.from_json(plan.to_json())
    assert again.mesh.dp_shard == 2 and again.mesh.hsdp and again.mesh.replicas == 2
    assert again.mesh.dp_text() == "dp 4 = 2 replicas x 2 shards"
    plan.save(str(tmp_path / "p.json"))
    assert load_plan_file(str(tmp_path / "p.json")).mesh.dp_shard == 2
    plain = json.loads(hand_plan(tiny, dp=4, zero=3).to_json())
    assert plain["mesh"] == {"pp": 1, "dp": 4, "tp": 1}  # no dp_shard: every plan file before HSDP reads unchanged
    assert Plan.from_dict(plain).mesh.shard_ranks == 4 and not Plan.from_dict(plain).mesh.hsdp


@pytest.mark.parametrize("value, zero, needle", [
    (3, 3, "mesh.dp_shard 3 must divide mesh.dp 4"),
    ("2", 3, "mesh.dp_shard must be a positive integer"),
    (2, 0, "(HSDP) shards ZeRO states, but layer"),
])
def test_a_hand_plan_with_a_bad_dp_shard_is_refused_in_one_line(tiny, tmp_path, value, zero, needle):
    d = json.loads(hand_plan(tiny, dp=4, zero=zero).to_json())
    d["mesh"]["dp_shard"] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanMismatchError) as err:
        load_plan_file(str(path))
    assert needle in err.value.message and "\n" not in err.value.message, err.value.message


def test_plan_for_model_refuses_hsdp_without_zero(tiny):
    with pytest.raises(PlanMismatchError, match="have zero 0; set their zero to 1, 2 or 3, or drop dp_shard"):
        hand_plan(tiny, dp=4, dp_shard=2)


def test_preflight_refuses_hsdp_this_torch_cannot_run(tiny, monkeypatch):
    from autopar.lower import data_parallel, preflight
    from autopar.lower.model_layers import resolve
    model, _ = tiny
    plan = hand_plan(tiny, dp=4, dp_shard=2, zero=3)
    assert data_parallel.hsdp_refusal() is None  # torch 2.13 runs it
    preflight.check_plan(model, plan, resolve(model, plan))
    monkeypatch.setattr(data_parallel, "hsdp_refusal", lambda: "this torch has no DeviceMesh._unflatten")
    with pytest.raises(PlanMismatchError, match=r"mesh.dp_shard 2 \(HSDP\) cannot run: this torch has no"):
        preflight.check_plan(model, plan, resolve(model, plan))
