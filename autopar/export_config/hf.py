"""A Plan for Hugging Face transformers (5.23): the `DistributedConfig` a model is
loaded with (`from_pretrained(..., distributed_config=DistributedConfig(**cfg))`:
tp / FSDP2 / pp sizes) and the `TrainingArguments` fields that carry the rest (batch,
accumulation, precision, checkpointing, clipping, compile), as one JSON file whose two
parts `HfArgumentParser` and `DistributedConfig` read.

DistributedConfig's FSDP2 reshards after forward (ZeRO 3) and does not combine FSDP
with pipeline parallelism; its sequence parallelism is not wired yet;
`activation_checkpointing` is one switch for whole blocks; no float8. HSDP is its
`dp_replicate_size` x `fsdp_size` (replicas x shard group).
"""
from __future__ import annotations

import json

from autopar.export_config import common

TARGET = "Hugging Face transformers"


def nearest(plan, notes: list[str], checkpoint: str | None = None):
    near = common.copy_plan(plan)
    common.no_ep(near, notes)
    if near.mesh.dp > 1 and near.mesh.pp > 1:
        common.fold_pipeline(near, notes, "DistributedConfig with FSDP")
    if near.mesh.dp > 1:
        common.set_uniform(near, notes, zero=3, why="DistributedConfig's FSDP2 reshards after forward")
    common.whole_block_choices(near, notes, checkpoint,
                               checkpoint_why="activation_checkpointing recomputes whole blocks",
                               offload_why="fsdp_cpu_offload offloads parameters, gradients and optimizer states")
    if near.mesh.pp > 1 and (near.schedule != "1f1b" or near.virtual_stages > 1):
        common.single_schedule(near, notes, "1f1b", TARGET)
    common.no_sequence_parallel(near, notes, TARGET)
    common.no_float8(near, notes, TARGET)
    common.no_compression(near, notes, "DistributedConfig's fsdp_mixed_precision reduces in fp32 "
                                       "(transformers.distributed.fsdp), and it has no reduce dtype")
    return near


def config(near, clip: float) -> dict:
    m = near.mesh
    distributed = {"tp_size": m.tp, "fsdp_size": m.shard_ranks, "dp_replicate_size": m.replicas, "pp_size": m.pp,
                   "fsdp_cpu_offload": common.offload_mode(near) != "none",
                   "fsdp_mixed_precision": near.precision != "fp32" and m.dp > 1,
                   "enable_sequence_parallel": False}
    training = {"output_dir": "output", "per_device_train_batch_size": near.micro_batch_size,
                "gradient_accumulation_steps": near.num_micro_batches,
                "bf16": near.precision == "bf16", "fp16": near.precision == "fp16",
                "activation_checkpointing": common.checkpoint_mode(near) != "none",
                "max_grad_norm": float(clip), "torch_compile": common.compiled(near)}
    return {"distributed_config": distributed, "training_args": training}


def export(plan, clip: float = common.DEFAULT_CLIP, checkpoint: str | None = None) -> common.Export:
    notes: list[str] = []
    near = nearest(plan, notes, checkpoint)
    cfg = {"_autopar_notes": common.header(plan, TARGET + " 5.23") + common.notes_lines(notes, near) + [
        f"global batch {near.global_batch_size} = per_device_train_batch_size x gradient_accumulation_steps x "
        f"{near.mesh.dp} data-parallel ranks"], **config(near, clip)}
    d = cfg["distributed_config"]
    summary = f"tp_size {d['tp_size']}, fsdp_size {d['fsdp_size']}, pp_size {d['pp_size']}"
    return common.Export(TARGET, json.dumps(cfg, indent=2) + "\n", near, notes, summary)
