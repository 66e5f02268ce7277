"""Tensor-parallel styles torch does not ship, for modules as people write them.

`ColwiseParallel` / `RowwiseParallel` accept only `nn.Linear` and
`nn.Embedding`, and `PrepareModuleInput` only plain tensor arguments. Models
in the wild need two more things:

* Transposed linears. transformers' `Conv1D` (GPT-2, GPT-J's ancestors)
  computes `x @ W + b` with W stored (in, out), the transpose of
  `nn.Linear`'s (out, in). Column-parallel then shards W on dim 1 (and the
  bias on dim 0), row-parallel shards W on dim 0 (bias replicated): the
  same maths as torch's styles with the weight's dims swapped, so the
  parameters keep the user's names and shapes (checkpoints still load).
* Keyword and nested arguments. Hugging Face attention is called as
  `self_attn(hidden_states=x, position_embeddings=(cos, sin), ...)`: every
  tensor reaching a TP region, positional or keyword, alone or in a tuple,
  must become a replicated DTensor so ops inside mix only DTensors.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.utils._pytree import tree_map_only


def is_transposed_linear(module: nn.Module) -> bool:
    """transformers' Conv1D: weight (in, out), forward `addmm(b, x, W)`."""
    w = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2
            and tuple(w.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


def _shard_params(module, mesh, placements: dict[str, list]):
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements[name]),
                                                     requires_grad=param.requires_grad))


class TransposedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a (in, out) weight: W Shard(1), bias Shard(0)."""

    def _apply(self, module, device_mesh):
        if not is_transposed_linear(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh,
            lambda name, m, mesh: _shard_params(m, mesh, {"weight": [Shard(1)], "bias": [Shard(0)]}),
            lambda m, inputs, mesh: self._prepare_input_fn(self.input_layouts, self.desired_input_layouts,
                                                           m, inputs, mesh),
            lambda m, outputs, mesh: self._prepare_output_fn(self.output_layouts, self.use_local_output,
                                                             m, outputs, mesh))


class TransposedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a (in, out) weight: W Shard(0), bias replicated."""

    def _apply(self, module, device_mesh):
        if not is_transposed_linear(module):
            return super()._apply(module, device_mesh)
        desired = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda name, m, mesh: _shard_params(m, mesh, {"weight": [Shard(0)], "bias": [Replicate()]}),
            lambda m, inputs, mesh: self._prepare_input_fn(self.input_layouts, desired, m, inputs, mesh),
            lambda m, outputs, mesh: self._prepare_output_fn(self.output_layouts, self.use_local_output,
                                                             m, outputs, mesh))


class ReplicateModuleInputs(ParallelStyle):
    """Every tensor argument (positional, keyword, nested in tuples) becomes a
    replicated DTensor. The main input (`main`: a position or a keyword name)
    arrives in `main_layout` (sequence shards under sequence parallelism)
    and is gathered; other tensors (RoPE cos/sin, masks, position ids) are
    the same on every tp rank already, so they are wrapped without traffic."""

    def __init__(self, main: int | str | None, main_layout=Replicate()):
        super().__init__()
        self.main, self.main_layout = main, main_layout

    def _apply(self, module, device_mesh):
        def wrap(t, layout):
            if isinstance(t, DTensor):
                return t if t.placements == (Replicate(),) else t.redistribute(device_mesh, [Replicate()])
            d = DTensor.from_local(t, device_mesh, [layout], run_check=False)
            return d if layout == Replicate() else d.redistribute(device_mesh, [Replicate()])

        def replicate_all(value):
            return tree_map_only(torch.Tensor, lambda t: wrap(t, Replicate()), value)

        def hook(_, args, kwargs):
            args = tuple(wrap(a, self.main_layout) if i == self.main and isinstance(a, torch.Tensor)
                         else replicate_all(a) for i, a in enumerate(args))
            kwargs = {k: wrap(v, self.main_layout) if k == self.main and isinstance(v, torch.Tensor)
                      else replicate_all(v) for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module
