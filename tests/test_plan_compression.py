"""Plan.grad_reduce_dtype (communication compression) in the JSON: a round trip keeps
it, a plan without it writes the JSON of before, and a hand plan that cannot mean it
is refused in one line (autopar/compression.py)."""
import json

import pytest

from autopar.errors import PlanMismatchError
from autopar.plan import Plan
from autopar.plan_file import load_plan_file
from conftest import hand_plan



def test_round_trip_and_the_json_of_before(tiny, tmp_path):
    plan = hand_plan(tiny, dp=2, zero=3, grad_reduce_dtype="bf16")
    plan.save(str(tmp_path / "p.json"))
    assert load_plan_file(str(tmp_path / "p.json")).grad_reduce_dtype == "bf16"
    plain = json.loads(hand_plan(tiny, dp=2, zero=3).to_json())
    assert "grad_reduce_dtype" not in plain  # uncompressed: every plan file before the field reads unchanged
    assert Plan.from_dict(plain).grad_reduce_dtype is None


@pytest.mark.parametrize("value, precision, dp, needle", [
    ("int8", "fp32", 2, "grad_reduce_dtype must be one of bf16"),
    ("bf16", "fp16", 2, "under fp16 training"),
    ("bf16", "fp32", 1, "with dp 1: no gradient is reduced"),
    (8, "fp32", 2, "grad_reduce_dtype must be a string"),
])
def test_a_hand_plan_that_cannot_mean_it_is_refused_in_one_line(tiny, tmp_path, value, precision, dp, needle):
    d = json.loads(hand_plan(tiny, dp=dp, zero=3, precision=precision).to_json())
    d["grad_reduce_dtype"] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanMismatchError) as err:
        load_plan_file(str(path))
    assert needle in err.value.message and "\n" not in err.value.message, err.value.message


def test_plan_for_model_refuses_bf16_reduction_of_fp16_gradients(tiny):
    with pytest.raises(PlanMismatchError, match="under fp16 training"):
        hand_plan(tiny, dp=2, zero=3, precision="fp16", grad_reduce_dtype="bf16")
