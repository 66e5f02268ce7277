"""What a DeepSpeed-only or FSDP-only user would run, beside autopar's plan
(autopar/solve/baselines.py, issue 33 item 4): data parallelism only, the best of
its family by the same cost model, never faster than the plan, carried by the
Plan's JSON, printed by `autopar plan` and shown by the report."""
import json

import pytest
from rich.console import Console

from cost_models.analytic import gpt, llama
from cost_models.hardware import ClusterSpec

from autopar.commands.plan import render
from autopar.plan import Plan
from autopar.plan_schema import type_problem
from autopar.report import render_html
from autopar.solve import plan
from autopar.solve.baselines import DEEPSPEED, FAMILIES, FSDP, data_parallel_gpus, family_layouts
from autopar.solve.planner import scaled_cluster
from autopar.solve.refine import fits, price_uniform

FAMILY = {f.stack: f for f in FAMILIES}


def _cluster(nodes, device="a100-80g"):
    return scaled_cluster(ClusterSpec.resolve(device), nodes)


@pytest.fixture(scope="module")
def gpt_1b():
    model = gpt("gpt-1.3b", hidden=2048, heads=16, layers=24, seq_len=2048, vocab_size=50257)
    cluster = _cluster(2)  # 16 GPUs
    return model, cluster, plan(model, cluster, global_batch_size=64, top_k=2)


@pytest.fixture(scope="module")
def llama_13b():
    # memory-tight: the plan mixes checkpointing per layer, DeepSpeed (no selective
    # checkpointing) needs ZeRO 3, FSDP2 selective checkpointing on every block
    model = llama("llama-13b", hidden=5120, heads=40, layers=40, seq_len=4096, vocab_size=32000, kv_heads=40,
                  ffn_hidden=13824)
    cluster = _cluster(1, "h100-sxm")
    return model, cluster, plan(model, cluster, global_batch_size=16, top_k=2)


@pytest.fixture(scope="module")
def wide():
    # one block holds 29B parameters: ZeRO 3 still gathers a whole block on each GPU
    # (58 GB in bf16, and as much again of its gradients), so only tensor parallelism fits
    model = gpt("wide", hidden=49152, heads=96, layers=4, seq_len=2048, vocab_size=32000)
    cluster = _cluster(1)
    return model, cluster, plan(model, cluster, global_batch_size=8, top_k=2)


def _limit(p):
    return p.solver["memory_limit_bytes"]


def test_baselines_are_data_parallel_only(gpt_1b, llama_13b):
    for _, cluster, p in (gpt_1b, llama_13b):
        assert [b["stack"] for b in p.baselines] == ["deepspeed", "fsdp"]
        for b in p.baselines:
            assert b["mesh"] == {"pp": 1, "dp": cluster.world_size, "tp": 1} and b["gpus"] == cluster.world_size
            assert b["schedule"] == "accumulate" and not b["sequence_parallel"]
            assert b["micro_batch_size"] * b["num_micro_batches"] * b["gpus"] == p.global_batch_size
            assert (b["zero"], b["offload"]) in FAMILY[b["stack"]].states
            assert b["checkpoint"] in FAMILY[b["stack"]].checkpoints
            assert b["fits"] and b["status"] == "ok"


@pytest.mark.parametrize("case", ["gpt_1b", "llama_13b"])
def test_each_baseline_is_the_best_of_its_family(case, request):
    """Every other layout of the family, priced by hand, is slower or does not fit
    (offloaded ones count only when nothing fits without offload)."""
    model, cluster, p = request.getfixturevalue(case)
    for b in p.baselines:
        step = b["predicted"]["step_time_s"]
        family = FAMILY[b["stack"]]
        for cand, option in family_layouts(family, cluster.world_size, p.global_batch_size):
            _, est = price_uniform(model, cluster, cand, option, precision="bf16", optimizer="adam")
            if est is not None and fits(est, _limit(p)) and (option[2] == "none" or b["offload"] != "none"):
                assert est.step_time_s >= step * (1 - 1e-9), (b["stack"], cand, option)
                assert b["offload"] == "none" or option[2] != "none"  # an offload pick: nothing fit without


def test_offload_only_when_nothing_fits_without_it():
    """On one CPU rank host offload prices a hair faster; no stack's user offloads a model that fits."""
    model = gpt("gpt-tiny", hidden=64, heads=4, layers=2, seq_len=64, vocab_size=256)
    p = plan(model, scaled_cluster(ClusterSpec.resolve("cpu"), 1, 1), global_batch_size=2, top_k=0)
    for b in p.baselines:
        assert b["fits"] and b["offload"] == "none"
        assert b["vs_plan"] >= 1 - 1e-9


def test_a_mutated_zero_level_is_not_better(llama_13b):
    """The pick's ZeRO level changed by hand (every other level DeepSpeed runs) is no faster."""
    model, cluster, p = llama_13b
    b = next(b for b in p.baselines if b["stack"] == "deepspeed")
    cand = next(c for c, _ in family_layouts(DEEPSPEED, cluster.world_size, p.global_batch_size)
                if c.micro_batch_size == b["micro_batch_size"])
    others = [z for z in range(4) if z != b["zero"]]
    for zero in others:
        _, est = price_uniform(model, cluster, cand, (zero, b["checkpoint"], "none"), precision="bf16",
                               optimizer="adam")
        assert not fits(est, _limit(p)) or est.step_time_s >= b["predicted"]["step_time_s"]


@pytest.mark.parametrize("case", ["gpt_1b", "llama_13b", "wide"])
def test_the_plan_is_never_slower_than_a_baseline_that_fits(case, request):
    """The baselines lie in the planner's own space (same GPUs): a faster one is a planner bug."""
    _, cluster, p = request.getfixturevalue(case)
    for b in p.baselines:
        if b["fits"] and b["gpus"] == cluster.world_size:
            assert p.predicted.step_time_s <= b["predicted"]["step_time_s"] * (1 + 1e-9), b
            assert b["vs_plan"] == pytest.approx(b["predicted"]["step_time_s"] / p.predicted.step_time_s)


def test_a_model_that_fits_only_with_tp_shows_fsdp_not_fitting(wide):
    _, _, p = wide
    assert p.mesh.tp > 1
    fsdp = next(b for b in p.baselines if b["stack"] == "fsdp")
    assert fsdp["fits"] is False and fsdp["status"] == "oom" and fsdp["vs_plan"] is None
    assert fsdp["why"].startswith("does not fit") and "GiB" in fsdp["why"]
    # the closest layout named is the smallest one FSDP2 has: full shard, CPU offload, full checkpointing
    assert (fsdp["zero"], fsdp["offload"], fsdp["checkpoint"], fsdp["micro_batch_size"]) == (3, "params", "full", 1)
    text = _terminal(p)
    assert "PyTorch FSDP2 (data parallel only): does not fit" in text


def _terminal(p) -> str:
    console = Console(record=True, width=400)
    render(p, console, top=1)
    return console.export_text()


def test_terminal_and_json_carry_the_baselines(gpt_1b):
    _, _, p = gpt_1b
    text = _terminal(p)
    assert "Beside one stack alone" in text
    for b in p.baselines:
        assert b["name"] in text and b["config"] in text
    # a plan whose baseline is slower says by how much
    slow = Plan.from_json(p.to_json())
    slow.baselines[0]["vs_plan"] = 1.5
    slow.baselines[0]["predicted"]["step_time_s"] = 1.5 * p.predicted.step_time_s
    assert "1.50x slower than autopar's plan" in _terminal(slow)
    data = json.loads(p.to_json())
    assert data["baselines"] == json.loads(json.dumps(p.baselines))
    again = Plan.from_json(p.to_json())
    assert again.baselines == p.baselines and again.to_json() == p.to_json()
    assert all(b["predicted"]["samples_per_s"] > 0 for b in again.baselines)


def test_the_report_shows_the_baselines(wide):
    _, _, p = wide
    html = render_html(p)
    assert 'id="baselines"' in html
    for b in p.baselines:
        assert b["name"] in html
    assert "does not fit" in html


def test_old_plans_without_the_field_load(gpt_1b):
    d = json.loads(gpt_1b[2].to_json())
    del d["baselines"]
    old = Plan.from_dict(d)
    assert old.baselines == []
    assert "Beside one stack alone" not in _terminal(old)
    assert 'id="baselines"' not in render_html(old)


def test_a_wrong_baseline_type_is_named():
    assert "baselines[0].fits" in type_problem({"baselines": [{"stack": "fsdp", "fits": "yes"}]})
    assert "missing field 'stack'" in type_problem({"baselines": [{"fits": True}]})


def test_data_parallelism_uses_the_gpus_the_batch_allows():
    assert data_parallel_gpus(1024, 1536, 8) == 512
    assert data_parallel_gpus(16, 64, 8) == 16
    assert data_parallel_gpus(16, 12, 8) == 4  # part of one node
    assert data_parallel_gpus(24, 12, 8) == 4  # 12 GPUs would be one and a half nodes
    model = gpt("gpt-125m", hidden=768, heads=12, layers=12, seq_len=1024, vocab_size=50257)
    p = plan(model, _cluster(2), global_batch_size=24, top_k=0)
    for b in p.baselines:
        assert b["gpus"] == 8 and b["mesh"]["dp"] == 8 and "on 8 of the 16 GPUs" in b["why"]


def test_family_words():
    assert FSDP.config(3, "full", "params", 1, 4) == ("fully_shard (full shard), CPUOffloadPolicy, full activation "
                                                      "checkpointing, micro-batch 1 x 4 accumulation steps")
    assert "ZeRO stage 2, offload_optimizer cpu" in DEEPSPEED.config(2, "none", "optimizer", 2, 1)


def test_a_cluster_that_cannot_shrink_leaves_the_plan_alone():
    from autopar.errors import ClusterSpecError
    from autopar.solve.baselines import price_baselines

    def refuse(nodes, per_node):
        raise ClusterSpecError("no such cluster")

    model = gpt("gpt-125m", hidden=768, heads=12, layers=12, seq_len=1024, vocab_size=50257)
    out = price_baselines(model, _cluster(2), 24, precision="bf16", optimizer="adam", limit_bytes=70e9,
                          plan_step_s=1.0, cluster_of=refuse)
    assert [b["status"] for b in out] == ["none", "none"] and "could not be built" in out[0]["why"]
    assert type_problem({"baselines": out}) is None
