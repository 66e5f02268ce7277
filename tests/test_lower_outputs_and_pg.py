"""Architectures the examples never had (issue 29), and the planner's lowering
check inside a process group.

* A forward returning a dict / dataclass / namedtuple: the loss reads its
  "logits" entry or its only tensor (autopar/lower/model_io.py); an output with
  none is refused by autopar.compile and `autopar compile` before planning.
* Pipeline stages hand on channels-last / permuted activations (ConvNeXt):
  sent contiguous.
* `what_runs.limits` gives the same answer in a process with a real process
  group (inside torchrun) as in one without, and leaves the real group working.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import ModelOutputError
from autopar.lower.manual_plan import plan_for_model
from autopar.lower.model_io import logits_of
from autopar.lower.what_runs import limits
from dist_utils import run_world
import outputs_worlds as ow

HERE = os.path.dirname(os.path.abspath(__file__))


class TwoOutputs(ow.DictLM):
    """Two tensors and neither is "logits": which one the loss reads cannot be told."""

    def forward(self, idx):
        out = super().forward(idx)
        return {"scores": out["logits"], "aux": out["aux"]}


def _example(b):
    return (torch.zeros(b, ow.SEQ, dtype=torch.long),)


def test_every_output_form_gives_its_logits():
    t, u = torch.ones(2, 3), torch.zeros(1)

    @dataclasses.dataclass
    class Out:
        pred: torch.Tensor
        steps: int = 3

    Named = collections.namedtuple("Named", "hidden logits")
    assert logits_of(t) is t
    assert logits_of({"logits": t, "aux": u, "note": "x"}) is t
    assert logits_of({"out": t}) is t and logits_of({"out": t, "n": 3}) is t  # the only tensor
    assert logits_of(Out(t)) is t
    assert logits_of(Named(u, t)) is t and logits_of((t, u)) is t


@pytest.mark.parametrize("out, says", [
    ({"a": torch.ones(2), "b": torch.ones(3)}, "a dict {'a': tensor(2,), 'b': tensor(3,)}: several tensors and "
                                               "none under the key 'logits'"),
    ({"note": "x"}, "a dict {'note': str}, which holds no tensor"),
    (None, "None, which is neither a tensor nor holds the logits"),
])
def test_an_output_without_logits_is_refused_with_what_it_was(out, says):
    with pytest.raises(ModelOutputError, match="under the key 'logits'") as err:
        logits_of(out)
    assert f"the model returned {says}" in str(err.value)


def test_compile_refuses_it_before_planning_and_before_any_process_group():
    model = TwoOutputs()
    for kwargs in ({"plan": plan_for_model(model, example_inputs=_example, dp=2)},
                   {"cluster_spec": autopar.ClusterSpec(gpus=2, device="cpu"), "global_batch_size": 4}):
        with pytest.raises(ModelOutputError) as err:
            autopar.compile(model, example_inputs=_example, loss_fn=ow.token_ce, **kwargs)
        assert err.value.message.startswith("the model returned a dict {'scores': tensor(1, 8, 32), 'aux': "
                                            "tensor()}: several tensors and none under the key 'logits'")
        assert "under the key 'logits'" in err.value.hint
        assert not dist.is_initialized()


def test_autopar_compile_command_refuses_it(tmp_path, capsys):
    from autopar.cli import main as cli
    source = tmp_path / "two.py"
    source.write_text(f"import sys\nsys.path.insert(0, {HERE!r})\nimport torch\n"
                      "from test_lower_outputs_and_pg import TwoOutputs as build_model, _example as example_inputs\n"
                      "from outputs_worlds import token_ce as loss_fn\n")
    assert cli(["compile", str(source), "--gpus", "2", "--device", "cpu", "-o", str(tmp_path / "build")]) == 2
    assert "several tensors and none under the key 'logits'" in capsys.readouterr().err
    assert not (tmp_path / "build").exists()


def test_limits_are_the_same_with_a_process_group():
    """A process that already has a (here fake) default group of another size checks
    as a fresh one, and its group is untouched afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    model = ow.RenormLM()
    graph = autopar.capture(model, _example)
    fresh = limits(model, graph, _example, tp_degrees=[2, 4])
    assert "aten.renorm.default does not have a sharding strategy" in fresh["tp"]["2"]
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    try:
        assert limits(model, graph, _example, tp_degrees=[2, 4]) == fresh
        assert dist.get_rank() == 1 and dist.get_world_size() == 3
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


CELLS = [
    ("dict_dp", "dict", dict(dp=2)),
    ("dict_pp", "dict", dict(pp=2, num_micro_batches=2)),
    ("dict_tp", "dict", dict(tp=2)),
    ("dict_out_pp", "dict_out", dict(pp=2, num_micro_batches=2)),
    ("convnext_pp", "convnext", dict(pp=2, num_micro_batches=2)),
    ("convnext_channels_last_pp", "convnext_channels_last", dict(pp=2, num_micro_batches=2)),
]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dict_outputs_and_channels_last_stages_train_as_one_process():
    results = run_world(ow.train_world, 2, CELLS, timeout=360)
    for name, *_ in CELLS:
        for r in results:
            assert "refused" not in r[name], (name, r[name])
            assert r[name]["loss_err"] < 1e-5 and r[name]["param_err"] < 1e-5, (name, r[name])
    assert "blocks.0.mlp.0.weight" in results[0]["dict_tp"]["tp_sharded"]  # tp did split the blocks


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_planning_inside_a_gloo_world_checks_the_lowering_as_a_fresh_process():
    fresh = ow.planning_answers()
    assert "aten.renorm.default" in fresh["tp2"] and "lowering cannot run it" in fresh["tp2"]
    for r in run_world(ow.planning_world, 2, timeout=360):
        assert {k: r[k] for k in fresh} == fresh
        assert r["all_reduce"] == 3.0  # the real group still works
        assert r["compiled_mesh"] == fresh["mesh"] and r["compiled_limits"] == fresh["plan_limits"]
        assert r["loss"] > 0


def test_sequence_parallelism_of_image_blocks_is_refused_naming_the_channels_dim():
    """A ConvNeXt block's activation is (N, C, H, W): dim 1 is channels, not a sequence.
    The planner's check says so with compile's own words (tensor_parallel.
    check_sequence_split; the depthwise conv's channel count error was the reason before)."""
    model, example, loss_fn, *_ = ow.build("convnext")
    graph = autopar.capture(model, example, loss_fn=loss_fn)
    found = limits(model, graph, example, tp_degrees=[2])
    assert "4-D" in found["sequence_parallel"]["2"] and "channels" in found["sequence_parallel"]["2"], found
    assert not found["tp"].get("2"), found  # tp alone still runs
