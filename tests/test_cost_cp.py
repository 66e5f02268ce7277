"""Context parallelism in `estimate` (Layout.cp): one cp rank prices its share of the
sequence (every op on seq / cp tokens, dp x cp ranks holding and reducing the states)
plus its attention over the ring; the field enters the memo and the Plan's JSON."""
import dataclasses
import json

import pytest

from cost_models.analytic import llama
from cost_models.context_parallel import cp_view, ring_extra_s
from cost_models.errors import CostModelError
from cost_models.estimate import estimate, layer_cost
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout

from autopar.plan import Mesh, Plan
from autopar.plan_file import cp_problem


def _model(seq=32768):
    return llama("l", hidden=4096, heads=32, kv_heads=8, layers=4, seq_len=seq, vocab_size=128256, ffn_hidden=14336)


CLUSTER = ClusterSpec.preset("dgx-h100", nodes=2)


def _layout(**kw):
    return Layout(**{"dp": 2, "zero": 3, "checkpoint": "full", **kw})


def test_cp_divides_activations_and_keeps_tokens_per_second():
    model = _model()
    one, two = estimate(model, _layout(dp=4), CLUSTER), estimate(model, _layout(dp=2, cp=2), CLUSTER)
    assert two.global_batch_size == 2 and one.global_batch_size == 4  # cp ranks share sequences, not samples
    act = lambda e: e.memory_breakdown[0]["activations"]  # noqa: E731
    assert act(two) == pytest.approx(act(one) / 2, rel=0.05)
    # the same tokens per GPU per step: within the ring's exposed part of the same throughput
    assert two.tokens_per_s == pytest.approx(one.tokens_per_s, rel=0.03)
    assert two.model_flops_per_step == pytest.approx(one.model_flops_per_step / 2, rel=1e-9)


def test_attention_layer_pays_the_whole_causal_square_over_cp():
    """The view prices (s / cp)^2 of attention; a cp rank computes s^2 / cp (head-tail
    balancing), so the attention layer costs more than its share's price and the MLP-only
    layers exactly their share's."""
    model, lay = _model(), _layout(dp=1, cp=4)
    share, share_layout = cp_view(model, lay)
    assert (share.seq_len, share_layout.dp, share_layout.cp) == (8192, 4, 1)
    attn = next(l for l in model.layers if any(op.kind == "attention" for op in l.ops))
    f, b = ring_extra_s(attn, model, lay, CLUSTER)
    assert f > 0 and b > 0
    cost, base = layer_cost(attn, model, lay, CLUSTER), layer_cost(attn, share, share_layout, CLUSTER)
    assert cost.fwd_s == pytest.approx(base.fwd_s + f) and cost.activation_bytes == base.activation_bytes
    assert cost.recompute_s == pytest.approx(base.recompute_s + f)  # full recomputation runs the ring again
    head = model.layers[-1]
    assert layer_cost(head, model, lay, CLUSTER).fwd_s == layer_cost(head, share, share_layout, CLUSTER).fwd_s


def test_cp_enters_the_memo_and_world():
    model = _model()
    assert _layout(dp=2, cp=2).world_size == 4
    a = layer_cost(model.layers[1], model, _layout(dp=2), CLUSTER)
    b = layer_cost(model.layers[1], model, _layout(dp=2, cp=2), CLUSTER)
    assert a.activation_bytes == pytest.approx(2 * b.activation_bytes)
    with pytest.raises(CostModelError, match="needs tp x pp x dp x cp = 32 GPUs"):
        estimate(model, _layout(dp=4, cp=8), CLUSTER)


def test_sequence_not_in_2cp_chunks_is_refused():
    with pytest.raises(CostModelError, match="2 x cp = 6 equal chunks"):
        estimate(_model(seq=32768), _layout(dp=1, cp=3), CLUSTER)


def test_plan_mesh_cp_json():
    plan = Plan(seq_len=4096, mesh=Mesh(dp=2, cp=2, tp=2), global_batch_size=2)
    assert plan.mesh.world_size == 8
    again = Plan.from_json(plan.to_json())
    assert again.mesh.cp == 2
    plain = json.loads(Plan(mesh=Mesh(dp=2, cp=1)).to_json())
    assert plain["mesh"] == {"pp": 1, "dp": 2, "tp": 1}  # cp 1 / None: the JSON of every plan before the field
    assert cp_problem(dataclasses.replace(plan, seq_len=4098)).startswith("mesh.cp 2 needs seq_len 4098 in 2 x cp")
    assert "no seq_len" in cp_problem(dataclasses.replace(plan, seq_len=None))
    assert cp_problem(plan) is None
