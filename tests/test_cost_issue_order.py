"""Overlap limited by what there is to overlap with (cost_models/issue_order.py): the last
backward run in issue order; a pipeline send across nodes pays NCCL's p2p latency."""
import pytest

from cost_models import comm as C
from cost_models import estimate as E
from cost_models import layer as L
from cost_models.analytic import gpt
from cost_models.estimate import estimate
from cost_models.hardware import ClusterSpec
from cost_models.issue_order import last_backward_exposed
from cost_models.layout import Layout


def test_the_last_bucket_and_a_backlog_are_exposed():
    # reductions half the backward: only the last layer's, issued as compute ends, shows
    assert last_backward_exposed([1.0] * 3, [0.0] * 3, [0.5] * 3) == pytest.approx(0.5)
    # reductions twice the backward: the link drains 4 s after compute ends (1 + 3 x 2 - 3)
    assert last_backward_exposed([1.0] * 3, [0.0] * 3, [2.0] * 3) == pytest.approx(4.0)


def test_fsdp2_prefetches_one_unit():
    """The first unit's gather has nothing to hide under; the next one's, issued as the first
    unit's backward starts, runs 2 s against 1 s of compute: the second unit waits 1 s."""
    assert last_backward_exposed([1.0, 1.0], [0.5, 2.0], [0.0, 0.0]) == pytest.approx(0.5 + 1.0)


def test_a_reduce_no_backward_can_hide_is_exposed_in_the_estimate(monkeypatch):
    """Layers whose own windows hid every reduction (no exposure priced) still leave the last
    layer's reduction, issued as the backward ends, with nothing to hide under; and the
    estimate adds what the issue-order run exposes to the step and to its breakdown."""
    lc = L.LayerCost(fwd_s=0.5, bwd_s=1.0, recompute_s=0.0, tp_comm_s=0.0, param_bytes=0, grad_bytes=0,
                     optimizer_bytes=0, activation_bytes=0, dp_comm_s=0.8, dp_comm_exposed_s=0.0,
                     dp_last_reduce_s=0.8)
    assert E._issue_order_tail([lc] * 4, [0, 1, 2, 3], 1) == pytest.approx(0.8)
    model = gpt("g", hidden=2048, heads=16, layers=8, seq_len=2048, vocab_size=32000)
    cluster, layout = ClusterSpec.preset("dgx-a100", nodes=16), Layout(dp=128, micro_batch_size=1)
    before = estimate(model, layout, cluster)
    monkeypatch.setattr(E, "_issue_order_tail", lambda costs, idx, m: 1.0)
    after = estimate(model, layout, cluster)
    assert after.step_time_s == pytest.approx(before.step_time_s + 1.0, rel=0.01)
    assert (after.time_breakdown["dp_comm_exposed_s"]
            == pytest.approx(before.time_breakdown["dp_comm_exposed_s"] + 1.0, rel=1e-6))


def test_pipeline_send_across_nodes_pays_ncclS_p2p_latency():
    """pp 2 with tp 8 filling each node: each stage's send crosses the network and pays NCCL's
    Simple p2p latency (8.4 + 14 us) beside its bytes on one NDR rail (50 GB/s x 0.85)."""
    model = gpt("g", hidden=4096, heads=32, layers=8, seq_len=2048, vocab_size=32000)
    cluster = ClusterSpec.preset("dgx-h100", nodes=2)
    est = estimate(model, Layout(tp=8, pp=2, micro_batch_size=1, num_micro_batches=8), cluster)
    send = est.per_stage[0]["p2p_s"]
    nbytes = 1 * 2048 * 4096 * 2
    assert send == pytest.approx(nbytes / (50e9 * 0.85) + (8.4 + 14.0) * 1e-6, rel=0.01)
