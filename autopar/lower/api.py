"""`autopar.compile`: plan (unless given a plan), then lower, on this rank."""
from __future__ import annotations

import os
import warnings

import torch

from autopar.engine import check_runs_on_autopar
from autopar.errors import AutoparError, PlanMismatchError
from autopar.lower.model_io import check_output
from autopar.lower.parallel_model import LoweringWarning, ParallelModel, lower
from autopar.plan import Plan, check_precision


def load_plan(plan) -> Plan:
    from autopar.plan_file import load_plan_file, plan_problem

    if isinstance(plan, (str, os.PathLike)):
        return load_plan_file(str(plan))  # every field checked, the bad one named
    if isinstance(plan, dict):
        plan = Plan.from_dict(plan)
    if not isinstance(plan, Plan):
        raise PlanMismatchError(f"plan must be a Plan, a dict or a JSON path, not {type(plan).__name__}")
    problem = plan_problem(plan)
    if problem:  # a hand-edited plan fails here, not as a TypeError deep in the lowering
        raise PlanMismatchError(f"the plan is not consistent: {problem}")
    return plan


def plan_on_rank0(make) -> Plan:
    """Plan once and share it: a time-limited search could pick different
    layouts on different ranks, and ranks that disagree deadlock."""
    import torch.distributed as dist

    from autopar.lower.mesh import init_distributed
    init_distributed()
    box, failure = [None], None
    if dist.get_rank() == 0:
        try:
            box[0] = make().to_dict()
        except Exception as exc:  # tell the other ranks instead of leaving them waiting
            failure = exc
            box[0] = {"__error__": getattr(exc, "message", f"{type(exc).__name__}: {exc}"),
                      "__hint__": getattr(exc, "hint", None)}
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if "__error__" in box[0]:
        raise AutoparError(f"planning failed on rank 0: {box[0]['__error__']}", hint=box[0]["__hint__"])
    return Plan.from_dict(box[0])


def compile(model: torch.nn.Module, cluster_spec=None, *, example_inputs, global_batch_size: int | None = None,
            loss_fn=None, optimizer=torch.optim.AdamW, optimizer_kwargs: dict | None = None, plan=None,
            constraints: dict | None = None, fusion: bool = False, init_fn=None,
            local_batch: bool = False, precision: str | None = None, memory_headroom: float | None = None,
            no_weight_decay_1d: bool = False, torch_compile: bool | str = "auto",
            torch_compile_backend: str = "inductor", torch_compile_mode: str | None = None,
            float8: bool = False) -> ParallelModel:
    """Return this rank's ParallelModel for `model` under `plan` (planned here if None).

    Call it in every process of a torchrun/SLURM job (or after
    init_process_group). `example_inputs` is a tuple of positional tensors
    for one micro-batch at the training sequence length, or a callable
    batch_size -> tuple; `loss_fn(logits, targets)` returns a mean loss (the
    model's output, its `.logits`, or a dict's "logits": see
    autopar/lower/model_io.py; any other output is refused here); None uses a
    Hugging Face causal LM's own loss. `init_fn(module)` initialises a
    meta-device model module by module (parameters and buffers; default for
    Hugging Face models: their `_init_weights`); real weights are kept.
    `precision` ('bf16', 'fp16', 'fp32'; None: the plan's, or bf16 when
    planning here) is the training compute dtype, planned and run.
    `memory_headroom` (fraction of device memory the plan leaves free; None:
    the planner's default, 0.1) applies when planning here.
    `no_weight_decay_1d`: biases and norm gains (tensors of < 2 dims) get no
    weight decay (a second parameter group); the rest `optimizer_kwargs`'s.
    `local_batch`: train_step gets this dp rank's share of the global batch
    (what `autopar.train.data.GlobalBatches` reads), not the whole batch.
    `torch_compile` (True, False or "auto": on for CUDA devices, off elsewhere):
    each block runs as `torch.compile`d code (`torch_compile_backend`, `torch_compile_mode`,
    the names of Hugging Face's TrainingArguments); a block that does not compile runs
    eager and is named in `ParallelModel.notes` (autopar/lower/compile_blocks.py).
    `float8`: when planning here, let each layer run its nn.Linears in float8 where that
    is faster on the planned device (torchao; compiled blocks and a GPU with float8
    tensor cores only, refused otherwise); a given plan runs the float8 Linears it names.
    """
    if precision is not None:
        check_precision(precision)
    from autopar.lower.compile_blocks import wanted
    from autopar.lower.mesh import local_device
    compiling = wanted(torch_compile, local_device())  # a typo fails here, not after a search
    check_output(model, example_inputs)  # an output loss_fn cannot read: refused before planning
    if plan is None:
        plan = _plan_here(model, cluster_spec, example_inputs=example_inputs, global_batch_size=global_batch_size,
                          loss_fn=loss_fn, constraints=constraints, fusion=fusion, precision=precision,
                          memory_headroom=memory_headroom, compiling=compiling, float8=float8)
    plan = load_plan(plan)
    check_runs_on_autopar(plan)  # priced for another engine (autopar plan --engine): not what runs here
    _check_plan_matches(plan, precision, global_batch_size)
    if fusion:
        from autopar.kernels.fusion import apply_fusions, find_fusions
        # A hand-written plan (or one saved with --no-fusion) lists no chains:
        # find them on the model itself, as the planner would have.
        model = apply_fusions(model, plan.fusions or find_fusions(model), compiled=compiling)
    from autopar.lower.model_io import positional_inputs
    split = positional_inputs(model, example_inputs)
    if split is not None:  # capture's inferred keyword inputs: labels become train_step's targets
        example_inputs = lambda batch: split(batch)[0]  # noqa: E731
    pm = lower(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer,
               optimizer_kwargs=optimizer_kwargs, init_fn=init_fn, local_batch=local_batch,
               no_weight_decay_1d=no_weight_decay_1d, torch_compile=torch_compile,
               torch_compile_backend=torch_compile_backend, torch_compile_mode=torch_compile_mode)
    unfused = fusions_priced_otherwise(plan, fusion, compiling)
    if unfused:
        import torch.distributed as dist

        pm.notes += unfused
        if dist.get_rank() == 0:
            warnings.warn(unfused[0], LoweringWarning, stacklevel=2)
    return pm


def _plan_here(model, cluster_spec, *, example_inputs, global_batch_size, loss_fn, constraints, fusion,
               precision, memory_headroom, compiling: bool, float8: bool, shared: bool = True):
    """autopar.compile without a plan: plan on rank 0 for this job (`job_cluster`), priced as
    `lower` will run it (the lowering's limits, compiled blocks, fused kernels, float8)."""
    try:
        from autopar.solve import plan as make_plan
    except ImportError as exc:  # the solver is optional for lowering
        raise AutoparError("no plan given and the planner is not available",
                           hint="pass plan=Plan or a plan JSON path") from exc
    cluster_spec = job_cluster(cluster_spec) if shared else cluster_spec
    if cluster_spec is None or global_batch_size is None:
        raise AutoparError("planning needs cluster_spec and global_batch_size (or pass plan=...)",
                           hint="e.g. autopar.compile(model, 'h100-sxm', example_inputs=..., "
                                "global_batch_size=256): a device name plans for this job's ranks")
    from autopar.lower.what_runs import limits
    from autopar.engine import engine_from_options
    kwargs = {"example_inputs": example_inputs, "global_batch_size": global_batch_size,
              "fusion": fusion,  # fused kernels priced only when they are swapped in below
              "check_lowering": limits,  # and priced as the blocks will run
              "engine": engine_from_options(compiled_blocks=compiling or None, float8=float8 or None)}
    if constraints:
        kwargs["constraints"] = constraints
    if precision is not None:
        kwargs["precision"] = precision
    if memory_headroom is not None:
        kwargs["memory_headroom"] = memory_headroom
    def make():
        from autopar.lower.model_layers import model_signature
        made = make_plan(captured_with_loss(model, example_inputs, loss_fn, precision=precision or "bf16"),
                         cluster_spec, module=model, **kwargs)
        made.model.setdefault("param_shapes", model_signature(model)["param_shapes"])
        return made
    return plan_on_rank0(make) if shared else make()


def replan(plan: Plan, model, *, example_inputs, loss_fn, global_batch_size: int) -> Plan:
    """The request `plan` answered, asked again at another global batch (train.py's
    --batch-size when the plan's layout cannot run it): the same cluster, pins,
    precision, memory headroom, fusions and engine (compiled blocks, float8), so only
    the batch differs. Planned in this process: inside a job, wrap the call in
    `plan_on_rank0`."""
    from autopar.engine import plan_engine

    engine = plan_engine(plan)
    return _plan_here(model, plan.cluster, example_inputs=example_inputs, global_batch_size=global_batch_size,
                      loss_fn=loss_fn, constraints=dict(plan.constraints or {}) or None, fusion=bool(plan.fusions),
                      precision=plan.precision, memory_headroom=(plan.solver or {}).get("memory_headroom"),
                      compiling=bool(engine.compiled_blocks), float8=bool(engine.float8), shared=False)


def _check_plan_matches(plan, precision, global_batch_size) -> None:
    """What compile was asked for, against what the plan priced."""
    if precision is not None and precision != plan.precision:
        raise PlanMismatchError(f"precision {precision} was asked for, but the plan's is {plan.precision}",
                                hint=f"drop precision= to train in the plan's {plan.precision}, or re-plan with "
                                     f"precision={precision!r} (its memory and speed differ)")
    if global_batch_size is not None and global_batch_size != plan.global_batch_size:
        raise PlanMismatchError(f"global_batch_size {global_batch_size} differs from the plan's "
                                f"{plan.global_batch_size}")


def fusions_priced_otherwise(plan, fusion: bool, compiling: bool) -> list[str]:
    """A sentence when the plan's step time counts fused kernels (`Plan.fusions`, charged on a
    GPU profile) that this program does not swap in (fusion=False), its blocks eager (priced
    compiled and compiled, inductor fuses the blocks' chains itself)."""
    from autopar.engine import plan_engine

    charged = (plan.assumptions.get("fusion") or {}).get("charged") if isinstance(plan.assumptions, dict) else None
    if fusion or not plan.fusions or not charged or (compiling and plan_engine(plan).compiled_blocks):
        return []
    return [f"the plan was priced with {len(plan.fusions)} fused kernel chains (Plan.fusions), and fusion=False "
            f"runs them unfused: expect the step time to be longer than the plan's; pass fusion=True, or re-plan "
            f"with --no-fusion to price what runs"]


def job_cluster(cluster_spec):
    """The cluster to plan for inside a job (a process group, or torchrun's WORLD_SIZE):
    a device name, or nothing on a recognised device, means this job's ranks (nodes of
    LOCAL_WORLD_SIZE); a preset, file or ClusterSpec of another size is refused with the
    Python call that plans for the job. Outside a job, `cluster_spec` as given."""
    import torch.distributed as dist

    from cost_models.devices import device_for_gpu_name
    from cost_models.hardware import ClusterSpec, shipped_devices

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "0") or 0)
    if world < 1:
        return cluster_spec
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world
    if world % per_node:
        per_node = world
    if cluster_spec is None:
        cluster_spec = device_for_gpu_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"
        if cluster_spec is None:
            raise AutoparError(f"this job's GPU ({torch.cuda.get_device_name()}) is not one autopar has a profile "
                               f"for", hint="name the nearest one: autopar.compile(model, 'h100-sxm', ...)")
    if isinstance(cluster_spec, str) and cluster_spec in shipped_devices():
        from autopar.solve.planner import scaled_cluster  # the device's own links, this job's shape
        return scaled_cluster(ClusterSpec.resolve(cluster_spec), world // per_node, per_node)
    cluster = ClusterSpec.resolve(cluster_spec)
    if cluster.world_size != world:
        name = cluster_spec if isinstance(cluster_spec, str) else f"a cluster of {cluster.world_size} GPUs"
        raise AutoparError(f"{name} has {cluster.world_size} GPUs, and this job runs {world} processes",
                           hint=f"plan for the job: autopar.compile(model, '{cluster.device}', ...) (its "
                                f"{world} ranks, {per_node} per node), or pass a plan made for {cluster.world_size}")
    return cluster


def captured_with_loss(model, example_inputs, loss_fn, precision: str = "bf16"):
    """What the planner prices: the model with the loss it trains with (the
    user's loss_fn adds its saved log-softmax and FLOPs to the head layer, as
    `autopar plan` does for a model file's loss_fn), captured in `precision`'s
    dtype (the planner captures a module it is handed the same way). A loss the meta-device
    trace cannot run is left out, as the CLI does; without loss_fn, a Hugging
    Face model is priced with the own loss the lowering trains it with."""
    if example_inputs is None:  # inferred inputs may carry labels: the model's own loss
        return model
    from autopar.capture import capture
    from autopar.lower.model_io import logits_of, own_token_loss, positional_inputs

    if loss_fn is None:
        # The lowering trains a Hugging Face model with its own loss (own_token_loss): price
        # that one (its fp32 log-softmax over the vocabulary is often the largest activation),
        # unless the inputs carry labels and the forward computes it already.
        if positional_inputs(model, example_inputs) is not None:
            return model
        try:
            loss_fn = own_token_loss(model)
        except AutoparError:
            return model

    try:
        # The lowering hands loss_fn the logits (`.logits` of a Hugging Face output)
        return capture(model, example_inputs, dtype=precision, loss_fn=lambda out, y: loss_fn(logits_of(out), y))
    except AutoparError:
        return model
