"""Expert parallelism: an MoE layer's experts split over a 1-D "ep" DeviceMesh.

As torchtitan's expert parallelism (torchtitan/models/common/token_dispatcher.py,
`AllToAllTokenDispatcher`; moe_sharding.py): each ep rank keeps
experts / ep of the layer's experts; the router and any shared experts stay
whole (replicated) on every rank. Each rank routes its own tokens, then

  dispatch: its (token, choice) rows, sorted by expert, go to the rank that
            holds the expert (one all-to-all; the row counts are exchanged
            first, as torchtitan does, so the receiving sizes are known);
  compute:  the rank's local experts run on the rows they received, through
            the model's own experts code (its grouped GEMM, biases, clamps);
  combine:  the outputs go back by the inverse all-to-all and are summed over
            the top-k choices with the routing weights, on the token's rank.

The all-to-alls are torch's autograd ones
(`torch.distributed._functional_collectives.all_to_all_single_autograd`):
backward sends the gradients the same way back.

ep folds into data parallelism (torchtitan: dp_shard x cp = efsdp x ep): each
ep rank reads different samples. So the parameters outside the experts are
replicated and their gradients must be averaged over the ep group, and an
expert's gradient (summed from every rank's tokens) divided by ep:
`reduce_gradients` does both with a plain all-reduce; the wiring into the Plan
folds them into FSDP2 over the dp mesh (a gradient divide factor for the
experts, as torchtitan sets on its efsdp mesh).

The load-balancing loss: transformers' MoE models compute it from the router
logits they record from the router module (`OutputRecorder(...Router,
index=0)`). Those logits are all-gathered over ep (autograd: backward
reduce-scatters), so the loss is the one of the whole batch, as one process
computes it on the concatenated batch; its gradient, averaged over ep by
`reduce_gradients`, is that process's too.

Forms run:
* experts as one module with 3-D parameters (experts, ...), called as
  `experts(tokens, top_k_index, top_k_weights)`: transformers 5.x Mixtral,
  Qwen2/3-MoE, OLMoE, DeepSeek-V3 (shared experts stay dense), GPT-OSS;
* experts as an nn.ModuleList the block loops over itself (a hand-written
  router): each entry becomes a proxy that sends the tokens the loop hands it
  to the expert's owner and back (one all-to-all pair per expert: every rank
  must call every expert, in the same order, as `for e in range(E)` does).

Refused, with the reason: DBRX (its experts are 2-D (experts x ffn, hidden)
weights viewed per expert, and its router returns the logits the block routes
on, so they cannot be gathered without changing the routing); experts not
divisible by ep.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import (
    all_gather_single_autograd, all_to_all_single, all_to_all_single_autograd, wait_tensor)
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import AutoparError

_ROUTER_NAMES = ("gate", "router")


class ExpertParallelError(AutoparError):
    """An MoE layer the expert-parallel style cannot split (the message says why)."""


def _local_range(num_experts: int, mesh: DeviceMesh, where: str) -> tuple[int, int]:
    ep = mesh.size()
    if num_experts % ep:
        raise ExpertParallelError(f"{where}: {num_experts} experts do not split over ep={ep}",
                                  hint=f"choose an ep degree that divides {num_experts}")
    per = num_experts // ep
    rank = mesh.get_local_rank()
    return rank * per, (rank + 1) * per


def _exchange(rows: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int, mesh: DeviceMesh):
    """Dispatch: rows sorted by expert go to the expert's rank. Returns the rows this
    rank received, the local expert of each, and the splits the combine inverts."""
    ep = mesh.size()
    counts = torch.bincount(expert_of_row, minlength=num_experts)
    with torch.no_grad():  # row counts per (source rank, local expert): the receiving sizes
        got = wait_tensor(all_to_all_single(counts, None, None, mesh)).view(ep, num_experts // ep)
    send = counts.view(ep, -1).sum(1).tolist()
    recv = got.sum(1).tolist()
    received = all_to_all_single_autograd(rows, recv, send, mesh)
    local = torch.arange(num_experts // ep).repeat(ep)
    local_expert = torch.repeat_interleave(local, got.reshape(-1))
    return received, local_expert, (send, recv)


class ExpertParallelExperts(nn.Module):
    """Stands where the layer's experts module stood: same call
    (tokens, top_k_index, top_k_weights) -> combined output; `local` is the
    model's own experts module holding this rank's experts only."""

    def __init__(self, local: nn.Module, num_experts: int, mesh: DeviceMesh):
        super().__init__()
        self.local, self.num_experts, self.mesh = local, num_experts, mesh

    def forward(self, hidden, top_k_index, top_k_weights):
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x[order // k]  # one row per (token, choice), grouped by expert
        received, local_expert, (send, recv) = _exchange(rows, flat[order], self.num_experts, self.mesh)
        # The model's own experts code on the received rows, one choice each, weight 1:
        # the routing weights are applied after the combine, on the token's own rank
        # (no weights to send, their gradient stays local). transformers' default
        # implementation runs them as one aten._grouped_mm (on CPU too in torch 2.13,
        # seen in the tests; it falls back to a loop over the local experts where
        # strides are not 16-byte aligned); a ModuleList runs the block's own loop.
        ones = torch.ones(received.shape[0], 1, dtype=top_k_weights.dtype, device=received.device)
        out = self.local(received, local_expert[:, None], ones)
        back = all_to_all_single_autograd(out.reshape(-1, shape[-1]), send, recv, self.mesh)
        y = torch.empty_like(back).index_copy(0, order, back).view(tokens, k, -1)
        y = (y * top_k_weights.view(tokens, k, 1).to(y.dtype)).sum(1)
        return y.to(hidden.dtype).reshape(shape)


class _ExpertProxy(nn.Module):
    """One entry of a ModuleList of experts the block loops over itself: the rows the
    loop hands it go to the expert's owner, run there, and come back. Every rank calls
    every proxy in the same order (the all-to-all pair is collective)."""

    def __init__(self, expert: nn.Module | None, index: int, owner: int, mesh: DeviceMesh, where: str):
        super().__init__()
        self.expert, self.index, self.owner, self.mesh, self.where = expert, index, owner, mesh, where

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        ep, me = self.mesh.size(), self.mesh.get_local_rank()
        shape = rows.shape
        flat = rows.reshape(-1, shape[-1])
        # per destination: (rows sent, which expert): a peer in another expert's exchange is a
        # loop that skips experts (the ones not hit) and would pair the wrong rows silently
        counts = torch.tensor([[0, self.index]] * ep, dtype=torch.long)
        counts[self.owner, 0] = flat.shape[0]
        with torch.no_grad():
            got = wait_tensor(all_to_all_single(counts, None, None, self.mesh))
        if (got[:, 1] != self.index).any():
            raise ExpertParallelError(
                f"{self.where}: ranks called different experts ({self.index} here, "
                f"{sorted(set(got[:, 1].tolist()) - {self.index})} on others)",
                hint="call every expert on every rank in the same order: loop over range(num_experts), "
                     "not over the experts this rank's tokens hit")
        send, recv = counts[:, 0].tolist(), got[:, 0].tolist()
        received = all_to_all_single_autograd(flat, recv, send, self.mesh)
        out = self.expert(received) if me == self.owner else received.new_zeros(0, shape[-1])
        # a non-owner sends nothing and has no expert: its output keeps the graph alive
        out = out if me == self.owner else out + received.sum() * 0
        back = all_to_all_single_autograd(out, send, recv, self.mesh)
        return back.reshape(*shape[:-1], back.shape[-1])


def _expert_params(experts: nn.Module, num_experts: int) -> dict:
    return {name: p for name, p in experts.named_parameters(recurse=False)
            if p.dim() >= 2 and p.shape[0] == num_experts}


def _gather_router_logits(router: nn.Module, mesh: DeviceMesh, where: str) -> None:
    """The router's first output (the logits the model records for its load-balancing
    loss, never routed on in these blocks) becomes the whole ep group's, in rank order."""
    forward = router.forward

    def gathered(*args, **kwargs):
        out = forward(*args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise ExpertParallelError(
                f"{where}: the router returns {type(out).__name__}, not (logits, weights, indices)",
                hint="route inside the router module, as transformers' MoE routers do, so its logits "
                     "are only recorded (for the load-balancing loss), never routed on")
        return (all_gather_single_autograd(out[0].contiguous(), 0, mesh),) + out[1:]
    router.forward = gathered


def _router(moe: nn.Module):
    return next((getattr(moe, n) for n in _ROUTER_NAMES if isinstance(getattr(moe, n, None), nn.Module)), None)


def _fused_refusal(moe: nn.Module, experts: nn.Module, where: str) -> ExpertParallelError | None:
    """Why a fused experts module cannot split (None: it can)."""
    num = getattr(experts, "num_experts", None)
    params = _expert_params(experts, num) if num else {}
    if not params or len(params) != len(list(experts.parameters())):
        return ExpertParallelError(
            f"{where}: {type(experts).__name__} keeps no 3-D (experts, ...) weights (DBRX stores its experts "
            f"as 2-D (experts x ffn, hidden) weights viewed per expert, and routes on its router's logits)",
            hint="run this model with ep=1 (its experts replicated, or split by tp)")
    if _router(moe) is None:
        return ExpertParallelError(f"{where}: no router module (`gate` or `router`) beside the experts",
                                   hint="name the router module `gate` or `router`, as transformers does")
    return None


def _split_fused(moe: nn.Module, experts: nn.Module, mesh: DeviceMesh, where: str) -> None:
    refused = _fused_refusal(moe, experts, where)
    if refused is not None:
        raise refused
    num = experts.num_experts
    params = _expert_params(experts, num)
    router = _router(moe)
    lo, hi = _local_range(num, mesh, where)
    for name, p in params.items():
        setattr(experts, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
    experts.num_experts = hi - lo
    _gather_router_logits(router, mesh, where)
    moe.experts = ExpertParallelExperts(experts, num, mesh)


def _split_module_list(moe: nn.Module, experts: nn.ModuleList, mesh: DeviceMesh, where: str) -> None:
    lo, hi = _local_range(len(experts), mesh, where)
    per = hi - lo
    moe.experts = nn.ModuleList(_ExpertProxy(e if lo <= i < hi else None, i, i // per, mesh, where)
                                for i, e in enumerate(experts))


def parallelize_experts(moe: nn.Module, ep_mesh: DeviceMesh, *, where: str = "") -> nn.Module:
    """Split `moe`'s experts (its `experts` child) over the 1-D `ep_mesh`; the router and
    shared experts stay replicated. Returns `moe`, changed in place."""
    where = where or type(moe).__name__
    if ep_mesh.ndim != 1:
        raise ExpertParallelError(f"{where}: expert parallelism takes a 1-D ep mesh, got {ep_mesh.ndim}-D",
                                  hint="pass mesh['ep']")
    experts = getattr(moe, "experts", None)
    if isinstance(experts, nn.ModuleList):
        _split_module_list(moe, experts, ep_mesh, where)
    elif isinstance(experts, nn.Module):
        _split_fused(moe, experts, ep_mesh, where)
    else:
        raise ExpertParallelError(f"{where}: no `experts` module", hint="pass the MoE layer that holds the experts")
    return moe


def expert_parameters(model: nn.Module) -> set:
    """The parameters held by ep-split experts (each on one ep rank only)."""
    found = set()
    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            found |= set(m.local.parameters())
        elif isinstance(m, _ExpertProxy) and m.expert is not None:
            found |= set(m.expert.parameters())
    return found


def reduce_gradients(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """After backward: the replicated parameters' gradients averaged over ep (each ep
    rank saw other samples), the experts' divided by ep (their gradient already sums
    every rank's tokens, each rank's loss a mean over its own samples)."""
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    local = expert_parameters(model)
    for p in model.parameters():
        if p.grad is None:
            continue
        if p not in local:
            dist.all_reduce(p.grad, group=group)
        p.grad.div_(ep)


# -- the Plan's ep (Plan.mesh.ep), as lower() applies it ---------------------------------


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module holding `experts` beside a router: the MoE layers
    as transformers and hand-written models hold them."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "experts", None), nn.Module) and _router(m) is not None
            and not isinstance(m.experts, (ExpertParallelExperts,))]


def ep_refusal(model: nn.Module, ep: int | None) -> str | None:
    """Why `model`'s experts cannot split over `ep` ranks as lowered (one line), or None.
    Asked before any process group, on every rank alike."""
    if not ep or ep == 1:
        return None
    blocks = moe_blocks(model)
    if not blocks:
        return (f"ep {ep}: {type(model).__name__} has no MoE layer (a module holding `experts` beside a "
                f"`gate` / `router`); drop ep")
    refused = moe_refusal(model)
    if refused:
        return refused
    for path, moe in blocks:
        experts = moe.experts
        count = len(experts) if isinstance(experts, nn.ModuleList) else experts.num_experts
        if count % ep:
            return f"ep {ep}: {path} has {count} experts, which do not split over {ep} ranks"
    return None


def moe_refusal(model: nn.Module) -> str | None:
    """Why the MoE layers of `model` cannot split their experts at any ep (DBRX's 2-D
    experts, no router module), or None (also for a model without MoE layers)."""
    for path, moe in moe_blocks(model):
        if not isinstance(moe.experts, nn.ModuleList):
            refused = _fused_refusal(moe, moe.experts, path)
            if refused is not None:
                return str(refused)
    return None


EP_AXES = ("efsdp", "ep")


def ep_meshes(plan, mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
    """(efsdp, ep) 1-D meshes unflattened from the plan's dp axis, ep inner (neighbouring dp
    ranks), as torchtitan's ParallelDims unflattens dp_shard x cp into efsdp x ep
    (DeviceMesh._unflatten, as autopar's HSDP mesh is made). Collective: every rank calls it."""
    m = plan.mesh
    both = mesh._unflatten("dp", (m.efsdp, m.ep), EP_AXES)
    return both["efsdp"], both["ep"]


def split_experts(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Every MoE layer of `model` with its experts split over `ep_mesh`."""
    for path, moe in moe_blocks(model):
        parallelize_experts(moe, ep_mesh, where=path)


def local_expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding this rank's experts (each one FSDP2 unit over efsdp)."""
    out = []
    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            out.append(m.local)
        elif isinstance(m, _ExpertProxy) and m.expert is not None:
            out.append(m.expert)
    return out


def shard_experts(stage: nn.Module, efsdp_mesh: DeviceMesh, plan, mp_policy) -> None:
    """This rank's experts in `stage`, one FSDP2 unit each over efsdp (torchtitan's
    moe_sharding: fully_shard(experts, mesh=efsdp) inside the block's unit over dp). Their
    gradient already sums the ep group's tokens (the all-to-all's backward); FSDP2 sums it
    over efsdp and divides by dp, not efsdp, so it is the mean over the global batch, as
    every dense gradient averaged over dp is (torchtitan sets the same divide factor)."""
    from torch.distributed.fsdp import fully_shard
    reshard = any(c.zero >= 3 for c in plan.layer_choices)
    for module in local_expert_modules(stage):
        unit = fully_shard(module, mesh=efsdp_mesh, reshard_after_forward=reshard,
                           **({"mp_policy": mp_policy} if mp_policy is not None else {}))
        unit.set_gradient_divide_factor(float(plan.mesh.ep_fold_ranks))
        # gloo has no PREMUL_SUM: sum, then divide. Not on one rank: torch 2.13's foreach_reduce
        # divides a one-rank group's gradient by the factor twice there (_fsdp_collectives.py 627, 686)
        if efsdp_mesh.device_type == "cpu" and efsdp_mesh.size() > 1:
            unit.set_force_sum_reduction_for_comms(True)


def whole_experts(state: dict, holders: dict, model: nn.Module, ep_mesh: DeviceMesh) -> dict:
    """`state` (name -> this rank's unsharded tensor) with the ep-split experts whole again:
    a fused weight's slices concatenated over the ep ranks in order, a ModuleList's experts
    collected from their owners. Collective over ep (a checkpoint or export under ep holds
    every expert, as one process's would)."""
    owned = {id(m) for e in local_expert_modules(model) for m in e.modules()}
    fused = {id(m.local) for m in model.modules() if isinstance(m, ExpertParallelExperts)}
    mine = {n: state[n] for n in state if any(id(mod) in owned for mod, _ in holders.get(n, ()))}
    parts = [None] * ep_mesh.size()
    dist.all_gather_object(parts, mine, group=ep_mesh.get_group())
    out = dict(state)
    for name in sorted({n for p in parts for n in p}):
        pieces = [p[name] for p in parts if name in p]
        is_fused = any(id(mod) in fused for mod, _ in holders.get(name, ()))
        out[name] = torch.cat(pieces, 0) if is_fused and len(pieces) > 1 else pieces[0]
    return dict(sorted(out.items()))
