"""Published training runs priced by the cost model (benchmarks/published_runs.py).

Acceptance (issue 3): every row within 20% of the published figure and the
median absolute error under 12%. The model does not meet it yet: every row is
predicted fast, by +8.5% (torchtitan 70B, A100) to +32% (torchtitan 8B on
500 W H100s), median +21% (BLOOM, MT-NLG, torchtitan 8B on H100 and the
8192-GPU Llama 3 run are outside 20%); that test is a strict xfail so it turns red the day
the gap closes and someone must update this note. What the model does meet
today is checked without xfail: no row off by more than 40%, the published
trends (more GPUs at a fixed batch -> lower per-GPU throughput) reproduced.
"""
import sys

import pytest
from conftest import ROOT, SHARED

sys.path.insert(0, str(ROOT / "benchmarks"))
import published_runs  # noqa: E402

CURRENT_TOLERANCE = 0.40


@pytest.fixture(scope="module")
def results():
    return published_runs.run(SHARED / "reference" / "published_runs.csv")


def test_every_row_priced_and_fits(results):
    assert len(results) == len(published_runs.RUNS) == 11
    for r in results:
        assert r["fits"], r["run"]  # the published layouts ran, so they must fit in our memory model
        assert r["predicted"] > 0


def test_current_accuracy_bound(results):
    worst = max(results, key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) < CURRENT_TOLERANCE, worst


def test_published_trends_are_reproduced(results):
    by = {r["run"]: r["predicted"] for r in results}
    mtnlg = [v for k, v in by.items() if k.startswith("MT-NLG")]
    assert mtnlg == sorted(mtnlg, reverse=True)  # 126 > 121 > 113: fewer micro-batches, bigger bubble
    llama = [v for k, v in by.items() if k.startswith("Llama3-405B")]
    assert llama[0] > llama[1]  # 430 > 400


@pytest.mark.xfail(strict=True, reason="known gap: whole-step throughput predicted 8-32% fast, median 21% "
                                       "(docs/cost_model.md, 'Accuracy')")
def test_issue3_acceptance(results):
    errors = sorted(abs(r["error"]) for r in results)
    assert all(e <= published_runs.TOLERANCE for e in errors)
    assert errors[len(errors) // 2] < published_runs.MEDIAN_TOLERANCE
