"""Tensor and sequence parallelism with DTensor `parallelize_module`.

Models are taken as users write them. Attention that splits a fused qkv
projection by the full hidden size and reshapes with the full head count
(`view(b, s, heads, h // heads)`), RoPE buffers multiplied into q/k, GQA's
`repeat_kv`: none of these know about tensor parallelism. So inside a block's
sub-module (attention, MLP) the activations stay DTensors
(`use_local_output=False`): shapes stay global, every reshape/split/expand
means what the author meant, and DTensor inserts whatever communication the
op needs (a split across a sharded dimension costs an all-gather, which the
cost model charges). Only the sub-module's output leaves as a plain tensor.

Which Linear is column- and which row-parallel is read from the data flow of
one traced forward (FakeTensorMode, no memory, no weights touched), not from
names: in a sub-module of a block, a Linear that consumes the sub-module's
input is column-parallel, the Linear whose output is the sub-module's output
is row-parallel. Sub-modules that fit neither stay replicated.

Layer styles (`LayerChoice.tp_style`):
  vocab            embeddings split over the vocabulary (RowwiseParallel on
                   nn.Embedding), the head's Linear column-parallel with a
                   replicated output;
  colwise_rowwise  attention heads / MLP hidden split as above;
  sequence         the same plus sequence parallelism: norms, dropouts and
                   residual adds on sequence shards (dim 1); consecutive
                   blocks hand each other sequence shards, the first block
                   scatters and the last block gathers;
  replicate        nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from autopar.errors import PlanMismatchError

_SDPA_REGISTERED = False


def register_cpu_attention_sharding() -> None:
    """DTensor ships sharding rules for the CUDA attention kernels only; on CPU
    SDPA lowers to `_scaled_dot_product_flash_attention_for_cpu`. Attention is
    independent per batch row and per head, so dims 0 and 1 of (b, heads, s, d)
    may be sharded, like the CUDA rules say."""
    global _SDPA_REGISTERED
    if _SDPA_REGISTERED:
        return
    from torch.distributed.tensor.experimental import register_sharding
    aten = torch.ops.aten

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _fwd(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        rules = [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None, None])]
        for d in (0, 1):
            rules.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None]))
        return rules

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
        rules = [([Replicate()] * 3, [Replicate()] * 6 + [None, None])]
        for d in (0, 1):
            rules.append(([Shard(d)] * 3, [Shard(d)] * 6 + [None, None]))
        return rules

    _SDPA_REGISTERED = True


@dataclass
class SubModulePlan:
    """TP roles inside one direct child of a block (found by `probe_blocks`)."""

    name: str
    colwise: list[str] = field(default_factory=list)
    rowwise: str | None = None
    arg_is_tensor: list[bool] = field(default_factory=list)


@dataclass
class BlockPlan:
    arg_is_tensor: list[bool]
    subs: list[SubModulePlan]
    norms: list[str]  # parameter-holding children without Linears (LayerNorm, RMSNorm)


def probe_blocks(model: nn.Module, blocks: dict[int, nn.Module], example_args: tuple) -> dict[int, BlockPlan]:
    """One forward under FakeTensorMode, hooks recording which tensor object flows where."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen: dict[int, dict] = {}
    hooks = []

    def record(key):
        def hook(mod, args, out):
            seen[key] = {"args": args, "out": out}
        return hook

    for bi, block in blocks.items():
        hooks.append(block.register_forward_hook(record(id(block))))
        for cname, child in block.named_children():
            hooks.append(child.register_forward_hook(record(id(child))))
            for lname, lin in child.named_modules():
                if isinstance(lin, nn.Linear):
                    hooks.append(lin.register_forward_hook(record(id(lin))))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            model(*example_args)
    finally:
        for h in hooks:
            h.remove()

    plans = {}
    for bi, block in blocks.items():
        rec = seen.get(id(block))
        if rec is None:
            raise PlanMismatchError(f"block {bi} was not called by the model's forward")
        subs, norms = [], []
        for cname, child in block.named_children():
            linears = [(n, m) for n, m in child.named_modules() if isinstance(m, nn.Linear)]
            if not linears:
                if any(True for _ in child.parameters()):
                    norms.append(cname)
                continue
            crec = seen.get(id(child))
            if crec is None or not crec["args"]:
                continue
            sub = SubModulePlan(name=cname, arg_is_tensor=[isinstance(a, torch.Tensor) for a in crec["args"]])
            for lname, lin in linears:
                lrec = seen.get(id(lin))
                if lrec is None:
                    continue
                if lrec["args"] and lrec["args"][0] is crec["args"][0]:
                    sub.colwise.append(lname)
                elif lrec["out"] is crec["out"]:
                    sub.rowwise = lname
            if sub.colwise and sub.rowwise:
                subs.append(sub)
        plans[bi] = BlockPlan(arg_is_tensor=[isinstance(a, torch.Tensor) for a in rec["args"]], subs=subs,
                              norms=norms)
    return plans


def _layouts(mask: list[bool], first, rest):
    return tuple((first if i == 0 else rest) if t else None for i, t in enumerate(mask))


def parallelize_block(block: nn.Module, plan: BlockPlan, tp_mesh, *, sequence_parallel: bool,
                      first: bool, last: bool) -> None:
    sp = sequence_parallel
    styles: dict[str, object] = {}
    for sub in plan.subs:
        prefix = f"{sub.name}." if sub.name else ""
        # Every tensor argument becomes a replicated DTensor so ops inside mix
        # only DTensors (RoPE cos/sin buffers times sharded q, for instance).
        styles[sub.name] = PrepareModuleInput(
            input_layouts=_layouts(sub.arg_is_tensor, Shard(1) if sp else Replicate(), Replicate()),
            desired_input_layouts=_layouts(sub.arg_is_tensor, Replicate(), Replicate()),
            use_local_output=False)
        for name in sub.colwise:
            styles[prefix + name] = ColwiseParallel(use_local_output=False)
        styles[prefix + sub.rowwise] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate(),
                                                       use_local_output=True)
    if sp:
        for name in plan.norms:
            styles[name] = SequenceParallel(use_local_output=True)
    parallelize_module(block, tp_mesh, styles)
    if sp:
        # Block boundary: sequence shards between consecutive blocks; the first
        # block scatters the replicated input, the last gathers its output.
        parallelize_module(block, tp_mesh, PrepareModuleInput(
            input_layouts=_layouts(plan.arg_is_tensor, Replicate() if first else Shard(1), None),
            desired_input_layouts=_layouts(plan.arg_is_tensor, Shard(1), None),
            use_local_output=True))
        parallelize_module(block, tp_mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate() if last else Shard(1),
            use_local_output=True))


def parallelize_vocab(module: nn.Module, tp_mesh, *, position: str, loss_parallel: bool = False) -> None:
    """Embeddings split over the vocabulary (pre layers), head Linears column-wise
    (post layers): logits gathered, or left vocab-sharded for `loss_parallel`."""
    for name, m in module.named_modules():
        if position == "pre" and isinstance(m, nn.Embedding):
            parallelize_module(m, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        elif position == "post" and isinstance(m, nn.Linear):
            out = Shard(-1) if loss_parallel else Replicate()
            parallelize_module(m, tp_mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=out,
                                                           use_local_output=not loss_parallel))


def loss_parallel_works(loss_fn, tp_mesh, logits_shape: tuple) -> bool:
    """Whether the user's loss can run on vocab-sharded logits (`loss_parallel`).

    With it, the head's column-parallel output stays sharded over the
    vocabulary and cross-entropy reduces across tp ranks (no all-gather of
    the logits). The loss function is arbitrary user code, so it is tried
    once on small random logits against the same loss on whole logits
    (value and gradient); anything it cannot do keeps the gathered logits.
    Every tp rank runs the same deterministic probe, so all ranks agree.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    g = torch.Generator().manual_seed(0)
    full = torch.randn(logits_shape, generator=g)
    target = torch.randint(0, logits_shape[-1], logits_shape[:-1], generator=g)
    device = tp_mesh.device_type
    full, target = full.to(device), target.to(device)
    try:
        ref_in = full.clone().requires_grad_()
        ref = loss_fn(ref_in, target)
        ref.backward()
        sharded = distribute_tensor(full, tp_mesh, [Shard(len(logits_shape) - 1)]).detach().requires_grad_()
        with loss_parallel():
            loss = loss_fn(sharded, target)
            loss.backward()
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        grad = sharded.grad.full_tensor()
        return bool(torch.allclose(value.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
                    and torch.allclose(grad, ref_in.grad, rtol=1e-4, atol=1e-6))
    except Exception:  # any unsupported op: fall back to gathered logits
        return False
