"""Throughput in the unit of the model's inputs: samples/s for every model,
tokens/s only for token models. "Token model" is read from the captured graph
(its inputs have a sequence axis: `seq_len` is set), never from the model's
name: a ViT is a transformer over images and reports samples/s.
Checked in the terminal, the Plan JSON, `autopar report`'s line and the HTML.
"""
from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"image": str(ROOT / "examples" / "vit.py") + ":vit_tiny",
          "token": str(ROOT / "examples" / "gpt.py") + ":gpt_tiny"}


def _run(argv):
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module", params=sorted(MODELS))
def planned(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    argv = ["plan", MODELS[request.param], "--gpus", "2", "--device", "cpu", "--batch-size", "8", "--top", "3"]
    plan_json = d / "plan.json"
    plan_json.write_text(_run(argv + ["--json"]))
    report_line = _run(["report", "--plan", str(plan_json), "-o", str(d / "plan.html")])
    return request.param, _run(argv), json.loads(plan_json.read_text()), report_line, (d / "plan.html").read_text()


def test_units_follow_the_captured_inputs(planned):
    kind, terminal, plan, report_line, html = planned
    p = plan["predicted"]
    assert p["samples_per_s"] == pytest.approx(plan["global_batch_size"] / p["step_time_s"])
    assert "samples/s" in terminal and "samples/s" in report_line
    alts = [a["predicted"] for a in plan["alternatives"] if a["predicted"].get("step_time_s")]
    assert alts and all(a["samples_per_s"] > 0 for a in alts)
    if kind == "image":
        assert plan["seq_len"] is None
        assert p["tokens_per_s"] is None and all(a.get("tokens_per_s") is None for a in alts)
        for text in (terminal, report_line, html):
            assert "tokens/s" not in text and "tok/s" not in text
    else:
        assert p["tokens_per_s"] == pytest.approx(p["samples_per_s"] * plan["seq_len"])
        assert "tokens/s" in terminal and "tokens/s" in report_line and "tok/s" in html


def test_an_older_image_plan_loads_with_samples(planned):
    kind, _, plan, _, _ = planned
    old = json.loads(json.dumps(plan))
    old["predicted"].pop("samples_per_s")  # plans saved before samples/s counted samples as "tokens"
    old["predicted"]["tokens_per_s"] = old["global_batch_size"] / old["predicted"]["step_time_s"]
    loaded = Plan.from_dict(old)
    assert loaded.predicted.samples_per_s == pytest.approx(plan["predicted"]["samples_per_s"])
    assert (loaded.predicted.tokens_per_s is None) == (kind == "image")
