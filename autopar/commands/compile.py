"""`autopar compile model.py[:factory] --gpus N -o build/`: emit a runnable build.

Plans with the shared plan options (or takes `--plan plan.json`), checks the
plan against the model (parameter names and shapes, world size), and writes
build/ (train.py, plan.json, model.py, launch.sh, launch.sbatch); see
autopar/lower/emit.py and docs/lowering.md.
"""
from __future__ import annotations

import os

import sys

from autopar.errors import PlanMismatchError


def add_arguments(parser) -> None:
    from autopar.commands.common import add_plan_arguments
    add_plan_arguments(parser)
    parser.add_argument("-o", "--output", default="build", metavar="DIR", help="output directory (default build/)")
    parser.add_argument("--plan", default=None, metavar="FILE",
                        help="lower this plan JSON instead of planning (checked against the model and --gpus)")


def run(args) -> int:
    from autopar.lower.emit import write_build

    if args.plan:
        from autopar.lower.api import load_plan
        from autopar.lower.model_layers import resolve
        from autopar.model_file import load_model
        plan = load_plan(args.plan)
        resolve(load_model(args.model).model, plan)  # same model as planned?
        if args.gpus is not None and args.gpus != plan.mesh.world_size:
            raise PlanMismatchError(f"--gpus {args.gpus} but the plan is for {plan.mesh.world_size} GPUs",
                                    hint="drop --plan to re-plan, or pass the plan's GPU count")
    else:
        from autopar.commands.common import plan_from_args
        from autopar.lower.model_layers import model_signature
        from autopar.model_file import load_model
        plan, _graph = plan_from_args(args)
        # Record parameter names and shapes so train.py refuses a different model.
        plan.model.setdefault("param_shapes", model_signature(load_model(args.model).model)["param_shapes"])
    files = write_build(args.output, plan, args.model, getattr(args, "gpus_per_node", None))
    m = plan.mesh
    print(f"autopar compile: pp={m.pp} x dp={m.dp} x tp={m.tp}, schedule {plan.schedule}, "
          f"{plan.num_micro_batches} x {plan.micro_batch_size} per dp rank, global batch {plan.global_batch_size}",
          file=sys.stderr)
    for f in files:
        print(f)
    out = os.path.normpath(args.output)  # "build/" and "build" print the same paths
    print(f"run: {out}/launch.sh   (or torchrun --nproc_per_node {m.world_size} {out}/train.py)",
          file=sys.stderr)
    return 0
