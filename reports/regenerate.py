#!/usr/bin/env python3
"""Regenerate the sample reports in reports/ with the current code.

    python3 reports/regenerate.py            # plan + render all samples
    python3 reports/regenerate.py gpt3_175b  # just one
    python3 reports/regenerate.py --check    # fail if the files differ from what the code produces now
    python3 reports/regenerate.py --render-only  # re-render the HTML from the saved plans (no planning)

Each sample runs the same code path as
`autopar report MODEL --gpus N --device D --batch-size B -o reports/NAME.html`
(the options go through autopar.commands.common, exactly as on the command
line) and also saves the Plan as reports/NAME.plan.json, so
`autopar report --plan reports/NAME.plan.json` reproduces the page and a
reviewer can diff plans.

--check compares plans field by field except the solver's wall-clock
`time_s` (the one value that legitimately changes between runs) and requires
the HTML rendered from the committed plan to equal the committed HTML byte
for byte.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "reports")

# name -> the `autopar report` arguments (model spec first).
SAMPLES = {
    "gpt3_175b_1024xa100": ["examples/gpt.py:gpt3_175b", "--gpus", "1024", "--device", "a100-80g",
                            "--batch-size", "1536"],
    "llama3_8b_64xh100": ["examples/llama.py:llama3_8b", "--gpus", "64", "--device", "h100-sxm",
                          "--batch-size", "256"],
    "llama3_70b_256xh100": ["examples/llama.py:llama3_70b", "--gpus", "256", "--device", "h100-sxm",
                            "--batch-size", "512"],
    "vit_h14_8xh100": ["examples/vit.py:vit_h14", "--gpus", "8", "--device", "h100-sxm",
                       "--batch-size", "512"],
}

VOLATILE_SOLVER_KEYS = ("time_s",)  # wall-clock, differs run to run


def _parse(argv: list[str]):
    from autopar.cli import build_parser

    return build_parser(["report", *argv]).parse_args(["report", *argv])


def plan_sample(name: str):
    """(Plan, ModelGraph) for one sample, through the CLI's own option parsing."""
    from autopar.commands import report as report_cmd

    args = _parse(SAMPLES[name] + ["-o", os.path.join(HERE, f"{name}.html")])
    return report_cmd._plan_from_model(args)


def render_from_saved(name: str, directory: str = HERE) -> str:
    from autopar.plan import Plan
    from autopar.report import render_html

    return render_html(Plan.load(os.path.join(directory, f"{name}.plan.json")))


def write_sample(name: str, directory: str) -> None:
    """Plan, save the plan JSON, and render the HTML from the saved plan.

    Rendering from the JSON (not the in-memory plan) makes the committed HTML
    exactly what `autopar report --plan NAME.plan.json` prints.
    """
    t0 = time.perf_counter()
    plan, _graph = plan_sample(name)
    plan.save(os.path.join(directory, f"{name}.plan.json"))
    html = render_from_saved(name, directory)
    with open(os.path.join(directory, f"{name}.html"), "w", encoding="utf-8") as f:
        f.write(html)
    print(f"{name}: {plan.model.get('name')} on {plan.mesh.world_size} GPUs -> "
          f"pp {plan.mesh.pp} x dp {plan.mesh.dp} x tp {plan.mesh.tp} {plan.schedule}, "
          f"{plan.predicted.tokens_per_s:,.0f} tok/s, MFU {plan.predicted.mfu:.1%}; "
          f"{len(html.encode()) / 1024:.0f} KiB; {time.perf_counter() - t0:.1f} s", flush=True)


def _comparable(plan_json: str) -> dict:
    d = json.loads(plan_json)
    for k in VOLATILE_SOLVER_KEYS:
        d.get("solver", {}).pop(k, None)
    return d


def check(names: list[str], replan: bool) -> int:
    bad = []
    for name in names:
        before = len(bad)
        html_path = os.path.join(HERE, f"{name}.html")
        plan_path = os.path.join(HERE, f"{name}.plan.json")
        if not (os.path.exists(html_path) and os.path.exists(plan_path)):
            bad.append(f"{name}: missing {name}.html or {name}.plan.json")
            continue
        with open(html_path, encoding="utf-8") as f:
            if f.read() != render_from_saved(name):
                bad.append(f"{name}.html differs from the HTML the current code renders from {name}.plan.json")
        if replan:
            plan, _ = plan_sample(name)
            with open(plan_path) as f:
                if _comparable(plan.to_json()) != _comparable(f.read()):
                    bad.append(f"{name}.plan.json differs from the plan the current code produces")
        print(f"{name}: {'matches' if len(bad) == before else 'DIFFERS'}", flush=True)
    for line in bad:
        print("error: " + line, file=sys.stderr)
    if bad:
        print("run `python3 reports/regenerate.py` to refresh the samples", file=sys.stderr)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"samples to regenerate (default all: {', '.join(SAMPLES)})")
    ap.add_argument("--check", action="store_true", help="compare instead of writing (re-plans too)")
    ap.add_argument("--render-only", action="store_true",
                    help="re-render the HTML from the saved plans; with --check, skip re-planning")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in SAMPLES]
    if unknown:
        ap.error(f"unknown sample(s) {', '.join(unknown)}; known: {', '.join(SAMPLES)}")
    names = args.names or list(SAMPLES)
    os.chdir(ROOT)  # model specs are relative to the repository root
    sys.path.insert(0, ROOT)
    if args.check:
        return check(names, replan=not args.render_only)
    from autopar.errors import AutoparError

    failed = 0
    for name in names:
        try:
            if args.render_only:
                with open(os.path.join(HERE, f"{name}.html"), "w", encoding="utf-8") as f:
                    f.write(render_from_saved(name))
                print(f"{name}: re-rendered", flush=True)
            else:
                write_sample(name, HERE)
        except AutoparError as exc:  # one broken sample must not stop the others
            failed += 1
            print(f"{name}: error: {exc}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
