"""Communication compression (Layout.grad_reduce_dtype): the gradient reductions move
bf16 bytes, the casts are priced as memory-bound copies, memory is unchanged, and a
bf16 gradient is not 'compressed' again (cost_models/compression.py)."""
import dataclasses

import pytest

from cost_models import compression
from cost_models.analytic import gpt
from cost_models.errors import CostModelError
from cost_models.estimate import estimate, layer_cost
from cost_models.hardware import ClusterSpec
from cost_models.layer_comm import copy_s
from cost_models.layout import Layout

REDUCTIONS = ("all_reduce", "reduce_scatter")


def _model():
    return gpt("g", hidden=4096, heads=32, layers=4, seq_len=2048, vocab_size=51200)


def _bytes(est, kinds) -> float:
    return sum(r["bytes"] for r in est.comm if r["axis"].startswith("dp") and r["collective"] in kinds)


@pytest.mark.parametrize("precision, main_grads", [("fp32", "same"), ("bf16", "fp32")])
@pytest.mark.parametrize("zero, dp_shard", [(0, None), (3, None), (3, 8)])
def test_reductions_move_half_the_bytes_and_gathers_do_not_change(precision, main_grads, zero, dp_shard):
    model, c = _model(), ClusterSpec.preset("dgx-h100", nodes=4)
    plain = Layout(dp=32, zero=zero, dp_shard=dp_shard, precision=precision, main_grads=main_grads,
                   num_micro_batches=2)
    squeezed = dataclasses.replace(plain, grad_reduce_dtype="bf16")
    a, b = estimate(model, plain, c), estimate(model, squeezed, c)
    assert _bytes(b, REDUCTIONS) == pytest.approx(_bytes(a, REDUCTIONS) / 2)
    assert _bytes(b, ("all_gather",)) == _bytes(a, ("all_gather",))
    assert b.peak_memory_bytes == a.peak_memory_bytes  # no error-feedback buffer
    assert b.step_time_s < a.step_time_s  # 4 nodes: the inter-node reduction shrinks more than the casts cost


def test_a_bf16_gradient_is_not_compressed_again():
    model, c = _model(), ClusterSpec.preset("dgx-h100", nodes=2)
    plain = Layout(dp=16, zero=3, precision="bf16", main_grads="same")
    a, b = estimate(model, plain, c), estimate(model, dataclasses.replace(plain, grad_reduce_dtype="bf16"), c)
    assert (a.step_time_s, _bytes(a, REDUCTIONS)) == (b.step_time_s, _bytes(b, REDUCTIONS))


def test_the_casts_are_priced_once_per_reduction():
    """The exposed step time of one layer grows by exactly the hook's casts' copy time when
    the reduction is fully hidden (a one-node cluster whose link is made very fast); DDP's
    bucket copies stay at the held width."""
    zero = 0
    model, c = _model(), ClusterSpec.preset("dgx-h100", nodes=1)
    link = dataclasses.replace(c.intra_link, bandwidth=1e18, latency_s=0.0)
    fast = dataclasses.replace(c, links={**(c.links or {}), c.intra_node_link: link})
    plain = Layout(dp=8, zero=zero, precision="fp32")
    layer = model.layers[1]
    a = layer_cost(layer, model, plain, fast, zero=zero)
    b = layer_cost(layer, model, dataclasses.replace(plain, grad_reduce_dtype="bf16"), fast, zero=zero)
    casts = compression.cast_bytes(b.params_local, 4, 2, zero >= 2, 8)
    assert casts > 0
    assert b.dp_comm_exposed_s - a.dp_comm_exposed_s == pytest.approx(copy_s(casts, c.device_profile), rel=1e-6)


def test_an_unknown_dtype_is_refused():
    with pytest.raises(CostModelError, match="grad_reduce_dtype must be one of bf16"):
        Layout(dp=2, grad_reduce_dtype="int8").validate()
