"""Published training runs priced by the cost model (benchmarks/published_runs.py).

These runs are the calibration set: the cost model's constants were set while
looking at them, so the bounds below state how well the model fits them, not
how well it predicts (the held-out check is test_megatron_weak_scaling_held_out).
Issue 3 asked for every row within 20% and a median under 12%; the median
holds, the per-row target no longer does since MT-NLG's micro-batch is read
honestly from its step times (issue 11): see CALIBRATION_WORST_BOUND. Also
checked: the published trends (more GPUs at a fixed batch -> lower per-GPU
throughput), Megatron-LM's own 530B MFU on the same layout, and the
micro-batch size MT-NLG's three published step times allow
(benchmarks/published_runs.identify_micro_batch). Rows the model cannot price
as run (torchtitan 405B: Float8 + torch.compile + async TP) are listed but
not counted.
"""
import sys

import pytest
from conftest import REFERENCE, ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import published_runs  # noqa: E402

# The honest bound on the calibration set today. Issue 3's 20% per-row target is not met: with
# the micro-batch MT-NLG's step times allow (1, not the rounded-up 2) its three rows are +16 /
# +17 / +22% fast (the step times leave 6 s per step outside the pipeline that the model does not
# explain). No constant was re-tuned to get back under 20%; cost-model fidelity on these
# DeepSpeed-engine runs is issue 13. Tighten this bound when that work lands.
CALIBRATION_WORST_BOUND = 0.22


@pytest.fixture(scope="module")
def results():
    return published_runs.run(REFERENCE / "published_runs.csv")


def test_every_row_priced_and_fits(results):
    assert len(results) == len(published_runs.RUNS) == 11
    for r in results:
        assert r["fits"], r["run"]  # the published layouts ran, so they must fit in our memory model
        assert r["predicted"] > 0


def test_not_comparable_rows_are_listed_but_not_counted(results):
    """torchtitan's 405B run used Float8 + torch.compile + async TP: priced as bf16 eager it is no
    prediction of that run, so it stays in the table, marked, and out of the statistics."""
    not_counted = [r for r in results if not r["counted"]]
    assert [r["run"] for r in not_counted] == ["torchtitan Llama3.1-405B, 512 H100 (tp8 pp8 dp8, 1F1B)"]
    assert "Float8" in not_counted[0]["not_comparable"]
    assert len(published_runs.counted(results)) == 10
    assert published_runs.statistics_of(results)["rows"] == 10
    assert "not counted" in published_runs.render(results)


def test_calibration_accuracy_bound(results):
    worst = max(published_runs.counted(results), key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) < CALIBRATION_WORST_BOUND, worst


def test_published_trends_are_reproduced(results):
    by = {r["run"]: r["predicted"] for r in results}
    mtnlg = [v for k, v in by.items() if k.startswith("MT-NLG")]
    assert mtnlg == sorted(mtnlg, reverse=True)  # 126 > 121 > 113: fewer micro-batches, bigger bubble
    llama = [v for k, v in by.items() if k.startswith("Llama3-405B")]
    assert llama[0] > llama[1]  # 430 > 400


def test_median_error_meets_the_issue(results):
    errors = sorted(abs(r["error"]) for r in published_runs.counted(results))
    assert errors[len(errors) // 2] < published_runs.MEDIAN_TOLERANCE
    assert published_runs.statistics_of(results)["median_abs"] < published_runs.MEDIAN_TOLERANCE


def test_issue3_targets_as_they_stand(results):
    """Issue 3's median target holds on the calibration set; its 20% per-row target does not
    (MT-NLG, see CALIBRATION_WORST_BOUND), and the report says so rather than claiming it."""
    counted = published_runs.counted(results)
    over = [r["run"] for r in counted if abs(r["error"]) > published_runs.TOLERANCE]
    assert all(run.startswith("MT-NLG") for run in over), over  # only the rows issue 13 is about
    assert ("not met" in published_runs.render(results)) == bool(over)


# Korthikanti et al. 2022 (abstract): the same 530B model and 2240-GPU layout as MT-NLG (tp 8, pp 35,
# micro-batch 1), run by Megatron-LM's 2022 code: 54.2% MFU with selective recomputation + sequence
# parallelism, 42.1% with full recomputation. Not in the CSV; held here so that closing the MT-NLG gap
# (a DeepSpeed-engine cost) is never done by slowing A100 compute in general.
@pytest.mark.parametrize("checkpoint, sp, published", [("selective", True, 0.542), ("full", False, 0.421)])
def test_megatron_lm_530b_mfu(checkpoint, sp, published):
    model = published_runs._mtnlg()
    layout = published_runs.Layout(tp=8, pp=35, dp=8, micro_batch_size=1, num_micro_batches=280, zero=1,
                                   checkpoint=checkpoint, sequence_parallel=sp, stage_layers=[4] + [3] * 33 + [4],
                                   p2p_blocking=True, main_grads="fp32")
    est = published_runs.estimate(model, layout, published_runs.ClusterSpec.resolve("dgx-a100:280"))
    assert est.mfu == pytest.approx(published, rel=0.12)


def test_identify_micro_batch_recovers_a_synthetic_pipeline():
    # steps of a 1F1B pipeline (pp 35) with micro-batch 2, per-sample slot 0.2 s and 0.5 s outside it
    pp, tau, b, c = 35, 0.2, 2, 0.5
    per_replica = [240, 192, 160]
    points = [(n, n * tau + (pp - 1) * b * tau + c) for n in per_replica]
    found = published_runs.identify_micro_batch(points, pp, per_replica)
    assert found["micro_batch_size"] == 2
    assert found["slot_per_sample_s"] == pytest.approx(tau)
    assert found["ratio"] == pytest.approx(b + c / ((pp - 1) * tau))
    assert found["outside_pipeline_s"] == pytest.approx(c)


def test_identify_micro_batch_never_implies_negative_time_outside_the_pipeline():
    # micro-batch 1 with 6 s outside the pipeline: ratio 1.88, nearer 2 than 1, but b = 2 would
    # need c = -0.8 s. The constraint c >= 0 means b <= ratio: floor, not round.
    pp, tau, b, c = 35, 0.2, 1, 6.0
    per_replica = [240, 192, 160]
    points = [(n, n * tau + (pp - 1) * b * tau + c) for n in per_replica]
    found = published_runs.identify_micro_batch(points, pp, per_replica)
    assert 1.5 < found["ratio"] < 2
    assert found["micro_batch_size"] == 1
    assert found["outside_pipeline_s"] == pytest.approx(c)
    with pytest.raises(ValueError, match="negative time outside the pipeline"):
        published_runs.identify_micro_batch([(n, n * tau) for n in per_replica], pp, per_replica)


def test_mtnlg_step_times_allow_micro_batch_one():
    """MT-NLG publishes 60.1 / 50.2 / 44.4 s at dp 8 / 10 / 12 (batch 1920, pp 35): a line through
    them has a 197 ms per-sample slope and a 12.7 s intercept, 1.89 pipeline slots of (pp - 1).
    Time outside the pipeline is >= 0, so b <= 1.89: micro-batch 1, leaving 6 s per step outside
    the pipeline (micro-batch 2 would need -0.7 s)."""
    import csv
    with open(REFERENCE / "published_runs.csv") as f:
        rows = list(csv.DictReader(f))
    found = published_runs._identified_micro_batches(rows)["MT-NLG-530B"]
    assert found["micro_batch_size"] == 1
    assert 1.7 < found["ratio"] < 2.0
    assert 5.5 < found["outside_pipeline_s"] < 6.5


def test_megatron_weak_scaling_held_out():
    """Narayanan et al. SC'21 Table 1 (1.7B-1T on 32-3072 A100), added after the constants were set."""
    import megatron_weak_scaling
    results = megatron_weak_scaling.run()
    assert len(results) == 10 and all(r["fits"] for r in results)
    for r in results:
        assert abs(r["error"]) <= megatron_weak_scaling.TOLERANCE, r
    # the published shape: per-GPU throughput grows with model size at fixed tp8 (bigger GEMMs)
    big = [r["predicted"] for r in results if r["params_B"] >= 39]
    assert big[-1] > big[0]


def test_time_breakdown_adds_up_to_the_step(results):
    """The report draws these parts as one bar: they must sum to the step, pipelines included."""
    parts = ("compute_s", "recompute_s", "tp_comm_s", "pp_comm_s", "dp_comm_exposed_s", "bubble_s", "optimizer_s",
             "straggler_s")
    for r in results:
        tb = r["time_breakdown"]
        assert sum(tb[k] for k in parts) == pytest.approx(r["step_time_s"], rel=1e-9), r["run"]
        assert tb["bubble_s"] >= 0 and tb["pp_comm_s"] >= 0
        assert 0 <= tb["nccl_contention_s"] <= tb["dp_comm_exposed_s"] + 1e-12
