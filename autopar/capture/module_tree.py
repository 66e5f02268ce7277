"""What the module tree says: the repeated blocks, their signatures, a meta copy.

Layers follow the module tree. The repeated blocks are the children of the
outermost ModuleList/Sequential containers (or ModuleDicts of blocks, as
torchtitan writes them) whose parameterised children repeat a class (a transformer's `blocks`, a ResNet's `layer1..layer4`);
containers nested inside a block (an MoE's `experts`) stay inside it.
Everything the model runs before the first block is the embedding/stem
layer, everything after the last block is the head layer.
"""
from __future__ import annotations

import copy
import hashlib
from collections import Counter

import torch
import torch.nn as nn

from autopar.errors import CaptureError

_PRIMITIVES = (int, float, bool, str, type(None))


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _composite(module: nn.Module) -> bool:
    return _has_params(module) and next(module.children(), None) is not None


def _never_called(module: nn.Module) -> bool:
    """A ModuleList / ModuleDict without a forward of its own: a namespace its parent walks."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


def _is_container(module: nn.Module) -> bool:
    """A ModuleList/Sequential holding composite modules, or a ModuleDict of
    blocks (torchtitan: `self.layers = nn.ModuleDict({"0": TransformerBlock(), ...})`).
    A ModuleDict counts only when its parameterised children are composite
    modules of one class: nanoGPT's `transformer = nn.ModuleDict(wte=..., h=...,
    ln_f=...)` is a namespace, and its `h` ModuleList stays the block container."""
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return any(_composite(c) for c in module.children())
    if isinstance(module, nn.ModuleDict):
        held = [c for c in module.children() if _has_params(c)]
        return len(held) >= 2 and all(_composite(c) for c in held) and len({type(c) for c in held}) == 1
    return False


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of the repeated blocks in module-tree order.

    A container qualifies when its parameterised children are composite
    modules (blocks, not bare Linears) of a class that occurs at least twice
    across all outermost containers, so ResNet stages holding a single
    Bottleneck still count, while an `nn.Sequential(Linear, ReLU, Linear)`
    head does not.
    """
    containers = [path for path, m in model.named_modules() if _is_container(m)]
    outer = [c for c in containers
             if not any(o != c and (o == "" or c.startswith(o + ".")) for o in containers)]
    counts = Counter(type(child) for path in outer for child in model.get_submodule(path).children()
                     if _composite(child))
    blocks = []
    for path in outer:
        container = model.get_submodule(path)
        if not any(_composite(c) and counts[type(c)] >= 2 for c in container.children()):
            continue
        if any(_never_called(c) for c in container.children() if _has_params(c)):
            # x-transformers' layers: each a ModuleList [norms, attention / MLP, residual]
            # the decoder walks itself. Nothing calls such a block, so it has no forward
            # to cut at: no stack here (the decoder stays one layer, priced whole).
            continue
        for name, child in container.named_children():
            if _has_params(child):
                blocks.append((f"{path}.{name}" if path else name, child))
    if blocks:
        return blocks
    # No repeated structure: each parameterised child of the root is a layer (inside
    # a container the root walks itself, each of its parameterised children).
    return list(_called_children(model, "")) or [("", model)]


def _called_children(module: nn.Module, prefix: str):
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if _never_called(child):
            yield from _called_children(child, path)
        elif _has_params(child):
            yield path, child


# A block's own position in the stack. Hugging Face stores it on every
# attention module (`layer_idx`, to index the KV cache) and Megatron as
# `layer_number`; it says where a block is, not what it computes. A per-layer
# difference in behaviour shows up as its own attribute (HF's `sliding_window`
# / `attention_type` per layer, a window size), which still makes blocks differ.
_POSITION_ATTRS = {"layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "block_idx", "block_id",
                   "block_index", "block_number"}


def _primitive_attrs(module: nn.Module) -> tuple:
    out = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or key == "training" or key in _POSITION_ATTRS:
            continue
        if isinstance(value, _PRIMITIVES) or (isinstance(value, tuple) and all(isinstance(v, _PRIMITIVES) for v in value)):
            out.append((key, value))
    return tuple(out)


def static_signature(module: nn.Module) -> str:
    """Equal for modules that compute the same thing up to their weights' values:
    same classes, same parameter/buffer shapes and dtypes, same plain config
    attributes (a per-layer window size makes blocks differ; the block's
    index in the stack does not, see _POSITION_ATTRS)."""
    parts = []
    for name, sub in module.named_modules():
        parts.append((name, type(sub).__module__, type(sub).__qualname__, _primitive_attrs(sub)))
    for name, p in module.named_parameters():
        parts.append((name, tuple(p.shape), str(p.dtype), p.requires_grad))
    for name, b in module.named_buffers():
        parts.append((name, tuple(b.shape), str(b.dtype)))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def meta_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` on the meta device with floating tensors in `dtype`.

    Parameters and buffers are swapped through deepcopy's memo, so real
    weights are never copied and tied weights stay tied. The caller's model
    is not touched.
    """
    memo = {}
    for p in model.parameters():  # deduplicated: tied weights appear once
        memo[id(p)] = nn.Parameter(_meta_like(p, dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = _meta_like(b, dtype)
    try:
        meta = copy.deepcopy(model, memo)
    except Exception as exc:
        raise CaptureError(f"could not copy the model to the meta device: {type(exc).__name__}: {exc}",
                           hint="capture deep-copies the module (weights are not copied); make the module "
                                "deep-copyable or build it under `with torch.device('meta'):` and pass that") from exc
    # Plain tensor attributes (not registered as buffers) must live on meta too.
    for module in meta.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.device.type != "meta":
                setattr(module, key, _meta_like(value, dtype))
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
            # A cumulative average reads num_batches_tracked's value (`1 / float(n)`),
            # which meta tensors lack; a momentum does the same ops on the statistics.
            module.momentum = 0.1
    meta.train()
    return meta


def _meta_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
