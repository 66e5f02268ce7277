"""ParallelModel: this rank's share of the model, its optimizer and its schedule.

`lower(model, plan, ...)` composes the parallelisms in torchtitan's order,
each from its own file, on one DeviceMesh ("pp", "dp", "tp"):

  0. float8     swap the plan's float8 Linears for torchao's Float8Linear (float8)
  1. pipeline   cut the model into this rank's stage modules (pipeline_parallel)
  2. tensor     parallelize_module on the local blocks, embeddings, head (tensor_parallel)
  3. checkpoint wrap the local layers the plan recomputes (checkpointing)
     compile    torch.compile each local block in place, when asked (compile_blocks)
  4. data       fully_shard per layer + stage root, or replicate (data_parallel)
  5. weights    meta -> local shards + the model's own init (materialize)
  6. tied       weights whose ends sit on different pipeline ranks: one copy (tied_weights)
                per end, gradients all-reduced over the ranks holding them
                (as Megatron does for the word embedding)
  7. optimizer  the user's optimizer class over the local (sharded) parameters
  8. schedule   the plan's pipeline schedule over the local stages
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from autopar.errors import AutoparError, PlanMismatchError
from autopar.lower import (batch_norm, checkpointing, compile_blocks, compression, context_parallel, data_parallel,
                           expert_parallel, float8, grad_norm, loss_scaling, pipeline_parallel, preflight, state_dict,
                           tensor_parallel,
                           tied_weights, weight_reads)
from autopar.lower.materialize import materialize
from autopar.lower.mesh import build_mesh, data_mesh, init_distributed, local_device
from autopar.lower.model_io import TokenWeighedLoss, default_init_fn, resolve_loss_fn
from autopar.lower.model_layers import ModelLayout, resolve
from autopar.lower.tp_styles import is_linear
from autopar.plan import Plan
from autopar.precision import DTYPES, LOW_PRECISION


class LoweringWarning(UserWarning):
    """The lowered program differs from the plan in a way the plan's numbers do not show."""


class ParallelModel:
    """This rank's part of a model compiled from a Plan.

    train_step(inputs, targets) -> float   one optimizer step over the global batch;
                                           returns the global mean loss (same on every rank)
    eval_step(inputs, targets) -> float    the same loss without training (eval mode, no grad)
    max_grad_norm, lr_scheduler,           what train_step does between backward and step:
    before_optimizer_step                  clip by the global norm, hooks(pm), then step
                                           the optimizer and the schedule
    after_optimizer_step                   hooks(pm) after the optimizer's step (float8: the
                                           weights' scales for the next all-gathers)
    clip_grad_norm_(max_norm) -> norm      the global norm over every dp / tp / pp shard
    grad_scaler                            fp16 plans: the dynamic loss scaler (loss_scaling);
                                           last_step_skipped says whether the step overflowed
    full_state_dict() -> {name: tensor}    unsharded parameters (a collective: call on all ranks)
    sharded_state_dict() -> {name: tensor} this rank's shards of parameters, buffers and optimizer
                                           state, layout-free names (autopar.train.snapshot)
    plan, mesh, module, stages, optimizer
    notes                                  where lowering runs something other than the plan says
                                           (e.g. zero 1 under tp/pp runs as zero 2), and which blocks
                                           run compiled or fell back to eager, one sentence each
    compiled_blocks                        compile_blocks.CompiledBlocks, or None when eager
    """

    def __init__(self, *, plan: Plan, mesh, layout: ModelLayout, stages: list[nn.Module], optimizer,
                 loss_fn, schedule, holders: dict, tied_groups: list, local_batch: bool, device,
                 fsdp: bool, replicated: bool = False, loss_parallel: bool = False, buffers: dict | None = None,
                 grad_scaler: loss_scaling.LossScaler | None = None):
        self.plan, self.mesh, self.layout, self.stages = plan, mesh, layout, stages
        self.optimizer, self.loss_fn, self.schedule = optimizer, loss_fn, schedule
        self._holders, self._tied_groups = holders, tied_groups
        self._buffers = buffers or {}  # persistent buffers by first name -> holders (state_dict)
        self.local_batch, self.device, self._fsdp, self._replicated = local_batch, device, fsdp, replicated
        self.loss_parallel = loss_parallel  # logits stay vocab-sharded into the loss
        # Between the backward and the optimizer step (train_step): clipping by the global
        # gradient norm, the user's hooks, then the optimizer and the learning-rate schedule.
        self.max_grad_norm: float | None = None
        self.track_grad_norm = False  # compute last_grad_norm even without clipping (metrics)
        self.last_grad_norm: float | None = None
        self.before_optimizer_step: list = []  # callables(ParallelModel)
        self.after_optimizer_step: list = []  # callables(ParallelModel)
        self.tied_aliases: dict[str, str] = {}  # state_dict name -> the name it is tied to
        self.first_step_s: float | None = None  # compiled blocks: the first step, compiling included
        self.lr_scheduler = None  # stepped after every optimizer step the loss scaler does not skip
        self.grad_scaler = grad_scaler
        self.last_step_skipped = False
        self.notes: list[str] = []
        self.compiled_blocks: compile_blocks.CompiledBlocks | None = None
        self.ep_mesh = None  # expert parallelism's 1-D mesh (lower() sets it under Plan.mesh.ep)
        self.pp_rank = mesh["pp"].get_local_rank()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.tp_rank = mesh["tp"].get_local_rank()
        n_stages = len(plan.stages)
        self.has_first = any(s.stage_index == 0 for s in stages)
        self.has_last = any(s.stage_index == n_stages - 1 for s in stages)
        self._schedules = {plan.num_micro_batches: schedule} if schedule is not None else {}
        self._build_schedule = None  # n -> the pipeline schedule for n micro-batches (lower sets it)
        self._batch_norms: list[str] = []  # BatchNorm paths: micro-batching refused (lower sets it)
        self.cp_mesh = mesh["cp"] if (plan.mesh.cp or 1) > 1 else None  # context parallelism's ring

    @property
    def module(self) -> nn.Module:
        """The (sharded) module; the whole model when the plan has no pipeline."""
        return self.stages[0] if len(self.stages) == 1 else nn.ModuleList(self.stages)

    # -- training ----------------------------------------------------------
    def _local_slice(self, t: torch.Tensor) -> torch.Tensor:
        if self.local_batch or self.plan.mesh.dp == 1:
            return t.to(self.device)
        dp = self.plan.mesh.dp
        if t.shape[0] % dp:
            raise PlanMismatchError(f"global batch of {t.shape[0]} samples does not split over dp={dp} ranks")
        n = t.shape[0] // dp
        return t[self.dp_rank * n:(self.dp_rank + 1) * n].to(self.device)

    def train_step(self, inputs, targets) -> float:
        started = time.perf_counter()
        inputs, targets = self._local_batch(inputs, targets)
        n = self.micro_batches(inputs[0].shape[0])
        self.optimizer.zero_grad(set_to_none=True)
        if self.grad_scaler is not None:
            self.grad_scaler.begin_step(self.device)
        if isinstance(self.loss_fn, TokenWeighedLoss):
            self._weigh_by_tokens(targets, n)
        with self._parallel_regions(), self._sequence_cut(inputs, targets) as (inputs, targets):
            if self.schedule is None:
                local_loss = self._accumulate(inputs, targets, n)
            else:
                losses: list[torch.Tensor] = []
                kwargs = {"target": targets, "losses": losses} if self.has_last else {}
                # return_outputs=False: otherwise the last stage keeps every micro-batch's
                # output (the logits, vocabulary-wide) until the step ends, to merge them
                # for a caller who only needs the losses
                self._schedule_for(n).step(*(inputs if self.has_first else ()), return_outputs=False, **kwargs)
                local_loss = self._pipeline_loss(losses)
        self._sync_tied_grads()
        skip = False
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)  # one all-reduce of the Inf flag over the world
            skip = self.grad_scaler.found_inf(self.optimizer)
        if self.max_grad_norm is not None or self.track_grad_norm:
            self.last_grad_norm = grad_norm.global_grad_norm(self)
            if self.max_grad_norm is not None and not skip:
                grad_norm.clip_grads_(self, self.max_grad_norm, self.last_grad_norm)
        for hook in self.before_optimizer_step:
            hook(self)
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)  # skipped on every rank when any gradient overflowed
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        for hook in self.after_optimizer_step:
            hook(self)
        self.last_step_skipped = skip
        if self.lr_scheduler is not None and not skip:  # as Megatron: a skipped step does not advance the schedule
            self.lr_scheduler.step()
        if self.compiled_blocks is not None and not self.compiled_blocks.agreed:
            # the first step traced and compiled every block kind, forward and backward
            self.first_step_s = time.perf_counter() - started
            self._agree_on_compiled_blocks()
        return self._global_mean(local_loss)

    def eval_step(self, inputs, targets) -> float:
        """The global mean loss of one batch under this layout without training: the
        modules in eval mode (no dropout, BatchNorm's running statistics), no gradients,
        no optimizer step (train.py's --eval-data). Collective, like train_step."""
        inputs, targets = self._local_batch(inputs, targets)
        n = self.micro_batches(inputs[0].shape[0])
        if isinstance(self.loss_fn, TokenWeighedLoss):
            self._weigh_by_tokens(targets, n)
        modes = [(m, m.training) for s in self.stages for m in s.modules()]
        for s in self.stages:
            s.eval()
        try:
            with torch.no_grad(), self._parallel_regions(), self._sequence_cut(inputs, targets) as (inputs, targets):
                if self.schedule is None:
                    chunks, tchunks = [x.tensor_split(n) for x in inputs], targets.tensor_split(n)
                    local_loss = sum(_plain(self.loss_fn(self.stages[0](*(c[i] for c in chunks)), tchunks[i])).float()
                                     for i in range(n)) / n
                else:
                    losses: list[torch.Tensor] = []
                    kwargs = {"target": targets, "losses": losses} if self.has_last else {}
                    self._schedule_for(n).eval(*(inputs if self.has_first else ()), **kwargs)
                    local_loss = self._pipeline_loss(losses)
        finally:
            for m, training in modes:
                m.training = training
        return self._global_mean(local_loss)

    def micro_batches(self, samples: int) -> int:
        """Micro-batches of the plan's size in this rank's `samples`: the plan's count, or
        another where the plan allows it (a run's own --batch-size or --batch-ramp:
        `runtime_batch_refusal`). The micro-batch itself never changes: its memory is priced."""
        mb = self.plan.micro_batch_size
        if samples % mb:
            raise PlanMismatchError(
                f"this rank's batch of {samples} samples is not a whole number of the plan's micro-batches "
                f"of {mb}", hint=f"feed global batches that are multiples of {mb * self.plan.mesh.dp} "
                                 f"(micro-batch x dp), or re-plan")
        n = samples // mb
        if n != self.plan.num_micro_batches:
            why = runtime_batch_refusal(self.plan, n, self._batch_norms)
            if why:
                raise PlanMismatchError(why, hint=f"feed global batches of {self.plan.global_batch_size} "
                                                  "samples, or re-plan for this batch (autopar compile --batch-size)")
        return n

    def _schedule_for(self, n: int):
        """The pipeline schedule running `n` micro-batches a step (the plan's is built by
        lower; others on first use, every rank at the same step)."""
        if n not in self._schedules:
            self._schedules[n] = self._build_schedule(n)
        return self._schedules[n]

    def _local_batch(self, inputs, targets) -> tuple[tuple, torch.Tensor]:
        """This rank's share of a global batch (or the batch as given, with local_batch)."""
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return tuple(self._local_slice(x) for x in inputs), self._local_slice(targets)

    def _parallel_regions(self):
        """What the model's forward runs under: tp's loss-parallel head and tp region."""
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        if self.plan.mesh.tp > 1:
            stack.enter_context(tensor_parallel.tp_region())
        return stack

    def _sequence_cut(self, inputs, targets):
        """This rank's share of every sequence under context parallelism, ring attention
        on (lower/context_parallel.py), or the batch as it is."""
        if self.cp_mesh is None:
            return contextlib.nullcontext((inputs, targets))
        return context_parallel.step_shard(self.stages[0].model, self.cp_mesh, inputs, targets, self.loss_fn)

    def _pipeline_loss(self, losses: list) -> torch.Tensor | None:
        """The last stage's mean micro-batch loss (None elsewhere), unscaled (fp16: the
        schedule's loss function scales it by a power of two, so this is exact)."""
        if not self.has_last:
            return None
        loss = torch.stack([_plain(l).float() for l in losses]).mean()
        return loss / self.grad_scaler.current if self.grad_scaler is not None else loss

    def _agree_on_compiled_blocks(self) -> None:
        """After the first step every block has met its compiled code: the ranks
        share which fell back to eager, all run those eager, rank 0 logs why."""
        fell_back = self.compiled_blocks.agree()  # collective, once, on every rank
        self.notes.extend(fell_back)
        if dist.get_rank() == 0:
            for note in fell_back:
                warnings.warn(note, LoweringWarning, stacklevel=3)

    def parameters(self):
        """This rank's parameters (shards and local copies), each once."""
        return _unique_parameters(self.stages)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global norm (every dp / tp / pp shard); returns the norm before.
        Collective. train_step does it itself when `max_grad_norm` is set."""
        norm = grad_norm.global_grad_norm(self)
        grad_norm.clip_grads_(self, max_norm, norm)
        return norm

    def _weigh_by_tokens(self, targets: torch.Tensor, n: int) -> None:
        """Global count of scored tokens (summed over dp: with local_batch the
        ranks' slices differ), shared by the step's micro-batches x dp ranks."""
        count = self.loss_fn.scored_tokens(targets).reshape(1).to(torch.float64)
        if self.plan.mesh.dp > 1:
            count = count.to(self.device)
            dist.all_reduce(count, group=self.mesh["dp"].get_group())
        shares = n * self.plan.mesh.dp * (self.plan.mesh.cp or 1)  # cp ranks score their own tokens
        self.loss_fn.tokens_per_share = max(float(count.item()), 1.0) / shares

    def _accumulate(self, inputs, targets, n: int) -> torch.Tensor:
        chunks = [x.tensor_split(n) for x in inputs]
        tchunks = targets.tensor_split(n)
        stage = self.stages[0]
        total = torch.zeros((), device=self.device)
        # DDP (replicate), and FSDP2 on one rank, reduce whole gradients once, after the last
        # micro-batch. FSDP2 over dp ranks reduce-scatters every micro-batch's (as torchtitan):
        # with sync off it would hold every unit's unsharded gradient until the last backward,
        # memory the plan does not book (Layout.grads_reduced_per_micro_batch, priced m times;
        # benchmarks/memory_lowered.py measured it)
        once = self._replicated or (self._fsdp and self.plan.mesh.dp * (self.plan.mesh.cp or 1) == 1)
        for i in range(n):
            if once:
                stage.set_requires_gradient_sync(i == n - 1)
            elif self.plan.mesh.hsdp:  # HSDP: the shards cross replicas once, summed (priced once per step)
                stage.set_requires_all_reduce(i == n - 1)
            loss = self.loss_fn(stage(*(c[i] for c in chunks)), tchunks[i])
            scaled = loss if self.grad_scaler is None else self.grad_scaler.scale_loss(loss)
            (scaled / n).backward()
            total += _plain(loss).float()
        return total / n

    def _global_mean(self, local_loss) -> float:
        # Only one rank per (dp) replica contributes: last pipeline rank, tp rank 0.
        contributes = self.has_last and self.tp_rank == 0 and local_loss is not None
        t = local_loss.reshape(1).clone() if contributes else torch.zeros(1, device=self.device)
        dist.all_reduce(t)
        return float(t.item() / (self.plan.mesh.dp * (self.plan.mesh.cp or 1)))

    def _sync_tied_grads(self) -> None:
        tied_weights.sync_grads(self._tied_groups)

    # -- state -------------------------------------------------------------
    def _local_params(self) -> dict[str, torch.Tensor]:
        return state_dict.local_tensors(self, self._holders)

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, persistent buffers and optimizer state under the
        user's names, sharded as this plan holds them (DTensor shards or whole
        tensors): what torch.distributed.checkpoint saves and reshards on load
        under any other plan (autopar.train.snapshot)."""
        return state_dict.for_dcp({**state_dict.model_tensors(self), **state_dict.optimizer_tensors(self)})[0]

    def full_state_dict(self, buffers: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded parameters under the user's names (tied weights once), and the
        persistent buffers with `buffers=True` (an export for inference). Collective."""
        mine = {}
        # 2-D (FSDP x TP) gathers warn that they take two all-gathers; expected here.
        quiet = logging.getLogger("torch.distributed.tensor._redistribute")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            local = self._local_params()
            if buffers:
                local.update(state_dict.local_tensors(self, self._buffers))
            for name, p in local.items():
                t = state_dict.full_tensor(p)
                mine[name] = t.detach().to("cpu", copy=True)
        finally:
            quiet.setLevel(level)
        if self.ep_mesh is not None:  # every expert whole, not this rank's experts / ep
            mine = expert_parallel.whole_experts(mine, self._holders, self.module, self.ep_mesh)
        if self.plan.mesh.pp == 1:
            return mine
        gathered = [None] * self.plan.mesh.pp
        dist.all_gather_object(gathered, mine, group=self.mesh["pp"].get_group())
        full = {}
        for part in gathered:
            for k, v in part.items():
                full.setdefault(k, v)
        return dict(sorted(full.items()))

    def local_parameter_bytes(self) -> int:
        """Bytes of parameter storage this rank holds (its shards only)."""
        seen, total = set(), 0
        for s in self.stages:
            for p in s.parameters():
                t = p._local_tensor if isinstance(p, DTensor) else p
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total


def runtime_batch_refusal(plan: Plan, n: int, batch_norms: list[str] = ()) -> str | None:
    """Why the plan's layout cannot run `n` micro-batches a step instead of its own count
    (None: it can; the micro-batch, whose memory is priced, stays the plan's):
    BatchNorm normalises over each micro-batch; GPipe holds every micro-batch's
    activations (more than planned do not fit as priced); a pipeline needs at least pp,
    and torch's interleaved schedule a multiple of pp."""
    pp, planned = plan.mesh.pp, plan.num_micro_batches
    if n < 1:
        return f"{n} micro-batches a step: a step needs at least one"
    if batch_norms and n > 1:
        return (f"the model normalises by batch statistics ({batch_norms[0]!r}): {n} micro-batches a step would "
                f"each normalise alone, where the plan runs one")
    if pp > 1 and plan.schedule == "gpipe" and n > planned:
        return (f"the plan's GPipe schedule holds every micro-batch's activations: {n} micro-batches a step need "
                f"more memory than the {planned} it was priced with")
    if pp > 1 and n < pp:
        return f"a pipeline of pp={pp} needs at least {pp} micro-batches a step, not {n}"
    if pp > 1 and plan.schedule == "interleaved" and n % pp:
        return f"the interleaved schedule runs micro-batches in rounds of pp={pp}: {n} is not a multiple"
    return None


def _unique_parameters(stages):
    """The parameters of this rank's stage modules, each once (a stage may share one)."""
    seen = set()
    for s in stages:
        for p in s.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor of a loss (a replicated DTensor under loss_parallel)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _try_loss_parallel(model, layout, tp_layers, tp_mesh, loss_fn, example_inputs, plan) -> bool:
    """Vocab-sharded logits into the loss when the head is one vocab-split
    Linear and the user's loss runs correctly under `loss_parallel`."""
    heads = [m for l in tp_layers if l.position == "post" for p in l.paths
             for m in model.get_submodule(p).modules() if is_linear(m)]
    if len(heads) != 1:
        return False
    vocab = heads[0].out_features if isinstance(heads[0], nn.Linear) else heads[0].nf  # Conv1D: nf outputs
    tokens = _example_args(example_inputs, 1)[0]
    return tensor_parallel.loss_parallel_works(loss_fn, tp_mesh, (1, *tokens.shape[1:], vocab))


def _example_args(example_inputs, batch: int) -> tuple:
    args = example_inputs(batch) if callable(example_inputs) else example_inputs
    return tuple(args) if isinstance(args, (tuple, list)) else (args,)


def _check_example_inputs(example_inputs) -> None:
    """Lowering feeds the model positional tensors (what train_step gets);
    capture also accepts a trailing dict of keywords, which cannot be split
    into micro-batches or sent between stages: say so instead of failing deep."""
    try:
        args = _example_args(example_inputs, 1)
    except Exception as exc:
        raise AutoparError(f"example_inputs(1) failed: {type(exc).__name__}: {exc}",
                           hint="example_inputs is a tuple of tensors for one micro-batch, or batch_size -> tuple")
    bad = [f"#{i} ({type(a).__name__})" for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
    if bad or not args:
        raise AutoparError(
            f"example_inputs must be positional tensors (what train_step(inputs, targets) feeds the model); "
            f"got {', '.join(bad) or 'nothing'}",
            hint="pass e.g. (input_ids,) or (input_ids, attention_mask); labels go to train_step as targets, "
                 "and keyword options such as use_cache=False are set by autopar")


def _dummy_inputs_fn(example_inputs, device):
    template = _example_args(example_inputs, 1)

    def make(batch: int) -> tuple:
        return tuple(torch.zeros((batch, *t.shape[1:]), dtype=t.dtype, device=device) for t in template)
    return make


def lower(model: nn.Module, plan: Plan, *, example_inputs, loss_fn, optimizer=torch.optim.AdamW,
          optimizer_kwargs=None, init_fn=None, local_batch: bool = False,
          no_weight_decay_1d: bool = False, torch_compile=False, torch_compile_backend: str = "inductor",
          torch_compile_mode: str | None = None) -> ParallelModel:
    # One piece (~95 lines) on purpose: the numbered steps of the module
    # docstring in their order, each a call into its own file, as torchtitan's
    # parallelize reads; the order is the thing a reader checks here.
    loss_fn = resolve_loss_fn(model, loss_fn)  # the user's, or a Hugging Face model's own
    compiling = compile_blocks.wanted(torch_compile, local_device())  # a bad value fails before any group
    _check_example_inputs(example_inputs)
    if init_fn is None:
        init_fn = default_init_fn(model)  # meta Hugging Face models: their own _init_weights
    # 0. float8 Linears swapped in first, as torchtitan converts before it parallelizes
    float8.convert(model, plan)
    # Every check that needs no process group runs first: ranks fail together
    # with a message instead of some of them waiting in a collective.
    layout = resolve(model, plan)
    pp, tp = plan.mesh.pp, plan.mesh.tp
    n_stages = len(plan.stages)
    preflight.check_plan(model, plan, layout)
    context_parallel.check_plan(model, plan, example_inputs)
    init_distributed()
    mesh = build_mesh(plan)  # checks the world size before creating any group
    device = local_device()
    pp_rank = mesh["pp"].get_local_rank()
    local = sorted(st.index for st in plan.stages if st.pp_rank == pp_rank)
    holders = weight_reads.param_holders(model)
    buffers = state_dict.buffer_holders(model)
    aliases = state_dict.tied_aliases(model)  # before tp / FSDP swap the tensors

    tp_layers = [l for l in layout.layers if l.stage in local and l.choice.tp_style != "replicate"]
    found = preflight.probe(model, plan, layout, _example_args(example_inputs, plan.micro_batch_size), mesh,
                            holders)
    unverified = found.unverified

    # BatchNorm over the global batch (after the fake-tensor probes above: they run no collective)
    if plan.mesh.dp > 1:
        batch_norm.synchronise(model, mesh["dp"].get_group(), device)

    # 0b. expert parallelism: each MoE layer's experts split over the ep mesh (from dp)
    efsdp_mesh = ep_mesh = None
    if (plan.mesh.ep or 1) > 1:
        efsdp_mesh, ep_mesh = expert_parallel.ep_meshes(plan, mesh)
        expert_parallel.split_experts(model, ep_mesh)

    # 1. pipeline stage modules (views over the model)
    dummy = _dummy_inputs_fn(example_inputs, device)
    returns = {i: bp.returns for i, bp in found.block_plans.items()}
    stages = [pipeline_parallel.StageModule(model, layout, i, n_stages, dummy, returns, found.pre_outputs,
                                            plan.micro_batch_size) for i in local]

    # 2. tensor parallel
    tp_mesh = mesh["tp"]
    use_loss_parallel = tp > 1 and _apply_tp(model, plan, layout, tp_layers, found, tp_mesh, loss_fn,
                                             example_inputs)
    float8.check_runs(model, plan)

    # Tied weights: re-tie the ends that share this rank (parallelize_module
    # swaps in new Parameter objects); ends on other pp ranks sync gradients.
    local_modules = {id(m) for s in stages for m in s.modules()}
    tied_local, tied_remote = tied_weights.retie_local(model, holders, local_modules, tp_mesh if tp > 1 else None)

    # 3. activation checkpointing, 4. data parallel
    for s in stages:
        checkpointing.apply_checkpointing(s.model, layout, {s.stage_index})
    # 3b. compiled blocks: after tp and checkpointing, before FSDP2 (torchtitan's order)
    compiled = None
    if compiling:
        compiled = compile_blocks.CompiledBlocks(torch_compile_backend, torch_compile_mode,
                                                 own_cache=tp > 1 and plan.mesh.dp * pp > 1)
        compiled.apply(stages, layout)
    fsdp, replicated = _apply_data_parallel(plan, layout, stages, mesh, tied_local | found.read_outside, efsdp_mesh)

    # 5. weights
    was_meta = materialize(stages, device, init_fn, model=model)

    # 6. tied ends on different pipeline ranks
    tied_groups = tied_weights.groups(mesh, plan, layout, model, tied_remote, local_modules, was_meta)

    # 7. optimizer over the unique local parameters
    opt = _optimizer(stages, optimizer, optimizer_kwargs, no_weight_decay_1d, plan, mesh, replicated)

    # 8. loss scaling (fp16) and schedule
    scaler = loss_scaling.LossScaler(device.type) if plan.precision == "fp16" else None
    schedule = build_schedule = None
    if pp > 1:
        def build_schedule(n: int):
            return pipeline_parallel.build_schedule(
                plan, stages, mesh["pp"].get_group(), device,
                loss_fn if scaler is None else loss_scaling.ScaledLoss(loss_fn, scaler), num_micro_batches=n)
        schedule = build_schedule(plan.num_micro_batches)
    pm = ParallelModel(plan=plan, mesh=mesh, layout=layout, stages=stages, optimizer=opt, loss_fn=loss_fn,
                       schedule=schedule, holders=holders, tied_groups=tied_groups, local_batch=local_batch,
                       device=device, fsdp=fsdp, replicated=replicated, loss_parallel=use_loss_parallel,
                       buffers=buffers, grad_scaler=scaler)
    pm.notes = (data_parallel.zero_substitutions(plan) + checkpointing.not_recomputed(layout) + unverified
                + compile_blocks.priced_otherwise(plan, compiling))
    pm.compiled_blocks = compiled
    pm.ep_mesh = ep_mesh
    pm._build_schedule, pm._batch_norms = build_schedule, batch_norm.batch_norms(model)
    pm.tied_aliases = aliases
    if float8.gathers_in_float8(plan):
        pm.after_optimizer_step.append(float8.precompute_scales)
    compile_note = [compiled.start_note()] if compiled is not None else []
    if dist.get_rank() == 0:  # once per job, not once per GPU
        for note in pm.notes:
            warnings.warn(note, LoweringWarning, stacklevel=3)
    pm.notes += compile_note  # what runs compiled: said, not warned (nothing differs from the plan)
    return pm


def _apply_tp(model, plan, layout, tp_layers, found, tp_mesh, loss_fn, example_inputs) -> bool:
    """This rank's layers split over tp (blocks by their probed plans, embeddings and
    heads over the vocabulary); True when the logits stay vocab-sharded into the loss."""
    use_loss_parallel = not found.whole and _try_loss_parallel(model, layout, tp_layers, tp_mesh, loss_fn,
                                                               example_inputs, plan)
    for l in tp_layers:
        if l.position == "block":
            first, last = layout.first_last(l)
            tensor_parallel.parallelize_block(
                model.get_submodule(l.paths[0]), found.block_plans[l.block_index], tp_mesh,
                sequence_parallel=preflight.sequence_parallel(plan, l), first=first, last=last)
        else:
            for p in l.paths:
                tensor_parallel.parallelize_vocab(model.get_submodule(p), tp_mesh, position=l.position,
                                                  loss_parallel=use_loss_parallel, whole=found.whole)
    return use_loss_parallel


def _apply_data_parallel(plan, layout, stages, mesh, tied_local, efsdp_mesh=None) -> tuple[bool, bool]:
    """DDP-style replication or FSDP2 over the dp mesh (also for ZeRO, offload or
    mixed precision on one rank), the experts over efsdp under ep; else autocast for low
    precision. (fsdp, replicated)."""
    fsdp = replicated = False
    if data_parallel.wraps(plan):
        compressed = compression.reduce_dtype(plan)  # Plan.grad_reduce_dtype
        if data_parallel.uses_replicate(plan):
            data_parallel.apply_replicate(stages[0], data_mesh(plan, mesh), compressed)
            replicated = True
        else:
            dp_mesh = data_parallel.fsdp_mesh(plan, mesh)  # under HSDP the 2-D (replicate, shard) mesh
            for s in stages:
                if efsdp_mesh is not None:  # ep: the experts' own units first (innermost)
                    expert_parallel.shard_experts(s, efsdp_mesh, plan, data_parallel.mixed_precision(
                        plan.precision, data_parallel.main_grads(plan)))
                data_parallel.apply_fsdp(s, layout, s.stage_index, dp_mesh, plan.precision, tied_local,
                                         data_parallel.main_grads(plan), compressed)
            fsdp = True
    if not fsdp and plan.precision in LOW_PRECISION:
        for s in stages:
            s.autocast_dtype = DTYPES[plan.precision]
    return fsdp, replicated


def _optimizer(stages, optimizer, optimizer_kwargs, no_weight_decay_1d, plan, mesh, replicated):
    params = list(_unique_parameters(stages))
    kwargs = dict(optimizer_kwargs or {})
    if any(isinstance(p, DTensor) for p in params) and not all(isinstance(p, DTensor) for p in params):
        # torch's foreach kernels reject a list mixing DTensor and plain tensors.
        kwargs.setdefault("foreach", False)
    if no_weight_decay_1d and kwargs.get("weight_decay"):
        # Biases and norm gains (every tensor of fewer than 2 dims; a DTensor shard
        # keeps its global dims) are not decayed, as GPT-2/3, Llama and nanoGPT train.
        params = [g for g in ({"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}) if g["params"]]
    if replicated and any(c.zero == 1 for c in plan.layer_choices):
        return data_parallel.zero_redundancy_optimizer(params, optimizer, kwargs, data_mesh(plan, mesh))
    return optimizer(params, **kwargs)
