"""Pricing another training engine's run (`autopar plan --engine ...`).

autopar prices its own program by default. With engine flags it prices a hand
layout as Megatron-core / NeMo or plain PyTorch would run it, so a comparison
with such a run compares layouts, not engines; such a plan is never lowered.
"""
from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT

from autopar.cli import main
from autopar.engine import AUTOPAR, ENGINES, Engine, check_runs_on_autopar, engine_from_options, with_engine
from autopar.errors import AutoparError, PlanMismatchError
from autopar.plan import Plan
from autopar.solve import layout_of, plan
from autopar.solve.layout import candidate_layout
from autopar.solve.search_space import Candidate
from cost_models.analytic import gpt
from cost_models.estimate import estimate
from cost_models.hardware import ClusterSpec

GPT = str(ROOT / "examples" / "gpt.py")
MEGATRON_OVERLAP = engine_from_options("megatron", tp_comm_overlap=True)


@pytest.fixture(scope="module")
def model():
    return gpt("gpt-1.3b", hidden=2048, heads=16, layers=8, seq_len=2048, vocab_size=51200)


@pytest.fixture(scope="module")
def cluster():
    return ClusterSpec.resolve("dgx-h100:1")


PINS = dict(tp=4, pp=2, dp=1, micro_batch=1, zero=1, checkpoint="none", schedule="1f1b", sequence_parallel=True)


def _cand(tp=4, pp=2, dp=2):
    return Candidate(pp=pp, dp=dp, tp=tp, micro_batch_size=1, num_micro_batches=4, schedule="1f1b",
                     virtual_stages=1, sequence_parallel=tp > 1)


def test_options_name_an_engine_or_say_what_is_wrong():
    assert engine_from_options() == AUTOPAR
    assert engine_from_options("megatron") == ENGINES["megatron"]
    # a single engine field without --engine prices another engine: plain PyTorch with it
    eng = engine_from_options(main_grads="fp32")
    assert eng.name == "pytorch" and eng.main_grads == "fp32" and eng.zero_as_pinned
    with pytest.raises(AutoparError, match="another engine"):
        engine_from_options("autopar", tp_comm_overlap=True)
    with pytest.raises(AutoparError, match="one of"):
        engine_from_options("pytorch", attention_kernel="flash9")
    with pytest.raises(AutoparError, match="unknown engine"):
        engine_from_options("deepspeed")
    assert Engine.from_dict(MEGATRON_OVERLAP.to_dict()) == MEGATRON_OVERLAP
    assert Engine.from_dict(None) is AUTOPAR


def test_attention_kernels_are_the_ones_the_cost_model_prices():
    from autopar.engine import ATTENTION_KERNELS
    from cost_models.compute import ATTENTION_IMPL_SPEED

    assert set(ATTENTION_KERNELS) == {k for k in ATTENTION_IMPL_SPEED if k}


def test_layout_states_the_engine_and_its_zero_levels():
    own = candidate_layout(_cand(), zero=1)
    assert own.zero == 2, "autopar runs ZeRO 1 beside tp / pp as FSDP2's ZeRO 2"
    assert (own.optimizer_impl, own.main_grads, own.tp_comm_overlap) == ("foreach", "same", False)
    meg = candidate_layout(_cand(), zero=1, engine=MEGATRON_OVERLAP)
    assert meg.zero == 1, "Megatron's distributed optimizer is a true ZeRO 1"
    assert (meg.optimizer_impl, meg.main_grads, meg.tp_comm_overlap) == ("fused", "fp32", True)
    assert not candidate_layout(_cand(tp=1, pp=1, dp=1), engine=MEGATRON_OVERLAP).fsdp_one_rank


def test_attention_kernel_is_priced_on_the_captured_ops(model, cluster):
    slow = with_engine(model, engine_from_options("pytorch", attention_kernel="flash-triton"))
    assert model.layers is not slow.layers, "the input spec is not touched"
    attn = [op for layer in slow.layers for op in layer.ops if op.kind == "attention"]
    assert attn and all(op.impl == "flash-triton" for op in attn)
    assert all(op.impl is None for layer in model.layers for op in layer.ops if op.kind == "attention")
    layout = candidate_layout(_cand(tp=1, pp=1, dp=8))
    # the 2022 Triton kernel is 1.4x / 2x slower than FlashAttention-2 (compute.ATTENTION_IMPL_SPEED)
    assert estimate(slow, layout, cluster).step_time_s > estimate(model, layout, cluster).step_time_s


def test_overlapped_tp_is_faster_than_exposed_and_the_plan_prices_as_layout_of(model, cluster):
    own = plan(model, cluster, global_batch_size=8, constraints=PINS, top_k=0)
    meg = plan(model, cluster, global_batch_size=8, constraints=PINS, top_k=0, engine=MEGATRON_OVERLAP)
    assert "engine" not in own.assumptions
    assert meg.assumptions["engine"]["name"] == "megatron"
    assert meg.predicted.step_time_s < own.predicted.step_time_s
    assert all(c.zero == 1 for c in meg.layer_choices), "pinned ZeRO 1 is priced as ZeRO 1"
    # the saved plan re-prices to its own numbers: the engine travels in the JSON
    back = Plan.from_json(meg.to_json())
    layout = layout_of(back)
    assert layout.tp_comm_overlap and layout.optimizer_impl == "fused" and layout.zero == 1
    assert estimate(model, layout, cluster).step_time_s == pytest.approx(meg.predicted.step_time_s, rel=1e-9)


def test_a_plan_for_another_engine_is_refused_by_the_lowering(model, cluster):
    meg = plan(model, cluster, global_batch_size=8, constraints=PINS, top_k=0, engine=MEGATRON_OVERLAP)
    with pytest.raises(PlanMismatchError, match="megatron engine"):
        check_runs_on_autopar(meg)
    check_runs_on_autopar(plan(model, cluster, global_batch_size=8, constraints=PINS, top_k=0))


def test_cli_engine_flags(capsys, tmp_path):
    base = ("plan", f"{GPT}:gpt_tiny", "--gpus", "2", "--device", "h100-sxm", "--batch-size", "4", "--tp", "2",
            "--dp", "1", "--pp", "1", "--micro-batch", "2", "--zero", "1", "--json")
    assert main([*base, "--engine", "megatron", "--tp-comm-overlap"]) == 0
    saved = Plan.from_json(capsys.readouterr().out)
    assert saved.assumptions["engine"]["tp_comm_overlap"] is True
    # a flag that describes another engine next to --engine autopar: exit 2, one clear line
    assert main([*base, "--engine", "autopar", "--main-grads", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "another engine" in err and "Traceback" not in err
    # compile lowers autopar's program only: no engine flags, and a saved foreign plan is refused
    path = tmp_path / "plan.json"
    path.write_text(saved.to_json())
    # the report of a saved foreign plan says what it was priced for
    assert main(["report", "--plan", str(path), "-o", str(tmp_path / "plan.html")]) == 0
    assert "the megatron engine (tp_comm_overlap=True" in (tmp_path / "plan.html").read_text()
    capsys.readouterr()
    assert main(["compile", "--plan", str(path), f"{GPT}:gpt_tiny", "-o", str(tmp_path / "build")]) == 2
    assert "megatron engine" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compile", f"{GPT}:gpt_tiny", "--gpus", "2", "--device", "cpu", "--engine", "megatron",
              "-o", str(tmp_path / "b2")])


def test_engine_flags_bring_the_cli_path_to_the_validation_pricing():
    """MPT-7B on 128 H100 (MosaicML's table, validation data): the model written as people
    write it and priced through the planner's layout with MosaicML's engine (Composer FSDP,
    fp32 gradient reduction, the 2022 Triton attention) lands where the validation script's
    analytic pricing does; without the flags it prices autopar's own, faster program."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cli_path_validation as cpv
    import validation_runs as vr

    row = next(r for r in vr.mpt_rows() if r["label"] == "MPT-7b s2048 128x h100_80gb mb6x1")
    results, _ = cpv.run(rows=[row])
    (got,) = results
    _, analytic = vr._price(row["model"](), row["layout"], row["cluster"])
    validation = vr._predicted(analytic, row["layout"], "tokens_per_s_per_gpu")
    assert got["run_engine"]["predicted"] == pytest.approx(validation, rel=0.03)
    assert got["autopar"]["predicted"] > 1.05 * got["run_engine"]["predicted"]
    json.dumps(results)  # plain data, as written to benchmarks/results


def test_validation_set_through_the_cli_path():
    """All 229 validation rows priced as a CLI user prices them (captured models, pinned
    layouts, the run's engine flags): within issue 13's 10% median, and the signed medians
    of the FSDP and the tp/pp rows within 5 points of each other (2.8 apart today:
    docs/cost_model.md section 10)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cli_path_validation as cpv

    results, skipped = cpv.run()
    s = cpv.summary(results)["run_engine"]
    assert s["all"]["rows"] >= 200 and not skipped
    assert s["all"]["median_abs_error"] <= 0.10
    assert abs(s["fsdp"]["median_signed_error"]) <= 0.05 and abs(s["tp/pp"]["median_signed_error"]) <= 0.05
    assert abs(s["family_gap_points"]) <= 5.0


def test_megatron_runs_each_memory_bound_module_as_one_kernel(cluster):
    """Megatron runs its own kernels, not the model file: an eager RMSNorm module is one
    Transformer Engine kernel there, so the bytes capture says one kernel would save are
    taken off (autopar's program and plain PyTorch run the model's eager ops)."""
    from dataclasses import replace

    import torch
    from test_capture_models import NormBlock

    from autopar.solve.planner import model_spec

    with torch.device("meta"):
        net = torch.nn.Sequential(NormBlock(2048), NormBlock(2048))
    spec = model_spec(net, (torch.randn(1, 2048, 2048, device="meta"),), precision="bf16")
    assert all(layer.module_fusion_saved_fwd != 0 for layer in spec.layers)
    meg = ENGINES["megatron"]
    as_run = with_engine(spec, meg)
    for layer, run in zip(spec.layers, as_run.layers):
        assert run.fused_bytes_saved_fwd == layer.fused_bytes_saved_fwd + layer.module_fusion_saved_fwd
        assert run.fused_bytes_saved_bwd == layer.fused_bytes_saved_bwd + layer.module_fusion_saved_bwd
    eager = with_engine(spec, replace(meg, fuses_modules=False))
    layout = candidate_layout(_cand(tp=1, pp=1, dp=8), engine=meg)
    assert estimate(as_run, layout, cluster).step_time_s < estimate(eager, layout, cluster).step_time_s
    assert not (AUTOPAR.fuses_modules or ENGINES["pytorch"].fuses_modules)


def test_compiled_blocks_are_priced_as_inductor_fuses_them_and_still_lowered(cluster):
    """`autopar plan --compile` (what autopar.compile plans on CUDA): each block's
    memory-bound chains fused across its modules, as one compiled graph is, and only
    the kernels that graph launches dispatched; embeddings and head stay eager. Still
    autopar's own program: the lowering takes the plan, and says so when the blocks run
    otherwise than priced."""
    import torch

    from autopar.engine import COMPILED
    from autopar.lower.compile_blocks import priced_otherwise
    from autopar.solve.fusion_costs import charge_compiled_blocks

    sys.path.insert(0, str(ROOT / "examples"))
    import llama
    net, inputs = llama.llama_tiny()
    from autopar.solve.planner import model_spec
    graph = model_spec(net, inputs, precision="bf16")
    blocks = [l for l in graph.layers if l.kind == "transformer_block"]
    assert blocks and all(l.compiled_fusion_saved_fwd != 0 and l.compiled_fusion_saved_bwd != 0 for l in blocks)
    assert all(l.attrs["compiled_kernels_fwd"] < l.attrs["host_ops_fwd"] / 2 for l in blocks)
    as_run = charge_compiled_blocks(graph)
    for layer, run in zip(graph.layers, as_run.layers):
        if layer in blocks:
            assert run.fused_bytes_saved_fwd == layer.compiled_fusion_saved_fwd
            assert run.attrs["host_ops_fwd"] == layer.attrs["compiled_kernels_fwd"]
        else:  # eager, as lowered
            assert run is layer

    kw = dict(example_inputs=inputs, global_batch_size=64, constraints=dict(tp=1, pp=1, zero=2, micro_batch=1))
    eager = plan(net, "h100-sxm:8", **kw)
    compiled = plan(net, "h100-sxm:8", engine=COMPILED, **kw)
    assert compiled.predicted.step_time_s < eager.predicted.step_time_s
    assert compiled.assumptions["engine"]["compiled_blocks"] is True and "engine" not in eager.assumptions
    check_runs_on_autopar(compiled)  # autopar's own program: lowered
    assert priced_otherwise(compiled, compiling=True) == [] and priced_otherwise(eager, compiling=False) == []
    assert "priced with its blocks compiled, and they run eager" in priced_otherwise(compiled, compiling=False)[0]
    with pytest.raises(AutoparError, match="--compile"):
        engine_from_options("megatron", compiled_blocks=True)
    assert torch.is_tensor(inputs(1)[0])
