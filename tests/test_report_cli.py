"""`autopar report`: renders saved plans, plans from model files, fails clearly."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import html5lib
import pytest

from autopar.cli import main
from autopar.plan import Plan
from autopar.report import render_html
from test_report_fixtures import make_small_plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def saved_plan(tmp_path):
    path = tmp_path / "plan.json"
    make_small_plan().save(str(path))
    return path


def test_report_renders_a_saved_plan(tmp_path, saved_plan, capsys):
    out = tmp_path / "plan.html"
    assert main(["report", "--plan", str(saved_plan), "-o", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render_html(Plan.load(str(saved_plan)))
    said = capsys.readouterr().out
    assert str(out) in said and "pp 2 x dp 2 x tp 2" in said


@pytest.mark.parametrize("argv, message", [
    (["report", "--plan", "/no/such/plan.json"], "plan file not found"),
    (["report"], "nothing to report"),
    (["report", "model.py", "--plan", "PLAN"], "not both"),
    (["report", "--plan", "PLAN", "-o", "plan.json"], "must end in .html"),
    (["report", "--plan", "PLAN", "-o", "/no/such/dir/plan.html"], "/no/such/dir does not exist"),
])
def test_bad_input_exits_2_with_a_message(argv, message, saved_plan, capsys):
    argv = [str(saved_plan) if a == "PLAN" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("content, message", [
    ("{", "not valid JSON"),
    (json.dumps({"schema_version": 99}), "schema version 99"),
    (json.dumps({"schema_version": 1, "stages": [{"layers": []}]}), "not a valid autopar plan"),
])
def test_broken_plan_files_are_reported_not_raised(tmp_path, content, message, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["report", "--plan", str(bad), "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "x.html").exists()


def test_report_takes_the_same_options_as_plan():
    from autopar.cli import build_parser

    plan_opts = {a.dest for a in build_parser(["plan"])._subparsers._group_actions[0].choices["plan"]._actions}
    report_opts = {a.dest for a in build_parser(["report"])._subparsers._group_actions[0].choices["report"]._actions}
    # plan's own output flags (--export-config and its --clip write a config, not a report)
    shared = plan_opts - {"json", "top", "html", "export_config", "clip"}
    assert shared <= report_opts


def test_plan_html_and_json_come_from_one_plan(tmp_path, capsys, monkeypatch):
    """`autopar plan --json --html`: the page is exactly the rendering of the printed plan."""
    from autopar.commands.common import load_graph

    out = tmp_path / "plan.html"
    # Everything pinned: the solver only prices one layout, so this stays quick.
    argv = ["plan", "examples/gpt.py:gpt_tiny", "--gpus", "8", "--pp", "2", "--tp", "2", "--dp", "2",
            "--micro-batch", "2", "--batch-size", "16", "--zero", "1", "--checkpoint", "none", "--offload", "none",
            "--schedule", "1f1b", "--sequence-parallel", "--json", "--html", str(out)]
    monkeypatch.chdir(ROOT)
    assert main(argv) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    graph, _ = load_graph(SimpleNamespace(model="examples/gpt.py:gpt_tiny"))
    assert (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp) == (2, 2, 2)
    assert out.read_text(encoding="utf-8") == render_html(plan, graph)


def test_report_plans_from_a_model_file(tmp_path, capsys, monkeypatch):
    out = tmp_path / "tiny.html"
    monkeypatch.chdir(ROOT)
    argv = ["report", "examples/gpt.py:gpt_tiny", "--gpus", "8", "--pp", "2", "--tp", "2", "--dp", "2",
            "--micro-batch", "2", "--batch-size", "16", "--zero", "1", "--checkpoint", "none", "--offload", "none",
            "--schedule", "1f1b", "--sequence-parallel", "-o", str(out)]
    assert main(argv) == 0
    assert "pp 2 x dp 2 x tp 2" in capsys.readouterr().out
    text = out.read_text(encoding="utf-8")
    tree = html5lib.HTMLParser(strict=True).parse(text)
    assert "examples/gpt.py:gpt_tiny" in "".join(tree.itertext())
    assert "<th>params</th>" in text  # the captured graph reached the renderer (parameter counts)
