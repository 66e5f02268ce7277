"""Selective activation checkpointing: which ops' outputs are kept.

One definition, read by both sides so the plan prices what actually runs:
- lowering (autopar/lower/checkpointing.py) hands it to torch's
  selective-checkpoint API: outputs of these ops are saved, every other op
  in a checkpointed layer is recomputed in backward;
- capture (autopar/capture) measures `activation_bytes_selective` as the
  saved bytes whose storage was produced by any other op.

Kept: the weight GEMMs and fused attention kernels (expensive to redo).
Recomputed: norms, activation functions, dropout, residual adds, and batched
matmuls (`bmm`), which in models written with explicit attention are the
QK^T and scores x V of the attention core, so for such models this policy
recomputes Korthikanti's attention core as Megatron's selective mode does.
"""
from __future__ import annotations

SAVED_OP_NAMES = frozenset({
    "aten.mm",
    "aten.addmm",
    "aten.linear",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
})


def saved_ops():
    """The policy as torch OpOverloads (default overloads), for the checkpoint API."""
    import torch

    ops = set()
    for name in SAVED_OP_NAMES:
        packet = getattr(torch.ops.aten, name.removeprefix("aten."), None)
        if packet is not None:
            ops.add(packet.default)
    return ops
