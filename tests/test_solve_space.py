"""Constraint parsing and the enumeration of meshes / micro-batching / schedules."""
import pytest

from autopar.errors import AutoparError
from autopar.solve.constraints import ConstraintError, check_against_cluster, parse_constraints, parse_schedule
from autopar.solve.problem import in_flight_numerators
from autopar.solve.search_space import divisors, enumerate_candidates


def test_parse_constraints_normalises_values():
    c = parse_constraints({"tp": "8", "pp": 4, "zero": "1", "checkpoint": "Full", "schedule": "interleaved:3",
                           "sequence_parallel": True})
    assert (c.tp, c.pp, c.zero, c.checkpoint, c.schedule, c.virtual_stages, c.sequence_parallel) == \
        (8, 4, 1, "full", "interleaved", 3, True)
    assert c.to_dict()["schedule"] == "interleaved:3"
    assert parse_constraints(None).to_dict() == {}


@pytest.mark.parametrize("raw, words", [
    ({"tpp": 2}, "unknown constraint"),
    ({"tp": 0}, "--tp must be a positive integer"),
    ({"zero": 4}, "--zero must be 0, 1, 2 or 3"),
    ({"checkpoint": "some"}, "--checkpoint must be one of"),
    ({"schedule": "zb"}, "is not a schedule"),
    ({"schedule": "1f1b:2"}, "only interleaved takes"),
    ({"schedule": "interleaved:1"}, "V >= 2"),
    ({"tp": 1, "sequence_parallel": True}, "contradicts --tp 1"),
    ({"pp": 1, "schedule": "interleaved"}, "contradicts --pp 1"),
    ({"offload": "params", "zero": 1}, "needs --zero 3"),
])
def test_bad_constraints_are_rejected_with_the_flag_named(raw, words):
    with pytest.raises(ConstraintError, match=words) as info:
        parse_constraints(raw)
    assert isinstance(info.value, AutoparError) and info.value.exit_code == 2


@pytest.mark.parametrize("raw, world, batch, words", [
    ({"tp": 8, "pp": 4, "dp": 4}, 64, 64, "= 128 GPUs, but the cluster has 64"),
    ({"tp": 3}, 64, 64, "does not divide the 64 GPUs"),
    ({"dp": 16}, 64, 24, "not divisible by --dp 16"),
    ({"micro_batch": 5}, 64, 64, "not divisible by --micro-batch 5"),
    ({"micro_batch": 4, "dp": 32}, 64, 64, "--dp 32 x --micro-batch 4"),
])
def test_constraints_checked_against_cluster_and_batch(raw, world, batch, words):
    with pytest.raises(ConstraintError, match=words):
        check_against_cluster(parse_constraints(raw), world, batch)


def test_enumeration_covers_exactly_the_valid_factorisations():
    cands, _ = enumerate_candidates(16, 32, 8, (1, 2, 4, 8))
    for c in cands:
        assert c.pp * c.dp * c.tp == 16
        assert c.dp * c.micro_batch_size * c.num_micro_batches == 32
        assert c.pp <= 8 and c.tp in (1, 2, 4, 8)
        assert (c.schedule == "interleaved") == (c.virtual_stages > 1)
        if c.schedule == "interleaved":
            assert c.num_micro_batches % c.pp == 0 and c.pp * c.virtual_stages <= 8
        assert not (c.sequence_parallel and c.tp == 1)
    meshes = {(c.pp, c.dp, c.tp) for c in cands}
    expected = {(pp, 16 // (pp * tp), tp) for tp in (1, 2, 4, 8) for pp in divisors(16 // tp) if pp <= 8}
    assert meshes == expected
    assert len(cands) == len(set(cands))  # no duplicates
    assert cands == enumerate_candidates(16, 32, 8, (1, 2, 4, 8))[0]  # deterministic order


def test_enumeration_honours_pins_and_reports_rejections():
    pins = parse_constraints({"tp": 2, "schedule": "interleaved:2", "micro_batch": 1})
    cands, _ = enumerate_candidates(16, 32, 8, (1, 2, 4, 8), pins)
    assert cands and all(c.tp == 2 and c.virtual_stages == 2 and c.micro_batch_size == 1 and c.pp > 1 for c in cands)
    # heads allow only tp 1 and 3: tp 2/4 rejected and explained
    cands, report = enumerate_candidates(4, 6, 2, (1, 3))
    assert {c.tp for c in cands} == {1}
    assert "no layer tp can split at this degree" in report.summary()
    cands, report = enumerate_candidates(7, 8, 4, (1,))
    assert cands == []
    assert "dp does not divide the global batch 8" in report.summary()
    assert "more pipeline stages than the 4 layers" in report.summary()


def test_in_flight_counts_match_the_cost_model_closed_forms():
    memory = pytest.importorskip("cost_models.memory")
    for schedule, pp, v, m in [("1f1b", 4, 1, 8), ("1f1b", 4, 1, 2), ("gpipe", 4, 1, 8), ("interleaved", 4, 2, 8),
                               ("interleaved", 8, 3, 16), ("1f1b", 1, 1, 8)]:
        mine = in_flight_numerators(schedule, pp, v, m)
        for r in range(pp):
            assert mine[r] / v == pytest.approx(memory.in_flight_micro_batches(schedule, pp, m, r, v))


def test_parse_schedule_forms():
    assert parse_schedule("1F1B") == ("1f1b", None)
    assert parse_schedule("interleaved") == ("interleaved", None)
    assert parse_schedule("interleaved:4") == ("interleaved", 4)


def test_1f1b_and_interleaving_need_at_least_pp_micro_batches():
    """torch's Schedule1F1B raises with fewer micro-batches than stages (lowering would
    silently fall back to GPipe), so such candidates are GPipe only."""
    cands, _ = enumerate_candidates(8, 8, 16, (1,))
    assert cands
    for c in cands:
        if c.pp > 1 and c.schedule in ("1f1b", "interleaved"):
            assert c.num_micro_batches >= c.pp
        if c.schedule == "interleaved":
            assert c.num_micro_batches % c.pp == 0
    few = [c for c in cands if c.pp > 1 and c.num_micro_batches < c.pp]
    assert few and {c.schedule for c in few} == {"gpipe"}
    # and with enough micro-batches all three are offered
    enough = {c.schedule for c in cands if c.pp == 2 and c.num_micro_batches >= 2}
    assert enough == {"gpipe", "1f1b", "interleaved"}


def test_pinned_1f1b_with_too_few_micro_batches_reports_why():
    pins = parse_constraints({"schedule": "1f1b"})
    cands, report = enumerate_candidates(8, 4, 16, (1,), pins)
    assert all(c.num_micro_batches >= c.pp for c in cands if c.pp > 1)
    assert "1f1b needs the micro-batch count to be at least pp" in report.summary()


@pytest.mark.parametrize("raw, batch, words", [
    ({"pp": 4, "schedule": "1f1b"}, 2, "--schedule 1f1b with --pp 4 needs at least 4 micro-batches"),
    ({"pp": 4, "dp": 2, "schedule": "1f1b"}, 4, "allows at most 2"),
    ({"pp": 2, "micro_batch": 2, "schedule": "interleaved"}, 2, "needs at least 2 micro-batches"),
])
def test_pinned_pipeline_schedule_with_too_few_micro_batches_is_an_error(raw, batch, words):
    with pytest.raises(ConstraintError, match=words) as exc:
        check_against_cluster(parse_constraints(raw), 8, batch)
    assert exc.value.exit_code == 2
    check_against_cluster(parse_constraints({**raw, "schedule": "gpipe"}), 8, batch)  # GPipe is fine


def test_cli_pinned_1f1b_with_too_few_micro_batches_exits_2(capsys):
    pytest.importorskip("cost_models.estimate")
    from pathlib import Path

    from autopar.cli import main
    gpt = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
    code = main(["plan", f"{gpt}:gpt_tiny", "--device", "cpu", "--gpus", "4", "--pp", "4", "--schedule", "1f1b",
                 "--batch-size", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "needs at least 4 micro-batches" in err and "Traceback" not in err
