"""A pipeline of one stage has one schedule name, `accumulate` (the
micro-batches run one after another and accumulate gradients): in the Plan,
its JSON, the terminal, the HTML report and the alternatives. Older plan
files, which said "1f1b" or "gpipe" there, still load.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.plan import ACCUMULATE, Mesh, Plan

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
OLD_NAMES = ("none (accumulate)", "none (gradient accumulation)", "no pp", "no pipeline)")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """`autopar plan` of gpt_tiny on 4 CPU ranks (a pp 1 winner and pp 1/2 alternatives): terminal, JSON, HTML."""
    d = tmp_path_factory.mktemp("schedule")
    html = d / "plan.html"
    argv = ["plan", GPT + ":gpt_tiny", "--gpus", "4", "--device", "cpu", "--top", "5", "--html", str(html)]
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    text = io.StringIO()
    with redirect_stdout(text), redirect_stderr(io.StringIO()):
        assert main(argv[:-2] + ["--json"]) == 0
    return out.getvalue(), json.loads(text.getvalue()), html.read_text()


def test_one_name_in_plan_terminal_and_report(planned):
    terminal, plan, html = planned
    assert plan["mesh"]["pp"] == 1 and plan["schedule"] == ACCUMULATE == "accumulate"
    one_stage = [a for a in plan["alternatives"] if a["mesh"]["pp"] == 1]
    assert one_stage and all(a["schedule"] == ACCUMULATE for a in one_stage)
    assert all(a["schedule"] != ACCUMULATE for a in plan["alternatives"] if a["mesh"]["pp"] > 1)
    assert "accumulate" in terminal and "accumulate" in html
    for old in OLD_NAMES:
        assert old not in terminal and old not in html


@pytest.mark.parametrize("old", ["1f1b", "gpipe"])
def test_older_plan_files_with_another_name_still_load(planned, tmp_path, old):
    d = json.loads(json.dumps(planned[1]))
    d["schedule"] = old
    for a in d["alternatives"]:
        if a["mesh"]["pp"] == 1:
            a["schedule"] = old
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    plan = Plan.load(str(path))
    assert plan.schedule == ACCUMULATE
    assert all(a["schedule"] == ACCUMULATE for a in plan.alternatives if a["mesh"]["pp"] == 1)
    assert main(["report", "--plan", str(path), "-o", str(tmp_path / "r.html")]) == 0


def test_a_plan_made_in_python_says_accumulate_without_a_pipeline():
    assert Plan(mesh=Mesh(pp=1, dp=2), schedule="1f1b").schedule == ACCUMULATE
    assert Plan(mesh=Mesh(pp=2), schedule="1f1b").schedule == "1f1b"


def test_accumulate_can_be_pinned_and_contradicts_a_pipeline(capsys):
    from autopar.errors import AutoparError
    from autopar.solve.constraints import parse_constraints

    assert parse_constraints({"schedule": "accumulate"}).schedule == ACCUMULATE
    with pytest.raises(AutoparError, match="contradicts --pp 2"):
        parse_constraints({"schedule": "accumulate", "pp": 2})
