"""A Plan as an accelerate config file (accelerate 1.15: the YAML `accelerate config`
writes and `accelerate launch --config_file` reads; FSDP2 plugin settings and its
`parallelism_config`, accelerate's ParallelismConfig: dp_replicate / dp_shard / tp / cp).

accelerate has no pipeline parallelism: a plan's pp ranks join data parallelism. FSDP2
takes one `fsdp_reshard_after_forward` (ZeRO 3 when true, ZeRO 2 when false) and one
`fsdp_activation_checkpointing` (whole blocks) for the model; `fsdp_offload_params`
offloads parameters, gradients and optimizer together; DDP (MULTI_GPU) is ZeRO 0 on
plain data parallelism; HSDP is `parallelism_config`'s dp_replicate x dp_shard with
FSDP2 (FSDP1 called it `fsdp_sharding_strategy: HYBRID_SHARD`). Its tensor parallelism is the model's own tp_plan (Hugging
Face models); its `sp_size` is DeepSpeed-Ulysses, not Megatron-style sequence
parallelism. The batch is the training script's: the comments say what to pass.
"""
from __future__ import annotations

import yaml

from autopar.export_config import common

TARGET = "accelerate"


def nearest(plan, notes: list[str], checkpoint: str | None = None):
    near = common.copy_plan(plan)
    common.no_ep(near, notes)
    common.fold_pipeline(near, notes, TARGET)
    m = near.mesh
    if m.dp > 1:
        zero = common.zero_level(near)
        ddp = zero == 0 and m.tp == 1 and common.offload_mode(near) == "none" and not m.hsdp
        common.set_uniform(near, notes, zero=0 if ddp else max(zero, 2),
                           why="FSDP2 reshards after forward (ZeRO 3) or not (ZeRO 2) for the whole model; DDP "
                               "(ZeRO 0) only without tp")
    common.whole_block_choices(near, notes, checkpoint,
                               checkpoint_why="fsdp_activation_checkpointing recomputes whole blocks",
                               offload_why="fsdp_offload_params offloads parameters, gradients and optimizer states")
    common.no_sequence_parallel(near, notes, TARGET)
    common.no_float8(near, notes, TARGET)
    return near


def config(near) -> dict:
    m = near.mesh
    cl = near.cluster if isinstance(near.cluster, dict) else {}
    zero = common.zero_level(near)
    fsdp = m.dp > 1 and zero > 0 or m.tp > 1
    cfg = {"compute_environment": "LOCAL_MACHINE",
           "distributed_type": "FSDP" if fsdp else ("MULTI_GPU" if m.world_size > 1 else "NO"),
           "mixed_precision": {"bf16": "bf16", "fp16": "fp16"}.get(near.precision, "no"),
           "num_machines": cl.get("nodes") or 1, "num_processes": m.world_size, "machine_rank": 0,
           "main_process_port": 29500, "rdzv_backend": "static", "same_network": True,
           "use_cpu": False, "debug": False}
    if fsdp:
        cfg["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_reshard_after_forward": zero >= 3,
            "fsdp_offload_params": common.offload_mode(near) != "none",
            "fsdp_activation_checkpointing": common.checkpoint_mode(near) != "none",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True}
        # the mesh said explicitly (accelerate reads it with FSDP2 only)
        # HSDP: FSDP2 on accelerate's (dp_replicate, dp_shard) mesh (FSDP1's HYBRID_SHARD)
        cfg["parallelism_config"] = {"parallelism_config_dp_replicate_size": m.replicas,
                                     "parallelism_config_dp_shard_size": m.shard_ranks,
                                     "parallelism_config_tp_size": m.tp, "parallelism_config_cp_size": 1}
    return cfg


def _compression(near, cfg: dict) -> list[str]:
    """Gradients reduced in bf16 (Plan.grad_reduce_dtype): set in the script, as accelerate's
    config file has no reduce dtype (FSDP2's mixed_precision_policy and DDP's comm_hook are
    FullyShardedDataParallelPlugin / DistributedDataParallelKwargs arguments)."""
    if not near.grad_reduce_dtype:
        return []
    if cfg["distributed_type"] == "FSDP":
        param = "torch.float32" if near.precision == "fp32" else "torch.bfloat16"
        return ["gradients reduced in bf16: Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, "
                f"mixed_precision_policy={{'param_dtype': {param}, 'reduce_dtype': torch.bfloat16, "
                f"'output_dtype': {param}}}))"]
    return ["gradients reduced in bf16: Accelerator(kwargs_handlers=[DistributedDataParallelKwargs("
            "comm_hook=DDPCommunicationHookType.BF16)]) (DDP's bf16_compress_hook)"]


def export(plan, clip: float = common.DEFAULT_CLIP, checkpoint: str | None = None) -> common.Export:
    notes: list[str] = []
    near = nearest(plan, notes, checkpoint)
    cfg = config(near)
    comments = common.header(plan, TARGET + " 1.15") + common.notes_lines(notes, near) + [
        "in the training script: DataLoader(batch_size=%d), Accelerator(gradient_accumulation_steps=%d), "
        "accelerator.clip_grad_norm_(model.parameters(), %s); global batch %d"
        % (near.micro_batch_size, near.num_micro_batches, clip, near.global_batch_size),
        "launch on each node: accelerate launch --config_file THIS --machine_rank N --main_process_ip HOST "
        "train.py"] + _compression(near, cfg)
    text = "\n".join(f"# {line}" for line in comments) + "\n" + yaml.safe_dump(cfg, sort_keys=False)
    summary = (f"{cfg['distributed_type']}" + (f", tp {near.mesh.tp}" if near.mesh.tp > 1 else "")
               + f", {near.mesh.world_size} processes on {cfg['num_machines']} machines")
    return common.Export(TARGET, text, near, notes, summary)
