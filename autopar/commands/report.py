"""`autopar report`: write a plan as one self-contained HTML file.

    autopar report examples/gpt.py:gpt3_175b --gpus 1024 --device a100-80g -o plan.html
    autopar report --plan plan.json -o plan.html

The first form plans exactly as `autopar plan` does (same options, same
code: autopar.commands.common) and renders that Plan; the second renders a
plan saved with `autopar plan ... --json`. Either way the page shows the
Plan's numbers only, so it always agrees with the terminal output.
"""
from __future__ import annotations

import argparse
import os

from autopar.errors import AutoparError, PlanMismatchError


def _common():
    try:
        from autopar.commands import common
    except ImportError:
        return None
    return common if hasattr(common, "add_plan_arguments") and hasattr(common, "plan_from_args") else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    common = _common()
    if common is not None:
        common.add_plan_arguments(p)
        # With --plan there is no model to plan, so the model argument the
        # planner declares as required becomes optional here; run() checks
        # that exactly one of the two is given.
        for action in p._actions:  # argparse has no public API to relax an added positional
            if action.dest == "model" and not action.option_strings:
                action.nargs, action.required, action.default = "?", False, None
    else:
        p.add_argument("model", nargs="?", default=None, help="model file (path.py or path.py:factory)")
    p.add_argument("--plan", dest="plan_file", metavar="PLAN.json", default=None,
                   help="render a plan saved with `autopar plan ... --json` instead of planning")
    p.add_argument("-o", "--output", metavar="FILE.html", default="plan.html",
                   help="where to write the report (default: plan.html)")


def _load_plan(path: str):
    from autopar.plan import Plan

    if not os.path.isfile(path):
        raise AutoparError(f"plan file not found: {path}",
                           hint="save one with `autopar plan MODEL --gpus N --json > plan.json`")
    try:
        return Plan.load(path)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # Plan.from_dict names schema problems itself; a hand-edited file can still miss a field.
        if isinstance(exc, AutoparError):
            raise
        raise PlanMismatchError(f"{path} is not a valid autopar plan: {type(exc).__name__}: {exc}",
                                hint="regenerate it with `autopar plan ... --json`") from exc


def _plan_from_model(args):
    common = _common()
    if common is None:
        raise AutoparError("planning from a model file is not available in this build (autopar.commands.common is missing)",
                           hint="render a saved plan instead: autopar report --plan plan.json -o plan.html")
    result = _with_progress(common, args)
    # plan_from_args may return the plan alone or (plan, graph); the graph adds parameter counts.
    if isinstance(result, tuple):
        plan, graph = result[0], (result[1] if len(result) > 1 else None)
    else:
        plan, graph = result, None
    return plan, graph


def _with_progress(common, args):
    """plan_from_args, with a spinner on stderr when it is a terminal (a 1,024-GPU search takes minutes)."""
    if not getattr(common, "stderr_is_tty", lambda: False)():
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
    if args.plan_file:
        plan, graph = _load_plan(args.plan_file), None
    else:
        plan, graph = _plan_from_model(args)
    if not args.output.endswith((".html", ".htm")):
        raise AutoparError(f"report file must end in .html: {args.output}", hint="e.g. -o plan.html")
    write_html(plan, args.output, graph=graph)
    size = os.path.getsize(args.output)
    print(f"wrote {args.output} ({size / 1024:.0f} KiB): {plan.model.get('name', 'model')} on "
          f"{plan.mesh.world_size} GPUs, pp {plan.mesh.pp} x dp {plan.mesh.dp} x tp {plan.mesh.tp}, "
          f"{plan.predicted.tokens_per_s:,.0f} tokens/s predicted")
    return 0
