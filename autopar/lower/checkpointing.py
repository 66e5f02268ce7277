"""Activation checkpointing (recomputation) per layer, as the plan says.

full       the layer's forward is recomputed in backward
           (`checkpoint_wrapper`, non-reentrant);
selective  torch's selective-checkpoint policy: outputs of the ops in
           autopar/checkpoint_policy.py (weight GEMMs, fused attention) are
           saved, everything else (norms, activations, dropout, bmm) is
           recomputed (`create_selective_checkpoint_contexts`);
none       nothing.
Recomputation changes no number: the tests check checkpointed training
against the same layout without it.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.checkpoint_policy import saved_ops
from autopar.lower.model_layers import ModelLayout

# Which ops' outputs are kept: one definition shared with capture, so the
# plan's activation memory prices exactly what runs here.
SAVE_OPS = saved_ops()


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def wrap(module: nn.Module, mode: str) -> nn.Module:
    if mode == "full":
        return checkpoint_wrapper(module, preserve_rng_state=True)
    if mode == "selective":
        return checkpoint_wrapper(module, preserve_rng_state=True, context_fn=_selective_context)
    return module


def apply_checkpointing(model: nn.Module, layout: ModelLayout, local_stages: set[int]) -> None:
    for l in layout.layers:
        if l.stage not in local_stages or l.choice.checkpoint == "none" or len(l.paths) != 1:
            continue
        path = l.paths[0]
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        wrapped = wrap(parent._modules[leaf], l.choice.checkpoint)
        parent._modules[leaf] = wrapped


def not_recomputed(layout: ModelLayout) -> list[str]:
    """Layers the plan recomputes that run without: a layer is recomputed by
    wrapping its one module, and these are several (a plan file written by
    hand; the planner never asks for it)."""
    names = [l.choice.name for l in layout.layers if l.choice.checkpoint != "none" and len(l.paths) != 1]
    if not names:
        return []
    return [f"checkpoint left out for layer(s) {', '.join(names)}: a layer of several modules cannot be wrapped "
            f"as one; it runs without recomputation (more activation memory than planned)"]
