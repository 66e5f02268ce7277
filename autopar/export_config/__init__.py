"""A Plan in the configuration of a training stack users already run: DeepSpeed,
torchtitan, Megatron-Core / NeMo, accelerate, Hugging Face transformers.

    from autopar.export_config import export
    result = export(plan, "deepspeed")     # -> Export: .text, .nearest (a Plan), .notes

Each target is one module (`deepspeed.py`, ...; `common.py` is what they share). A target
writes what it can express; where it cannot take a choice of the plan (per-layer ZeRO,
uneven stages, a schedule it lacks), it writes the nearest layout it can and says so in
`notes`, which its file carries as comments. This package reads a Plan only: pricing
the nearest layout is the command's (autopar/commands/export_config.py).
"""
from __future__ import annotations

from autopar.errors import AutoparError
from autopar.export_config import accelerate, deepspeed, hf, megatron, torchtitan
from autopar.export_config.common import DEFAULT_CLIP

# target name -> (module, default file name); imported by name, so the house drawing
# (farm-studio) sees every arrow
TARGETS = {
    "deepspeed": (deepspeed, "ds_config.json"),
    "torchtitan": (torchtitan, "torchtitan_train.sh"),
    "megatron": (megatron, "megatron.yaml"),
    "accelerate": (accelerate, "accelerate_config.yaml"),
    "hf": (hf, "hf_distributed.json"),
}


def export(plan, target: str, clip: float = DEFAULT_CLIP, checkpoint: str | None = None):
    """The Export of `plan` for `target` (one of TARGETS). `checkpoint`: the one checkpointing
    mode a target applying one to every layer takes (default: the most recomputing one any
    layer of the plan uses, which fits wherever the plan fits)."""
    if target not in TARGETS:
        raise AutoparError(f"unknown export target {target!r}", hint=f"one of: {', '.join(TARGETS)}")
    if (plan.mesh.cp or 1) > 1:  # refused rather than written without the cut (each target spells cp its own way)
        raise AutoparError(f"the plan cuts sequences over cp {plan.mesh.cp} ranks, which export-config does not "
                           f"write yet", hint="run it with autopar compile, or re-plan with --cp 1 to export")
    return TARGETS[target][0].export(plan, clip, checkpoint)


__all__ = ["TARGETS", "export"]
