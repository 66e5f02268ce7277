"""layer_cost's memo: keyed on everything the computation reads, never on a label.

A cached cost once came back for another layer whose signature forgot one of
its fields (analytic `fused_qkv`): 1.5572 ms where a fresh computation gave
1.5621 ms. The key is now the layer's content (every field but its name and
module paths), so a field that changes the cost changes the key, including
fields added later."""
import dataclasses

import pytest

from cost_models import fingerprint as F
from cost_models import layer as L
from cost_models import layer_compute
from cost_models.analytic import block, gpt
from cost_models.estimate import layer_cost
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout
from cost_models.workload import LayerSpec

SHAPE = dict(hidden=2048, heads=16, ffn_hidden=8192)


def _fresh(layer, model, layout, cluster):
    L._LAYER_CACHE.clear()
    layer_compute._CORE_CACHE.clear()
    return layer_cost(layer, model, layout, cluster)


@pytest.fixture
def setting():
    model = gpt("g", hidden=2048, heads=16, layers=2, seq_len=2048, vocab_size=50304)
    return model, Layout(tp=2, dp=4, micro_batch_size=2), ClusterSpec.preset("dgx-a100")


def test_a_cached_cost_is_the_fresh_cost_of_a_layer_with_another_qkv(setting):
    model, layout, cluster = setting
    fused = block(0, **SHAPE, fused_qkv=True)
    separate = block(0, **SHAPE, fused_qkv=False)
    # the bug's shape: two different layers under one signature
    impostor = dataclasses.replace(separate, signature=fused.signature)
    first = layer_cost(fused, model, layout, cluster)
    cached = layer_cost(impostor, model, layout, cluster)
    fresh = _fresh(impostor, model, layout, cluster)
    assert cached.fwd_s == fresh.fwd_s and cached.bwd_s == fresh.bwd_s
    assert fresh.fwd_s != first.fwd_s  # three GEMMs are not priced as one
    # and the analytic signature tells them apart too (the solver shares variables by it)
    assert fused.signature != separate.signature


def test_every_layer_field_is_in_the_key(setting):
    """Change any one field (but the name, module paths, op prefix and signature label): the
    fingerprint changes, so no cached cost of the original layer is returned."""
    base = block(0, **SHAPE)
    fp = F.layer_fingerprint(base)
    changed = {"name": False, "module_paths": False, "signature": False, "op_prefix": False}
    for f in dataclasses.fields(LayerSpec):
        value = getattr(base, f.name)
        if f.name in changed:
            new = dataclasses.replace(base, **{f.name: "x" if isinstance(value, str) else ["x"]})
            assert F.layer_fingerprint(new) == fp, f.name
            continue
        if isinstance(value, bool) or value is None:
            bumped = 1
        elif isinstance(value, (int, float)):
            bumped = value + 1
        elif isinstance(value, str):
            bumped = value + "x"
        elif isinstance(value, (list, tuple)):
            bumped = type(value)(list(value)[:-1]) if value else type(value)([1])
        elif isinstance(value, dict):
            bumped = {**value, "new": 1}
        else:  # a sympy expression
            bumped = value + 1
        assert F.layer_fingerprint(dataclasses.replace(base, **{f.name: bumped})) != fp, f.name
    # an op changed in place of its list is a new layer too
    ops = list(base.ops)
    ops[1] = dataclasses.replace(ops[1], count=ops[1].count + 1)
    assert F.layer_fingerprint(dataclasses.replace(base, ops=ops)) != fp
    # and an attribute a later version adds enters the key without anyone listing it
    other = dataclasses.replace(base)
    other.some_new_field = 3
    assert F.layer_fingerprint(other) != fp


def test_identical_layers_still_share_one_cached_cost(setting):
    model, layout, cluster = setting
    a, b = model.layers[1], model.layers[2]
    assert a.name != b.name and F.layer_fingerprint(a) == F.layer_fingerprint(b)
    assert layer_cost(a, model, layout, cluster) is layer_cost(b, model, layout, cluster)


def test_layout_fields_enter_the_key(setting):
    """A Layout field layer_cost reads (here main_grads) changes the cost; the key follows
    the Layout dataclass's fields, not a hand-kept list."""
    model, layout, cluster = setting
    layer = model.layers[1]
    same = layer_cost(layer, model, layout, cluster)
    fp32 = dataclasses.replace(layout, main_grads="fp32")
    assert layer_cost(layer, model, fp32, cluster).grad_bytes == _fresh(layer, model, fp32, cluster).grad_bytes
    assert layer_cost(layer, model, fp32, cluster).grad_bytes != same.grad_bytes
    key_fields = set(F._LAYOUT_KEY_FIELDS) | F._LAYOUT_FIELDS_NOT_READ
    assert key_fields == {f.name for f in dataclasses.fields(Layout)}
