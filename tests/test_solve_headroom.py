"""Memory headroom: plans keep (1 - headroom) x usable memory as their limit, say so in
the Plan (solver.memory_headroom / memory_limit_bytes, in the JSON) and on the terminal.
Before it, plans sat at 97-100 % of usable memory (GPT-3 6.7B on 8 x A100-40GB: 99.9 %)."""
import io
import json

import pytest

pytest.importorskip("cost_models.estimate", reason="cost_models.estimate is not in this checkout")

from cost_models.analytic import gpt  # noqa: E402
from cost_models.estimate import estimate  # noqa: E402
from cost_models.hardware import ClusterSpec  # noqa: E402

from autopar.cli import main  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from autopar.solve import ConstraintError, layout_of, plan  # noqa: E402
from autopar.solve.planner import DEFAULT_MEMORY_HEADROOM, scaled_cluster  # noqa: E402

GPT_6_7B = dict(hidden=4096, heads=32, layers=32, seq_len=2048, vocab_size=50304)


@pytest.fixture(scope="module")
def model():
    return gpt("gpt3-6.7b", **GPT_6_7B)


@pytest.fixture(scope="module")
def cluster():
    return scaled_cluster(ClusterSpec.resolve("a100-40g"), 1)  # 8 x 40 GB: memory binds


@pytest.mark.parametrize("headroom", [None, 0.0, 0.25])
def test_peak_stays_within_the_limit(model, cluster, headroom):
    p = plan(model, cluster, global_batch_size=16, memory_headroom=headroom, top_k=2)
    h = DEFAULT_MEMORY_HEADROOM if headroom is None else headroom
    usable = cluster.device_profile.usable_memory_bytes
    assert p.solver["memory_headroom"] == h
    assert p.solver["memory_limit_bytes"] == pytest.approx((1 - h) * usable)
    est = estimate(model, layout_of(p), cluster)
    assert max(est.peak_memory_bytes) <= (1 - h) * usable
    # every alternative that fits respects it too; the ones over it say so
    for a in p.alternatives:
        if a["status"] != "oom" and a["predicted"]:
            assert max(a["predicted"]["peak_memory_bytes"]) <= (1 - h) * usable
    # and it is in the JSON, and survives a round trip
    again = Plan.from_json(p.to_json())
    assert again.solver["memory_headroom"] == h
    assert json.loads(p.to_json())["solver"]["memory_limit_bytes"] == p.solver["memory_limit_bytes"]


def test_the_default_headroom_changes_a_plan_that_filled_memory(model, cluster):
    full = plan(model, cluster, global_batch_size=16, memory_headroom=0.0, top_k=0)
    default = plan(model, cluster, global_batch_size=16, top_k=0)
    usable = cluster.device_profile.usable_memory_bytes
    # issue 11 saw 97%; since the estimate counts one micro-batch's activations and
    # gradients as never peaking together (docs/cost_model.md section 4), the same plan was
    # priced at 95%, and since the data-parallel reduce-scatter moments are booked per
    # micro-batch (ca4c147) at 91%: the solver's own memory terms still add them, so it stays
    # conservative. What the test holds: without headroom the plan uses memory the default
    # 10% headroom forbids
    assert max(full.predicted.peak_memory_bytes) > 0.9 * usable
    assert max(default.predicted.peak_memory_bytes) <= 0.9 * usable
    assert default.predicted.step_time_s >= full.predicted.step_time_s  # memory bought with time


def test_headroom_via_constraints_for_autopar_compile(model, cluster):
    """autopar.compile(constraints=...) hands its constraints to the planner."""
    p = plan(model, cluster, global_batch_size=16, constraints={"memory_headroom": 0.3}, top_k=0)
    assert p.solver["memory_headroom"] == 0.3 and p.constraints["memory_headroom"] == 0.3
    assert max(p.predicted.peak_memory_bytes) <= 0.7 * cluster.device_profile.usable_memory_bytes
    # the argument wins over the constraint
    q = plan(model, cluster, global_batch_size=16, constraints={"memory_headroom": 0.3}, memory_headroom=0.2,
             top_k=0)
    assert q.solver["memory_headroom"] == 0.2


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, "0.1", True, float("nan")])
def test_bad_headroom_is_refused(model, cluster, bad):
    with pytest.raises(ConstraintError, match="headroom"):
        plan(model, cluster, global_batch_size=16, memory_headroom=bad, top_k=0)
    with pytest.raises(ConstraintError, match="headroom"):
        plan(model, cluster, global_batch_size=16, constraints={"memory_headroom": bad}, top_k=0)


def test_a_layout_that_only_fits_without_headroom_is_refused_and_says_why(model, cluster):
    pins = dict(pp=1, dp=8, tp=1, micro_batch=2, zero=3, checkpoint="none", offload="none")
    p = plan(model, cluster, global_batch_size=16, memory_headroom=0.0, top_k=0, constraints=pins)
    used = max(p.predicted.peak_memory_bytes) / cluster.device_profile.usable_memory_bytes
    with pytest.raises(InfeasibleError, match="memory headroom"):
        plan(model, cluster, global_batch_size=16, memory_headroom=1 - used + 0.02, top_k=0, constraints=pins)


def test_older_plans_without_a_headroom_still_load_and_print(model, cluster):
    from rich.console import Console

    from autopar.commands.plan import render

    p = plan(model, cluster, global_batch_size=16, top_k=0)
    d = json.loads(p.to_json())
    for key in ("memory_headroom", "memory_limit_bytes"):
        d["solver"].pop(key)
    old = Plan.from_dict(d)
    buf = io.StringIO()
    render(old, Console(file=buf, width=160))
    assert "memory limit" not in buf.getvalue() and "Memory per GPU" in buf.getvalue()
    buf = io.StringIO()
    render(p, Console(file=buf, width=160))
    assert "memory limit" in buf.getvalue() and "10% headroom" in buf.getvalue()


def test_cli_memory_headroom(capsys):
    from conftest import ROOT

    gpt_file = str(ROOT / "examples" / "gpt.py")
    base = ["plan", f"{gpt_file}:gpt2_small", "--gpus", "8", "--device", "a100-80g", "--batch-size", "32"]
    assert main(base + ["--memory-headroom", "0.3", "--json"]) == 0
    p = Plan.from_json(capsys.readouterr().out)
    assert p.solver["memory_headroom"] == 0.3
    assert max(p.predicted.peak_memory_bytes) <= 0.7 * p.predicted.memory_breakdown[0]["capacity"]
    assert main(base + ["--memory-headroom", "0.3", "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "memory limit" in out and "30% headroom" in out
    assert main(base + ["--memory-headroom", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "--memory-headroom" in err and "Traceback" not in err
