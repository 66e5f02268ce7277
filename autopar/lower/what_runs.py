"""Plan only what runs: which layouts this lowering can run for a model,
found before the planner offers them (issue 12).

The planner prices layouts; this file asks the lowering whether it can run
them, so a plan never names a layout that crashes at its first step. Two
questions, both answered without real memory or a real process group:

* pipeline: the refusals lowering makes before any collective
  (`pipeline_parallel.check_stand_ins`, `check_block_outputs`: two block
  stacks, blocks returning more than their activation, parameters held by
  no module of a pre/post layer, a pre-block module whose output is not one
  tensor) are run on the model alone;
* tensor / sequence parallelism at each tp degree: one block of each
  distinct kind (class and parameter shapes) is split exactly as lowering
  splits it (`tensor_parallel.parallelize_block`) over a fake process group
  of tp ranks (torch's "fake" backend: collectives do nothing), and runs
  one forward and backward on fake tensors (FakeTensorMode) with the inputs
  the model's own forward gives it. Whatever DTensor cannot propagate (an
  op without a sharding rule, a view across a sharded dim, mixed plain and
  distributed tensors) raises here instead of on a cluster.

The answer is a plain dict the planner reads (`ModelGraph.lowering_limits`),
with the reason for each layout it rules out:
    {"checked": True, "pipeline": reason | None,
     "tp": {"2": reason, ...}, "sequence_parallel": {"2": reason, ...},
     "unverified": [what the fake run could not decide],
     "tp_checked": [the tp degrees tried: those the planner's cluster can use],
     "runs_whole": {embedding / head layer: why tp leaves it whole},
     "hsdp": reason, only where this torch cannot run HSDP (data_parallel.hsdp_refusal),
     "compression": reason, only where this torch cannot reduce in bf16 (compression.refusal),
     "ep": reason, only where the model's MoE layers cannot split their experts (DBRX:
           expert_parallel.moe_refusal),
     "cp": why context parallelism cannot cut this model's sequences, only where it
           cannot (context_parallel.model_refusal; cp runs at pp 1 without HSDP)}
Fake tensors have no values, so a step that reads one (`.item()`) cannot
be decided here; such a layout is not offered either (the reason says so,
and "unverified" lists it), while a hand-made plan that asks for it is
lowered (the lowering matrix, benchmarks/lowering_matrix, runs layouts for
real). DTensor's own index arithmetic for strided shards runs on real
tensors during the check (`_index_math_on_real_tensors`).

The fake process group never replaces a real one: the check runs alike in
a process without a process group (`autopar plan`) and inside torchrun,
where `autopar.compile(plan=None)` plans on rank 0 of a real gloo / nccl
world, and gives the same answer (`fake_tp_mesh`). It issues no real
collective: DTensor's run on fake tensors, whose collectives do nothing.
"""
from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.capture.value_answers import ValueAnswers
from autopar.errors import AutoparError, ModelOutputError, PlanMismatchError
from autopar.lower.fake_mesh import fake_tp_mesh
from autopar.lower.model_io import fake_attempts, on_model_device, probe_forward

_UNDECIDABLE = ("DataDependentOutputException", "GuardOnDataDependentSymNode")


def _first_line(exc: BaseException) -> str:
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    if len(text) > 1 and len(text[0]) < 40:
        # DTensor's "aten.nonzero.default" then "Sharding propagation failed for ...": the why is on line 2
        text = [f"{text[0]}: {text[1]}"]
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


first_line = _first_line  # public: the lowering words its own refusals alike


def _fake_on(t: torch.Tensor, device) -> torch.Tensor:
    """A tensor of `t`'s shape, strides, dtype and grad flag on `device` (fake under FakeTensorMode)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).requires_grad_(t.requires_grad)


def _empty_copy(block: nn.Module, device) -> nn.Module:
    """The block with empty parameters and buffers on `device` (fake tensors
    when called under FakeTensorMode): real weights are never copied."""
    memo = {}
    for t in list(block.parameters()) + list(block.buffers()):
        empty = torch.empty(t.shape, dtype=t.dtype, device=device)
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(block, memo)


def _signature(block: nn.Module) -> tuple:
    return (type(block).__qualname__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))


@contextlib.contextmanager
def _index_math_on_real_tensors():
    """DTensor's `_StridedShard` (a head-split tensor reshaped across a
    sequence shard) computes which rows a rank holds from an `arange` and
    `.tolist()`: index arithmetic on sizes, not on data, which fake tensors
    cannot answer. Run it on real tensors while verifying; without it those
    layouts could only be called undecided."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # another torch: the layouts stay undecided
        yield
        return
    original = _StridedShard.__dict__.get("local_shard_size_and_offset")
    if original is None:
        yield
        return

    def on_real_tensors(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)
    _StridedShard.local_shard_size_and_offset = on_real_tensors
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


def _run_split_block(block, block_plan, inputs, mesh, sequence_parallel: bool, ends: bool = True,
                     collectives: list | None = None) -> bool:
    """parallelize_block on an empty copy, then forward + backward on fake tensors;
    the collectives it issued are appended to `collectives` (see `_Collectives`).

    In the block's own dtypes and without capture's bf16 stand-in for
    meta kernels that refuse fp32: DTensor's sharding propagation runs those
    same meta kernels in the real step (a `_grouped_mm` on fp32 DTensors
    fails there, so it must fail here). MoE experts the lowering splits run
    on local tensors instead, as in the real step; only their local run is
    in bf16 here (tp_experts._low: values are not read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten, tree_map_only

    from autopar.lower import tensor_parallel

    args, kwargs = inputs
    device = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
    with FakeTensorMode(allow_non_fake_inputs=True), _index_math_on_real_tensors():
        if (device is None or device.type == "meta") and mesh.device_type == "cpu":
            # A meta-built model (the CLI's) runs on fake CPU tensors as a CPU-built one does:
            # DTensor on meta tensors let through what fails there (T5's attention output,
            # viewed across its head split), so the CLI offered a split the check refuses
            # to the same model built on the CPU. (A GPU mesh keeps meta tensors: DTensor
            # would move CPU weights to the mesh's device, away from the inputs.)
            device = torch.device("cpu")
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _fake_on(t, device) if t.is_meta else t,
                                         (args, kwargs))
        blk = _empty_copy(block, device or "cpu")
        if sequence_parallel and not ends:
            # A block inside its stack receives the previous block's sequence
            # shard (dim 1) and hands on its own: give it this rank's shard.
            args, kwargs = _local_sequence_shard(args, kwargs, block_plan.main_argument, mesh)
        # ends=True: the block scatters its activation into sequence shards on
        # entry and gathers it on exit (the first and last block of a stack).
        tensor_parallel.parallelize_block(blk, block_plan, mesh, sequence_parallel=sequence_parallel,
                                          first=ends, last=ends)
        seen = _Collectives() if collectives is not None else None  # the lowering's own check counts nothing
        with tensor_parallel.tp_region(), seen if seen is not None else contextlib.nullcontext():
            out = blk(*args, **kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().sum().backward()
        if seen is not None:
            collectives += seen.seen
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements) for p in blk.parameters())


# torch's functional collectives (what DTensor issues) -> nccl-tests' names
_COLLECTIVE_KINDS = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
                     "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
                     "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
                     "all_to_all_single": "all_to_all"}


class _Collectives(TorchDispatchMode):
    """The collectives a split block issues, as (kind, bytes, 'fwd' | 'bwd'),
    bytes in nccl-tests' convention (an all-gather's gathered output, a
    reduce-scatter's input). A DTensor op is handed back unhandled, as
    torch's CommDebugMode does, so that DTensor desugars it and this mode
    sees the local collectives it becomes, redistributions included."""

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        kind = _COLLECTIVE_KINDS.get(getattr(packet, "__name__", "")) if func.namespace == "_c10d_functional" \
            else None
        if kind is not None:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if kind == "all_gather":
                nbytes *= int(args[1])  # (inputs, group_size, group_name): the gathered size
            phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
            self.seen.append((kind, nbytes, phase))
        return out


def record_blocks(model, blocks: dict[int, nn.Module], example_args, model_kwargs, outputs_of=None):
    """(block plans, {index: (args, kwargs)} each block was called with, pre outputs) from one fake forward.
    A model built on the meta device (the CLI's, or one lowered before materialisation)
    runs on meta copies of the inputs: fake tensors keep each tensor's device, and a
    meta weight meeting a CPU input is a device mismatch, not a verdict on the layout."""
    from autopar.lower import tensor_parallel

    example_args = on_model_device(model, example_args)
    seen, hooks = {}, []

    def keep(i):
        def hook(module, args, kwargs):
            seen.setdefault(i, (args, kwargs))  # the first call (a block reused in a loop: its first input)
        return hook
    for i, b in blocks.items():
        hooks.append(b.register_forward_pre_hook(keep(i), with_kwargs=True))
    def probe(share, fake):
        outputs, answers = {}, ValueAnswers(share)
        with probe_forward(model, fake=False):  # probe_blocks enters its own FakeTensorMode
            plans = tensor_parallel.probe_blocks(model, blocks, example_args, model_kwargs, outputs_of=outputs_of,
                                                 outputs=outputs, answers=answers, fake=fake)
        return plans, outputs, answers.answered
    try:
        for fake in fake_attempts(model):  # a meta-built model: meta tensors first
            seen.clear()
            try:
                plans, outputs, answered = probe(0.5, fake)
                break
            except (PlanMismatchError, ModelOutputError):
                raise
            except Exception:  # noqa: BLE001 - on meta only: the fake run gives the answer
                if fake:
                    raise
        if answered:
            # Value-sized ops were answered (an expert loop's nonzero): what the
            # probe records must not depend on the answer, or it describes no real step.
            again, outputs_again, _ = probe(0.25, True)
            _same_shapes(plans, outputs, again, outputs_again)
    finally:
        for h in hooks:
            h.remove()
    return plans, seen, outputs


def _same_shapes(plans, outputs, again, outputs_again) -> None:
    for i, p in plans.items():
        if (p.activation_shape, p.returns) != (again[i].activation_shape, again[i].returns):
            raise PlanMismatchError(
                f"block {i}'s activation or outputs are sized by tensor values (nonzero / boolean-mask "
                f"indexing: {p.activation_shape} or {again[i].activation_shape}), which a pipeline or tp "
                f"split cannot plan for",
                hint="plan with data parallelism / ZeRO only, or give the layer fixed shapes (a capacity)")
    for path, out in outputs.items():
        if outputs_again.get(path) != out:
            raise PlanMismatchError(
                f"module {path!r} returns a tensor sized by tensor values (nonzero / boolean-mask indexing: "
                f"{out} or {outputs_again.get(path)}), which pipeline stages cannot be cut around",
                hint="plan with data parallelism / ZeRO only, or give the layer fixed shapes (a capacity)")


def pipeline_failure(model: nn.Module, layout, num_stages: int, example_args: tuple, returns: dict,
                     pre_outputs: dict, probe_batch: int) -> str | None:
    """Every stage's forward, chained as the schedule chains them, on fake
    tensors: stage i runs the user's forward on its view of the model (stand-
    ins for other stages' blocks and pre-block modules) and hands its output
    to stage i + 1. Glue code that reads something a stand-in cannot give
    (an attribute, a second output) fails here, on every rank alike, instead
    of on one rank while the others wait in the schedule. None: it runs.
    A meta-built model runs on meta tensors first (what fake tensors of meta
    weights compute, without FakeTensorMode's dispatch); only a failure there
    is run again on fake tensors, whose failure is the answer."""
    for fake in fake_attempts(model):
        try:
            _chain_stages(model, layout, num_stages, example_args, returns, pre_outputs, probe_batch, fake)
            return None
        except (PlanMismatchError, ModelOutputError):  # not a pipeline's failure: the model's own
            raise
        except Exception as exc:  # noqa: BLE001 - any failure on fake tensors is the answer
            if fake:
                where = getattr(exc, "stage", "?")
                return f"pipeline stage {where} of {num_stages} fails on its stand-ins: {_first_line(exc)}"
    return None


def _chain_stages(model, layout, num_stages, example_args, returns, pre_outputs, probe_batch, fake: bool) -> None:
    """pipeline_failure's forwards; an exception carries the stage it failed in (`.stage`)."""
    from autopar.lower.pipeline_parallel import StageModule

    stages, i = [], 0
    # A meta-device model (planning, or lowering before materialisation) runs on meta inputs:
    # stand-ins make their zeros on the device of what they are given.
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    try:
        with probe_forward(model, fake=fake):
            def dummy(batch):
                return tuple(torch.zeros((batch, *t.shape[1:]), dtype=t.dtype, device=device) for t in example_args)
            x = on_model_device(model, example_args)
            for i in range(num_stages):
                stages.append(StageModule(model, layout, i, num_stages, dummy, returns, pre_outputs, probe_batch))
                out = stages[-1](*x)
                x = out if isinstance(out, tuple) else (out,)
    except Exception as exc:
        try:
            exc.stage = i
        except AttributeError:  # an exception type without a __dict__
            pass
        raise
    finally:
        for st in stages:
            st.release()


def block_failures(model: nn.Module, blocks: dict[int, nn.Module], example_args: tuple, model_kwargs: dict,
                   tp: int, sequence_parallel: bool, *, recorded=None, mesh=None,
                   allow_replicated: bool = False, collectives: dict | None = None
                   ) -> tuple[dict[int, str], list[str]]:
    """Blocks (index -> reason) that cannot run split over `tp` ranks, and
    what could not be decided. One block per distinct signature is run; the
    others share its answer. A block that runs but splits nothing counts as
    failing unless `allow_replicated` (the lowering of a hand-made plan: it
    computes the right function, only without the planned split). With no
    `mesh` a fake process group of tp ranks
    is made (planning); lowering passes its real tp mesh: under
    FakeTensorMode DTensor's collectives move no data, and every rank runs
    every signature, so all ranks reach the same answer. `collectives`, when
    given, receives {index: [(kind, bytes, phase), ...]} for the blocks that run
    split: what DTensor issued for one micro-batch of the example's size."""
    from autopar.lower import tensor_parallel

    if recorded is None:
        recorded = record_blocks(model, blocks, example_args, model_kwargs)[:2]
    plans, inputs = recorded
    failures, undecided, by_sig = {}, [], {}
    tensor_parallel.register_cpu_attention_sharding()
    with (contextlib.nullcontext(mesh) if mesh is not None else fake_tp_mesh(tp)) as mesh:
        for i, block in sorted(blocks.items()):
            sig = _signature(block)
            if sig not in by_sig:
                issued: list = []
                by_sig[sig] = (*_try(block, plans[i], inputs.get(i), mesh, sequence_parallel, issued,
                                     drop_failing=allow_replicated), issued, i)
            status, why, issued, first = by_sig[sig]
            if not plans[first].colwise:  # dropped by _try: alike for every block of the signature
                plans[i].colwise, plans[i].rowwise, plans[i].rowwise_whole = [], [], []
            if status == "runs" and collectives is not None:
                collectives[i] = issued
            if status == "fails" or status == "replicated" and not allow_replicated:
                failures[i] = why
            elif status == "undecided" and why not in undecided:
                undecided.append(why)
    return failures, undecided


def _local_sequence_shard(args, kwargs, where, mesh):
    n, i = mesh.size(), mesh.get_local_rank()
    if isinstance(where, int):
        args = tuple(a.tensor_split(n, dim=1)[i] if k == where else a for k, a in enumerate(args))
    else:
        kwargs = {k: (v.tensor_split(n, dim=1)[i] if k == where else v) for k, v in kwargs.items()}
    return args, kwargs


def _try(block, block_plan, inputs, mesh, sequence_parallel, collectives: list | None = None,
         drop_failing: bool = False):
    """(status, why) of one block split as `block_plan` says: "runs", "replicated"
    (it runs, but splits no weight), "undecided" or "fails". When pairs no
    child holds (`block_plan.colwise`) cannot run split (T5's attention output,
    gathered for its per-head bias, then viewed) but the block runs without
    them, it is "replicated" if nothing else splits; with `drop_failing`
    (lowering a hand-made plan) they are dropped from the plan, in place,
    and the block is lowered as it runs."""
    try:
        # Under sequence parallelism the first/last blocks of a stack and the
        # ones inside it take different paths (scatter/gather vs shards in and out);
        # the collectives kept are those of a block inside the stack (most blocks).
        split = [_run_split_block(block, block_plan, inputs, mesh, sequence_parallel, ends,
                                  collectives if ends == (not sequence_parallel) else None)
                 for ends in ((True, False) if sequence_parallel else (True,))]
        if not any(split):
            # It runs, but every tp rank computes the whole block: not what a
            # tensor-parallel plan prices (nn.MultiheadAttention's packed
            # in_proj is no Linear; a block with no Linears at all).
            return "replicated", (f"{type(block).__name__}'s forward has no column/row-parallel pair of Linears "
                                  f"(a Linear's output reaching another Linear): it would run whole on every "
                                  f"tp rank")
        return "runs", None
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        if type(exc).__name__ in _UNDECIDABLE or "cannot be called on meta" in str(exc):
            return "undecided", f"{type(block).__name__}: a value-dependent step ({type(exc).__name__})"
        why = _first_line(exc)
    if block_plan.colwise:
        import dataclasses
        if collectives is not None:
            collectives.clear()
        bare = dataclasses.replace(block_plan, colwise=[], rowwise=[], rowwise_whole=[])
        status, again = _try(block, bare, inputs, mesh, sequence_parallel, collectives)
        dropped = ", ".join(block_plan.colwise + block_plan.rowwise)
        if status == "replicated" or status == "runs" and drop_failing:
            if drop_failing:
                block_plan.colwise, block_plan.rowwise, block_plan.rowwise_whole = [], [], []
            return status, again and (f"{type(block).__name__}: its Linears {dropped} cannot run split ({why}); "
                                      f"without them it would run whole on every tp rank")
    return "fails", why


def limits(model: nn.Module, graph, example_inputs, tp_degrees=None) -> dict:
    """What the lowering runs for `model` (captured as `graph`): the dict
    described at the top of this file, for the tp degrees given (default:
    every degree the blocks allow; the planner passes those its cluster can
    use). Never raises: a check that cannot run says so under "checked"/"why"."""
    if not dist.is_available():
        return {"checked": False, "why": "this torch has no torch.distributed: layouts are checked when lowered"}
    try:
        short = _short_answer(model, graph, example_inputs, tp_degrees)
        return short if short is not None else _limits(model, graph, example_inputs, tp_degrees)
    except AutoparError as exc:
        return {"checked": False, "why": exc.message}
    except Exception as exc:  # noqa: BLE001 - the planner still plans; lowering checks again
        return {"checked": False, "why": f"the check failed: {_first_line(exc)}"}


def _short_answer(model, graph, example_inputs, tp_degrees) -> dict | None:
    """The answer of the model with its stacks of identical blocks cut short
    (short_stacks.py), when that answer refuses nothing; else None."""
    from autopar.lower.manual_plan import plan_for_model
    from autopar.lower.model_layers import resolve
    from autopar.lower.short_stacks import clean, short_stacks
    try:
        stacks = resolve(model, plan_for_model(model, example_inputs=example_inputs, graph=graph)).stacks
        with short_stacks(model, graph, stacks) as short:
            answer = None if short is None else _limits(model, short, example_inputs, tp_degrees)
    except Exception:  # noqa: BLE001 - the whole model gives the answer
        return None
    return answer if answer is not None and clean(answer) else None


def _limits(model, graph, example_inputs, tp_degrees=None) -> dict:
    from autopar.lower import pipeline_parallel
    from autopar.lower.manual_plan import plan_for_model
    from autopar.lower.model_io import forward_kwargs, positional_inputs
    from autopar.lower.model_layers import resolve

    if example_inputs is None:  # what capture traced when the caller gave none
        from autopar.capture.auto_inputs import infer_example_inputs
        example_inputs = infer_example_inputs(model)
        if example_inputs is None:
            raise AutoparError("no example inputs to run the model's blocks with")
    split = positional_inputs(model, example_inputs)
    if split is not None:
        example_inputs = lambda batch: split(batch)[0]  # noqa: E731
    args = example_inputs(1) if callable(example_inputs) else example_inputs
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    out = {"checked": True, "pipeline": None, "tp": {}, "sequence_parallel": {}, "unverified": []}
    from autopar.lower.data_parallel import hsdp_refusal
    if why_not_hsdp := hsdp_refusal():  # HSDP (Mesh.dp_shard) is model-independent: only this torch can refuse it
        out["hsdp"] = why_not_hsdp
    from autopar.lower.compression import refusal as compression_refusal
    if why_not_compressed := compression_refusal():  # Plan.grad_reduce_dtype: likewise
        out["compression"] = why_not_compressed
    from autopar.lower.expert_parallel import moe_refusal
    if why_not_ep := moe_refusal(model):  # the experts' form, whatever the ep degree (DBRX)
        out["ep"] = why_not_ep
    from autopar.lower.context_parallel import model_refusal
    seq_len = getattr(graph, "seq_len", None)  # no sequence (images): nothing to cut, nothing to say
    if seq_len and (why_not_cp := model_refusal(model, seq_len, n_inputs=len(args), graph=graph)):
        out["cp"] = why_not_cp  # absent where cp runs: the answers (and plans) of before read unchanged
    layout = resolve(model, plan_for_model(model, example_inputs=example_inputs, graph=graph))
    blocks = {l.block_index: model.get_submodule(l.paths[0]) for l in layout.layers if l.position == "block"}
    degrees = sorted({d for l in graph.layers if l.kind not in ("embedding", "head")
                      for d in (l.tp_degrees or ()) if d > 1})
    if tp_degrees is not None:
        degrees = [d for d in degrees if d in set(tp_degrees)]
    off_stack = _split_off_stack(graph, layout)
    if not blocks or off_stack:
        # Lowering splits attention / MLP pairs only inside the blocks of a stack; a layer
        # priced as split elsewhere would run whole (or only its embedding split).
        why = (f"layer {off_stack!r} is not a block of a stack (an nn.ModuleList or nn.Sequential of layers), and lowering "
               f"splits attention / MLP Linears only there" if off_stack else "the model has no block stack")
        out["tp"] = {str(d): why for d in degrees}
        if not blocks:
            out["pipeline"] = "the model has no block stack to cut between"
            return out
    out["runs_whole"] = _runs_whole(model, layout, args)
    stand_ins = pipeline_parallel.stand_in_modules(model, layout)
    plans, inputs, pre_outputs = record_blocks(model, blocks, args, forward_kwargs(model), stand_ins)
    try:
        if layout.num_blocks >= 2:
            pipeline_parallel.check_stand_ins(model, layout, 1, 2)
        pipeline_parallel.check_block_outputs(plans, {i: l.paths[0] for l in layout.layers
                                                      if l.position == "block" for i in [l.block_index]},
                                              pre_outputs)
        if layout.num_blocks < 2:
            out["pipeline"] = (f"the block stack {layout.stacks[0] if layout.stacks else ''!r} holds "
                               f"{layout.num_blocks} block: no two pipeline stages to cut between")
        else:  # two stages, cut as a plan would cut them
            two = resolve(model, plan_for_model(model, pp=2, num_micro_batches=2, graph=graph))
            pipeline_parallel.check_stage_cuts(two, 2)  # a layer lowering cannot cut between
            out["pipeline"] = pipeline_failure(model, two, 2, args, {i: p.returns for i, p in plans.items()},
                                               pre_outputs, 1)
    except PlanMismatchError as exc:
        out["pipeline"] = exc.message
    out["tp_checked"] = degrees  # others (advice for another GPU count) are checked when lowered
    runs = _split_runs(model, blocks, args, plans, inputs, layout, degrees, refused=set(out["tp"]))
    for tp in degrees:
        for sp, key in ((False, "tp"), (True, "sequence_parallel")):
            if out["tp"].get(str(tp)):
                continue  # not offered at all
            if sp and (why := _sequence_split_refusal(layout, plans, tp)):
                out[key][str(tp)] = why
                continue
            failures, undecided, issued = runs[tp, sp]
            _keep_collectives(out, str(tp), "sp" if sp else "plain", issued, plans, inputs, layout)
            what = f"tp={tp}{' with sequence parallelism' if sp else ''}"
            if failures:
                i, why = next(iter(sorted(failures.items())))
                path = next(l.paths[0] for l in layout.layers if l.block_index == i)
                out[key][str(tp)] = f"block {path!r} cannot run split over {what}: {why}"
            elif undecided:
                # Not shown to run is not offered (correct or refused); a hand plan may still ask for it.
                out["unverified"] += [f"{what}: {u}" for u in undecided]
                out[key][str(tp)] = f"cannot be shown to run split over {what} on fake tensors: {undecided[0]}"
    return out


def _split_runs(model, blocks, args, plans, inputs, layout, degrees, refused: set) -> dict:
    """{(tp, sequence_parallel): (failures, undecided, collectives issued)} of
    block_failures for every degree not refused before any run, the runs split
    over two processes (two_processes.py: they are independent; about half the
    wall time on two cores). A degree whose plain split fails is also run with
    sequence parallelism here, an answer `_limits` then does not read: the
    same answers as one process running them in turn."""
    from autopar.lower.model_io import forward_kwargs
    from autopar.two_processes import map_split

    jobs = [(tp, sp) for tp in degrees if str(tp) not in refused for sp in (False, True)
            if not (sp and _sequence_split_refusal(layout, plans, tp))]

    def run(job):
        tp, sp = job
        issued: dict = {}
        failures, undecided = block_failures(model, blocks, args, forward_kwargs(model), tp, sp,
                                             recorded=(plans, inputs), collectives=issued)
        return failures, undecided, issued
    # under sequence parallelism a block runs twice (first/last of a stack, and inside it)
    return dict(zip(jobs, map_split(run, jobs, weights=[2.0 if sp else 1.0 for _, sp in jobs])))


def _runs_whole(model, layout, args) -> dict:
    """{layer name: why} for the embedding / head layers tp leaves whole: a head
    Linear the model reads by weight instead of calling, a layer whose weight
    the root reads, and every layer tied to either (weight_reads.read_by_weight,
    as the lowering decides)."""
    from autopar.lower import weight_reads
    ends = [l for l in layout.layers if l.position in ("pre", "post")]
    whole, why = weight_reads.read_by_weight(model, ends, weight_reads.param_holders(model), args)
    cause = "; ".join(f"{p}: {w}" for p, w in why.items())
    return {l.choice.name: f"tensor parallelism leaves it whole, with the layers tied to it ({cause})"
            for l in ends if any(id(m) in whole for p in l.paths for m in model.get_submodule(p).modules())}


def _sequence_split_refusal(layout, plans, tp: int) -> str | None:
    """What compile's own check (tensor_parallel.check_sequence_split) says of the first block it refuses."""
    from autopar.lower import tensor_parallel
    for l in layout.layers:
        if l.position == "block" and l.block_index in plans:
            try:
                tensor_parallel.check_sequence_split(l.paths[0], plans[l.block_index], tp)
            except PlanMismatchError as exc:
                return exc.message
    return None


def _split_off_stack(graph, layout) -> str | None:
    """The first layer the planner would split into column/row pairs (a block or MLP
    kind with tp degrees) that lowering does not see as a block of a stack."""
    kinds = {l.name: l for l in graph.layers}
    for l in layout.layers:
        g = kinds.get(l.choice.name)
        if (l.position != "block" and g is not None and g.kind not in ("embedding", "head", "norm")
                and set(g.tp_degrees or ()) - {1}):
            return l.choice.name
    return None


def _keep_collectives(out: dict, tp: str, variant: str, issued: dict, plans, inputs, layout) -> None:
    """out["tp_collectives"][tp][variant]: per distinct kind of block, the first
    such block's path and what one of its micro-batches issues, forward and
    backward, as "kind ratio" items: bytes (nccl-tests' convention) per byte
    of the block's activation (batch x sequence x hidden), so the cost model
    scales each to any micro-batch, sequence and precision
    (autopar/solve/lowering_costs.py, LayerSpec.tp_collectives). E.g. GPT's
    fused-qkv block: {"block": "blocks.0", "fwd": "all_gather 3, all_reduce 1,
    all_reduce 1", "bwd": ...}."""
    path_of = {l.block_index: l.paths[0] for l in layout.layers if l.position == "block"}
    groups: dict = {}
    for i, seen in sorted(issued.items()):
        shape = plans[i].activation_shape
        args, kwargs = inputs[i]
        where = plans[i].main_argument
        main = args[where] if isinstance(where, int) else kwargs.get(where)
        if not shape or not isinstance(main, torch.Tensor):
            continue
        act = math.prod(shape) * main.element_size()
        key = tuple(", ".join(f"{kind} {nbytes / act:.6g}" for kind, nbytes, when in seen if when == phase)
                    for phase in ("fwd", "bwd"))
        groups.setdefault(key, path_of.get(i, str(i)))
    out.setdefault("tp_collectives", {}).setdefault(tp, {})[variant] = [
        {"block": path, "fwd": fwd, "bwd": bwd} for (fwd, bwd), path in groups.items()]
