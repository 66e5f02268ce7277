"""A run's own global batch (train.py --batch-size) and a batch ramp (--batch-ramp
START:STEPS): more or fewer of the plan's micro-batches a step where its layout
allows it, refused with the fix where it does not, the data order exact across a
ramp and a resume."""
import json
import os

import pytest

from autopar.lower.manual_plan import plan_for_model
from autopar.lower.parallel_model import runtime_batch_refusal
from autopar.train.data import BatchSizes, GlobalBatches
from dist_utils import run_world
from train_worlds import GPT_TINY, gpt_tiny_tokens, main_world, write_plan

ARGS = ["--seed", "3", "--lr", "1e-2", "--quiet", "--no-plot"]


def test_a_ramp_grows_in_whole_micro_batches_and_counts_what_it_read():
    sizes = BatchSizes(16, 4, start=8, steps=4)
    assert [sizes.size(k) for k in range(6)] == [8, 8, 12, 12, 16, 16]  # 8 + 2k, rounded down to 4s
    assert [sizes.consumed(k) for k in range(7)] == [0, 8, 16, 28, 40, 56, 72]
    assert sizes.to_dict() == {"global_batch": 16, "ramp": "8:4"}
    assert not BatchSizes(16, 4).ramped and BatchSizes(16, 4).size(3) == 16
    with pytest.raises(Exception, match="must lie in"):
        BatchSizes(16, 4, start=2, steps=4)


def test_a_ramped_order_reads_every_sample_once_an_epoch_on_every_dp_rank():
    data = list(range(50))
    sizes = BatchSizes(12, 4, start=4, steps=5)
    ranks = [GlobalBatches(data, 12, 2, r, seed=1, sizes=sizes) for r in range(2)]
    read = []
    assert [sizes.size(k) for k in range(9)] == [4, 4, 4, 8, 8, 12, 12, 12, 12]
    for step in range(9):  # 76 samples: one epoch and 26 more
        got = [ranks[r].indices(step) for r in range(2)]
        assert sum(len(g) for g in got) == sizes.size(step)
        read += got[0] + got[1]
    assert sorted(read[:50]) == data  # the first epoch: each sample once
    assert len(read) == 76 and len(set(read[50:])) == 26  # the second epoch's start: no repeats
    # a fresh reader (a resumed run) at step 6 reads what the uninterrupted one did
    again = GlobalBatches(data, 12, 2, 1, seed=1, sizes=BatchSizes(12, 4, start=4, steps=5))
    assert again.indices(6) == ranks[1].indices(6)
    assert ranks[0].state_dict()["batch_ramp"] == "4:5"


def test_a_resume_at_another_global_batch_continues_the_saved_order():
    """A run at 8 a step saved at step 3 and resumed at 16 (then 4, ramped back up):
    each resumed step reads the samples after those the saved run had read, so an
    epoch still reads every sample once; a later resume with the same flags reads
    what the resumed run read, and another seed is still another order."""
    data = list(range(64))
    first = GlobalBatches(data, 8, 2, 0, seed=1, sizes=BatchSizes(8, 4))
    read = [i for k in range(3) for r in range(2) for i in GlobalBatches(data, 8, 2, r, seed=1).indices(k)]
    bigger = [GlobalBatches(data, 16, 2, r, seed=1, sizes=BatchSizes(16, 4)) for r in range(2)]
    said = [b.resume(first.state_dict(), 3) for b in bigger]
    assert said[0] and "8 -> 16" in said[0]
    read += [i for k in range(3, 5) for b in bigger for i in b.indices(k)]
    assert len(read) == len(set(read)) == 56  # 24 + 32 samples, none read twice in the epoch
    saved = bigger[0].state_dict()
    assert saved["phase"] == {"step": 3, "offset": 24}
    again = GlobalBatches(data, 16, 2, 1, seed=1, sizes=BatchSizes(16, 4))
    assert again.resume(saved, 4) is None and again.indices(4) == bigger[1].indices(4)  # the same flags: the same order
    ramped = GlobalBatches(data, 16, 1, 0, seed=1, sizes=BatchSizes(16, 4, start=4, steps=2))
    assert ramped.resume(saved, 5) and ramped.position(5) == 24 + 2 * 16  # where the saved run would read at step 5
    assert [ramped.batch_size(k) for k in (5, 6, 7)] == [4, 8, 16]  # its ramp starts at the change
    with pytest.raises(Exception, match="another data order"):
        GlobalBatches(data, 16, 1, 0, seed=2).resume(saved, 5)


def test_what_a_layout_cannot_run_at_another_batch_is_refused_with_why():
    model, example = __import__("gpt").gpt_tiny()
    accumulate = plan_for_model(model, example_inputs=example, dp=1, micro_batch_size=2, num_micro_batches=2)
    assert runtime_batch_refusal(accumulate, 6) is None and runtime_batch_refusal(accumulate, 1) is None
    assert "BatchNorm" not in (runtime_batch_refusal(accumulate, 3, ["bn1"]) or "")
    assert "each normalise alone" in runtime_batch_refusal(accumulate, 3, ["bn1"])
    gpipe = plan_for_model(model, example_inputs=example, pp=2, micro_batch_size=2, num_micro_batches=2,
                           schedule="gpipe")
    assert "more memory" in runtime_batch_refusal(gpipe, 4) and runtime_batch_refusal(gpipe, 2) is None
    assert "at least 2" in runtime_batch_refusal(gpipe, 1)
    one_f = plan_for_model(model, example_inputs=example, pp=2, micro_batch_size=2, num_micro_batches=2,
                           schedule="1f1b")
    assert runtime_batch_refusal(one_f, 8) is None  # 1F1B holds at most pp micro-batches in flight
    inter = plan_for_model(model, example_inputs=example, pp=2, micro_batch_size=2, num_micro_batches=2,
                           schedule="interleaved", virtual_stages=2)
    assert "multiple" in runtime_batch_refusal(inter, 3) and runtime_batch_refusal(inter, 4) is None


def _run(world, plan, tmp_path, name, extra, steps=4):
    out = tmp_path / name
    os.makedirs(out, exist_ok=True)
    argv = ARGS + ["--data", gpt_tiny_tokens(tmp_path), "--steps", str(steps), "--losses-out", str(out / "losses.json"),
                   "--metrics", str(out / "metrics.jsonl")] + extra
    assert run_world(main_world, world, GPT_TINY, plan, argv, timeout=300) == [0] * world
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "losses.json").read_text()), rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_batch_size_runs_more_micro_batches_as_a_plan_for_that_batch_would(tmp_path):
    """--batch-size 16 on a plan for 8 (dp 2 x micro-batch 4, pp 2 1F1B) runs 2 micro-batches
    a step and trains as the plan made for 16 does; ignoring the flag would train on 8."""
    for name, layout in [("dp", dict(dp=2, zero=3, micro_batch_size=4)),
                         ("pp", dict(pp=2, micro_batch_size=2, schedule="1f1b"))]:
        small = write_plan(str(tmp_path / f"{name}8.json"), num_micro_batches=2 if name == "pp" else 1, **layout)
        big = write_plan(str(tmp_path / f"{name}16.json"), num_micro_batches=4 if name == "pp" else 2, **layout)
        got, rows = _run(2, small, tmp_path, f"{name}_flag", ["--batch-size", str(16 if name == "dp" else 8)])
        ref, _ = _run(2, big, tmp_path, f"{name}_plan", [])
        plain, _ = _run(2, small, tmp_path, f"{name}_plain", [])
        assert max(abs(a - b) / b for a, b in zip(got, ref)) < 1e-5, (name, got, ref)
        assert max(abs(a - b) / b for a, b in zip(got, plain)) > 1e-3, (name, got, plain)
        assert {r["global_batch"] for r in rows} == {16 if name == "dp" else 8}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_batch_ramp_resumes_exactly_and_bad_batches_are_refused_at_start(tmp_path, capfd):
    plan = write_plan(str(tmp_path / "dp2.json"), dp=2, zero=3, micro_batch_size=2)  # global batch 4
    ramp = ["--batch-size", "16", "--batch-ramp", "4:4"]
    ref, rows = _run(2, plan, tmp_path, "ref", ramp + ["--save-dir", str(tmp_path / "ckpt"), "--save-every", "3"],
                     steps=6)
    assert [r["global_batch"] for r in rows] == [4, 4, 8, 12, 16, 16]  # 4 + 3k in whole 4s, then 16
    assert rows[0]["predicted_step_time_s"] is None  # priced for the plan's batch of 4 only: not this step
    resumed, rows2 = _run(2, plan, tmp_path, "resumed",
                          ramp + ["--resume", str(tmp_path / "ckpt" / "step-00000003")], steps=6)
    assert resumed == ref[3:]  # bit for bit: the ramp's data order is a function of the step
    assert [r["global_batch"] for r in rows2] == [12, 16, 16]
    # refused before training, with the fix
    rcs = run_world(main_world, 2, GPT_TINY, plan, ARGS + ["--synthetic", "--batch-size", "6"], timeout=120)
    assert rcs == [2, 2]
    err = capfd.readouterr().err
    assert "--batch-size 6" in err and "multiple of 4" in err and "autopar compile MODEL --batch-size 6" in err
    other = run_world(main_world, 2, GPT_TINY, plan, ARGS + ["--data", gpt_tiny_tokens(tmp_path), "--steps", "2",
                                                             "--seed", "4", "--resume",
                                                             str(tmp_path / "ckpt" / "step-00000003")], timeout=120)
    assert other == [2, 2] and "another data order" in capfd.readouterr().err
    # another global batch on resume: a new stretch of the same order, said at start
    _, grown = _run(2, plan, tmp_path, "grown", ["--batch-size", "8", "--resume",
                                                 str(tmp_path / "ckpt" / "step-00000003")], steps=6)
    assert [r["global_batch"] for r in grown] == [8, 8, 8]
    assert "the global batch changes at step 3: 12 -> 8" in capfd.readouterr().err


def _planned(path, batch: int) -> str:
    """A plan the planner made for gpt_tiny on 2 CPU ranks (fp32), as `autopar plan -o` writes it."""
    import contextlib
    import io

    from autopar.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", GPT_TINY, "--gpus", "2", "--device", "cpu", "--precision", "fp32", "--batch-size",
                     str(batch), "--json"]) == 0
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(out.getvalue())
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_batch_the_planned_layout_cannot_run_is_re_planned_at_start(tmp_path, capfd):
    """--batch-size 6 on a plan the planner made for 4 (dp 2 x micro-batch 2: multiples of 4):
    the same request is planned again at 6 (written as plan.batch-6.json beside the plan,
    made once by the preflight and read by every rank), and the run trains as the plan made
    for 6 by `autopar plan` does, priced at its own batch. A hand-made plan is refused instead."""
    from autopar.plan import Plan
    from autopar.train import main

    base = _planned(tmp_path / "build" / "plan.json", 4)
    plan4 = Plan.load(base)
    assert (plan4.global_batch_size, 4 % (plan4.micro_batch_size * plan4.mesh.dp)) == (4, 0)
    assert 6 % (plan4.micro_batch_size * plan4.mesh.dp), "the layout must be one that cannot run 6"
    fresh = _planned(tmp_path / "fresh6.json", 6)
    extra = ["--batch-size", "6"]
    assert main(GPT_TINY, base, ["--preflight", "--data", gpt_tiny_tokens(tmp_path)] + extra) == 0
    assert "re-planning for 6" in capfd.readouterr().err
    replanned = Plan.load(str(tmp_path / "build" / "plan.batch-6.json"))
    assert replanned.global_batch_size == 6 and replanned.solver["replanned_from"]["global_batch_size"] == 6
    assert replanned.to_dict()["mesh"] == Plan.load(fresh).to_dict()["mesh"]
    got, rows = _run(2, base, tmp_path, "replanned", extra)
    assert "re-planning" not in capfd.readouterr().err  # the ranks read the preflight's plan
    ref, _ = _run(2, fresh, tmp_path, "fresh", [])
    assert max(abs(a - b) / b for a, b in zip(got, ref)) < 1e-5, (got, ref)
    assert {r["global_batch"] for r in rows} == {6}
    assert all(r["predicted_step_time_s"] == replanned.predicted.step_time_s for r in rows)
    # a plan written by hand keeps its layout: refused with the fix, not re-chosen
    hand = write_plan(str(tmp_path / "hand.json"), dp=2, zero=3, micro_batch_size=2)
    assert run_world(main_world, 2, GPT_TINY, hand, ARGS + ["--synthetic"] + extra, timeout=120) == [2, 2]
    assert "multiple of 4" in capfd.readouterr().err


def test_a_prediction_is_held_only_against_the_steps_run_at_its_batch(tmp_path):
    """The plan priced its own global batch: the median step time the summary, the plot and the
    report set beside it comes from the steps run at that batch, not from ramp steps at another."""
    from autopar.metrics_file import predictions, run_facts, series
    from autopar.train.metrics import Metrics

    rows = [{"step": k, "loss": 1.0, "step_time_s": t, "global_batch": b}
            for k, (t, b) in enumerate([(9.0, 4), (1.0, 4), (1.0, 8), (1.0, 8), (2.0, 16), (2.0, 16)])]
    facts = run_facts(series(rows, 16), predictions({"step_time_s": 2.0}))
    assert facts["median_step_time_s"] == 2.0 and facts["step_time_ratio"] == 1.0
    assert run_facts(series(rows), predictions({"step_time_s": 2.0}))["median_step_time_s"] == 1.0  # every step

    model, example = __import__("gpt").gpt_tiny()
    plan = plan_for_model(model, example_inputs=example, dp=1, micro_batch_size=2)
    plan.predicted.step_time_s = 2.0
    metrics = Metrics(plan)
    for k, (t, b) in enumerate([(9.0, 1), (1.0, 1), (1.0, 1), (3.0, 2), (3.0, 2)]):  # a ramp to the plan's
        metrics.record(k, loss=1.0, step_time_s=t, global_batch=b * plan.global_batch_size // 2)
    assert "2 s predicted, 3 s measured" in metrics.summary()
    other = Metrics(plan)
    other.record(0, loss=1.0, step_time_s=5.0, global_batch=4 * plan.global_batch_size)
    assert "no step ran at the plan's global batch" in other.summary()
