"""A Plan as a DeepSpeed config (JSON; DeepSpeed 0.19, `deepspeed.runtime.config.DeepSpeedConfig`).

DeepSpeed takes one ZeRO stage, offload and checkpointing setting for the whole
model, runs pipelines with its own 1F1B (`PipelineModule`, stages cut by a
`partition_method`: 'uniform' layer counts, 'parameters', 'type:REGEX'; no explicit
per-stage counts) and refuses ZeRO 2/3 under a pipeline. Tensor parallelism is
AutoTP (`tensor_parallel.autotp_size`, for the Hugging Face architectures it knows);
it has no Megatron-style sequence parallelism and no float8. HSDP's nearest is
ZeRO++'s hpZ (`zero_hpz_partition_size`: ZeRO 3's parameter all-gathers inside groups
of that many ranks, from a secondary copy), whose gradients and optimizer states stay
sharded over the whole dp: the nearest layout is priced as whole-dp ZeRO 3. DeepSpeed's parser
ignores top-level keys it does not know, so the notes ride in `_autopar_notes` and
the PipelineModule call in `_autopar_pipeline_module`. A plan whose gradients are
reduced in bf16 (Plan.grad_reduce_dtype) writes `"communication_data_type": "bf16"`
(DeepSpeedConfig.communication_data_type: the dtype of its gradient all-reduce /
reduce-scatter, cast back after); ZeRO++'s `zero_quantized_gradients` (qgZ: int4
gradient all-to-all) and `zero_quantized_weights` (qwZ: int8 parameter gathers) are
narrower than anything autopar runs, so they are left off and said in the notes.
"""
from __future__ import annotations

import json

from autopar.export_config import common

TARGET = "DeepSpeed"


def nearest(plan, notes: list[str], checkpoint: str | None = None):
    near = common.copy_plan(plan)
    common.no_ep(near, notes)
    pipeline = near.mesh.pp > 1
    zero = common.zero_level(near)
    if pipeline and zero > 1:
        zero_why = "DeepSpeed's pipeline engine refuses ZeRO 2 and 3"
        zero = 1
    else:
        zero_why = "one ZeRO stage for the whole model"
    common.set_uniform(near, notes, zero=zero, why=zero_why)
    ckpt = checkpoint or common.checkpoint_mode(near)
    common.set_uniform(near, notes, checkpoint="full" if ckpt != "none" else "none",
                       why="DeepSpeed checkpoints whole layers, with deepspeed.checkpointing")
    offload = common.offload_mode(near)
    if offload == "params" and zero < 3:
        common.set_uniform(near, notes, offload="optimizer", why="DeepSpeed offloads parameters under ZeRO 3 only")
    else:
        common.set_uniform(near, notes, offload=offload, why="one offload setting for the whole model")
    if pipeline:
        common.single_schedule(near, notes, "1f1b", TARGET)
        common.even_stages(near, notes, "PipelineModule partition_method='uniform' balances layer counts")
    _hpz(near, notes)
    common.no_sequence_parallel(near, notes, TARGET)
    common.no_float8(near, notes, TARGET)
    return near


def _hpz(near, notes: list[str]) -> None:
    """HSDP's note: ZeRO++ hpZ where it exists (ZeRO 3, `config` writes it), else nothing."""
    m = near.mesh
    if m.hsdp and common.zero_level(near) == 3:
        common.no_hsdp(near, notes, f"DeepSpeed's nearest is ZeRO++ hpZ (zero_hpz_partition_size {m.dp_shard}): the "
                                    f"parameters' all-gathers stay inside groups of {m.dp_shard} ranks, the "
                                    "gradients and optimizer states do not")
    else:
        common.no_hsdp(near, notes, "DeepSpeed shards ZeRO 1 / 2 over the whole dp (hpZ is ZeRO 3 only)")


def config(plan, near, notes: list[str], clip: float) -> dict:
    zero = common.zero_level(near)
    offload = common.offload_mode(near)
    ckpt = common.checkpoint_mode(near)
    zero_cfg = {"stage": zero}
    if plan.mesh.hsdp and zero == 3:  # HSDP's nearest: ZeRO++ hpZ (`_hpz`)
        zero_cfg["zero_hpz_partition_size"] = plan.mesh.dp_shard
    if offload != "none":
        zero_cfg["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "params":
        zero_cfg["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = {
        "train_batch_size": near.global_batch_size,
        "train_micro_batch_size_per_gpu": near.micro_batch_size,
        "gradient_accumulation_steps": near.num_micro_batches,
        "gradient_clipping": clip,
        "zero_optimization": zero_cfg,
        "bf16": {"enabled": near.precision == "bf16"},
        "fp16": _fp16(near.precision == "fp16"),
        "activation_checkpointing": {"partition_activations": ckpt != "none" and near.mesh.tp > 1,
                                     "cpu_checkpointing": False, "contiguous_memory_optimization": False},
    }
    if near.grad_reduce_dtype:  # autopar's bf16 reduction; ZeRO++'s qgZ / qwZ (8/4-bit) stay off (_compression)
        cfg["communication_data_type"] = near.grad_reduce_dtype
    if near.mesh.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": near.mesh.tp}
    if near.mesh.pp > 1:
        cfg["pipeline"] = {"stages": near.mesh.pp, "partition": "uniform",
                           "activation_checkpoint_interval": 1 if ckpt != "none" else 0}
        cfg["_autopar_pipeline_module"] = (
            f"PipelineModule(layers=<the model's {len(near.layer_choices)} layers, in order>, "
            f"num_stages={near.mesh.pp}, partition_method='uniform', "
            f"activation_checkpoint_interval={1 if ckpt != 'none' else 0})  # stages of "
            f"{'/'.join(map(str, common.stage_sizes(near)))} layers")
    cfg["_autopar_notes"] = (common.header(plan, TARGET) + common.notes_lines(notes, near) + _usage(near, ckpt)
                             + _compression(near))
    return cfg


def _usage(near, ckpt: str) -> list[str]:
    """What the training script does for this file to mean what it says."""
    m = near.mesh
    lines = [f"train_batch_size = micro-batch x accumulation x the {m.dp} data-parallel ranks DeepSpeed counts "
             f"through the mpu passed to deepspeed.initialize (world {m.world_size} / (tp {m.tp} x pp {m.pp}))"]
    if ckpt != "none" and m.pp == 1:
        lines.append("activation checkpointing runs where the model calls deepspeed.checkpointing.checkpoint "
                     "(around each transformer block); this section configures it")
    return lines


def _compression(near) -> list[str]:
    if not near.grad_reduce_dtype:
        return []
    return [f"communication_data_type {near.grad_reduce_dtype}: gradients reduced in {near.grad_reduce_dtype} and cast "
            "back, as autopar's plan runs them; ZeRO++ zero_quantized_gradients / zero_quantized_weights (int4 / "
            "int8 quantized communication) are left off: autopar neither runs nor prices them"]


def _fp16(enabled: bool) -> dict:
    if not enabled:
        return {"enabled": False}
    # dynamic loss scaling (loss_scale 0), as autopar's train.py scales fp16 losses
    return {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
            "hysteresis": 2, "min_loss_scale": 1}


def export(plan, clip: float = common.DEFAULT_CLIP, checkpoint: str | None = None) -> common.Export:
    notes: list[str] = []
    near = nearest(plan, notes, checkpoint)
    cfg = config(plan, near, notes, clip)
    summary = (f"ZeRO {cfg['zero_optimization']['stage']}, micro-batch {near.micro_batch_size} x "
               f"{near.num_micro_batches} accumulation, train batch {near.global_batch_size}"
               + (f", autotp {near.mesh.tp}" if near.mesh.tp > 1 else "")
               + (f", {near.mesh.pp} pipeline stages" if near.mesh.pp > 1 else ""))
    return common.Export(TARGET, json.dumps(cfg, indent=2) + "\n", near, notes, summary)
