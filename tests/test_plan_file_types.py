"""A hand-edited plan with a value of the wrong type is refused naming the
field (JSON path) and the type it needs, exit 2: on the command line
(`autopar report --plan`) and in the library (`autopar.compile(plan=...)`,
`Plan.from_dict`), never as a raw TypeError from deep inside.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.errors import PlanMismatchError
from autopar.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def plan_dict():
    out = subprocess.run([sys.executable, "-m", "autopar", "plan", GPT + ":gpt_tiny", "--gpus", "4", "--device",
                          "cpu", "--json", "--top", "2"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _edit(d, path, value):
    d = json.loads(json.dumps(d))
    at = d
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return d


# (JSON path, bad value, words the message must carry)
CASES = [
    (["stages"], 3, ["stages must be a list", "got 3"]),
    (["mesh"], [1], ["mesh must be an object"]),
    (["mesh", "tp"], "2", ["mesh.tp must be a positive integer", "'2'"]),
    (["predicted"], 3, ["predicted must be an object"]),
    (["stages", 0], 3, ["stages[0] must be an object"]),
    (["stages", 0, "layers"], 3, ["stages[0].layers must be a list"]),
    (["stages", 0, "layers", 0], "x", ["stages[0].layers[0] must be an object"]),
    (["stages", 0, "layers", 0, "name"], 5, ["stages[0].layers[0].name must be a string"]),
    (["stages", 0, "layers", 0, "reshard_after_forward"], "yes", ["reshard_after_forward must be true or false"]),
    (["stages", 0, "layers", 0, "module_paths"], [3], ["module_paths must be a list of strings"]),
    (["stages", 0, "predicted"], 3, ["stages[0].predicted must be an object"]),
    (["stages", 0, "predicted", "fwd_s"], "x", ["stages[0].predicted.fwd_s must be a number"]),
    (["model"], 3, ["model must be an object"]),
    (["model", "total_params"], "x", ["model.total_params must be a number"]),
    (["alternatives"], 3, ["alternatives must be a list"]),
    (["alternatives", 0, "mesh", "tp"], "2", ["alternatives[0].mesh.tp must be a positive integer"]),
    (["constraints"], {"tp": "2"}, ["constraints.tp must be a positive integer"]),
    (["fusions"], 3, ["fusions must be a list"]),
    (["solver"], 3, ["solver must be an object"]),
    (["assumptions"], 3, ["assumptions must be an object"]),
    (["seq_len"], "x", ["seq_len must be a positive integer or null"]),
    (["precision"], 16, ["precision must be a string"]),
    (["predicted", "time_breakdown", "compute_s"], "x", ["predicted.time_breakdown.compute_s must be a number"]),
    (["predicted", "memory_breakdown", 0, "params"], "x", ["predicted.memory_breakdown[0].params must be a number"]),
    (["cluster", "device"], 3, ["cluster.device must be a string"]),
]


@pytest.mark.parametrize("path, value, needles", CASES, ids=[".".join(map(str, c[0])) for c in CASES])
def test_wrong_type_is_named_on_the_command_line(capsys, tmp_path, plan_dict, path, value, needles):
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(_edit(plan_dict, path, value)))
    code = main(["report", "--plan", str(file), "-o", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "TypeError" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("path, value, needles", CASES[:8], ids=[".".join(map(str, c[0])) for c in CASES[:8]])
def test_wrong_type_is_named_in_the_library(plan_dict, path, value, needles):
    import torch

    import autopar
    from gpt import gpt_tiny

    bad = _edit(plan_dict, path, value)
    with pytest.raises(PlanMismatchError) as info:
        Plan.from_dict(bad)
    for needle in needles:
        assert needle in info.value.message
    model, _ = gpt_tiny()
    with pytest.raises(PlanMismatchError) as info:
        autopar.compile(model, example_inputs=(torch.zeros(1, 16, dtype=torch.long),), plan=bad)
    for needle in needles:
        assert needle in info.value.message
    assert info.value.exit_code == 2


def test_a_valid_plan_still_loads(plan_dict):
    plan = Plan.from_dict(plan_dict)
    assert Plan.from_dict(json.loads(plan.to_json())).to_dict() == plan.to_dict()
