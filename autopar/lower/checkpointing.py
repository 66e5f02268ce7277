"""Activation checkpointing (recomputation) per layer, as the plan says.

full       the layer's forward is recomputed in backward
           (`checkpoint_wrapper`, non-reentrant);
selective  torch's selective-checkpoint policy: outputs of matmuls and
           attention are saved, everything cheap (norms, activations,
           dropout, reshapes) is recomputed
           (`create_selective_checkpoint_contexts`);
none       nothing.
Recomputation changes no number: the tests check checkpointed training
against the same layout without it.
"""
from __future__ import annotations


import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.lower.model_layers import ModelLayout

_aten = torch.ops.aten
# Expensive to recompute: keep their outputs.
SAVE_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


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
