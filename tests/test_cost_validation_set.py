"""The validation set (benchmarks/validation_runs.py): published runs no constant was
set from, priced as they ran. Issue 13's acceptance, checked on every change:
median |error| <= 10% over >= 60 runs, and the fsdp and tp/pp families' signed
medians within 5 points of each other (a model biased toward one family steers
the planner toward it). Issue 35's set that can fail (benchmarks/validation_set.py): >= 6
sources, none over a third, each scale band within its written-down bound. Plus the
TP-overlap rule on hand-made numbers."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import validation_runs as V  # noqa: E402
import validation_set as S  # noqa: E402

from cost_models.analytic import gpt  # noqa: E402
from cost_models.estimate import estimate  # noqa: E402
from cost_models.hardware import ClusterSpec  # noqa: E402
from cost_models.layout import Layout  # noqa: E402
from cost_models.overlap import TP_OVERLAP_SM_SHARE, tp_overlapped  # noqa: E402


@pytest.fixture(scope="module")
def priced():
    return V.run()


def test_validation_set_meets_the_acceptance(priced):
    results, skipped = priced
    assert len(results) >= 60
    allst = V.summary(results)
    fsdp = V.summary([r for r in results if r["family"] == "fsdp"])
    tppp = V.summary([r for r in results if r["family"] == "tp/pp"])
    assert fsdp["rows"] >= 20 and tppp["rows"] >= 10
    assert allst["median_abs"] <= V.MEDIAN_TARGET
    assert abs(fsdp["signed_median"] - tppp["signed_median"]) <= V.FAMILY_GAP_TARGET
    # the set spans what the issue asks: 125M to >= 175B, A100 and H100
    assert any("MPT-125m" in r["run"] for r in results) and any("175B" in r["run"] for r in results)
    assert any("a100" in r["run"].lower() for r in results) and any("h100" in r["run"].lower() for r in results)
    # nothing silently dropped: every unpriced row says why
    assert all(s["why"] for s in skipped)


@pytest.fixture(scope="module")
def the_set(priced):
    return V.validation_set(priced[0])  # the full pricing's rows, re-used: no second pricing


def test_validation_set_holds_its_rules(the_set):
    """Issue 35: >= 6 sources, none over a third, each scale band's median |error| within the bound
    written down at the first pricing, no calibration row. A cost change that moves a band out fails here."""
    rows, counts = the_set
    assert S.check(rows) == []
    sources = S.summarize(rows, "set_source")
    assert len(sources) >= S.MIN_SOURCES
    assert all(st["rows"] * 3 <= len(rows) for st in sources.values())
    assert {r["band"] for r in rows} == {b for b, _, _ in S.BANDS}
    assert counts["mosaicml/llm-foundry"][1] > counts["mosaicml/llm-foundry"][0]  # thinned, and says so


def test_set_check_fails_when_a_band_leaves_its_bound(the_set):
    rows, _ = the_set
    for band, bound in S.BAND_BOUNDS.items():
        moved = [{**r, "error": r["error"] + 2 * bound} if r["band"] == band else r for r in rows]
        assert any(band in p for p in S.check(moved)), band
    # a calibration row slipped into the set is caught by its (model, GPUs)
    intruder = {**rows[0], "run": "Llama3-8B 64x A100 (FSDP2)", "gpus": 64}  # torchtitan 2024-08
    assert any("calibration" in p for p in S.check(rows + [intruder]))


def test_halving_the_all_reduce_bytes_fails_the_set(monkeypatch):
    """The audit's mutation that moved the old set's median by 0.1 point: all-reduce priced on half
    its bytes. The > 512 band (all tp/pp, data-parallel reduces across nodes) leaves its bound."""
    import cost_models.comm as comm
    import cost_models.layer as layer

    real = comm.collective_time

    def halved(kind, nbytes, place, cluster):
        return real(kind, nbytes / 2 if kind == "all_reduce" else nbytes, place, cluster)

    monkeypatch.setattr(comm, "collective_time", halved)
    monkeypatch.setattr(layer, "_LAYER_CACHE", {})  # layer costs priced before the mutation are memoised
    rows, _ = V.validation_set()  # priced afresh under the mutation
    assert any("> 512 GPUs" in p for p in S.check(rows)), S.summarize(rows, "band")


def test_select_keeps_each_source_within_a_third_at_a_fixed_stride():
    specs = [{"source": "big", "i": i} for i in range(30)] + [{"source": f"s{k}", "i": 0} for k in range(6)]
    kept, counts = S.select(specs)
    assert counts["big"] == (3, 30) and len(kept) == 9  # k = 3: 3 <= (3 + 6) / 3
    assert [s["i"] for s in kept if s["source"] == "big"] == [0, 10, 20]
    assert S.select(specs)[0] == kept  # deterministic


def test_mpt_shapes_reproduce_published_parameter_counts():
    for spec in V.mpt_rows():
        if spec.get("skip"):
            continue
        model = spec["model"]()
        assert sum(layer.params for layer in model.layers) == spec["num_params"], spec["label"]


def test_tp_overlap_hides_all_but_one_chunk_under_long_gemms():
    comm, tp = 1.0, 4
    # GEMMs longer than the rest of the comm: one chunk exposed, plus the SMs the overlap takes
    long = tp_overlapped(comm, 10.0, tp, "fwd")
    assert long == pytest.approx(0.25 + 0.75 * TP_OVERLAP_SM_SHARE["fwd"])
    # short GEMMs: what they cannot cover stays exposed
    short = tp_overlapped(comm, 0.25, tp, "bwd")
    assert short == pytest.approx(0.25 + 0.5 + 0.25 * TP_OVERLAP_SM_SHARE["bwd"])
    assert tp_overlapped(comm, 0.0, tp, "fwd") == pytest.approx(comm)  # nothing to hide under


def test_tp_overlap_only_lowers_tp_time():
    model = gpt("g", hidden=4096, heads=32, layers=4, seq_len=2048, vocab_size=51200)
    cluster = ClusterSpec.resolve("dgx-h100:1")
    base = Layout(tp=4, dp=2, micro_batch_size=1, num_micro_batches=4, sequence_parallel=True)
    plain = estimate(model, base, cluster)
    over = estimate(model, Layout(**{**base.to_dict(), "tp_comm_overlap": True}), cluster)
    assert 0 < over.time_breakdown["tp_comm_s"] < plain.time_breakdown["tp_comm_s"]
    assert over.time_breakdown["compute_s"] == pytest.approx(plain.time_breakdown["compute_s"])
    assert over.step_time_s < plain.step_time_s
    assert over.peak_memory_bytes == plain.peak_memory_bytes
