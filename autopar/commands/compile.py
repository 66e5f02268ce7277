"""`autopar compile model.py[:factory] --gpus N -o build/`: emit a runnable build.

Plans with the shared plan options (or takes `--plan plan.json`), checks the
plan against the model (parameter names and shapes, world size), and writes
build/ (train.py, plan.json, model.py, launch.sh, launch.sbatch); see
autopar/lower/emit.py and docs/lowering.md.

With --plan the model may be left out: the plan records the model file it
was made from (`model.source`).
"""
from __future__ import annotations

import os
import sys

from autopar.errors import AutoparError, PlanMismatchError


def add_arguments(parser) -> None:
    from autopar.commands.common import add_plan_arguments
    add_plan_arguments(parser, model_required=False, engine=False)
    parser.add_argument("-o", "--output", default="build", metavar="DIR", help="output directory (default build/)")
    parser.add_argument("--plan", default=None, metavar="FILE",
                        help="lower this plan JSON instead of planning (checked against the model and --gpus)")


def _plan_from_file(args):
    """The saved plan, checked against the model and the GPU count it is compiled for."""
    from autopar.commands.common import planning_options_given
    from autopar.plan_file import load_plan_file
    from autopar.lower.model_io import check_output
    from autopar.lower.model_layers import resolve
    from autopar.model_file import load_model

    plan = load_plan_file(args.plan)
    world = plan.mesh.world_size
    if args.gpus is not None and args.gpus != world:
        raise PlanMismatchError(f"--gpus {args.gpus} but {args.plan} is a plan for {world} GPUs "
                                f"(pp {plan.mesh.pp} x dp {plan.mesh.dp} x tp {plan.mesh.tp})",
                                hint=f"pass --gpus {world}, or drop --plan to re-plan for {args.gpus} GPUs")
    ignored = planning_options_given(args, allowed=("gpus", "gpus_per_node"))
    if ignored:
        raise AutoparError(f"{', '.join(ignored)} would be ignored: --plan lowers the saved plan as it is",
                           hint="drop them, or drop --plan to re-plan with them")
    if args.model is None:
        args.model = plan.model.get("source") if isinstance(plan.model, dict) else None
        if not args.model:
            raise AutoparError(f"{args.plan} does not record its model file; name it: "
                               f"autopar compile MODEL.py[:factory] --plan {args.plan}")
        from autopar.model_file import split_spec

        if not os.path.isfile(split_spec(args.model)[0]):  # recorded relative to where `autopar plan` ran
            raise AutoparError(f"{args.plan} records its model as {args.model}, which is not a file from here",
                               hint=f"name the model file: autopar compile PATH/TO/model.py[:factory] --plan {args.plan}")
        print(f"autopar compile: model {args.model} (recorded in {args.plan})", file=sys.stderr)
    loaded = load_model(args.model)
    resolve(loaded.model, plan)  # the same model as planned? (names and shapes)
    check_output(loaded.model, loaded.example_inputs)  # an output loss_fn cannot read: refused here
    _check_loss(loaded, args.model)
    return plan


def _check_loss(loaded, spec: str) -> None:
    """What train.py's start refuses, refused before a build is written: a model with no
    loss to train (no loss_fn in the file, and not a model whose own loss autopar reproduces)."""
    from autopar.lower.model_io import resolve_loss_fn

    try:
        resolve_loss_fn(loaded.model, loaded.loss_fn)
    except AutoparError as exc:
        raise AutoparError(f"{spec}: {exc.message}",
                           hint="define loss_fn(logits, targets) in the model file (e.g. F.cross_entropy over "
                                "the flattened logits)") from exc


def run(args) -> int:
    from autopar.lower.emit import write_build
    from autopar.engine import check_runs_on_autopar

    if args.plan:
        plan = _plan_from_file(args)
    else:
        if args.model is None:
            raise AutoparError("nothing to compile: give a model file or --plan plan.json",
                               hint="e.g. autopar compile examples/gpt.py:gpt_tiny --gpus 4 --device cpu -o build/")
        from autopar.commands.common import plan_from_args
        from autopar.lower.model_io import check_output
        from autopar.lower.model_layers import model_signature
        from autopar.model_file import load_model
        plan, _graph = plan_from_args(args)  # bad flags fail first, before the model is built
        loaded = load_model(args.model)
        check_output(loaded.model, loaded.example_inputs)  # an output loss_fn cannot read: refused here
        _check_loss(loaded, args.model)
        # Record parameter names and shapes so train.py refuses a different model.
        plan.model.setdefault("param_shapes", model_signature(loaded.model)["param_shapes"])
        from autopar.lower.model_layers import resolve
        resolve(loaded.model, plan)  # what train.py's start checks: the plan's layers found in the model
    check_runs_on_autopar(plan)  # a plan priced for another engine (autopar plan --engine) is not lowered
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise AutoparError(f"-o {args.output} is a file; compile writes a folder (train.py, plan.json, ...)",
                           hint="pass a folder name, e.g. -o build/")
    files = write_build(args.output, plan, args.model, getattr(args, "gpus_per_node", None))
    m = plan.mesh
    dp = (f"dp={m.dp}" + (f" ({m.replicas} replicas x {m.dp_shard} shards)" if m.hsdp else "")
          + (f" x cp={m.cp}" if (m.cp or 1) > 1 else ""))
    print(f"autopar compile: pp={m.pp} x {dp} x tp={m.tp}, schedule {plan.schedule}, "
          f"{plan.num_micro_batches} x {plan.micro_batch_size} per dp rank, global batch {plan.global_batch_size}",
          file=sys.stderr)
    for f in files:
        print(f)
    out = os.path.normpath(args.output)  # "build/" and "build" print the same paths
    print(f"run: {out}/launch.sh   (or torchrun --nproc_per_node {m.world_size} {out}/train.py)",
          file=sys.stderr)
    return 0
