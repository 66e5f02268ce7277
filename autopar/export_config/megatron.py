"""A Plan as Megatron-Core / NeMo arguments (megatron-core 0.16: the fields of
`TransformerConfig` (with `ModelParallelConfig`), `DistributedDataParallelConfig` and
`OptimizerConfig`, as NeMo's YAML names them), the batch, and the same as Megatron-LM
command-line flags.

Megatron expresses pipelines exactly: `pipeline_model_parallel_layout` places the
embedding (E), each transformer layer (t) and the loss head (L) on every (virtual)
stage, so uneven and interleaved stages keep their cut. It takes one recomputation
setting and one data-parallel sharding for the whole model: ZeRO 1 is the distributed
optimizer, ZeRO 2 / 3 Megatron-FSDP's 'optim_grads' / 'optim_grads_params' (without a
pipeline); CPU offload is the optimizer's; no GPipe schedule. dtypes are written by
name ('bfloat16'), as NeMo's YAML does; the model's own sizes (hidden_size,
num_attention_heads, ...) are left for the model's config.
"""
from __future__ import annotations

import shlex

import yaml

from autopar.export_config import common

TARGET = "Megatron-Core"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# settings Megatron-LM's flags take by default or set elsewhere (dtypes follow --bf16 / --fp16)
MEGATRON_LM_DEFAULTS = {("data_parallel_sharding_strategy", "no_shard"), ("optimizer_offload_fraction", 0.0),
                        ("optimizer", "adam"), ("params_dtype", "bfloat16"), ("params_dtype", "float16"),
                        ("params_dtype", "float32"), ("pipeline_dtype", "bfloat16"), ("pipeline_dtype", "float16"),
                        ("pipeline_dtype", "float32")}
SHARDING = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def nearest(plan, notes: list[str], checkpoint: str | None = None):
    near = common.copy_plan(plan)
    common.no_ep(near, notes)
    common.no_hsdp(near, notes, "not expressible in Megatron-Core, whose distributed optimizer and Megatron-FSDP "
                                "shard over the whole data-parallel group")
    if near.mesh.dp > 1:
        zero = common.zero_level(near)
        if near.mesh.pp > 1 and zero > 1:
            common.set_uniform(near, notes, zero=1, why="the distributed optimizer; Megatron-FSDP (ZeRO 2/3) is "
                                                         "not combined with a pipeline")
        else:
            common.set_uniform(near, notes, zero=zero, why="one data-parallel sharding for the whole model")
    common.set_uniform(near, notes, checkpoint=checkpoint or common.checkpoint_mode(near),
                       why="one recompute_granularity for every transformer layer")
    offload = common.offload_mode(near)
    if offload != "none":
        common.set_uniform(near, notes, offload="optimizer",
                           why="Megatron offloads the optimizer (optimizer_cpu_offload), not the parameters")
        if near.mesh.dp > 1 and common.zero_level(near) == 0:
            common.set_uniform(near, notes, zero=1, why="optimizer_cpu_offload needs the distributed optimizer")
    if near.mesh.pp > 1 and near.schedule == "gpipe":
        notes.append("pipeline schedule gpipe: 1f1b (Megatron runs 1F1B, interleaved with virtual stages)")
        near.schedule = "1f1b"
    if near.sequence_parallel and near.mesh.tp == 1:
        near.sequence_parallel = False
    if common.has_float8(near):
        notes.append("float8 on the plan's chosen Linears only: Megatron's fp8 converts every Transformer Engine "
                     "Linear of the transformer layers; priced here with the plan's own float8 Linears")
    if near.precision == "fp32":  # its DDP reduces in the gradients' dtype or fp32, never narrower
        common.no_compression(near, notes, "Megatron-Core reduces fp32 training's gradients in fp32 "
                                           "(DistributedDataParallelConfig has grad_reduce_in_fp32 only)")
    return near


def layout(near) -> str:
    """The stages as Megatron's layout string: E (embedding), t (a transformer layer), L (loss head)."""
    def char(c):
        return {"embedding": "E", "head": "L"}.get(c.kind, "t")
    return "|".join("".join(char(c) for c in s.layers) for s in near.stages)


def model_shape(plan) -> dict:
    """hidden_size, num_attention_heads (+ num_query_groups, ffn_hidden_size) from the shape the
    command found in the captured model (`Plan.model["shape"]`); None where it is not known (the
    model's own config then fills them)."""
    shape = (plan.model or {}).get("shape") or {} if isinstance(plan.model, dict) else {}
    out = {"hidden_size": shape.get("hidden"), "num_attention_heads": shape.get("heads")}
    if shape.get("kv_heads") and shape.get("kv_heads") != shape.get("heads"):
        out["num_query_groups"] = shape["kv_heads"]
    if shape.get("ffn_hidden"):
        out["ffn_hidden_size"] = shape["ffn_hidden"]
    return out


def sections(near, clip: float) -> dict:
    m = near.mesh
    zero = common.zero_level(near) if m.dp > 1 else 0
    ckpt = common.checkpoint_mode(near)
    layers = sum(1 for c in near.layer_choices if c.kind not in ("embedding", "head"))
    transformer = {
        "tensor_model_parallel_size": m.tp, "pipeline_model_parallel_size": m.pp,
        "virtual_pipeline_model_parallel_size": near.virtual_stages if near.virtual_stages > 1 else None,
        "sequence_parallel": bool(near.sequence_parallel), "num_layers": layers,
        **model_shape(near),
        "bf16": near.precision == "bf16", "fp16": near.precision == "fp16",
        "params_dtype": DTYPES[near.precision],
        "recompute_granularity": None if ckpt == "none" else ckpt,
        "recompute_method": "uniform" if ckpt == "full" else None,
        "recompute_num_layers": 1 if ckpt == "full" else None,
    }
    if m.pp > 1:
        transformer["pipeline_dtype"] = DTYPES[near.precision]
        transformer["pipeline_model_parallel_layout"] = layout(near)
    if common.has_float8(near):
        transformer.update(fp8="e4m3", fp8_recipe="tensorwise")
    fsdp = zero >= 2
    ddp = {"use_distributed_optimizer": zero == 1, "use_megatron_fsdp": fsdp,
           "data_parallel_sharding_strategy": SHARDING[zero] if fsdp else "no_shard"}
    if near.grad_reduce_dtype:  # bf16 reduction of bf16 training: Megatron's own default, said explicitly
        ddp["grad_reduce_in_fp32"] = False
    offload = common.offload_mode(near) != "none"
    optimizer = {"optimizer": "adam", "bf16": near.precision == "bf16", "fp16": near.precision == "fp16",
                 "use_distributed_optimizer": zero >= 1, "clip_grad": float(clip),
                 "optimizer_cpu_offload": offload, "optimizer_offload_fraction": 1.0 if offload else 0.0}
    if near.precision == "fp16":
        optimizer.update(loss_scale=None, initial_loss_scale=2.0 ** 16)  # None: dynamic loss scaling
    training = {"micro_batch_size": near.micro_batch_size, "global_batch_size": near.global_batch_size,
                "data_parallel_size": m.dp, "seq_length": near.seq_len}
    return {"transformer_config": transformer, "ddp_config": ddp, "optimizer_config": optimizer,
            "training": training}


def megatron_lm_flags(cfg: dict) -> str:
    """The same settings as Megatron-LM's pretrain_gpt.py flags (--field-name value; --flag for true)."""
    flags = []
    seen = set()
    for section in ("transformer_config", "ddp_config", "optimizer_config", "training"):
        for key, value in cfg[section].items():
            if key == "data_parallel_size":  # derived by Megatron-LM from the world size
                continue
            if key in seen or value is None or value is False or (key, value) in MEGATRON_LM_DEFAULTS:
                continue
            seen.add(key)
            if key == "virtual_pipeline_model_parallel_size":
                key = "num_virtual_stages_per_pipeline_rank"
            flag = "--" + key.replace("_", "-")
            flags.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
    return " ".join(flags)


def export(plan, clip: float = common.DEFAULT_CLIP, checkpoint: str | None = None) -> common.Export:
    notes: list[str] = []
    near = nearest(plan, notes, checkpoint)
    cfg = sections(near, clip)
    cfg["megatron_lm_args"] = megatron_lm_flags(cfg)
    comments = common.header(plan, TARGET + " 0.16 / NeMo") + common.notes_lines(notes, near)
    if cfg["transformer_config"]["hidden_size"] is None:
        comments.append("hidden_size, num_attention_heads (and the rest of the model's shape) come from the "
                        "model's config: the model was not captured for this export")
    text = "\n".join(f"# {line}" for line in comments) + "\n" + yaml.safe_dump(cfg, sort_keys=False, width=1000)
    t = cfg["transformer_config"]
    summary = (f"tp {t['tensor_model_parallel_size']} x pp {t['pipeline_model_parallel_size']}"
               + (f" (layout {t['pipeline_model_parallel_layout']})" if near.mesh.pp > 1 and len(near.stages) <= 4
                  else "")
               + f", micro-batch {near.micro_batch_size}, global batch {near.global_batch_size}")
    return common.Export(TARGET, text, near, notes, summary)
