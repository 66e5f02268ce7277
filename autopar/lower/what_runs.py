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
     "unverified": [what the fake run could not decide]}
Fake tensors have no values, so a step that reads one (`.item()`, `tolist`
inside a redistribution of a strided shard) cannot be decided here; such a
layout stays offered and is listed under "unverified" (the lowering matrix,
benchmarks/lowering_matrix, runs them for real).

The fake process group is the process's default group, so the check runs
only in a process that has none yet (planning before `init_process_group`;
`autopar plan`); otherwise `checked` is False with the reason.
"""
from __future__ import annotations

import contextlib
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import AutoparError, PlanMismatchError

_UNDECIDABLE = ("DataDependentOutputException", "GuardOnDataDependentSymNode")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


@contextlib.contextmanager
def fake_tp_mesh(size: int):
    """A 1-D "tp" DeviceMesh of `size` ranks over torch's fake backend (this process is rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook  # init_process_group prefixes "[rank0]" to every later traceback
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


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


def _cast(tree, dtype):
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def _run_split_block(block, block_plan, inputs, mesh, sequence_parallel: bool, dtype) -> None:
    """parallelize_block on a meta copy, then forward + backward on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten

    from autopar.lower import tensor_parallel

    args, kwargs = inputs
    device = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
    from autopar.capture.dtype_fallback import Bf16ShapeFallback

    with FakeTensorMode(allow_non_fake_inputs=True), Bf16ShapeFallback():
        blk = _empty_copy(block, device or "cpu")
        if dtype != torch.float32:
            blk = blk.to(dtype)
            args, kwargs = _cast(args, dtype), _cast(kwargs, dtype)
        # first and last: the activation is scattered into sequence shards on
        # entry and gathered on exit, so the block's inner SP path runs.
        tensor_parallel.parallelize_block(blk, block_plan, mesh, sequence_parallel=sequence_parallel,
                                          first=True, last=True)
        with tensor_parallel.tp_region():
            out = blk(*args, **kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().sum().backward()


def _record_inputs(model, blocks: dict[int, nn.Module], example_args, model_kwargs, outputs_of=None):
    """(block plans, {index: (args, kwargs)} each block was called with, pre outputs) from one fake forward."""
    from autopar.lower import tensor_parallel

    seen, hooks = {}, []

    def keep(i):
        def hook(module, args, kwargs):
            seen.setdefault(i, (args, kwargs))  # the first call (a block reused in a loop: its first input)
        return hook
    for i, b in blocks.items():
        hooks.append(b.register_forward_pre_hook(keep(i), with_kwargs=True))
    outputs = {}
    try:
        plans = tensor_parallel.probe_blocks(model, blocks, example_args, model_kwargs, outputs_of=outputs_of,
                                             outputs=outputs)
    finally:
        for h in hooks:
            h.remove()
    return plans, seen, outputs


def block_failures(model: nn.Module, blocks: dict[int, nn.Module], example_args: tuple, model_kwargs: dict,
                   tp: int, sequence_parallel: bool, *, recorded=None) -> tuple[dict[int, str], list[str]]:
    """Blocks (index -> reason) that cannot run split over `tp` ranks, and
    what could not be decided. One block per distinct signature is run; the
    others share its answer. Needs no process group (makes a fake one)."""
    from autopar.lower import tensor_parallel

    if recorded is None:
        recorded = _record_inputs(model, blocks, example_args, model_kwargs)[:2]
    plans, inputs = recorded
    failures, undecided, by_sig = {}, [], {}
    tensor_parallel.register_cpu_attention_sharding()
    with fake_tp_mesh(tp) as mesh:
        for i, block in sorted(blocks.items()):
            sig = _signature(block)
            if sig not in by_sig:
                by_sig[sig] = _try(block, plans[i], inputs.get(i), mesh, sequence_parallel)
            status, why = by_sig[sig]
            if status == "fails":
                failures[i] = why
            elif status == "undecided" and why not in undecided:
                undecided.append(why)
    return failures, undecided


def _try(block, block_plan, inputs, mesh, sequence_parallel):
    if inputs is None:
        return "fails", "the block is not called by the model's forward"
    error = None
    for dtype in (torch.float32, torch.bfloat16):
        # Some meta kernels take only their fast dtype (MoE's _grouped_mm: bf16):
        # a block that runs in bf16 runs; its fp32 CPU kernel exists.
        try:
            _run_split_block(block, block_plan, inputs, mesh, sequence_parallel, dtype)
            return "runs", None
        except Exception as exc:  # noqa: BLE001 - any failure is the answer
            if type(exc).__name__ in _UNDECIDABLE or "cannot be called on meta" in str(exc):
                return "undecided", f"{type(block).__name__}: a value-dependent step ({type(exc).__name__})"
            error = exc
    return "fails", _first_line(error)


def limits(model: nn.Module, graph, example_inputs) -> dict:
    """What the lowering runs for `model` (captured as `graph`): the dict
    described at the top of this file. Never raises: a check that cannot run
    says so under "checked"/"why"."""
    if dist.is_available() and dist.is_initialized():
        return {"checked": False, "why": "a process group already exists in this process, so no fake one "
                                         "can be made: layouts are checked when the plan is lowered"}
    try:
        return _limits(model, graph, example_inputs)
    except AutoparError as exc:
        return {"checked": False, "why": exc.message}
    except Exception as exc:  # noqa: BLE001 - the planner still plans; lowering checks again
        return {"checked": False, "why": f"the check failed: {_first_line(exc)}"}


def _limits(model, graph, example_inputs) -> dict:
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
    layout = resolve(model, plan_for_model(model, example_inputs=example_inputs, graph=graph))
    blocks = {l.block_index: model.get_submodule(l.paths[0]) for l in layout.layers if l.position == "block"}
    if not blocks:
        out["pipeline"] = "the model has no block stack to cut between"
        return out
    stand_ins = pipeline_parallel.stand_in_modules(model, layout)
    plans, inputs, pre_outputs = _record_inputs(model, blocks, args, forward_kwargs(model), stand_ins)
    try:
        if layout.num_blocks >= 2:
            pipeline_parallel.check_stand_ins(model, layout, 1, 2)
        pipeline_parallel.check_block_outputs(plans, {i: l.paths[0] for l in layout.layers
                                                      if l.position == "block" for i in [l.block_index]},
                                              pre_outputs)
    except PlanMismatchError as exc:
        out["pipeline"] = exc.message
    degrees = sorted({d for l in graph.layers if l.kind not in ("embedding", "head")
                      for d in (l.tp_degrees or ()) if d > 1})
    for tp in degrees:
        for sp, key in ((False, "tp"), (True, "sequence_parallel")):
            if sp and out["tp"].get(str(tp)):
                continue  # not offered at all
            failures, undecided = block_failures(model, blocks, args, forward_kwargs(model), tp, sp,
                                                 recorded=(plans, inputs))
            out["unverified"] += [f"tp={tp}{' + sequence parallelism' if sp else ''}: {u}" for u in undecided]
            if failures:
                i, why = next(iter(sorted(failures.items())))
                path = next(l.paths[0] for l in layout.layers if l.block_index == i)
                out[key][str(tp)] = f"block {path!r} fails when split over tp={tp}" \
                                    f"{' with sequence parallelism' if sp else ''}: {why}"
    return out
