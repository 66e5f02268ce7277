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
names: in a sub-module of a block, a Linear that consumes one of the
sub-module's tensor arguments (positional or keyword: Hugging Face calls
`self_attn(hidden_states=...)`) is column-parallel, the last other Linear,
producing the shape of the sub-module's output (the first element when it
returns `(output, weights)`), is row-parallel. Sub-modules that fit neither
stay replicated. transformers' Conv1D counts as a Linear with a transposed
weight (tp_styles.py).

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
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.errors import PlanMismatchError
from autopar.lower.tp_styles import (ModuleInputs, ModuleOutputs, TransposedColwiseParallel,
                                     TransposedRowwiseParallel, is_linear, replicate_parameters)

_SDPA_REGISTERED = False


def register_cpu_attention_sharding() -> None:
    """DTensor ships sharding rules for the CUDA attention kernels only; on CPU
    SDPA lowers to `_scaled_dot_product_flash_attention_for_cpu`. Attention is
    independent per batch row and per head, so dims 0 and 1 of (b, heads, s, d)
    may be sharded, like the CUDA rules say; an attention mask (padding)
    follows q on a sharded dim it spans and is replicated where it broadcasts."""
    global _SDPA_REGISTERED
    if _SDPA_REGISTERED:
        return
    from torch.distributed.tensor.experimental import register_sharding
    aten = torch.ops.aten

    def mask_placement(attn_mask, query, d):
        # The keyword-only attn_mask needs a placement too (DTensor counts
        # keyword tensors among the inputs): split with q where it has q's
        # extent on that dim, replicated where it broadcasts (size 1).
        if attn_mask is None:
            return []
        return [Shard(d) if d is not None and attn_mask.shape[d] == query.shape[d] and attn_mask.shape[d] > 1
                else Replicate()]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _fwd(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        rules = [([Replicate(), Replicate()],
                  [Replicate(), Replicate(), Replicate(), None, None] + mask_placement(attn_mask, query, None))]
        for d in (0, 1):
            rules.append(([Shard(d), Shard(d)],
                          [Shard(d), Shard(d), Shard(d), None, None] + mask_placement(attn_mask, query, d)))
        return rules

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
        rules = [([Replicate()] * 3, [Replicate()] * 6 + [None, None] + mask_placement(attn_mask, query, None))]
        for d in (0, 1):
            rules.append(([Shard(d)] * 3, [Shard(d)] * 6 + [None, None] + mask_placement(attn_mask, query, d)))
        return rules

    _SDPA_REGISTERED = True


@dataclass
class SubModulePlan:
    """TP roles inside one direct child of a block (found by `probe_blocks`)."""

    name: str
    colwise: list[str] = field(default_factory=list)
    rowwise: str | None = None
    arg_is_tensor: list[bool] = field(default_factory=list)
    main_input: int | str | None = None  # the argument the column-parallel Linears consume (position or keyword)


@dataclass
class BlockPlan:
    arg_is_tensor: list[bool]
    subs: list[SubModulePlan]
    norms: list[str]  # parameter-holding children without Linears (LayerNorm, RMSNorm)
    activation_shape: tuple = ()  # the block's activation (main argument) at the probed micro-batch
    # What the block returns: "tensor", ("tuple", n) when every element after
    # the first is None or a tensor nothing reads, or a description of what
    # else it returns (pipeline stand-ins for skipped blocks return the same
    # structure, None after the activation).
    returns: object = "tensor"
    main_argument: int | str = 0  # where the activation is passed: a position, or a keyword


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]  # Hugging Face attention returns (output, weights)
    return None


def probe_blocks(model: nn.Module, blocks: dict[int, nn.Module], example_args: tuple,
                 model_kwargs: dict | None = None, outputs_of: dict[str, nn.Module] | None = None,
                 outputs: dict | None = None) -> dict[int, BlockPlan]:
    """One forward under FakeTensorMode, hooks recording which tensor object flows where.

    In each direct child of a block: Linears (or transposed Conv1D linears)
    whose input *is* one of the child's tensor arguments are column-parallel;
    the last other Linear called, when its output has the shape of the
    child's output, is row-parallel (its output may still pass a dropout or
    a bias before it leaves). Children with no such pair stay replicated.
    The same forward fills `outputs[path]` for each module of `outputs_of`:
    (shape, dtype) of the tensor it returns, else what it returns (pipeline
    stand-ins replace those modules on later stages)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.capture.dtype_fallback import Bf16ShapeFallback

    seen: dict[int, dict] = {}
    order = [0]
    hooks = []

    reads = _Reads()

    def record(key):
        def hook(mod, args, kwargs, out):
            order[0] += 1
            seen[key] = {"args": args, "kwargs": kwargs, "out": out, "order": order[0], "ops_before": reads.n}
        return hook

    for bi, block in blocks.items():
        hooks.append(block.register_forward_hook(record(id(block)), with_kwargs=True))
        for cname, child in block.named_children():
            hooks.append(child.register_forward_hook(record(id(child)), with_kwargs=True))
            for lname, lin in child.named_modules():
                if is_linear(lin):
                    hooks.append(lin.register_forward_hook(record(id(lin)), with_kwargs=True))
    for path, m in (outputs_of or {}).items():
        hooks.append(m.register_forward_hook(record(path), with_kwargs=True))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), Bf16ShapeFallback(), reads, torch.no_grad():
            final = model(*example_args, **(model_kwargs or {}))
        reads.see(final)
    finally:
        for h in hooks:
            h.remove()

    for path in outputs_of or {}:
        out = seen.get(path, {}).get("out")
        if outputs is not None:
            outputs[path] = ((tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor)
                             else "nothing (it was not called)" if path not in seen else f"a {type(out).__name__}")
    plans = {}
    for bi, block in blocks.items():
        rec = seen.get(id(block))
        if rec is None:
            raise PlanMismatchError(f"block {bi} was not called by the model's forward")
        subs, norms = [], []
        for cname, child in block.named_children():
            linears = [(n, m) for n, m in child.named_modules() if is_linear(m)]
            if not linears:
                if any(True for _ in child.parameters()):
                    norms.append(cname)
                continue
            crec = seen.get(id(child))
            if crec is None:
                continue
            inputs = {i: a for i, a in enumerate(crec["args"]) if isinstance(a, torch.Tensor)}
            inputs.update({k: v for k, v in crec["kwargs"].items() if isinstance(v, torch.Tensor)})
            out = _first_tensor(crec["out"])
            if not inputs or out is None:
                continue
            sub = SubModulePlan(name=cname, arg_is_tensor=[isinstance(a, torch.Tensor) for a in crec["args"]])
            last = None
            for lname, lin in linears:
                lrec = seen.get(id(lin))
                if lrec is None or not lrec["args"]:
                    continue
                key = next((k for k, v in inputs.items() if v is lrec["args"][0]), None)
                if key is not None:
                    sub.colwise.append(lname)
                    sub.main_input = key if sub.main_input is None else sub.main_input
                elif last is None or lrec["order"] > last[1]:
                    last = (lname, lrec["order"], lrec["out"])
            if last is not None and isinstance(last[2], torch.Tensor) and last[2].shape == out.shape:
                sub.rowwise = last[0]
            if sub.colwise and sub.rowwise:
                subs.append(sub)
        # The block's activation: its first positional tensor argument (Hugging
        # Face layers take `hidden_states` first), else a `hidden_states` keyword.
        where = next((i for i, a in enumerate(rec["args"]) if isinstance(a, torch.Tensor)), "hidden_states")
        main = rec["args"][where] if isinstance(where, int) else rec["kwargs"].get(where)
        returns = _returns(rec["out"], reads.read_after(rec["ops_before"]))
        plans[bi] = BlockPlan(arg_is_tensor=[isinstance(a, torch.Tensor) for a in rec["args"]], subs=subs,
                              norms=norms, activation_shape=tuple(main.shape) if isinstance(main, torch.Tensor) else (),
                              returns=returns, main_argument=where)
    return plans


class _Reads(TorchDispatchMode):
    """When each tensor was last read by an op of the forward (by object
    identity; op count), the model's own outputs counting as read at the
    end: a block's extra output (GPT-J's attention weights, output_attentions
    off) that nothing reads after the block may be None on a pipeline stage
    that skips the block. The block outputs stay alive in the probe's
    records, so their ids are not reused meanwhile; a reused id of a dead
    tensor can only make an output look read (a refusal, never a wrong run)."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.last: dict[int, int] = {}

    def see(self, tree) -> None:
        from torch.utils._pytree import tree_flatten
        self.n += 1
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                self.last[id(t)] = self.n

    def read_after(self, n: int) -> set[int]:
        return {i for i, at in self.last.items() if at > n}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.see((args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _returns(out, read_ids: set[int] = frozenset()):
    """A block's output structure: what a pipeline stand-in must return."""
    if isinstance(out, torch.Tensor):
        return "tensor"
    if type(out) in (tuple, list) and out and isinstance(out[0], torch.Tensor):
        extra = [type(o).__name__ for o in out[1:]
                 if o is not None and not (isinstance(o, torch.Tensor) and id(o) not in read_ids)]
        return ("tuple", len(out)) if not extra else f"a tuple whose later elements ({', '.join(extra)}) are read"
    return f"a {type(out).__name__}"


def check_sequence_split(path: str, plan: BlockPlan, tp: int) -> None:
    """Sequence parallelism cuts the block's activation into tp equal pieces
    along dim 1; torch's collectives need equal pieces (an uneven split
    aborts a rank inside gloo/NCCL), so refuse it here, on every rank alike."""
    shape = plan.activation_shape
    if len(shape) < 3 or shape[1] % tp:
        what = f"sequence of {shape[1]}" if len(shape) >= 3 else f"activation of shape {list(shape)}"
        raise PlanMismatchError(
            f"block {path!r}: sequence parallelism over tp={tp} needs tp to divide the sequence dim (dim 1) of "
            f"the block's (batch, sequence, hidden) activation; it has a {what}",
            hint="plan without sequence parallelism (--no-sequence-parallel / sequence_parallel=False), "
                 "or use a sequence length tp divides")


def parallelize_block(block: nn.Module, plan: BlockPlan, tp_mesh, *, sequence_parallel: bool,
                      first: bool, last: bool) -> None:
    """The whole block is one DTensor region.

    Inside it every parameter is a DTensor (Linears of an attention / MLP
    pair column- and row-parallel, everything else replicated), the block's
    activation enters as a DTensor, and tensors the block makes or reads on
    its own (positions from `arange`, buffers, masks) are taken as
    replicated by DTensor's implicit replication, which the training step
    switches on (`tp_region`). DTensor's sharding propagation then computes
    the function the author wrote, whatever runs between the split Linears
    (q/k norms, in-place residual adds, custom attention, tuples), and
    inserts the communication an op needs; the layouts below only say where
    the planned communication happens. Sequence parallelism: the block's
    activation is a sequence shard (dim 1) outside attention / MLP, which
    gather it on entry and reduce-scatter on exit; consecutive blocks hand
    each other shards, the first scatters and the last gathers."""
    sp = sequence_parallel
    hidden = Shard(1) if sp else Replicate()
    styles: dict[str, object] = {}
    for sub in plan.subs:
        prefix = f"{sub.name}." if sub.name else ""
        styles[sub.name] = ModuleInputs(sub.main_input, hidden, Replicate())
        for name in sub.colwise:
            styles[prefix + name] = TransposedColwiseParallel(use_local_output=False)
        styles[prefix + sub.rowwise] = TransposedRowwiseParallel(output_layouts=hidden, use_local_output=False)
    if sp:
        # Children autopar does not split (attention it cannot divide by
        # heads, such as nn.MultiheadAttention's packed in_proj, or Linears
        # called directly by the block) may mix sequence positions: they get
        # the whole sequence and run replicated. Norms stay on shards.
        split = {sub.name for sub in plan.subs} | set(plan.norms)
        for name, child in block.named_children():
            if name not in split and any(True for _ in child.parameters()):
                styles[name] = ModuleInputs(None, gather_all=True)
    parallelize_module(block, tp_mesh, styles)
    replicate_parameters(block, tp_mesh)
    parallelize_module(block, tp_mesh, ModuleInputs(plan.main_argument, Replicate() if first or not sp else hidden,
                                                    hidden))
    parallelize_module(block, tp_mesh, ModuleOutputs(Replicate() if last or not sp else hidden))


def tp_region():
    """The context the forward and backward of TP blocks run in: plain tensors
    meeting DTensors count as replicated (see `parallelize_block`)."""
    from torch.distributed.tensor.experimental import implicit_replication
    return implicit_replication()


def parallelize_vocab(module: nn.Module, tp_mesh, *, position: str, loss_parallel: bool = False) -> None:
    """Embeddings split over the vocabulary (pre layers), head Linears column-wise
    (post layers): logits gathered, or left vocab-sharded for `loss_parallel`."""
    for name, m in module.named_modules():
        if position == "pre" and isinstance(m, nn.Embedding):
            parallelize_module(m, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        elif position == "post" and is_linear(m):  # nn.Linear, or a transposed Conv1D head
            out = Shard(-1) if loss_parallel else Replicate()
            parallelize_module(m, tp_mesh, TransposedColwiseParallel(input_layouts=Replicate(), output_layouts=out,
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
