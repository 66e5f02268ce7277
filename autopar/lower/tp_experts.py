"""Tensor parallelism for MoE experts stored as 3-D parameters.

transformers 5.x keeps a layer's experts in one module (`MixtralExperts`,
`Qwen2MoeExperts`): `gate_up_proj` (experts, 2 x ffn, hidden) and `down_proj`
(experts, hidden, ffn), run by `torch._grouped_mm` (or a loop of `linear` on
`param[e]`). DTensor cannot run those GEMMs itself (the sharding propagation
of `_grouped_mm` runs its meta kernel, which takes bf16 only), and a split
must keep gate and up paired: the forward chunks the fused output in two.

So, as torchtitan's `GroupedExperts` under tp: the ffn dim of every expert is
split over tp, and the experts' own forward runs on *local* tensors.

* The column weight (gate_up) is sharded on its ffn dim *strided*
  (`_StridedShard(dim, split_factor=pieces)`): each rank holds its slice of
  gate and its slice of up, so `chunk(2, -1)` of its local output gives the
  rank's gate and up. The row weight (down) is sharded on its ffn dim. The
  parameters stay DTensors with the user's global shapes (state dicts,
  snapshots and `full_tensor()` see the original layout).
* The inputs (activation, routing weights, expert ids) enter whole: a
  DTensor is made replicated and converted to local with a *partial*
  gradient (each rank's experts see only their ffn slice), summed once at
  the door (`tp_styles._enter`, as for a column-parallel Linear's input).
* The output is this rank's partial sum, handed back as a `Partial()`
  DTensor: DTensor reduces it where the block reads it (an all-reduce, or a
  reduce-scatter into a sequence shard).

Which module is an experts module, and which of its weights is column or
row, is read off the block's recorded ops with capture's `tp_flow` (the
dataflow the cost model prices), never from class names: a module whose 3-D
parameters feed column and row GEMMs of the same tensor-parallel groups.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_flatten, tree_map_only

from autopar.capture.tp_dataflow import (_CUTS, _LINEAR_GEMMS, _TRANSPOSES, _cut_dim, _equal_pieces,
                                         split_groups, tp_flow)
from autopar.errors import PlanMismatchError

# Ops after the row GEMM that keep a partial sum a partial sum (linear in it):
# routing weights multiply it, tokens are gathered back and summed per token.
_LINEAR_AFTER_ROW = {"aten.mul", "aten.div", "aten.index", "aten.view", "aten._unsafe_view", "aten.reshape",
                     "aten.unsqueeze", "aten.squeeze", "aten.sum", "aten.index_add", "aten.index_add_",
                     "aten.index_put", "aten.index_put_", "aten._to_copy", "aten.clone", "aten.contiguous",
                     "aten.expand", "aten.permute", "aten.transpose", "aten.t", "aten.add", "aten.add_",
                     "aten.neg", "aten.cat", "aten.stack", "aten.slice", "aten.select", "aten.alias"}
_ZEROS = {"aten.zeros", "aten.zeros_like", "aten.new_zeros", "aten.zero_"}
# ... of which these join tensors: each other one must be a partial sum too, or zeros.
_JOINS = {"aten.add", "aten.add_", "aten.index_add", "aten.index_add_", "aten.index_put", "aten.index_put_",
          "aten.cat", "aten.stack"}


@dataclass
class ExpertsPlan:
    """One experts module of a block: which 3-D weights split how (found by `find_experts`)."""

    path: str  # the module, a path in the block
    column: dict = field(default_factory=dict)  # parameter -> (dim, pieces): the ffn dim, fused pieces
    row: dict = field(default_factory=dict)  # parameter -> its ffn dim
    why: str | None = None  # why it cannot be split (the lowering refuses tp with this)


def find_experts(block: nn.Module, ops: list) -> list[ExpertsPlan]:
    """The block's experts modules, from its recorded forward (`ModuleFlow` records)."""
    owners = {id(m): p for p, m in block.named_modules() if any(t.dim() == 3 for t in m.parameters(recurse=False))}
    if not owners:
        return []
    flow = tp_flow(ops, is_head=False)
    by_idx = {r.idx: r for r in ops}
    plans: dict[str, ExpertsPlan] = {}
    for r in ops:
        if r.op not in _LINEAR_GEMMS or id(r.module) not in owners:
            continue
        source = _weight_source(r, by_idx, flow.state)
        if source is None or block.get_parameter(source[0]).dim() != 3:
            continue  # no weight, or not an experts' one (a router's matrix held beside them)
        path = owners[id(r.module)]
        plan = plans.setdefault(path, ExpertsPlan(path))
        name, swaps = source
        if plan.why is None:
            plan.why = _add_gemm(plan, r, name, swaps, flow, ops)
    for plan in plans.values():
        plan.why = plan.why or _check_plan(block, plan, flow, ops)
        if plan.why:
            plan.column, plan.row = {}, {}
    return list(plans.values())


def _weight_source(r, by_idx: dict, state: dict) -> tuple[str, int] | None:
    """(parameter name in the block, transposes of its last two dims on the way)
    of the weight operand of GEMM `r`, walking back through the views that made it."""
    if r.param_names:  # the parameter itself is the operand (weights stored (experts, in, out))
        return (r.param_names[0], 0) if len(r.param_names) == 1 and r.op != "aten.addmm" else None
    weights = [i for i in r.inputs if state.get(i) == "param"]
    if len(weights) != 1 or r.inputs[:1] == (weights[0],) or r.op in ("aten.addmm", "aten.baddbmm"):
        return None  # no weight, or not the second operand: not a weight GEMM of the Linear form
    swaps, rec = 0, by_idx.get(weights[0])
    while rec is not None:
        if rec.op in _TRANSPOSES:
            swapped = _swaps_last_two(rec)
            if swapped is None:
                return None
            swaps += swapped
        elif rec.op not in ("aten.select", "aten.unbind", "aten.index") and \
                len(rec.in_shapes[0]) != len(rec.out_shapes[0]):
            return None  # a reshape of the weight: its dims cannot be followed
        if rec.param_names:
            return (rec.param_names[0], swaps) if len(rec.param_names) == 1 else None
        ups = [i for i in rec.inputs if state.get(i) == "param"]
        rec = by_idx.get(ups[0]) if len(ups) == 1 else None
    return None


def _swaps_last_two(rec) -> int | None:
    n, dims = len(rec.in_shapes[0]), rec.dims or {}
    if rec.op in ("aten.t", "aten.mT", "aten.numpy_T"):
        return 1
    if "dim0" in dims:
        pair = {dims["dim0"] % n, dims["dim1"] % n}
        return 1 if pair == {n - 1, n - 2} else 0 if len(pair) == 1 else None
    if rec.op == "aten.permute" and "dims" in dims:
        order = [d % n for d in dims["dims"]]
        same = order[:-2] == list(range(n - 2))
        return 0 if same and order[-2:] == [n - 2, n - 1] else 1 if same and order[-2:] == [n - 1, n - 2] else None
    return None


def _add_gemm(plan: ExpertsPlan, r, name: str, swaps: int, flow, ops: list) -> str | None:
    """Record the role of one GEMM's weight in `plan`; the reason it cannot be split, or None.
    The weight operand of x @ W is (.., in, out): a (experts, out, in) parameter reaches it
    transposed once, so its out dim is 1 after an odd number of swaps and 2 after an even one."""
    prefix = f"{plan.path}." if plan.path else ""
    local = name[len(prefix):] if name.startswith(prefix) else None
    if local is None or "." in local:
        return f"its GEMM reads {name}, not a parameter of its own"
    out_dim, in_dim = (1, 2) if swaps % 2 else (2, 1)
    if r.idx in flow.cols and r.idx in flow.valid:
        role, want = plan.column, (out_dim, _pieces(r, ops))
    elif any(r is row for row in flow.rows):
        role, want = plan.row, in_dim
    else:
        return f"its GEMM on {local} is neither column- nor row-parallel (no row GEMM after it)"
    if want == (out_dim, None):
        return f"the output of its GEMM on {local} is cut into unequal pieces"
    if role.setdefault(local, want) != want or local in plan.column and local in plan.row:
        return f"{local} plays two roles in its GEMMs"
    return None


def _pieces(col, ops: list) -> int | None:
    """Into how many equal pieces the column GEMM's output is cut on its last dim
    (gate and up fused: 2), 1 when it is not cut, None for unequal pieces."""
    for r in ops:
        if col.idx in r.inputs and r.op in _CUTS and _cut_dim(r) == -1:
            return len(r.out_shapes) if _equal_pieces(r, -1) else None
    return 1


def _check_plan(block: nn.Module, plan: ExpertsPlan, flow, ops: list) -> str | None:
    """Why the experts module cannot be split as `plan` says, or None."""
    module = block.get_submodule(plan.path)
    if not plan.column or not plan.row:
        return "its 3-D weights do not form a column / row pair"
    split = set(plan.column) | set(plan.row)
    others = [n for n, _ in module.named_parameters() if n not in split]
    if others:
        return f"its parameters {', '.join(others)} would need a split of their own (biases, norms)"
    mine = {r.idx for r in ops if _inside(r.module, module)}
    gemms = {r.idx for r in ops if r.op in _LINEAR_GEMMS}
    for cols, rows in split_groups(flow):
        members = set(cols) | {r.idx for r in rows}
        if members & mine and not members <= mine & gemms:
            return "its tensor-parallel group reaches GEMMs outside it"
    return _partial_stays_linear(ops, mine, {r.idx for r in flow.rows if r.idx in mine})


def _inside(module, top: nn.Module) -> bool:
    return module is top or any(module is m for m in top.modules())


def _partial_stays_linear(ops: list, mine: set, rows: set) -> str | None:
    """The module returns a partial sum, reduced later: every op inside it that
    reads the row GEMMs' outputs must be linear in them (a norm or a bias after
    the down projection would be applied to each rank's part)."""
    derived, zeros = set(rows), set()
    by_idx = {r.idx: r for r in ops}
    for r in ops:
        if r.idx not in mine:
            continue
        if r.op in _ZEROS:
            zeros.add(r.idx)
        hit = [i for i in r.inputs if i in derived]
        if not hit or r.out_is_int:
            continue
        if r.op not in _LINEAR_AFTER_ROW:
            return f"{r.op} reads the down projection's output before its sum over tp ranks"
        floats = [i for i in r.inputs if i not in by_idx or not by_idx[i].out_is_int]
        if r.op in _JOINS and (r.uses_param or any(i not in derived and i not in zeros for i in floats)):
            return f"{r.op} joins a whole tensor to the down projection's output before its sum over tp ranks"
        if r.op in ("aten.mul", "aten.div") and len(hit) > 1:
            return f"{r.op} of two partial sums"
        derived.add(r.idx)
    return None


def parallelize_experts(block: nn.Module, plans: list[ExpertsPlan], tp_mesh) -> None:
    """Shard each experts module's weights (see the top of this file) and run its forward on local tensors."""
    from torch.distributed.tensor.placement_types import _StridedShard

    tp = tp_mesh.size()
    for plan in plans:
        if plan.why:
            raise PlanMismatchError(f"experts {plan.path!r} cannot be split over tp: {plan.why}",
                                    hint="plan this model without tensor parallelism")
        module = block.get_submodule(plan.path)
        placements = {n: _StridedShard(d, split_factor=k) if k > 1 else Shard(d) for n, (d, k) in plan.column.items()}
        placements.update({n: Shard(d) for n, d in plan.row.items()})
        for name, placement in placements.items():
            p = getattr(module, name)
            pieces = plan.column.get(name, (None, 1))[1]
            if p.shape[placement.dim] % (pieces * tp):
                raise PlanMismatchError(
                    f"experts {plan.path!r}: tp={tp} does not divide the experts' ffn size "
                    f"{p.shape[placement.dim] // pieces} ({name} of shape {list(p.shape)})",
                    hint="use a tp degree that divides the experts' intermediate size")
            module.register_parameter(name, nn.Parameter(distribute_tensor(p, tp_mesh, [placement]),
                                                         requires_grad=p.requires_grad))
        module.forward = _local_forward(module, module.forward, tp_mesh)


def _local_forward(module: nn.Module, forward, mesh):
    """`forward` on local tensors: inputs whole (gradient summed at the door),
    weights this rank's shards, output this rank's partial sum as a Partial DTensor."""
    from autopar.lower.tp_styles import _enter

    def whole(t: DTensor) -> torch.Tensor:
        return _enter(t, mesh, Replicate(), Replicate()).to_local(grad_placements=[Partial()])

    def run(*args, **kwargs):
        args, kwargs = tree_map_only(DTensor, whole, (args, kwargs))
        with _local_parameters(module) as fake:
            out = forward(*_low(args, fake), **_low(kwargs, fake))
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise PlanMismatchError(f"experts module {type(module).__name__} returns a {type(out).__name__}, "
                                    f"not one tensor: its partial sums cannot be reduced")
        if fake:  # the dtype the real step returns
            out = out.to(next(t.dtype for t in tree_flatten((args, kwargs))[0]
                              if isinstance(t, torch.Tensor) and t.is_floating_point()))
        return DTensor.from_local(out, mesh, [Partial()], run_check=False)
    return run


def _low(tree, fake: bool):
    """On fake tensors (the lowering's check, what_runs.py) the experts run in
    bf16: the meta kernel of `_grouped_mm` accepts nothing else, and a fake run
    reads shapes, not values (capture/dtype_fallback.py). Autograd casts the
    gradients back."""
    if not fake:
        return tree
    return tree_map_only(torch.Tensor, lambda t: t.to(torch.bfloat16) if t.dtype == torch.float32 else t, tree)


@contextlib.contextmanager
def _local_parameters(module: nn.Module):
    """The module's DTensor parameters (read now: FSDP swaps in its unsharded ones
    before each forward) replaced by their local shards for one forward; yields
    whether they are fake tensors (see `_low`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    params = dict(module.named_parameters(recurse=False))
    local = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in params.items()}
    fake = any(isinstance(t, FakeTensor) for t in local.values())
    module._parameters.update(_low(local, fake))
    try:
        yield fake
    finally:
        module._parameters.update(params)
