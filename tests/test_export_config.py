"""autopar export-config (issue 33): every exported config of the benchmark plans is read
by the target's own code, and every plan field a target can express reaches it.

The benchmark plans are the committed samples in reports/ (GPT-3 175B on 1,024 A100,
the same with a pinned pp 16 x tp 8 pipeline, Llama 3 70B on 256 H100, Llama 3 8B on
64 H100). Each target's parser:
- DeepSpeed: deepspeed.runtime.config.DeepSpeedConfig (pydantic ZeRO / TP sections,
  the batch arithmetic over the data-parallel size an mpu reports);
- torchtitan: torchtitan.config.ConfigManager.parse_args on the exported command line;
- Megatron-Core: TransformerConfig (pipeline layout, recompute, sequence parallel),
  DistributedDataParallelConfig, OptimizerConfig, the micro-batch calculator;
- accelerate: `accelerate launch`'s own parser and _validate_launch_command on the file,
  then its FSDP plugin and ParallelismConfig from the environment launch prepares;
- transformers: HfArgumentParser(TrainingArguments) with unknown keys refused, and
  DistributedConfig.
They are optional test dependencies (pyproject's dev extra); a test is skipped only
where its package is missing.
"""
from __future__ import annotations

import copy
import json
import os
import shlex

import pytest
import torch
import yaml

from autopar.export_config import TARGETS, export
from autopar.plan import Mesh
from autopar.plan_file import load_plan_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANS = ("gpt3_175b_1024xa100", "gpt3_175b_pinned_pp16_tp8_1024xa100", "llama3_70b_256xh100", "llama3_8b_64xh100")


def _load(name):
    return load_plan_file(os.path.join(ROOT, "reports", f"{name}.plan.json"))


def _mutated():
    """Llama 3 8B's plan with tp 2 and micro-batch 2 (same world, same global batch): a target
    that ignores either field exports what the benchmark plan already had and fails below."""
    plan = _load("llama3_8b_64xh100")
    assert (plan.mesh.tp, plan.micro_batch_size) == (1, 1)
    plan.mesh = Mesh(pp=1, dp=32, tp=2)
    plan.micro_batch_size, plan.num_micro_batches = 2, plan.global_batch_size // (32 * 2)
    return plan


def _pipelined_fp16():
    """Llama 3 8B's plan on a pp 2 x dp 32 mesh with uneven stages (16 and 18 layers), fp16, ZeRO 1
    and optimizer offload: the fields the benchmark plans leave at one value."""
    from autopar.export_config.common import restage

    plan = _load("llama3_8b_64xh100")
    plan.mesh = Mesh(pp=2, dp=32, tp=1)
    plan.schedule, plan.precision = "1f1b", "fp16"
    plan.micro_batch_size, plan.num_micro_batches = 1, plan.global_batch_size // 32
    for c in plan.layer_choices:
        c.zero, c.offload, c.reshard_after_forward = 1, "optimizer", False
    restage(plan, [16, len(plan.layer_choices) - 16])
    return plan


def _hsdp():
    """Llama 3 8B's plan (8 nodes of 8) as HSDP: ZeRO 3 sharded over each node's 8 dp ranks,
    replicated across the 8 nodes (Mesh.dp_shard)."""
    plan = _load("llama3_8b_64xh100")
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (64, 1, 1)
    plan.mesh = Mesh(pp=1, dp=64, tp=1, dp_shard=8)
    for c in plan.layer_choices:
        c.zero, c.reshard_after_forward = 3, True
    return plan


def _compressed():
    """Llama 3 8B's plan with its gradients reduced in bf16 (Plan.grad_reduce_dtype)."""
    plan = _load("llama3_8b_64xh100")
    plan.grad_reduce_dtype = "bf16"
    return plan


VARIANTS = {"mutated": _mutated, "pipelined_fp16": _pipelined_fp16, "hsdp": _hsdp, "compressed": _compressed}


@pytest.fixture(scope="module", params=PLANS + tuple(VARIANTS))
def plan(request):
    return VARIANTS[request.param]() if request.param in VARIANTS else _load(request.param)


# -- DeepSpeed ----------------------------------------------------------------------------------
def test_deepspeed_config_parser_reads_every_export(plan, monkeypatch):
    pytest.importorskip("deepspeed")
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.utils import partition_uniform

    result = export(plan, "deepspeed")
    near = result.nearest

    class Mpu:  # what Megatron's mpu tells DeepSpeed: the data-parallel world (tp and pp ranks excluded)
        def get_data_parallel_world_size(self):
            return near.mesh.dp

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)  # no process group here
    cfg = DeepSpeedConfig(json.loads(result.text), mpu=Mpu())
    assert cfg.world_size == near.mesh.dp
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        plan.global_batch_size, near.micro_batch_size, near.num_micro_batches)
    assert cfg.train_micro_batch_size_per_gpu == plan.micro_batch_size  # DeepSpeed keeps the plan's micro-batch
    assert cfg.zero_optimization_stage == max(c.zero for c in near.layer_choices)
    assert cfg.gradient_clipping == 1.0 and cfg.bfloat16_config.enabled == (plan.precision == "bf16")
    assert cfg.float16_config.enabled == (plan.precision == "fp16")
    if plan.precision == "fp16":
        assert cfg.float16_config.loss_scale == 0  # dynamic loss scaling
    assert cfg.communication_data_type == ({"bf16": torch.bfloat16}.get(plan.grad_reduce_dtype))
    offload = max((c.offload for c in plan.layer_choices), key=("none", "optimizer", "params").index)
    assert (cfg.zero_config.offload_optimizer is not None) == (offload != "none")
    assert cfg.tensor_parallel_config.autotp_size == (plan.mesh.tp if plan.mesh.tp > 1 else 0)
    if plan.mesh.pp > 1:
        assert cfg.pipeline["stages"] == plan.mesh.pp
        assert cfg.zero_optimization_stage <= 1  # DeepSpeed's pipeline engine refuses ZeRO 2/3
        parts = partition_uniform(len(near.layer_choices), plan.mesh.pp)  # PipelineModule's 'uniform'
        assert [b - a for a, b in zip(parts, parts[1:])] == [len(s.layers) for s in near.stages]
        assert any("uneven pipeline stages" in n for n in result.notes)


# -- torchtitan ---------------------------------------------------------------------------------
def _torchtitan_args(text: str) -> list[str]:
    """The command line after `-m torchtitan.train`, with a registry entry for models torchtitan
    does not have (the file asks for TORCHTITAN_MODULE / TORCHTITAN_CONFIG)."""
    words = shlex.split(text.replace("\\\n", " "), comments=True)  # sh's line continuations, then its words
    args = words[words.index("torchtitan.train") + 1:]
    fill = {"${TORCHTITAN_MODULE:?the torchtitan model module, e.g. llama3}": "llama3",
            "${TORCHTITAN_CONFIG:?its config function, e.g. llama3_8b}": "llama3_debugmodel"}
    return [fill.get(a, a) for a in args]


def test_torchtitan_config_manager_parses_every_export(plan):
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    result = export(plan, "torchtitan")
    near = result.nearest
    cfg = ConfigManager().parse_args(_torchtitan_args(result.text))
    p, t = cfg.parallelism, cfg.training
    assert (p.data_parallel_shard_degree * p.data_parallel_replicate_degree, p.tensor_parallel_degree,
            p.pipeline_parallel_degree) == (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp)
    assert p.enable_sequence_parallel == (plan.sequence_parallel or plan.mesh.tp == 1)
    assert t.global_batch_size == plan.global_batch_size
    assert t.seq_len == plan.seq_len and t.max_norm == 1.0
    ac = type(cfg.activation_checkpoint).__qualname__.split(".")[0]
    # torchtitan 0.3.0's `activation-checkpoint:none` leaves the section None (it has no NoAC class)
    assert ac == {"none": "NoneType", "selective": "SelectiveAC", "full": "FullAC"}[near.layer_choices[1].checkpoint]
    if plan.mesh.pp > 1:  # uneven stages kept exactly, as module lists
        assert p.module_fqns_per_model_part == [[m for c in s.layers for m in c.module_paths] for s in plan.stages]
        assert p.pipeline_parallel_microbatch_size == plan.micro_batch_size
        assert t.local_batch_size == plan.micro_batch_size * plan.num_micro_batches
    else:
        assert t.local_batch_size == plan.micro_batch_size
    assert p.fsdp_reshard_after_forward == ("always" if near.layer_choices[1].zero >= 3 else "never")


# -- Megatron-Core ------------------------------------------------------------------------------
MODEL_SHAPES = {"gpt3_175b": dict(hidden_size=12288, num_attention_heads=96),
                "llama3_70b": dict(hidden_size=8192, num_attention_heads=64, num_query_groups=8),
                "llama3_8b": dict(hidden_size=4096, num_attention_heads=32, num_query_groups=8)}


def _transformer_config(fields: dict):
    import torch
    from megatron.core.transformer import TransformerConfig

    for key in ("params_dtype", "pipeline_dtype"):  # written by name, as NeMo's YAML does
        if fields.get(key):
            fields[key] = getattr(torch, fields[key])
    return TransformerConfig(**fields)


def test_megatron_export_of_a_captured_model_carries_its_shape(tmp_path, capsys):
    """With the model captured, the file needs nothing added: TransformerConfig takes it as written."""
    pytest.importorskip("megatron.core")
    from autopar.cli import main

    out = tmp_path / "megatron.yaml"
    plan = os.path.join(ROOT, "reports", "llama3_70b_256xh100.plan.json")
    assert main(["export-config", plan, "--to", "megatron", "-o", str(out)]) == 0
    tc = _transformer_config(yaml.safe_load(out.read_text())["transformer_config"])
    assert (tc.hidden_size, tc.num_attention_heads, tc.num_query_groups, tc.ffn_hidden_size) == (8192, 64, 8, 28672)
    assert "s/step" in capsys.readouterr().out


def test_megatron_core_configs_accept_every_export(plan):
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.optimizer import OptimizerConfig

    result = export(plan, "megatron")
    cfg = yaml.safe_load(result.text)
    tc = _transformer_config(dict(cfg["transformer_config"], **MODEL_SHAPES[plan.model["name"]]))
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size) == (plan.mesh.tp, plan.mesh.pp)
    assert tc.sequence_parallel == plan.sequence_parallel and tc.bf16 == (plan.precision == "bf16")
    assert tc.fp16 == (plan.precision == "fp16")
    if plan.mesh.pp > 1:  # uneven stages kept exactly: Megatron's own layout object counts them
        per_stage = [len(stage) for row in tc.pipeline_model_parallel_layout.layout for stage in row]
        assert per_stage == [len(s.layers) for s in plan.stages]
    DistributedDataParallelConfig(**cfg["ddp_config"])
    OptimizerConfig(**cfg["optimizer_config"])
    b = cfg["training"]
    calc = ConstantNumMicroBatchesCalculator(b["global_batch_size"], b["micro_batch_size"], b["data_parallel_size"],
                                             False, 0)
    assert (b["micro_batch_size"], calc.get()) == (plan.micro_batch_size, plan.num_micro_batches)
    assert "--tensor-model-parallel-size %d" % plan.mesh.tp in cfg["megatron_lm_args"]


# -- accelerate ---------------------------------------------------------------------------------
def test_accelerate_launch_reads_every_export(plan, tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    result = export(plan, "accelerate")
    near = result.nearest
    path = tmp_path / "accelerate.yaml"
    path.write_text(result.text)
    parser = launch_command_parser()
    known = vars(parser.parse_args(["x.py"]))
    data = yaml.safe_load(result.text)
    for section in ("fsdp_config", "parallelism_config"):  # launch copies these keys onto its flags unchecked
        assert set(data.get(section, {})) <= set(known), section
    args = parser.parse_args(["--config_file", str(path), "--main_process_ip", "127.0.0.1", "train.py"])
    _validate_launch_command(args)
    assert (args.num_processes, args.num_machines) == (plan.mesh.world_size, plan.cluster["nodes"])
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    if near.mesh.tp > 1 or near.mesh.dp > 1 and near.layer_choices[1].zero > 0:
        fsdp = FullyShardedDataParallelPlugin()
        assert fsdp.fsdp_version == 2 and fsdp.reshard_after_forward == (near.layer_choices[1].zero >= 3)
        pc = ParallelismConfig()
        assert (pc.dp_shard_size or 1, pc.tp_size or 1) == (near.mesh.shard_ranks, plan.mesh.tp)
        assert (pc.dp_replicate_size or 1) == near.mesh.replicas  # HSDP's replicas, else 1
        assert pc.dp_replicate_size * pc.dp_shard_size * pc.tp_size == plan.mesh.world_size
    if plan.mesh.pp > 1:
        assert any("pipeline parallelism" in n for n in result.notes)
    assert f"DataLoader(batch_size={plan.micro_batch_size})" in result.text or plan.mesh.pp > 1


# -- Hugging Face transformers ------------------------------------------------------------------
def test_transformers_reads_every_export(plan, monkeypatch):
    pytest.importorskip("transformers")
    import transformers.training_args
    from transformers import HfArgumentParser, TrainingArguments
    from transformers.distributed import DistributedConfig

    # the export is for GPUs; this machine has none, and TrainingArguments checks bf16 on it
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    result = export(plan, "hf")
    cfg = json.loads(result.text)
    (args,) = HfArgumentParser(TrainingArguments).parse_dict(cfg["training_args"], allow_extra_keys=False)
    dist = DistributedConfig(**cfg["distributed_config"])  # its from_dict would drop unknown keys
    near = result.nearest
    assert args.per_device_train_batch_size == near.micro_batch_size
    assert args.gradient_accumulation_steps == near.num_micro_batches
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * dist.dp_size == plan.global_batch_size
    assert (dist.tp_size, dist.dp_replicate_size * dist.fsdp_size * dist.pp_size * dist.tp_size) == (
        plan.mesh.tp, plan.mesh.world_size)
    assert (dist.fsdp_size, dist.dp_replicate_size) == (near.mesh.shard_ranks, near.mesh.replicas)
    assert args.bf16 == (plan.precision == "bf16") and args.max_grad_norm == 1.0


# -- HSDP in each target -------------------------------------------------------------------------
def test_hsdp_reaches_each_target_or_is_said():
    plan = _hsdp()
    args = _torchtitan_args(export(plan, "torchtitan").text)
    assert args[args.index("--parallelism.data_parallel_replicate_degree") + 1] == "8"
    assert args[args.index("--parallelism.data_parallel_shard_degree") + 1] == "8"
    assert export(plan, "torchtitan").nearest.mesh.dp_shard == 8  # torchtitan runs it exactly
    ds = export(plan, "deepspeed")
    assert json.loads(ds.text)["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert not ds.nearest.mesh.hsdp and any("ZeRO++ hpZ" in n for n in ds.notes)  # priced as whole-dp ZeRO 3
    acc = yaml.safe_load(export(plan, "accelerate").text)["parallelism_config"]
    assert (acc["parallelism_config_dp_replicate_size"], acc["parallelism_config_dp_shard_size"]) == (8, 8)
    hf = json.loads(export(plan, "hf").text)["distributed_config"]
    assert (hf["dp_replicate_size"], hf["fsdp_size"]) == (8, 8)
    mg = export(plan, "megatron")
    assert not mg.nearest.mesh.hsdp and any("HSDP (dp 64 = 8 replicas x 8 shards): not expressible" in n
                                            for n in mg.notes)


def test_compression_reaches_each_target_or_is_said():
    plan = _compressed()
    ds = export(plan, "deepspeed")
    assert json.loads(ds.text)["communication_data_type"] == "bf16" and ds.nearest.grad_reduce_dtype == "bf16"
    assert any("zero_quantized_gradients" in n for n in json.loads(ds.text)["_autopar_notes"])
    assert "communication_data_type" not in json.loads(export(_load("llama3_8b_64xh100"), "deepspeed").text)
    acc = export(plan, "accelerate")
    assert "torch.bfloat16" in acc.text and acc.nearest.grad_reduce_dtype == "bf16"
    mg = export(plan, "megatron")
    assert 'grad_reduce_in_fp32: false' in mg.text and mg.nearest.grad_reduce_dtype == "bf16"
    for target, why in (("torchtitan", "mixed_precision_reduce accepts float32 only"),
                        ("hf", "fsdp_mixed_precision reduces in fp32")):
        result = export(plan, target)
        assert result.nearest.grad_reduce_dtype is None and any(why in n for n in result.notes), result.notes
    fp32 = copy.deepcopy(plan)
    fp32.precision = "fp32"
    mg32 = export(fp32, "megatron")
    assert mg32.nearest.grad_reduce_dtype is None and any("grad_reduce_in_fp32 only" in n for n in mg32.notes)


# -- what cannot be expressed, and the command ---------------------------------------------------
def test_a_target_that_expresses_everything_says_so_and_changes_nothing():
    plan = _load("llama3_8b_64xh100")
    exact = copy.deepcopy(plan)
    for c in exact.layer_choices:
        c.checkpoint = "selective"
    result = export(exact, "megatron")
    assert result.exact and "expressed exactly" in result.text
    assert result.nearest.to_dict() == exact.to_dict()


def test_export_config_command_prices_the_nearest_layout(tmp_path, capsys):
    from autopar.cli import main

    out = tmp_path / "ds.json"
    plan = os.path.join(ROOT, "reports", "gpt3_175b_pinned_pp16_tp8_1024xa100.plan.json")
    assert main(["export-config", plan, "--to", "deepspeed", "-o", str(out), "--clip", "0.5"]) == 0
    said = capsys.readouterr().out
    assert json.loads(out.read_text())["gradient_clipping"] == 0.5
    assert "uneven pipeline stages" in said and "nearest expressible layout" in said
    # the plan re-priced on the captured model gives what the plan file predicted
    predicted = json.loads(open(plan).read())["predicted"]["step_time_s"]
    assert f"autopar's plan: {predicted:.3f} s/step" in said
    assert "s/step" in said.split("nearest expressible layout")[1]


def test_export_config_without_the_model_says_no_price(tmp_path, capsys):
    from autopar.cli import main

    data = json.loads(open(os.path.join(ROOT, "reports", "llama3_8b_64xh100.plan.json")).read())
    data["model"]["source"] = "missing/model.py:llama3_8b"
    src = tmp_path / "plan.json"
    src.write_text(json.dumps(data))
    assert main(["export-config", str(src), "--to", "hf", "-o", str(tmp_path / "hf.json")]) == 0
    said = capsys.readouterr().out
    assert "not available here" in said and "not found from here" in said
    with pytest.raises(SystemExit):  # argparse names the five targets
        main(["export-config", str(src), "--to", "nope"])
    assert sorted(TARGETS) == ["accelerate", "deepspeed", "hf", "megatron", "torchtitan"]


def test_plan_exports_the_plan_it_made(tmp_path, capsys):
    from autopar.cli import main

    out, tiny = tmp_path / "megatron.yaml", os.path.join(ROOT, "examples", "gpt.py") + ":gpt_tiny"
    assert main(["plan", tiny, "--gpus", "2", "--device", "cpu", "--json",
                 "--export-config", "megatron", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    plan = json.loads(captured.out)  # stdout stays the Plan under --json; the export talks on stderr
    cfg = yaml.safe_load(out.read_text())
    assert cfg["transformer_config"]["tensor_model_parallel_size"] == plan["mesh"]["tp"]
    assert "predicted" in captured.err and "s/step" in captured.err
    assert main(["plan", tiny, "--gpus", "2", "-o", str(out)]) == 2  # -o needs --export-config
    assert "without --export-config" in capsys.readouterr().err
