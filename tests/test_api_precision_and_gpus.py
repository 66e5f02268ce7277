"""The library takes what the command line takes:

- `autopar.plan(..., precision=)` and `autopar.compile(..., precision=)`
  (bf16 / fp16 / fp32) reach the Plan, so a CPU cluster can plan fp32
  without a hand-written plan; a misspelt precision is refused by name.
- `autopar.ClusterSpec(gpus=N, device=...)` is the cluster `--gpus N
  --device ...` gives (nodes from the device's node size), and a count that
  does not fill whole nodes gets the CLI's message, spelled for the API.
"""
from __future__ import annotations

import argparse

import pytest

import autopar
from autopar.commands.common import add_plan_arguments, cluster_from_args
from autopar.errors import AutoparError


def cli_cluster(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return cluster_from_args(parser.parse_args(["m.py", *argv]))


@pytest.mark.parametrize("kwargs, argv", [
    ({"gpus": 4, "device": "cpu"}, ["--gpus", "4", "--device", "cpu"]),
    ({"gpus": 16, "device": "a100-80g"}, ["--gpus", "16", "--device", "a100-80g"]),
    ({"gpus": 16, "device": "dgx-h100"}, ["--gpus", "16", "--device", "dgx-h100"]),
    ({"gpus": 7, "device": "h100-sxm", "gpus_per_node": 7}, ["--gpus", "7", "--gpus-per-node", "7"]),
    ({"gpus": 8}, ["--gpus", "8"]),
])
def test_cluster_spec_takes_a_gpu_count_as_the_cli_does(kwargs, argv):
    spec = autopar.ClusterSpec(**kwargs)
    assert spec.world_size == kwargs["gpus"]
    assert spec.to_dict() == cli_cluster(*argv).to_dict()


@pytest.mark.parametrize("kwargs, needles", [
    ({"gpus": 12, "device": "h100-sxm"}, ["gpus=12 is not a whole number of 8-GPU nodes", "gpus=8 (1 node)",
                                          "gpus=16 (2 nodes)", "gpus_per_node=6"]),
    ({"gpus": 7, "device": "cpu"}, ["gpus=7 is part of one 8-GPU node", "gpus=7, gpus_per_node=7"]),
    ({"gpus": 0, "device": "cpu"}, ["gpus must be a positive integer"]),
    ({"gpus": 8, "nodes": 2}, ["gpus=8 but nodes=2"]),
])
def test_a_gpu_count_that_does_not_fill_nodes_is_refused_clearly(kwargs, needles):
    with pytest.raises(ValueError) as info:
        autopar.ClusterSpec(**kwargs)
    assert not isinstance(info.value, TypeError)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_the_cli_message_is_unchanged(capsys):
    from autopar.errors import ClusterSpecError

    with pytest.raises(ClusterSpecError) as info:
        cli_cluster("--gpus", "12")
    assert "--gpus 12 is not a whole number of 8-GPU nodes" in info.value.message
    assert "--gpus 8 (1 node) or --gpus 16 (2 nodes)" in info.value.hint


def _tiny():
    from gpt import gpt_tiny

    model, inputs = gpt_tiny()
    return model, inputs


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_plan_takes_a_precision(precision):
    model, inputs = _tiny()
    plan = autopar.plan(model, autopar.ClusterSpec(gpus=2, device="cpu"), example_inputs=inputs,
                        global_batch_size=4, precision=precision, fusion=False, top_k=0)
    assert plan.precision == precision and plan.assumptions["precision"] == precision


def test_compile_passes_precision_to_the_plan(monkeypatch):
    import autopar.lower.api as api

    seen = {}

    def fake_lower(model, plan, **kwargs):
        seen["plan"] = plan
        return "lowered"

    monkeypatch.setattr(api, "lower", fake_lower)
    monkeypatch.setattr(api, "plan_on_rank0", lambda make: make())  # no process group in a unit test
    model, inputs = _tiny()
    assert autopar.compile(model, autopar.ClusterSpec(gpus=1, device="cpu"), example_inputs=inputs,
                           global_batch_size=2, precision="fp32") == "lowered"
    assert seen["plan"].precision == "fp32"


@pytest.mark.parametrize("call", ["plan", "compile"])
def test_an_unknown_precision_is_refused_by_name(call):
    model, inputs = _tiny()
    with pytest.raises(AutoparError, match="precision must be bf16, fp16 or fp32, got 'fp8'"):
        if call == "plan":
            autopar.plan(model, "cpu", example_inputs=inputs, global_batch_size=4, precision="fp8")
        else:
            autopar.compile(model, "cpu", example_inputs=inputs, global_batch_size=4, precision="fp8")


def test_compile_refuses_a_precision_that_contradicts_its_plan():
    from autopar.lower.manual_plan import plan_for_model

    model, inputs = _tiny()
    plan = plan_for_model(model, precision="fp32", example_inputs=inputs(1))
    with pytest.raises(AutoparError, match="precision bf16 was asked for, but the plan.s is fp32"):
        autopar.compile(model, example_inputs=inputs, plan=plan, precision="bf16")


def test_compile_inside_a_job_plans_for_the_job(monkeypatch):
    """Issue 32: `autopar.compile(model, "cpu", ...)` inside a 2-rank torchrun planned for
    8 ranks (a device name meant one node of 8) and failed on every rank with a CLI hint.
    Inside a job a device name (or nothing, on the CPU) means the job's ranks; a cluster
    of another size is refused with the Python call that plans for the job."""
    from autopar.lower.api import job_cluster

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert job_cluster("cpu") == "cpu"  # not in a job: as given
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for spec in ("cpu", None):
        cluster = job_cluster(spec)
        assert (cluster.nodes, cluster.gpus_per_node, cluster.device) == (2, 2, "cpu")
    h100 = job_cluster("h100-sxm")
    assert (h100.world_size, h100.gpus_per_node, h100.intra_node_link) == (4, 2, "nvlink4")
    with pytest.raises(AutoparError, match="dgx-h100 has 8 GPUs, and this job runs 4 processes") as caught:
        job_cluster("dgx-h100")
    assert "autopar.compile(model, 'h100-sxm', ...)" in caught.value.hint
