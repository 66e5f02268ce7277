"""Never worse than the hand plan: for every published run (benchmarks/reference/
published_runs.csv, layouts as benchmarks/published_runs.py reads them), the
unconstrained plan's predicted throughput is at least that of the published
layout pinned with the constraint flags, under the same cost model."""
import sys

import pytest
from conftest import ROOT

pytest.importorskip("cost_models.estimate", reason="cost_models.estimate (issue 3) is not in this checkout")
sys.path.insert(0, str(ROOT / "benchmarks"))
published_runs = pytest.importorskip("published_runs")

from autopar.solve import plan  # noqa: E402
from autopar.solve.planner import resolve_cluster  # noqa: E402


def pins_of(layout) -> dict:
    """The published layout as `autopar plan` flags: --tp --pp --dp --micro-batch --zero
    --checkpoint --schedule --sequence-parallel (unstated values stay free)."""
    pins = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "micro_batch": layout.micro_batch_size,
            "zero": layout.zero, "sequence_parallel": bool(layout.sequence_parallel) if layout.tp > 1 else None}
    if layout.checkpoint is not None:
        pins["checkpoint"] = layout.checkpoint
    if layout.pp > 1:
        pins["schedule"] = (f"interleaved:{layout.virtual_stages}" if layout.schedule == "interleaved"
                            else layout.schedule)
    return {k: v for k, v in pins.items() if v is not None}


@pytest.mark.parametrize("run", published_runs.RUNS, ids=[r.label for r in published_runs.RUNS])
def test_unconstrained_plan_is_never_worse_than_the_published_layout(run):
    model = run.model()
    cluster = resolve_cluster(run.cluster)
    gbs = run.layout.global_batch_size
    hand = plan(model, cluster, global_batch_size=gbs, constraints=pins_of(run.layout), top_k=1)
    free = plan(model, cluster, global_batch_size=gbs, top_k=1)
    assert (hand.mesh.tp, hand.mesh.pp, hand.mesh.dp) == (run.layout.tp, run.layout.pp, run.layout.dp)
    assert free.predicted.tokens_per_s >= hand.predicted.tokens_per_s * (1 - 1e-9), (
        f"{run.label}: free {free.predicted.tokens_per_s:.0f} tok/s < published layout "
        f"{hand.predicted.tokens_per_s:.0f} tok/s")
