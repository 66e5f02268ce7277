"""What the planner refuses names the real cause, and what it cannot check it does not offer.

- a layer that splits at no tp size (ALBERT's MLM head: its LayerNorm spans the
  column-split dim) runs replicated and vetoes no tp degree; a degree a layer
  does refuse is named with that layer and its sizes;
- a lowering check that could not run (no repeated blocks, a failure) leaves
  only what needs no split of the model: dp / ZeRO, never tp or pp;
- a model built on the meta device (the CLI's) is checked, not skipped;
- a pipeline cut outside a block stack says so, not "embedding layer".
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.solve.planner import tp_degrees, tp_refusals
from autopar.solve.search_space import enumerate_candidates
from cost_models.workload import LayerSpec


def _layer(name, kind, degrees, **attrs):
    return LayerSpec(name=name, kind=kind, params=1, param_bytes=2, fwd_flops=1, bwd_flops=2, activation_bytes=1,
                     output_bytes=1, tp_degrees=degrees, attrs=attrs)


class _Spec:
    def __init__(self, layers):
        self.layers = layers


def test_an_unsplittable_layer_vetoes_nothing_and_a_refusing_layer_is_named():
    blocks = [_layer(f"blocks.{i}", "transformer_block", (1, 2, 4), heads=4, ffn_hidden=64) for i in range(2)]
    mlm_head = _layer("predictions", "mlp", (1,))  # a norm over the split dim: never split
    assert tp_degrees(_Spec(blocks + [mlm_head])) == (1, 2, 4)
    odd = _layer("blocks.2", "transformer_block", (1, 3), heads=3, ffn_hidden=96)
    spec = _Spec(blocks + [odd])
    assert tp_degrees(spec) == (1,)
    why = tp_refusals(spec, [1, 2, 4])
    assert set(why) == {2, 4} and why[2] == "tp does not divide layer blocks.2's heads 3, ffn_hidden 96"
    _, report = enumerate_candidates(4, 8, 3, tp_degrees(spec), tp_why=why)
    assert "tp does not divide layer blocks.2's heads 3, ffn_hidden 96" in report.summary()


def test_an_unchecked_lowering_offers_only_data_parallel_layouts():
    limits = {"checked": False, "why": "Net has no repeated blocks to place layers from"}
    cands, report = enumerate_candidates(8, 16, 6, (1, 2, 4, 8), lowering_limits=limits)
    assert cands and {(c.tp, c.pp) for c in cands} == {(1, 1)}
    assert "no repeated blocks" in report.summary()
    # a graph planned without any module (no check asked for): nothing is restricted
    free, _ = enumerate_candidates(8, 16, 6, (1, 2, 4, 8), lowering_limits=None)
    assert any(c.tp > 1 for c in free) and any(c.pp > 1 for c in free)


class _Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_model_on_the_meta_device_is_checked():
    from autopar.lower.what_runs import limits
    with torch.device("meta"):
        model = _Net()
    inputs = lambda b: (torch.randn(b, 8, 32),)  # noqa: E731  CPU inputs, as a model file gives
    got = limits(model, autopar.capture(model, inputs), inputs, tp_degrees=[2])
    assert got["checked"] is True, got.get("why")
    assert got["pipeline"] is None and got["tp_checked"] == [2]


def test_a_pipeline_cut_outside_the_block_stack_says_why():
    from autopar.errors import PlanMismatchError
    from autopar.lower.model_layers import ModelLayout, ResolvedLayer
    from autopar.lower.pipeline_parallel import check_stage_cuts
    from autopar.plan import LayerChoice

    layers = [ResolvedLayer(choice=LayerChoice(name=n), stage=s, paths=[n]) for n, s in
              (("emb", 0), ("blocks.0", 0), ("blocks.1", 1))]
    for l in layers:
        l.position = "pre"  # no stack recognised: everything runs before it
    layout = ModelLayout(layers=layers, blocks_path=None, num_blocks=0, tied=[], stacks=[], stack_ends={})
    with pytest.raises(PlanMismatchError) as err:
        check_stage_cuts(layout, 2)
    msg = str(err.value)
    assert "'blocks.1' is not a block of the stack" in msg and "none found" in msg and "embedding" not in msg
