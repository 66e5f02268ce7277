"""A Plan as a torchtitan launch (torchtitan 0.3: `torchtitan.config.ConfigManager`, a
`--module` / `--config` pair from its config registry plus `--section.field` overrides
on the command line; no TOML file any more).

torchtitan expresses pipelines exactly: uneven stages as `module_fqns_per_model_part`
(the modules of each stage, virtual stages included), the schedule by name, the
micro-batch size. Data parallelism is FSDP2 over `data_parallel_shard_degree` with one
`fsdp_reshard_after_forward` policy ('always' = ZeRO 3, 'never' = ZeRO 2) or DDP
(`data_parallel_replicate_degree`, ZeRO 0, plain data parallelism only), or HSDP
with both degrees above 1 (replicas x shard group, as autopar's `Mesh.dp_shard`); one
activation-checkpointing mode for every block; CPU offload of parameters, gradients
and optimizer together; bf16 or fp32 (no fp16). float8 is a model converter chosen in
the config registry, not on the command line.
"""
from __future__ import annotations

import shlex

from autopar.export_config import common

TARGET = "torchtitan"
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}
# autopar's example models that torchtitan's registry also has (--module, --config)
REGISTRY = {"llama3_8b": ("llama3", "llama3_8b"), "llama3_70b": ("llama3", "llama3_70b"),
            "llama3_405b": ("llama3", "llama3_405b")}
AC = {"none": "activation-checkpoint:none", "selective": "activation-checkpoint:selective",
      "full": "activation-checkpoint:full"}


def nearest(plan, notes: list[str], checkpoint: str | None = None):
    near = common.copy_plan(plan)
    common.no_ep(near, notes)
    m = near.mesh
    if m.dp > 1:
        zero = common.zero_level(near)
        ddp = zero == 0 and m.tp == 1 and m.pp == 1 and common.offload_mode(near) == "none" and not m.hsdp
        common.set_uniform(near, notes, zero=0 if ddp else max(zero, 2),
                           why="FSDP2 reshards after forward (ZeRO 3) or not (ZeRO 2) for the whole model; "
                               "DDP (ZeRO 0) only without tp and pp")
    common.set_uniform(near, notes, checkpoint=checkpoint or common.checkpoint_mode(near),
                       why="one activation-checkpointing mode for every block")
    offload = common.offload_mode(near)
    common.set_uniform(near, notes, offload="params" if offload != "none" else "none",
                       why="training.enable_cpu_offload offloads parameters, gradients and optimizer states")
    common.bf16_for_fp16(near, notes, TARGET)
    if common.has_float8(near):
        notes.append("float8 Linears: set in the config registry (Float8LinearConverter in model_registry's "
                      "converters), not on the command line; this launch runs bf16")
        common.no_float8(near, [], TARGET)
    if not near.sequence_parallel and m.tp > 1:
        notes.append("tensor parallelism without sequence parallelism: kept (--parallelism."
                     "no-enable-sequence-parallel)")
    common.no_compression(near, notes, "torchtitan's training.mixed_precision_reduce accepts float32 only "
                                       "(torchtitan.config.configs.Training)")
    return near


def arguments(near, clip: float) -> list[str]:
    """The ConfigManager overrides, `--section.field value`, then the checkpointing subcommand."""
    m = near.mesh
    zero = common.zero_level(near)
    ddp = m.dp > 1 and zero == 0
    # HSDP: replicas x shard group (FSDP2 on torchtitan's (dp_replicate, dp_shard) mesh)
    args = ["--parallelism.data_parallel_replicate_degree", str(m.dp if ddp else m.replicas),
            "--parallelism.data_parallel_shard_degree", str(1 if ddp else m.shard_ranks),
            "--parallelism.fsdp_reshard_after_forward", "always" if zero >= 3 else "never",
            "--parallelism.tensor_parallel_degree", str(m.tp),
            "--parallelism.pipeline_parallel_degree", str(m.pp)]
    if m.tp > 1 and not near.sequence_parallel:
        args.append("--parallelism.no-enable-sequence-parallel")
    local = near.micro_batch_size
    if m.pp > 1:
        local = near.micro_batch_size * near.num_micro_batches  # split into pipeline micro-batches
        parts = [",".join(p for c in s.layers for p in c.module_paths) for s in near.stages]
        args += ["--parallelism.pipeline_parallel_schedule", SCHEDULES[near.schedule],
                 "--parallelism.pipeline_parallel_microbatch_size", str(near.micro_batch_size),
                 "--parallelism.module_fqns_per_model_part", *parts,
                 "--training.disable_cuda_graphs"]  # torchtitan refuses CUDA graphs under a pipeline
    args += ["--training.local_batch_size", str(local),
             "--training.global_batch_size", str(near.global_batch_size),
             "--training.max_norm", _number(clip),
             "--training.mixed_precision_param", "float32" if near.precision == "fp32" else "bfloat16"]
    if near.seq_len:
        args += ["--training.seq_len", str(near.seq_len)]
    if common.offload_mode(near) != "none":
        args.append("--training.enable_cpu_offload")
    if common.compiled(near):
        args.append("--compile.enable")
    args.append(AC[common.checkpoint_mode(near)])
    return args


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def script(plan, near, notes: list[str], clip: float) -> str:
    name = (plan.model or {}).get("name") if isinstance(plan.model, dict) else None
    module, config = REGISTRY.get(name, ('"${TORCHTITAN_MODULE:?the torchtitan model module, e.g. llama3}"',
                                         '"${TORCHTITAN_CONFIG:?its config function, e.g. llama3_8b}"'))
    cl = near.cluster if isinstance(near.cluster, dict) else {}
    nodes, per_node = cl.get("nodes") or 1, cl.get("gpus_per_node") or near.mesh.world_size
    lines = ["#!/bin/sh"] + [f"# {line}" for line in common.header(plan, TARGET + " 0.3")
                              + common.notes_lines(notes, near)]
    if name not in REGISTRY:
        lines.append(f"# {name} is not in torchtitan's model registry: set TORCHTITAN_MODULE / TORCHTITAN_CONFIG to "
                     "the registry entry of the same model (the module names in module_fqns_per_model_part are "
                     "autopar's model file's)")
    launch = ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={per_node}"]
    if nodes > 1:
        launch += ["--rdzv_backend=c10d", '--rdzv_endpoint="${MASTER_ADDR:?the first node}:29500"']
    args = ["--module", module, "--config", config] + [shlex.quote(a) for a in arguments(near, clip)]
    lines.append(" ".join(launch) + " -m torchtitan.train \\")
    pairs = _pairs(args)
    lines += [f"  {p} \\" for p in pairs[:-1]] + [f"  {pairs[-1]}"]
    return "\n".join(lines) + "\n"


def _pairs(args: list[str]) -> list[str]:
    """One option per line: a flag with its values."""
    out: list[str] = []
    for a in args:
        if a.startswith("--") or not out or a.startswith("activation-checkpoint:"):
            out.append(a)
        else:
            out[-1] += " " + a
    return out


def export(plan, clip: float = common.DEFAULT_CLIP, checkpoint: str | None = None) -> common.Export:
    notes: list[str] = []
    near = nearest(plan, notes, checkpoint)
    m = near.mesh
    summary = ((f"dp_replicate {m.replicas} x dp_shard {m.dp_shard}" if m.hsdp else f"dp_shard {m.dp}")
               + f" x tp {m.tp} x pp {m.pp}"
               + (f" ({SCHEDULES[near.schedule]}, {len(near.stages)} model parts)" if m.pp > 1 else "")
               + f", {AC[common.checkpoint_mode(near)]}")
    return common.Export(TARGET, script(plan, near, notes, clip), near, notes, summary)
