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

Which Linear is column- and which row-parallel is read from the dataflow of
one traced forward (FakeTensorMode, no memory, no weights touched), not from
names or from where the Linears sit: the block's ops are recorded as capture
records them and read by capture's own `tp_flow` (autopar/capture/
tp_dataflow.py), the analysis the cost model prices. A GEMM whose input is
full is column-parallel, one fed a sharded (or gathered) region is
row-parallel; each GEMM is traced back to the Linear whose forward ran it
(transformers' Conv1D counts as a Linear with a transposed weight,
tp_styles.py). A group of regions that meet in a row GEMM is split only when
every GEMM of it is a Linear's own, and each of those Linears plays that one
role (nn.MultiheadAttention's packed in_proj_weight is no Linear: its
attention stays whole).

Where a group lies inside one direct child of the block (an attention or MLP
module) whose tensor argument the column Linears read, the child is the
region's door (`SubModulePlan`: under sequence parallelism it gathers once
on entry). Otherwise (Megatron-style blocks holding qkv, proj, fc1, fc2
themselves; an MLP spread over two children) the Linears are listed on the
block (`BlockPlan.colwise` / `rowwise`) and each column Linear's input is made
whole where it is read, once per tensor (`tp_styles.SharedInput`).

Layer styles (`LayerChoice.tp_style`):
  vocab            embeddings split over the vocabulary (tp_styles.VocabParallelEmbedding on
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

import contextlib

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.errors import PlanMismatchError
from autopar.lower.tp_styles import (ModuleInputs, ModuleOutputs, PiecewiseColwiseParallel, SharedInput,
                                     TransposedColwiseParallel, TransposedRowwiseParallel, VocabParallelEmbedding,
                                     is_linear, replicate_parameters)

_SDPA_REGISTERED = False


def register_cpu_attention_sharding() -> None:
    """DTensor ships sharding rules for the CUDA attention kernels only; on CPU
    SDPA lowers to `_scaled_dot_product_flash_attention_for_cpu`. Attention is
    independent per batch row and per head, so dims 0 and 1 of (b, heads, s, d)
    may be sharded, like the CUDA rules say; an attention mask must already be
    split like q where it spans q's sharded dim (see `mask_placement`)."""
    global _SDPA_REGISTERED
    if _SDPA_REGISTERED:
        return
    from torch.distributed.tensor.experimental import register_sharding
    aten = torch.ops.aten

    def mask_placement(attn_mask, query, d):
        # The keyword-only attn_mask needs a placement too (DTensor counts
        # keyword tensors among the inputs), but DTensor reshards positional
        # arguments only: the mask is used as the ranks hold it. So a rule
        # (q split on dim d, or whole for None) fits only a mask already
        # split with q where it has q's extent on d and whole where it
        # broadcasts there; None drops the rule. T5's per-head position bias
        # is a whole tensor: its attention runs on gathered q, k, v.
        if attn_mask is None:
            return []
        need = (Shard(d) if d is not None and attn_mask.shape[d] == query.shape[d] and attn_mask.shape[d] > 1
                else Replicate())
        return [need] if all(p == need for p in attn_mask.placements) else None

    def rules(query, attn_mask, n_out, n_in, n_scalars):
        found = []
        for d in (None, 0, 1):
            mask = mask_placement(attn_mask, query, d)
            if mask is not None:
                p = Replicate() if d is None else Shard(d)
                found.append(([p] * n_out, [p] * n_in + [None] * n_scalars + mask))
        return found

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _fwd(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        return rules(query, attn_mask, 2, 3, 2)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
        return rules(query, attn_mask, 3, 6, 2)

    # DTensor caches each op's sharding by its positional arguments only: the
    # mask must enter that key, or a decision made for a call without a
    # per-head mask (another model in this process) is reused for one with it.
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default):
        DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[op] = RuntimeSchemaInfo(
            static_kwargkey=["attn_mask"], needs_pytree=True)
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
    # Pairs no single child holds (paths in the block): column- and row-parallel Linears;
    # `rowwise_whole`: row Linears whose output is not shaped like the activation (it
    # leaves whole, never as a sequence shard).
    colwise: list[str] = field(default_factory=list)
    rowwise: list[str] = field(default_factory=list)
    rowwise_whole: list[str] = field(default_factory=list)
    # MoE experts stored as 3-D parameters: split on their ffn dim, run on local tensors (tp_experts.py)
    experts: list = field(default_factory=list)
    # Column Linears (paths in the block) of a fused projection reshaped into its pieces and cut
    # (timm's qkv -> (3, heads, head_dim)): sharded strided, each rank its heads of every piece
    pieces: dict = field(default_factory=dict)


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]  # Hugging Face attention returns (output, weights)
    return None


def probe_blocks(model: nn.Module, blocks: dict[int, nn.Module], example_args: tuple,
                 model_kwargs: dict | None = None, outputs_of: dict[str, nn.Module] | None = None,
                 outputs: dict | None = None, answers=None, fake: bool = True) -> dict[int, BlockPlan]:
    """One forward under FakeTensorMode: each block's ops recorded for `tp_flow`
    (see the top of this file), hooks recording which tensor object each
    child and Linear of a block was given and returned. The same forward
    fills `outputs[path]` for each module of `outputs_of`: (shape, dtype) of
    the tensor it returns, else what it returns (pipeline stand-ins replace
    those modules on later stages). `answers`: the values fake tensors lack
    (capture/value_answers.py), counted there. `fake=False`: a meta-built model
    on meta inputs, without FakeTensorMode (what_runs.record_blocks tries it first)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.capture.dtype_fallback import Bf16ShapeFallback
    from autopar.capture.tp_dataflow import ModuleFlow
    from autopar.capture.value_answers import ValueAnswers

    seen: dict[int, dict] = {}
    hooks = []
    reads = _Reads()

    def record(key):
        def hook(mod, args, kwargs, out):
            seen[key] = {"args": args, "kwargs": kwargs, "out": out, "ops_before": reads.n}
        return hook

    for bi, block in blocks.items():
        hooks.append(block.register_forward_hook(record(id(block)), with_kwargs=True))
        for child in list(block.children()) + [m for m in block.modules() if is_linear(m)]:
            hooks.append(child.register_forward_hook(record(id(child)), with_kwargs=True))
    for path, m in (outputs_of or {}).items():
        hooks.append(m.register_forward_hook(record(path), with_kwargs=True))
    flow = ModuleFlow(blocks)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), \
                answers or ValueAnswers(), Bf16ShapeFallback(), reads, flow, torch.no_grad():
            final = model(*example_args, **(model_kwargs or {}))
        reads.see(final)
    finally:
        flow.remove()
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
        # The block's activation: its first positional tensor argument (Hugging
        # Face layers take `hidden_states` first), else a `hidden_states` keyword.
        where = next((i for i, a in enumerate(rec["args"]) if isinstance(a, torch.Tensor)), "hidden_states")
        main = rec["args"][where] if isinstance(where, int) else rec["kwargs"].get(where)
        plans[bi] = BlockPlan(
            arg_is_tensor=[isinstance(a, torch.Tensor) for a in rec["args"]], subs=[],
            norms=[n for n, c in block.named_children()
                   if not any(is_linear(m) for m in c.modules()) and any(True for _ in c.parameters())],
            activation_shape=tuple(main.shape) if isinstance(main, torch.Tensor) else (),
            returns=_returns(rec["out"], reads.read_after(rec["ops_before"])), main_argument=where)
        _place_pairs(block, plans[bi], _linear_groups(block, flow.ops.get(bi, []), plans[bi].pieces), seen)
        _place_experts(block, plans[bi], flow.ops.get(bi, []))
    return plans


def _linear_groups(block: nn.Module, ops: list, pieces: dict) -> list[tuple[list[str], list[str]]]:
    """The block's tensor-parallel groups as (column Linears, row Linears), paths
    in the block, from capture's dataflow analysis of its recorded ops. A group
    is kept only when each of its GEMMs ran in a Linear's own forward and each
    of those Linears has that one role in every call (a Linear called twice,
    once as a column and once elsewhere, would be split for one and wrong
    for the other: its group stays whole). Fills `pieces` with the column
    Linears of a fused projection cut into its pieces (TPFlow.pieces), by path."""
    from autopar.capture.tp_dataflow import split_groups, tp_flow

    flow = tp_flow(ops, is_head=False)
    path = {id(m): n for n, m in block.named_modules() if is_linear(m)}
    gemms = [r for r in ops if id(r.module) in path and r.kind == "gemm"]
    role = {}  # GEMM idx -> (group, "col" | "row")
    groups = split_groups(flow)
    for g, (cols, rows) in enumerate(groups):
        role.update({c: (g, "col") for c in cols})
        role.update({r.idx: (g, "row") for r in rows})
    roles_of: dict[str, set] = {}
    for r in gemms:
        roles_of.setdefault(path[id(r.module)], set()).add(role.get(r.idx))
    by_idx = {r.idx: r for r in ops}
    out = []
    for cols, rows in groups:
        records = [by_idx[c] for c in cols] + rows
        names = [path.get(id(r.module)) for r in records]
        if None in names or any(len(roles_of[n]) != 1 for n in names):
            continue
        out.append((list(dict.fromkeys(names[:len(cols)])), list(dict.fromkeys(names[len(cols):]))))
        pieces.update({path[id(by_idx[c].module)]: k for c, k in flow.pieces.items() if c in cols})
    return out


def _place_pairs(block: nn.Module, plan: BlockPlan, groups: list, seen: dict) -> None:
    """Each group as a sub-module plan where one direct child holds it all, the
    child was called with the tensors its column Linears read and returns
    the shape of its row Linear's output (its door: the old, per-child form);
    else its Linears go on the block's own lists."""
    order = {n: i for i, (n, _) in enumerate(block.named_modules())}
    by_child: dict[str, list] = {}
    for cols, rows in groups:
        tops = {n.split(".")[0] for n in cols + rows}
        if len(tops) == 1 and all("." in n for n in cols + rows) and len(rows) == 1:
            by_child.setdefault(tops.pop(), []).append((cols, rows))
    subs = {}
    for name, found in by_child.items():
        sub = _sub_module_plan(block, name, found[0], seen) if len(found) == 1 else None
        if sub is not None:
            subs[name] = sub
    for cols, rows in groups:
        if any(n.split(".")[0] in subs for n in cols + rows):
            continue
        plan.colwise += cols
        for n in rows:
            plan.rowwise.append(n)
            out = _first_tensor(seen.get(id(block.get_submodule(n)), {}).get("out"))
            if out is None or tuple(out.shape) != plan.activation_shape:
                plan.rowwise_whole.append(n)
    plan.subs = [subs[n] for n, _ in block.named_children() if n in subs]
    for names in (plan.colwise, plan.rowwise, plan.rowwise_whole):
        names.sort(key=order.__getitem__)


def _place_experts(block: nn.Module, plan: BlockPlan, ops: list) -> None:
    """The block's experts modules (tp_experts.find_experts). A child holding them
    is no norm: under sequence parallelism it takes the whole sequence (every
    rank's experts see every token)."""
    from autopar.lower.tp_experts import find_experts

    plan.experts = find_experts(block, ops)
    tops = {e.path.split(".")[0] for e in plan.experts}
    plan.norms = [n for n in plan.norms if n not in tops]


def _sub_module_plan(block: nn.Module, name: str, group: tuple, seen: dict) -> SubModulePlan | None:
    """The group (cols, [row]) as the child `name`'s plan, or None when the child is no door to it."""
    cols, (row,) = group
    child = block.get_submodule(name)
    crec = seen.get(id(child))
    if crec is None:
        return None
    inputs = {i: a for i, a in enumerate(crec["args"]) if isinstance(a, torch.Tensor)}
    inputs.update({k: v for k, v in crec["kwargs"].items() if isinstance(v, torch.Tensor)})
    out = _first_tensor(crec["out"])
    row_out = _first_tensor(seen.get(id(block.get_submodule(row)), {}).get("out"))
    if out is None or row_out is None or row_out.shape != out.shape:
        return None
    order = {n: i for i, (n, _) in enumerate(child.named_modules())}
    local = sorted((n.split(".", 1)[1] for n in cols), key=order.__getitem__)
    keys = []
    for n in local:
        lrec = seen.get(id(child.get_submodule(n)))
        key = next((k for k, v in inputs.items() if lrec and lrec["args"] and v is lrec["args"][0]), None)
        if key is None:
            return None  # a column Linear reads something the child made: no door
        keys.append(key)
    return SubModulePlan(name=name, colwise=local, rowwise=row.split(".", 1)[1],
                         arg_is_tensor=[isinstance(a, torch.Tensor) for a in crec["args"]], main_input=keys[0])


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
    if len(shape) > 3:
        raise PlanMismatchError(
            f"block {path!r}: sequence parallelism shards the sequence dim (dim 1) of a (batch, sequence, "
            f"hidden) activation; the block's is {len(shape)}-D {list(shape)} (an image's channels are dim 1)",
            hint="plan without sequence parallelism (--no-sequence-parallel / sequence_parallel=False)")
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
    each other shards, the first scatters and the last gathers. Pairs the
    block holds itself (`plan.colwise` / `rowwise`) have no door: their
    column Linears' input is gathered where it is read (`SharedInput`), their
    row Linears hand back the activation's layout."""
    sp = sequence_parallel
    hidden = Shard(1) if sp else Replicate()
    styles: dict[str, object] = {}
    for sub in plan.subs:
        prefix = f"{sub.name}." if sub.name else ""
        styles[sub.name] = ModuleInputs(sub.main_input, hidden, Replicate())
        for name in sub.colwise:
            styles[prefix + name] = _colwise(plan, prefix + name)
        styles[prefix + sub.rowwise] = TransposedRowwiseParallel(output_layouts=hidden, use_local_output=False)
    for name in plan.colwise:
        styles[name] = _colwise(plan, name)
    for name in plan.rowwise:
        out = Replicate() if name in plan.rowwise_whole else hidden
        styles[name] = TransposedRowwiseParallel(output_layouts=out, use_local_output=False)
    if sp:
        # Children autopar does not split (attention it cannot divide by
        # heads, such as nn.MultiheadAttention's packed in_proj, or Linears
        # no pair holds) may mix sequence positions: they get the whole
        # sequence and run replicated. Norms stay on shards.
        split = ({sub.name for sub in plan.subs} | set(plan.norms)
                 | {n.split(".")[0] for n in plan.colwise + plan.rowwise})
        experts = {e.path.split(".")[0] for e in plan.experts}
        for name, child in block.named_children():
            if (name not in split or name in experts) and any(True for _ in child.parameters()):
                styles[name] = ModuleInputs(None, gather_all=True)
    parallelize_module(block, tp_mesh, styles)
    if plan.colwise:
        # No child takes these Linears' input at its door: each input is made
        # whole where it is read, once per tensor per forward of the block.
        cache: dict = {}
        parallelize_module(block, tp_mesh, {name: SharedInput(cache) for name in plan.colwise})
        block.register_forward_pre_hook(lambda *_: cache.clear())
        block.register_forward_hook(lambda *_: cache.clear(), always_call=True)
    if plan.experts:
        from autopar.lower.tp_experts import parallelize_experts
        parallelize_experts(block, plan.experts, tp_mesh)
    replicate_parameters(block, tp_mesh)
    parallelize_module(block, tp_mesh, ModuleInputs(plan.main_argument, Replicate() if first or not sp else hidden,
                                                    hidden))
    parallelize_module(block, tp_mesh, ModuleOutputs(Replicate() if last or not sp else hidden))


def _colwise(plan: BlockPlan, name: str):
    if name in plan.pieces:
        return PiecewiseColwiseParallel(plan.pieces[name])
    return TransposedColwiseParallel(use_local_output=False)


def tp_region():
    """The context the forward and backward of TP blocks run in: plain tensors
    meeting DTensors count as replicated (see `parallelize_block`)."""
    from torch.distributed.tensor.experimental import implicit_replication
    return implicit_replication()


def parallelize_vocab(module: nn.Module, tp_mesh, *, position: str, loss_parallel: bool = False,
                      whole: frozenset = frozenset()) -> None:
    """Embeddings split over the vocabulary (pre layers), head Linears column-wise
    (post layers): logits gathered, or left vocab-sharded for `loss_parallel`.
    Modules in `whole` (ids: Linears the model reads by weight, and what is
    tied to them) stay whole."""
    for name, m in module.named_modules():
        if id(m) in whole:
            continue
        if position == "pre" and isinstance(m, nn.Embedding):
            parallelize_module(m, tp_mesh, VocabParallelEmbedding())
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
