"""The cost of GPT's fused qkv split under tensor parallelism: an all-gather of
the qkv output forward, a reduce-scatter backward, and an attention core that
every tp rank computes and stores in full."""
import dataclasses

import pytest

from cost_models import comm as C
from cost_models.analytic import block, gpt
from cost_models.errors import CostModelError
from cost_models.estimate import estimate, layer_cost
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout
from cost_models.memory import activation_bytes, activation_expr
from cost_models.workload import B, S, ModelSpec, evaluate

H, HEADS, SEQ = 2048, 16, 2048


def _model(split: bool, **kw) -> ModelSpec:
    return gpt("g", hidden=H, heads=HEADS, layers=4, seq_len=SEQ, vocab_size=50304, fused_qkv_split=split, **kw)


@pytest.fixture(scope="module")
def cluster():
    return ClusterSpec.preset("dgx-h100")


def _cost(model, tp, cluster, **kw):
    layout = Layout(tp=tp, dp=1, micro_batch_size=2, num_micro_batches=1, **kw)
    return layer_cost(model.layers[1], model, layout, cluster)


@pytest.mark.parametrize("tp", [2, 4])
def test_split_charges_more_comm_compute_and_memory(tp, cluster):
    split, heads = _model(True), _model(False)
    a, b = _cost(split, tp, cluster), _cost(heads, tp, cluster)
    assert a.tp_comm_s > b.tp_comm_s
    assert a.fwd_s > b.fwd_s and a.bwd_s > b.bwd_s  # the attention core is not divided by tp
    assert a.activation_bytes > b.activation_bytes
    # exactly one all-gather of the qkv output forward and a reduce-scatter backward more
    place = C.group_placement("tp", tp, 1, 1, cluster)
    qkv = evaluate(split.layers[1].tp_gather_bytes, 2, SEQ)
    assert qkv == 2 * SEQ * 3 * H * 2
    extra = C.collective_time("all_gather", qkv, place, cluster) + C.collective_time("reduce_scatter", qkv, place,
                                                                                      cluster)
    assert a.tp_comm_s - b.tp_comm_s == pytest.approx(extra)


def test_gather_bytes_alone_only_adds_communication(cluster):
    model = _model(True)
    layer = model.layers[1]
    no_gather = dataclasses.replace(layer, tp_gather_bytes=0, signature=layer.signature + ":nogather")
    other = ModelSpec("g", [model.layers[0], no_gather, model.layers[-1]], seq_len=SEQ)
    a, b = _cost(model, 4, cluster), layer_cost(no_gather, other, Layout(tp=4, micro_batch_size=2), cluster)
    assert a.tp_comm_s > b.tp_comm_s and a.tp_comm_fwd_s > b.tp_comm_fwd_s
    assert a.fwd_s == b.fwd_s and a.activation_bytes == b.activation_bytes


def test_tp1_is_unchanged(cluster):
    a, b = _cost(_model(True), 1, cluster), _cost(_model(False), 1, cluster)
    assert a.tp_comm_s == b.tp_comm_s == 0
    assert a.fwd_s == b.fwd_s and a.bwd_s == b.bwd_s and a.activation_bytes == b.activation_bytes


def test_full_checkpointing_recomputes_the_gather(cluster):
    model = _model(True)
    full = _cost(model, 4, cluster, checkpoint="full")
    assert full.recompute_s == pytest.approx(full.fwd_s + full.tp_comm_fwd_s)
    assert full.tp_comm_fwd_s > _cost(_model(False), 4, cluster, checkpoint="full").tp_comm_fwd_s


def test_split_memory_keeps_the_core_whole():
    h, a, t = H, HEADS, 4
    spec = block(0, hidden=h, heads=a, ffn_hidden=4 * h, attention="math", dropout=True, fused_qkv_split=True)
    megatron = block(0, hidden=h, heads=a, ffn_hidden=4 * h, attention="math", dropout=True)
    b, s = 1, SEQ
    # Korthikanti: 34sbh + 5as^2b; Megatron divides 24sbh + 5as^2b by t, the fused split
    # only the MLP's 16sbh and the out-projection's locally sliced input (2sbh)
    assert activation_bytes(megatron, b, s, tp=t) == pytest.approx(s * b * h * (10 + (24 + 5 * a * s / h) / t))
    assert activation_bytes(spec, b, s, tp=t) == pytest.approx(s * b * h * (16 + 5 * a * s / h + 18 / t))
    # selective checkpointing drops the (replicated) core in full
    assert activation_bytes(spec, b, s, tp=t, checkpoint="selective") == pytest.approx(s * b * h * (16 + 18 / t))
    assert activation_expr(spec, tp=t, checkpoint="selective").subs({B: b, S: s}) == pytest.approx(
        activation_bytes(spec, b, s, tp=t, checkpoint="selective"))


def test_split_estimate_reports_gather_traffic(cluster):
    layout = Layout(tp=4, dp=2, micro_batch_size=1, num_micro_batches=2)
    split, heads = estimate(_model(True), layout, cluster), estimate(_model(False), layout, cluster)
    tp_row = lambda est: next(c for c in est.comm if c["axis"] == "tp")
    assert tp_row(split)["bytes"] > tp_row(heads)["bytes"]
    assert split.step_time_s > heads.step_time_s and split.peak_memory_bytes[0] > heads.peak_memory_bytes[0]


def test_split_needs_a_fused_qkv():
    with pytest.raises(CostModelError, match="fused_qkv"):
        block(0, hidden=64, heads=4, ffn_hidden=256, fused_qkv=False, fused_qkv_split=True)


def test_sequence_parallelism_does_not_split_the_gathered_core(cluster):
    """Sequence parallelism splits the norms and residuals by tp, but the attention
    core after the gather is whole on every rank: SP must not divide it."""
    t = 4
    split, heads = _model(True, attention="math"), _model(False, attention="math")
    a = _cost(split, t, cluster, sequence_parallel=True)
    b = _cost(heads, t, cluster, sequence_parallel=True)
    assert a.fwd_s > b.fwd_s
    spec = split.layers[1]
    gathered = evaluate(spec.activation_bytes_tp_gathered, 2, SEQ)
    rest = evaluate(spec.activation_bytes - spec.activation_bytes_tp_gathered, 2, SEQ)
    assert gathered > 0
    assert a.activation_bytes == pytest.approx(gathered + rest / t)
    assert b.activation_bytes == pytest.approx(evaluate(heads.layers[1].activation_bytes, 2, SEQ) / t)
