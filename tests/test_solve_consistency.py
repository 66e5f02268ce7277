"""The stage solver's memory table and cost_models.estimate price a pipeline
rank's activations the same way: micro-batches in flight (the count torch's
schedule keeps, tests/test_cost_pipeline.py) x the rank's bytes per micro-batch."""
import pytest

pytest.importorskip("cost_models.estimate", reason="cost_models.estimate (issue 3) is not in this checkout")

from cost_models.analytic import gpt  # noqa: E402
from cost_models.estimate import estimate  # noqa: E402
from cost_models.hardware import ClusterSpec  # noqa: E402
from cost_models.memory import FRAGMENTATION, peak_chunk_bytes  # noqa: E402

from autopar.solve.constraints import Constraints  # noqa: E402
from autopar.solve.layout import candidate_layout  # noqa: E402
from autopar.solve.planner import scaled_cluster  # noqa: E402
from autopar.solve.problem import KIB  # noqa: E402
from autopar.solve.search_space import Candidate  # noqa: E402
from autopar.solve.table import TableBuilder  # noqa: E402

# 1 embedding + 12 blocks + head: 14 layers
MODEL = dict(hidden=1024, heads=16, layers=12, seq_len=1024, vocab_size=32000)


@pytest.fixture(scope="module")
def model():
    return gpt("gpt-consistency", **MODEL)


@pytest.fixture(scope="module")
def cluster():
    return scaled_cluster(ClusterSpec.resolve("a100-80g"), 1)  # 8 GPUs


@pytest.mark.parametrize("schedule, v, m, stage_layers", [
    ("1f1b", 1, 8, [4, 3, 3, 4]),
    ("gpipe", 1, 6, [4, 3, 3, 4]),
    # embedding alone in stage 0, head alone in the last: ranks 1 and 2 hold two equal block chunks
    ("interleaved", 2, 8, [1, 2, 2, 2, 2, 2, 2, 1]),
])
def test_table_activations_equal_estimate_per_rank(model, cluster, schedule, v, m, stage_layers):
    pp = 4
    # dp 1: no data-parallel reduce moments in the backward (pipeline_parallel.ReducingStage's
    # reduce-scatters, booked by the estimate with their own activations), whose breakdown
    # is not the in-flight activations this test holds the table to
    cand = Candidate(pp=pp, dp=1, tp=1, micro_batch_size=1, num_micro_batches=m, schedule=schedule, virtual_stages=v)
    builder = TableBuilder(model, cluster, constraints=Constraints(zero=0, checkpoint="none"))
    problem = builder(cand)
    assert all(len(opts) == 1 for opts in problem.group_options)  # pinned: one option per layer
    layout = candidate_layout(cand, zero=0, checkpoint="none")
    layout.stage_layers = stage_layers
    est = estimate(model, layout, cluster)

    bounds = [sum(stage_layers[:i]) for i in range(len(stage_layers) + 1)]
    checked = 0
    for r in range(pp):
        stages = [k * pp + r for k in range(v)]
        layers = [j for s in stages for j in range(bounds[s], bounds[s + 1])]
        opt = [problem.group_options[problem.layer_group[j]][0] for j in layers]
        # the table stores (1 + fragmentation) x bytes, rounded up to KiB
        per_mb = sum(o.act_mem for o in opt) * KIB / (1 + FRAGMENTATION)
        working = max(o.peaks[0] for o in opt) * KIB / (1 + FRAGMENTATION)
        planner = problem.in_flight_num[r] / v * per_mb + working
        chunk_bytes = [sum(problem.group_options[problem.layer_group[j]][0].act_mem
                           for j in range(bounds[s], bounds[s + 1])) for s in stages]
        if len(set(chunk_bytes)) > 1:
            # unequal chunks (the embedding's rank): the estimate follows the exact
            # per-chunk peak, which count x average does not capture
            exact = peak_chunk_bytes(schedule, pp, m, [c * KIB / (1 + FRAGMENTATION) for c in chunk_bytes], r)
            assert est.memory_breakdown[r]["activations"] == pytest.approx(exact + working, rel=1e-3)
            continue
        assert est.memory_breakdown[r]["activations"] == pytest.approx(planner, rel=1e-3)
        checked += 1
    assert checked >= 2
