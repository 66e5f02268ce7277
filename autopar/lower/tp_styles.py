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
* Embeddings whose backward stays split. `RowwiseParallel` on an
  `nn.Embedding` looks the ids up through DTensor's MaskPartial, but torch
  2.13 has no vocabulary-sharded strategy for `embedding_dense_backward`:
  every tp rank builds the whole vocab x hidden gradient, then keeps its
  rows (Llama 3 405B at tp 8: 4.2 GB of bf16 and its memset on every rank,
  which the cost model, pricing the split, never books).
  `VocabParallelEmbedding` looks up on the local rows, as Megatron's
  VocabParallelEmbedding does, so autograd's gradient is the local rows'.
* Keyword and nested arguments. Hugging Face attention is called as
  `self_attn(hidden_states=x, position_embeddings=(cos, sin), ...)`: every
  tensor reaching a TP region, positional or keyword, alone or in a tuple,
  must become a replicated DTensor so ops inside mix only DTensors.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
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


class PiecewiseColwiseParallel(ParallelStyle):
    """Column-parallel for a fused projection whose output the model reshapes
    into `pieces` and cuts (timm's qkv: (3, heads, head_dim), then unbind):
    weight and bias sharded strided (`_StridedShard(split_factor=pieces)`), so
    each rank holds its heads of every piece and DTensor's reshape lands the
    shard on the heads dim, with no gather. The GEMM itself runs on local
    tensors: DTensor's mm rules know no strided placement and would gather the
    weight and the output's gradient in backward. Its input's gradient leaves
    as a partial sum (Megatron's conjugate all-reduce, where DTensor meets it)."""

    def __init__(self, pieces: int):
        super().__init__()
        self.pieces = pieces

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor.placement_types import _StridedShard
        k = self.pieces
        out_dim = 1 if is_transposed_linear(module) else 0
        _shard_params(module, device_mesh, {"weight": [_StridedShard(out_dim, split_factor=k)],
                                            "bias": [_StridedShard(0, split_factor=k)]})
        module.forward = lambda x: _piecewise_linear(module, x, k)
        return module


def _piecewise_linear(module, x, pieces: int):
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import _StridedShard
    w, b = module.weight, module.bias
    mesh = w.device_mesh
    x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    if x.placements != (Replicate(),):
        x = x.redistribute(mesh, [Replicate()])
    xl = x.to_local(grad_placements=[Partial()])
    wl, bl = w.to_local(), b.to_local() if b is not None else None
    y = torch.nn.functional.linear(xl, wl.t() if is_transposed_linear(module) else wl, bl)
    shape = (*x.shape[:-1], w.shape[1] if is_transposed_linear(module) else w.shape[0])
    return DTensor.from_local(y, mesh, [_StridedShard(y.dim() - 1, split_factor=pieces)], run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


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


class VocabParallelEmbedding(RowwiseParallel):
    """nn.Embedding split over the vocabulary (weight Shard(0)), ids and output
    replicated: each tp rank looks the ids up in its own rows (the others read
    row 0 and are zeroed), and the ranks' outputs are summed (one all-reduce,
    what RowwiseParallel issues too). The backward of the local lookup is the
    gradient of the local rows only (see the module docstring). An embedding
    this cannot run alike (max_norm renormalises rows in place, scale_grad_by_freq
    counts ids per rank, sparse gradients, a vocabulary tp does not divide) is
    split by RowwiseParallel instead."""

    def __init__(self):
        super().__init__(input_layouts=Replicate(), output_layouts=Replicate())

    def _apply(self, module, device_mesh):
        if not local_lookup_runs(module, device_mesh.size()):
            return super()._apply(module, device_mesh)
        _shard_params(module, device_mesh, {"weight": [Shard(0)]})
        module.forward = functools.partial(_vocab_parallel_lookup, module, device_mesh)
        return module


def local_lookup_runs(module: nn.Module, tp: int) -> bool:
    return (type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq
            and not module.sparse and module.num_embeddings % tp == 0)


def _vocab_parallel_lookup(module: nn.Embedding, mesh, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to_local() if isinstance(ids, DTensor) else ids  # replicated: every rank has them all
    rows = module.weight.to_local()
    start = mesh.get_local_rank() * rows.shape[0]
    outside = (ids < start) | (ids >= start + rows.shape[0])
    pad = module.padding_idx
    pad = pad - start if pad is not None and start <= pad < start + rows.shape[0] else None
    out = F.embedding((ids - start).masked_fill(outside, 0), rows, pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0)
    # the sum over ranks; its backward hands every rank the whole (replicated) output gradient
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _as_dtensor(t: torch.Tensor, mesh, layout, desired):
    """`t` as a DTensor in `desired`: a plain tensor is taken to be `layout`
    (its local part), a DTensor is redistributed."""
    if not isinstance(t, DTensor):
        t = DTensor.from_local(t, mesh, [layout], run_check=False)
    return t if t.placements == (desired,) else t.redistribute(mesh, [desired])


def _sum_gradient_here(t: DTensor) -> DTensor:
    """`t` unchanged forward; backward, its gradient made whole right here.

    The column-parallel Linears a replicated activation feeds send back a
    partial sum of its gradient. Left partial, it travels lazily through the
    norm and the residual add into the previous row-parallel output, where
    DTensor resolves it with 2 all-gathers and a reduce-scatter per attention
    (measured with CommDebugMode on Llama, tp 2; the attention alone issues
    none). Summed here, it is one all-reduce at the entry of each attention /
    MLP, Megatron's `f` operator and what ColwiseParallel's own input does.
    (from_local's backward redistributes the gradient to the placements given.)"""
    local = t.to_local(grad_placements=t.placements)
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False)


def _enter(value: torch.Tensor, mesh, layout, desired) -> DTensor:
    """An activation entering a column-parallel region: `value` in `desired`
    (see `_as_dtensor`), its gradient summed here when it was already whole."""
    t = _as_dtensor(value, mesh, layout, desired)
    return _sum_gradient_here(t) if t is value and t.placements == (Replicate(),) else t


def _needs_autograd_wrap(t) -> bool:
    # Plain tensors that need no gradient may stay plain inside a TP region:
    # autopar runs TP regions under DTensor's implicit replication, which
    # treats them as replicated where they meet a DTensor (they are the same
    # on every tp rank: tp ranks see the same batch). A plain tensor that
    # needs a gradient must become a DTensor here, so that its gradient is
    # reduced over the tp ranks on its way back (from_local's backward).
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.requires_grad


class ModuleInputs(ParallelStyle):
    """The arguments of a module inside or at the edge of a TP region.

    `main` (a position or a keyword name) is the activation the module works
    on: a plain tensor arriving in `main_layout` (a sequence shard under
    sequence parallelism, else whole) or a DTensor, redistributed to
    `desired`. Every other tensor argument (positional, keyword, nested in
    tuples) that needs a gradient becomes a replicated DTensor; the rest
    stays as it is (see `_needs_autograd_wrap`). `gather_all`: every DTensor
    argument is made whole (a module autopar does not split, e.g.
    `nn.MultiheadAttention`, meeting sequence shards: it mixes positions)."""

    def __init__(self, main: int | str | None, main_layout=Replicate(), desired=Replicate(), *,
                 gather_all: bool = False):
        super().__init__()
        self.main, self.main_layout, self.desired, self.gather_all = main, main_layout, desired, gather_all

    def _apply(self, module, device_mesh):
        def one(t):
            if isinstance(t, DTensor):
                return t.redistribute(device_mesh, [Replicate()]) if self.gather_all else t
            if _needs_autograd_wrap(t):
                return DTensor.from_local(t, device_mesh, [Replicate()], run_check=False)
            return t

        def other(value):
            return tree_map_only(torch.Tensor, one, value)

        def convert(key, value):
            if key == self.main and isinstance(value, torch.Tensor):
                return _enter(value, device_mesh, self.main_layout, self.desired)
            return other(value)

        def hook(_, args, kwargs):
            return (tuple(convert(i, a) for i, a in enumerate(args)),
                    {k: convert(k, v) for k, v in kwargs.items()})

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class SharedInput(ParallelStyle):
    """The input of a column-parallel Linear that no sub-module takes at its
    door (a Megatron-style block calling qkv, fc1 itself; see ModuleInputs):
    made whole where it is read. Linears reading one tensor (q, k and v of
    one normed activation; gate and up) share one conversion through `cache`
    (the block's, emptied around each of its forwards): one all-gather of
    a sequence shard, one all-reduce of a whole activation's gradient, not
    one per Linear. A plain tensor here is one the block made itself: whole.
    Runs before the Linear's own input hook (ColwiseParallel's)."""

    def __init__(self, cache: dict):
        super().__init__()
        self.cache = cache

    def _apply(self, module, device_mesh):
        def hook(_, args):
            x = args[0]
            hit = self.cache.get(id(x))
            if hit is None or hit[0] is not x:
                hit = self.cache[id(x)] = (x, _enter(x, device_mesh, Replicate(), Replicate()))
            return (hit[1], *args[1:])

        module.register_forward_pre_hook(hook, prepend=True)
        return module


class ModuleOutputs(ParallelStyle):
    """The end of a TP region: every DTensor the module returns (alone, in a
    tuple, in a ModelOutput) leaves as a plain tensor, the first one (the
    activation) in `main_layout`, the others whole. Redistributing first
    makes the layout a promise: whatever placement DTensor's propagation
    left a tensor in, the next region reads what it expects."""

    def __init__(self, main_layout=Replicate()):
        super().__init__()
        self.main_layout = main_layout

    def _apply(self, module, device_mesh):
        def hook(_, args, output):
            first = [True]

            def plain(t):
                layout = self.main_layout if first[0] else Replicate()
                first[0] = False
                return _as_dtensor(t, device_mesh, layout, layout).to_local()
            return tree_map_only(DTensor, plain, output)

        module.register_forward_hook(hook)
        return module


def replicate_parameters(module: nn.Module, mesh) -> None:
    """Every parameter of `module` that no parallel style sharded becomes a
    replicated DTensor (norm weights, q/k norms, biases, learned scales,
    `nn.MultiheadAttention`'s packed projections): inside a TP region every
    parameter is a DTensor, so DTensor's sharding propagation computes the
    function the author wrote and reduces these parameters' gradients over
    the tp ranks. Tied parameters stay one object."""
    done: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()], src_data_rank=None),
                                           requires_grad=p.requires_grad)
            sub.register_parameter(name, done[id(p)])
