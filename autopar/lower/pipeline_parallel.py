"""Pipeline parallelism with torch.distributed.pipelining.

A stage must run a slice of the user's forward without the user rewriting it
(GPT's forward is `x = drop(wte(idx) + wpe(pos[:s])); for block in blocks:
...; return lm_head(ln_f(x))`). A `StageModule` runs that same forward on a
*view* of the model in which:
  - blocks before the stage are `_SkipBlock`s: the first one swaps in the
    activation received from the previous stage, the rest pass it on;
  - blocks after the stage are `_StopBlock`s: the first one ends the forward
    and its input becomes the stage's output;
  - embeddings of other stages are `_ZeroEmbedding`s (zeros of the right
    shape, no weights), other stages' post layers are never reached.
So the glue code between layers (the add of two embeddings, the RoPE slicing
`rope_cos[:s]` that feeds every block) runs unchanged on every stage, and a
non-first stage only needs dummy model inputs of the right shape.

The model's inputs after the first (an attention mask, position ids) travel
from stage to stage with the activation, so every stage's glue code sees the
real ones. Stages are cut between blocks (the embedding layers start stage
0, the head layers end the last stage). Stage i lives on pp coordinate i % pp; with
interleaving a rank holds several stages, as the looped schedules expect.
Schedules: gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B (at least pp
micro-batches, else an error), interleaved -> ScheduleInterleaved1F1B.
Over dp ranks a stage's FSDP2 units reduce-scatter every micro-batch's
gradients (`ReducingStage`), as gradient accumulation does at pp = 1; ZeRO-3
units reshard after every backward, ZeRO-2 units stay gathered until the
step's last one.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from autopar.errors import PlanMismatchError
from autopar.lower.model_io import forward_kwargs, logits_of
from autopar.lower.model_layers import ModelLayout


class _StageOutput(Exception):
    def __init__(self, value):
        self.value = value


class _StandIn(nn.Module):
    """A block another stage runs. Reads of the block's attributes (code such
    as `self.layers[0].self_attn.scaling`, or a config the glue code looks
    up) go to the real block, which stays unregistered: it is not part of
    this stage's parameters."""

    def __init__(self, block: nn.Module | None):
        super().__init__()
        self._block = [block]  # a list: not a registered child

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__["_block"][0]
            if block is None:
                raise
            return getattr(block, name)


class _SkipBlock(_StandIn):
    """Returns the activation in the block's own output structure (`returns`:
    "tensor" or ("tuple", n) whose later elements are None), so glue code
    reading `outputs[0]` gets the activation, not its first row."""

    def __init__(self, stage: "StageModule", inject: bool, block: nn.Module | None = None, returns="tensor"):
        super().__init__(block)
        self._stage = [stage]  # a list: not a registered child (no cycle in the module tree)
        self.inject, self.returns = inject, returns

    def forward(self, x, *args, **kwargs):
        out = self._stage[0]._received if self.inject else x
        if self.returns == "tensor":
            return out
        return (out,) + (None,) * (self.returns[1] - 1)


class _StopBlock(_StandIn):
    def forward(self, x, *args, **kwargs):
        raise _StageOutput(x)


def check_stand_ins(model: nn.Module, layout: ModelLayout, stage: int, num_stages: int) -> None:
    """What a stage needs stand-ins for, and refuses when it cannot have one.
    Lowering calls it for every stage on every rank before any process group
    exists, so a refusal stops all ranks alike instead of leaving the first
    stage's ranks waiting for stages that raised."""
    first, last = stage == 0, stage == num_stages - 1
    if num_stages > 1 and not first and layout.num_blocks == 0:
        raise PlanMismatchError("pipeline stages need a block ModuleList to cut between")
    if num_stages > 1 and len(layout.stacks) > 1:
        # The decoder's blocks read the encoder's output (cross-attention) on
        # every stage, besides the activation the schedule hands on.
        raise PlanMismatchError(
            f"pipeline parallelism over {len(layout.stacks)} block stacks ({', '.join(layout.stacks)}: an "
            f"encoder-decoder) is not supported: decoder stages would need the encoder's output too",
            hint="plan with pp=1 (tensor and data parallelism apply to both stacks)")
    for l in layout.layers:
        if l.param_paths and ((l.position == "pre" and not first) or (l.position == "post" and not last)):
            # Glue code on every stage would read the root-held parameter
            # (ViT's pos_embedding): a copy per pp rank, gradients never met.
            raise PlanMismatchError(
                f"layer {l.choice.name!r} owns parameters held by no module of it "
                f"({', '.join(l.param_paths)}); pipeline stages cannot give later stages a stand-in",
                hint="move the parameter into a module (e.g. an nn.Module holding it), or plan without pp")


def stand_in_modules(model: nn.Module, layout: ModelLayout) -> dict[str, nn.Module]:
    """Pre-block modules with weights other than nn.Embedding (BERT's
    BertEmbeddings, BLOOM's embedding LayerNorm, ViT's patch embedding):
    later stages replace them by zeros of the output shape the probe records."""
    out = {}
    for l in layout.layers:
        if l.position == "pre":
            for p in l.paths:
                m = model.get_submodule(p)
                if any(True for _ in m.parameters()) and not isinstance(m, nn.Embedding):
                    out[p] = m
    return out


def check_block_outputs(block_plans: dict, paths: dict, pre_outputs: dict | None = None) -> None:
    """Stages hand each other one activation; a block that returns more, which
    the model reads (T5's position bias, a cache) would leave later stages
    without it.
    A pre-block module later stages replace must return one tensor."""
    for p, out in sorted((pre_outputs or {}).items()):
        if not isinstance(out, tuple):
            raise PlanMismatchError(
                f"pre-block module {p!r} returns {out}; pipeline stages after the first replace it by zeros "
                f"of its output, which needs a single tensor",
                hint="plan without pipeline parallelism (pp=1) for this model")
    for i, bp in sorted(block_plans.items()):
        if bp.returns != "tensor" and not isinstance(bp.returns, tuple):
            raise PlanMismatchError(
                f"block {paths[i]!r} returns {bp.returns}; pipeline stages hand the next stage only the block's "
                f"activation, so blocks on later stages would not receive the rest",
                hint="plan without pipeline parallelism (pp=1) for this model")


class _ZeroOutput(_StandIn):
    """Zeros shaped like a pre-block module's output (its batch dim from the
    call's first tensor): the real output is discarded on later stages,
    where the first block's input is the received activation. Attribute
    reads (ViT's `embeddings.patch_embeddings.num_patches`) go to the real module."""

    def __init__(self, module: nn.Module, shape: tuple, dtype: torch.dtype, probe_batch: int):
        super().__init__(module)
        self.shape, self.dtype, self.probe_batch = tuple(shape), dtype, probe_batch

    def forward(self, *args, **kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        shape = list(self.shape)
        if x is not None and x.dim() and shape and shape[0] == self.probe_batch:
            shape[0] = x.shape[0]
        return torch.zeros(shape, dtype=self.dtype, device=x.device if x is not None else None)


class _ZeroEmbedding(_StandIn):
    """Zeros of an embedding's width for each index (later stages); attribute
    reads (`embed_tokens.weight.dtype`, `padding_idx`) go to the real table."""

    def __init__(self, module: nn.Embedding):
        super().__init__(module)
        self.dim, self.dtype = module.embedding_dim, module.weight.dtype

    def forward(self, idx, *args, **kwargs):
        return torch.zeros(*idx.shape, self.dim, dtype=self.dtype, device=idx.device)


def _shallow_view(module: nn.Module) -> nn.Module:
    """A new module object with the same class, attributes and children, own dicts."""
    view = copy.copy(module)
    view._modules = OrderedDict(module._modules)
    view._parameters = OrderedDict(module._parameters)
    view._buffers = OrderedDict(module._buffers)
    for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_forward_hooks_with_kwargs",
                  "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_state_dict_hooks",
                  "_load_state_dict_pre_hooks"):
        if hasattr(module, hooks):
            setattr(view, hooks, OrderedDict())
    return view


def _set(root: nn.Module, path: str, new: nn.Module) -> None:
    """Replace the module at `path` inside a view, copying (shallowly) every
    ancestor on the way that is still shared with the user's model."""
    parts = path.split(".")
    parent = root
    owned = root.__dict__.setdefault("_autopar_owned", {id(root)})
    for name in parts[:-1]:
        child = parent._modules[name]
        if id(child) not in owned:
            child = _shallow_view(child)
            owned.add(id(child))
            parent._modules[name] = child
        parent = child
    parent._modules[parts[-1]] = new


class StageModule(nn.Module):
    """One pipeline stage (or, with pp == 1, the whole model) as one module.

    `forward(*args)`: on the first stage args are the model inputs, on the
    others the activation from the previous stage."""

    def __init__(self, model: nn.Module, layout: ModelLayout | None, stage: int, num_stages: int,
                 dummy_inputs=None, block_returns: dict | None = None, pre_outputs: dict | None = None,
                 probe_batch: int = 1):
        super().__init__()
        self.stage_index, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self._received = None
        self.autocast_dtype = None  # set when the plan asks for bf16/fp16 without FSDP's mixed precision
        self._dummy_inputs = dummy_inputs  # batch_size -> tuple of model inputs (shape only)
        self._forward_kwargs = forward_kwargs(model)  # e.g. use_cache=False for Hugging Face models
        self._hooks = []  # hooks this stage put on the user's modules (release() removes them)
        if num_stages == 1:
            self.model = model
            return
        view = _shallow_view(model)
        blocks = view.get_submodule(layout.blocks_path)
        mine = [l.block_index for l in layout.layers_of_stage(stage) if l.position == "block"]
        lo = min(mine) if mine else None
        if lo is None:  # a stage of only pre or only post layers
            lo = 0 if self.is_first else layout.num_blocks
        hi = (max(mine) + 1) if mine else lo
        # The stack's own class (a Sequential keeps chaining its entries), its entries
        # swapped for stand-ins outside this stage.
        new_blocks = copy.copy(blocks)
        new_blocks._modules = OrderedDict()
        for i in range(layout.num_blocks):
            if i < lo:
                new_blocks._modules[str(i)] = _SkipBlock(self, inject=(i == 0), block=blocks[i],
                                                         returns=(block_returns or {}).get(i, "tensor"))
            elif i < hi:
                new_blocks._modules[str(i)] = blocks[i]
            else:
                new_blocks._modules[str(i)] = _StopBlock(blocks[i])
        if not self.is_first and lo == 0 and hi > 0:
            # No pass-through block before this stage's first block (the
            # previous stage held only embeddings): hand the received
            # activation to that block directly. The block belongs to this
            # stage alone, so the hook touches no other stage.
            self._hooks.append(blocks[0].register_forward_pre_hook(self._inject_received))
        self.model = view
        _set(view, layout.blocks_path, new_blocks)
        check_stand_ins(model, layout, stage, num_stages)
        for l in layout.layers:
            if l.position == "pre" and not self.is_first:
                for p in l.paths:
                    m = view.get_submodule(p)
                    if isinstance(m, nn.Embedding):
                        _set(view, p, _ZeroEmbedding(m))
                    elif any(True for _ in m.parameters()):  # else (dropout...): runs as it is on the zeros
                        shape, dtype = pre_outputs[p]
                        _set(view, p, _ZeroOutput(m, shape, dtype, probe_batch))
            elif l.position == "post" and not self.is_last:
                # A stage that ends with the last block (the head alone on the
                # next stage): the first post module called ends the stage.
                for p in l.paths:
                    _set(view, p, _StopBlock(view.get_submodule(p)))
        if not self.is_first and layout.num_blocks == 0:
            raise PlanMismatchError("pipeline stages need a block ModuleList to cut between")

    def release(self) -> None:
        """Remove what this stage put on the user's modules (a stage built only to be tried)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _inject_received(self, module, args):
        return (self._received, *args[1:])

    def forward(self, *args):
        if self.autocast_dtype is None:
            return self._forward(*args)
        device_type = args[0].device.type
        with torch.autocast(device_type, dtype=self.autocast_dtype):
            return self._forward(*args)

    def _forward(self, *args):
        if self.num_stages == 1:
            return logits_of(self.model(*args, **self._forward_kwargs))
        if self.is_first:
            model_args, extra = args, args[1:]
        else:
            # (activation, *the model's other inputs), as the previous stage sent them
            self._received, *extra = args
            model_args = (self._dummy_inputs(args[0].shape[0])[0], *extra)
        try:
            out = logits_of(self.model(*model_args, **self._forward_kwargs))
        except _StageOutput as stop:
            out = stop.value
        finally:
            self._received = None
        if self.is_last:
            return out
        # Sent to the next stage: gloo sends only contiguous tensors, and torch's
        # stages receive into buffers of the sent strides. A channels-last or
        # permuted activation (ConvNeXt's blocks) is copied, values unchanged.
        # The gradient sent back is the receive buffer's `.grad`, which autograd
        # lays out as the buffer (its layout contract): contiguous as well.
        out = out.contiguous()
        if extra:
            # The model's inputs after the first (an attention mask, position
            # ids) travel with the activation: later stages' glue code needs
            # them, and torch's stages pass tensors without gradients along.
            return (out, *(e.contiguous() if isinstance(e, torch.Tensor) else e for e in extra))
        return out


def check_stage_cuts(layout: ModelLayout, num_stages: int) -> None:
    """Stages must be contiguous, cut between blocks, pre layers first, post layers last."""
    order = {"pre": 0, "block": 1, "post": 2}
    prev = (-1, -1, -1)
    for l in layout.layers:
        key = (l.stage, order[l.position], l.block_index if l.block_index is not None else -1)
        if key < prev:
            raise PlanMismatchError(f"layer {l.choice.name!r} is out of order across pipeline stages")
        prev = key
        if l.position != "block" and l.stage != (0 if l.position == "pre" else num_stages - 1):
            # Lowering cuts stages only between the blocks of a stack (a ModuleList of
            # layers); what runs before / after the stack stays with the first / last stage.
            where = ("before" if l.position == "pre" else "after")
            stacks = ", ".join(repr(s) for s in layout.stacks) or "none found"
            raise PlanMismatchError(
                f"layer {l.choice.name!r} is not a block of the stack lowering cuts pipeline stages between "
                f"({stacks}): it runs {where} the stack, so it must be on the "
                f"{'first' if l.position == 'pre' else 'last'} pipeline stage, and this plan puts it on stage "
                f"{l.stage}",
                hint="hold the repeated blocks in one nn.ModuleList or nn.Sequential, or plan without pipeline parallelism")


def check_schedule(plan) -> None:
    """The plan's schedule must be the one that runs: torch's Schedule1F1B
    needs at least pp micro-batches (each rank warms up with pp - rank
    forwards) and interleaving a multiple of pp. Running GPipe instead would
    hold all micro-batches' activations at once, the memory the plan did not
    price, so a plan asking for it is an error, not a fallback."""
    pp, n_mb = plan.mesh.pp, plan.num_micro_batches
    if pp == 1:
        return
    if plan.schedule == "accumulate":  # the name of the schedule without a pipeline
        raise PlanMismatchError(f"schedule 'accumulate' means no pipeline, but the plan has pp={pp}",
                                hint="use schedule 'gpipe', '1f1b' or 'interleaved' with pp > 1")
    if plan.schedule == "1f1b" and n_mb < pp:
        raise PlanMismatchError(
            f"schedule 1f1b with pp={pp} needs at least {pp} micro-batches, the plan has {n_mb}",
            hint=f"use num_micro_batches >= {pp} (global batch >= {pp * plan.mesh.dp * plan.micro_batch_size}), "
                 f"or schedule 'gpipe'")
    if plan.schedule == "interleaved" and n_mb % pp:
        raise PlanMismatchError(
            f"interleaved 1F1B needs micro-batches ({n_mb}) divisible by pp ({pp})",
            hint=f"use a multiple of {pp} micro-batches, or schedule '1f1b'")


class ReducingStage(PipelineStage):
    """A PipelineStage whose FSDP2 units reduce-scatter each micro-batch's gradients, as
    ParallelModel._accumulate keeps them at pp = 1.
    torch's stage turns gradient sync and reshard-after-backward off for every
    micro-batch (`backward_maybe_with_nosync`) and reduces in `perform_reduce_grad`
    after the last, so a stage would hold every unit's unsharded gradient, and under
    ZeRO-3 its gathered parameters, from its first backward to the step's end: memory the
    plan does not book (benchmarks/memory_lowered.py measured -18% / -22%). Here FSDP2's
    own post-backward hooks reduce (sync on; ZeRO-3 units reshard after every backward), the
    cost model prices the m reduce-scatters (Layout.grads_reduced_per_micro_batch), and
    torch's `perform_reduce_grad` then finds nothing left to reduce (FSDP's post_backward
    is a no-op without gradients) and only scales. Full backwards only: autopar lowers
    no zero-bubble schedule (split input / weight backwards keep torch's path). Under HSDP
    the shards cross replicas once, after the last micro-batch, as ParallelModel._accumulate
    does (`replica_all_reduce_once`)."""

    replica_all_reduce_once = False

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if self.replica_all_reduce_once:
            self.submod.set_requires_all_reduce(last_backward)
        # units gathered from forward to backward anyway (ZeRO-2) stay gathered until the
        # last micro-batch's backward: one all-gather a step, as priced
        for unit in getattr(self.submod, "kept_gathered", ()):
            unit.set_reshard_after_backward(last_backward, recurse=False)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


def build_schedule(plan, stage_modules: list[StageModule], pp_group, device, loss_fn,
                   num_micro_batches: int | None = None):
    """torch's schedule for the plan, running `num_micro_batches` a step (default the plan's)."""
    check_schedule(plan)
    n_stages = len(stage_modules) * plan.mesh.pp
    # FSDP2 on one dp rank (16-bit training) reduces once, after the last micro-batch, as
    # at pp = 1: its "reduce-scatter" is a copy, its unsharded gradient the whole gradient
    stage_cls = ReducingStage if plan.mesh.dp > 1 else PipelineStage
    stages = [stage_cls(m, m.stage_index, n_stages, device, group=pp_group) for m in stage_modules]
    for stage in stages:
        if isinstance(stage, ReducingStage):
            stage.replica_all_reduce_once = plan.mesh.hsdp
    n_mb = num_micro_batches or plan.num_micro_batches
    if plan.schedule == "interleaved" or len(stages) > 1:
        return ScheduleInterleaved1F1B(stages, n_mb, loss_fn=loss_fn)
    if plan.schedule == "1f1b":
        return Schedule1F1B(stages[0], n_mb, loss_fn=loss_fn)
    return ScheduleGPipe(stages[0], n_mb, loss_fn=loss_fn)
