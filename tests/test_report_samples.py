"""The sample reports in reports/ are what the current code renders from their plans.

Re-planning the four samples takes minutes, so this test checks the cheap,
exact half: each committed NAME.html equals render_html(NAME.plan.json)
byte for byte, is valid HTML5 and is under 2 MB. `python3 reports/regenerate.py
--check` re-plans too (see docs/report.md).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import html5lib
import pytest

from autopar.plan import Plan
from autopar.report import render_html

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports"


def _regenerate_module():
    spec = importlib.util.spec_from_file_location("regenerate", REPORTS / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REGENERATE = _regenerate_module()
SAMPLES = REGENERATE.SAMPLES


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample_report_matches_current_code(name):
    model_file = ROOT / SAMPLES[name][0].split(":")[0]
    if not model_file.exists():
        pytest.skip(f"{model_file.relative_to(ROOT)} is not in this checkout, so there is no {name} sample")
    html_path, plan_path = REPORTS / f"{name}.html", REPORTS / f"{name}.plan.json"
    assert html_path.exists() and plan_path.exists(), f"run `python3 reports/regenerate.py {name}`"
    html = html_path.read_text(encoding="utf-8")
    plan = Plan.load(str(plan_path))
    assert html == render_html(plan), f"stale: run `python3 reports/regenerate.py --render-only {name}`"
    html5lib.HTMLParser(strict=True).parse(html)
    assert len(html.encode()) < 2 * 1024 * 1024
    assert plan.mesh.world_size == int(SAMPLES[name][SAMPLES[name].index("--gpus") + 1])


def test_index_lists_the_saved_plans():
    readme = REPORTS / "README.md"
    assert readme.exists(), "run `python3 reports/regenerate.py --render-only`"
    assert readme.read_text(encoding="utf-8") == REGENERATE.index_text()
