"""`autopar report`: write a plan as one self-contained HTML file.

    autopar report examples/gpt.py:gpt3_175b --gpus 1024 --device a100-80g -o plan.html
    autopar report --plan plan.json -o plan.html
    autopar report --plan plan.json --metrics m.jsonl -o run.html   # + the run beside it

The first form plans exactly as `autopar plan` does (same options, same
code: autopar.commands.common) and renders that Plan; the second renders a
plan saved with `autopar plan ... --json`. Either way the page shows the
Plan's numbers only, so it always agrees with the terminal output. With
`--metrics FILE` (what `train.py --metrics` wrote) the page adds a "This run"
section: the run's measurements beside the Plan's predictions.
"""
from __future__ import annotations

import argparse
import os

from autopar.errors import AutoparError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from autopar.commands.common import add_plan_arguments

    # With --plan there is no model to plan; run() checks that exactly one is given.
    add_plan_arguments(p, model_required=False)
    p.add_argument("--plan", dest="plan_file", metavar="PLAN.json", default=None,
                   help="render a plan saved with `autopar plan ... --json` instead of planning")
    p.add_argument("--metrics", metavar="FILE", default=None,
                   help="a training run's metrics file (train.py --metrics FILE): adds a 'This run' section, its "
                        "loss, step time and memory per step beside the plan's predictions")
    p.add_argument("-o", "--output", metavar="FILE.html", default="plan.html",
                   help="where to write the report (default: plan.html)")


def _plan_from_model(args):
    """(Plan, ModelGraph) planned from the model file (reports/regenerate.py calls this too)."""
    from autopar.commands import common

    return _with_progress(common, args)


def _with_progress(common, args):
    """plan_from_args, with a spinner on stderr when it is a terminal (a 1,024-GPU search takes minutes)."""
    if not common.stderr_is_tty():
        return common.plan_from_args(args)
    from rich.console import Console

    with Console(stderr=True).status("capturing the model...") as status:
        def progress(phase, done, total, best_s):
            best = f", best {best_s:.3f} s/step" if best_s else ""
            status.update(f"{phase} layouts: {done}/{total}{best}")
        return common.plan_from_args(args, progress=progress)


def run(args) -> int:
    from autopar.report import write_html

    model = getattr(args, "model", None)
    if args.plan_file and model:
        raise AutoparError("give either a model file or --plan, not both",
                           hint="`autopar report MODEL --gpus N` plans and renders; `autopar report --plan plan.json` renders a saved plan")
    if not args.plan_file and not model:
        raise AutoparError("nothing to report: give a model file or --plan plan.json",
                           hint="e.g. autopar report examples/gpt.py:gpt3_175b --gpus 1024 --device a100-80g -o plan.html")
    from autopar.commands.common import check_report_path

    check_report_path(args.output, "-o")  # before minutes of planning, not after
    if args.metrics:
        from autopar.metrics_file import read_rows

        read_rows(args.metrics)  # a file that is not a run's metrics is refused before planning too
    if args.plan_file:
        from autopar.commands.common import planning_options_given
        from autopar.plan_file import load_plan_file

        ignored = planning_options_given(args)
        if ignored:  # silently drawing the saved plan would look like those flags were applied
            raise AutoparError(f"{', '.join(ignored)} would be ignored: --plan renders the saved plan as it is",
                               hint="drop them, or re-plan: autopar report MODEL " + " ".join(ignored) + " ...")

        plan, graph = load_plan_file(args.plan_file), None
    else:
        plan, graph = _plan_from_model(args)
    write_html(plan, args.output, graph=graph, metrics=args.metrics)
    size = os.path.getsize(args.output)
    print(f"wrote {args.output} ({size / 1024:.0f} KiB): {plan.model.get('name', 'model')} on "
          f"{plan.mesh.world_size} GPUs, pp {plan.mesh.pp} x dp {plan.mesh.dp} x tp {plan.mesh.tp}, "
          + (f"{plan.predicted.tokens_per_s:,.0f} tokens/s ({plan.predicted.samples_per_s:,.1f} samples/s) predicted"
             if plan.token_model and plan.predicted.tokens_per_s is not None
             else f"{plan.predicted.samples_per_s:,.1f} samples/s predicted"))
    return 0
