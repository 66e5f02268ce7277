"""`autopar export-config PLAN.json --to TARGET -o PATH`: a plan as the configuration of
another training stack (DeepSpeed, torchtitan, Megatron-Core / NeMo, accelerate, Hugging
Face transformers); `autopar plan ... --export-config TARGET -o PATH` does the same for
the plan it just made.

    autopar export-config plan.json --to deepspeed -o ds_config.json
    autopar export-config plan.json --to torchtitan -o train.sh

The translation is autopar/export_config/. What the target cannot express is said in
the file and here, with the nearest layout it can express; where the model can be
captured (the plan's recorded model file is found from here, or `autopar plan` just
captured it) that layout is priced by the cost model beside the plan's own prediction,
and where a target takes one checkpointing mode for every layer, the fastest mode that
fits memory is the one written.
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

from autopar.errors import AutoparError
from autopar.export_config import TARGETS, export
from autopar.export_config.common import CHECKPOINT_STRENGTH, DEFAULT_CLIP, describe

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan_file", metavar="PLAN.json", help="a plan saved with `autopar plan ... --json`")
    p.add_argument("--to", dest="target", required=True, choices=tuple(TARGETS), help="the training stack")
    p.add_argument("-o", "--output", metavar="PATH", default=None,
                   help="where to write it (default: " + ", ".join(f"{n} for {t}" for t, (_, n) in TARGETS.items())
                        + ")")
    add_export_options(p)
    p.add_argument("--model", default=None, metavar="FILE.py[:factory]",
                   help="the model file, to price the nearest layout (default: the one the plan records)")


def add_export_options(p) -> None:
    p.add_argument("--clip", type=float, default=DEFAULT_CLIP, metavar="NORM",
                   help=f"gradient clipping by the global norm written into the config (default {DEFAULT_CLIP})")


def run(args) -> int:
    from autopar.plan_file import load_plan_file

    check_output(args.output, args.clip)
    plan = load_plan_file(args.plan_file)
    graph, why = _graph_of(plan, args.model)
    write_export(plan, graph, args.target, args.output, clip=args.clip, no_graph_why=why)
    return 0


def add_plan_export_arguments(p) -> None:
    """`autopar plan`'s flags for the same export of the plan it makes."""
    p.add_argument("--export-config", default=None, choices=tuple(TARGETS), metavar="TARGET",
                   help="also write the plan as a config of TARGET: " + ", ".join(TARGETS) + " (-o PATH)")
    p.add_argument("-o", "--output", default=None, metavar="PATH", help="with --export-config: where to write it")
    add_export_options(p)


def check_plan_export(args) -> None:
    if args.output and not args.export_config:
        raise AutoparError(f"-o {args.output} without --export-config: `autopar plan` writes a file only for it",
                           hint="add --export-config deepspeed|torchtitan|megatron|accelerate|hf, or use --html FILE")
    if args.export_config:
        check_output(args.output, args.clip)


def plan_export(args, plan, graph) -> None:
    if args.export_config:
        write_export(plan, graph, args.export_config, args.output, clip=args.clip,
                     out=sys.stderr if args.json else sys.stdout)


def check_output(path: str | None, clip: float) -> None:
    """Refused before any planning or capture: a folder that does not exist, a bad clip."""
    if not clip > 0:  # also refuses nan
        raise AutoparError(f"--clip must be a positive number, got {clip}")
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        what = "is a folder" if os.path.isdir(path) else f"folder {folder} does not exist"
        raise AutoparError(f"-o {path}: {what}", hint="pass a file path in an existing folder")


def _graph_of(plan, model: str | None):
    """(the captured model, None) or (None, why it cannot be captured here)."""
    from autopar.commands.common import load_graph
    from autopar.model_file import split_spec

    spec = model or (plan.model.get("source") if isinstance(plan.model, dict) else None)
    if not spec:
        return None, "the plan records no model file (pass --model)"
    if not os.path.isfile(split_spec(spec)[0]):
        return None, f"its model file {spec} is not found from here (pass --model)"
    try:
        graph, _ = load_graph(SimpleNamespace(model=spec, seq_len=None, precision=plan.precision, json=True))
    except AutoparError as exc:
        return None, f"capturing {spec} failed: {exc.message}"
    return graph, None


def write_export(plan, graph, target: str, path: str | None, *, clip: float = DEFAULT_CLIP,
                 no_graph_why: str | None = None, out=None) -> None:
    """Write `plan` for `target` to `path` and say what it sets, what it could not express and,
    with `graph`, the nearest layout's predicted step time beside the plan's own."""
    out = out or sys.stdout
    path = path or TARGETS[target][1]
    if graph is not None:
        plan = with_shape(plan, graph)
        result, priced = _fastest_fitting(plan, graph, target, clip)
    else:
        result, priced = export(plan, target, clip), None
    with open(path, "w", encoding="utf-8") as f:
        f.write(result.text)
    print(f"wrote {path}: {result.target} config of {plan.model.get('name') or 'the model'}: {result.summary}",
          file=out)
    for line in _report(plan, result, priced, graph, no_graph_why):
        print(line, file=out)


def with_shape(plan, graph):
    """A copy of `plan` whose `model["shape"]` holds the captured blocks' width and heads
    (what Megatron's config names; the Plan itself records no model shape)."""
    from autopar.export_config.common import copy_plan

    attrs = next((getattr(layer, "attrs", None) or {} for layer in graph.layers
                  if (getattr(layer, "attrs", None) or {}).get("heads")), {})
    shape = {k: attrs[k] for k in ("hidden", "heads", "kv_heads", "ffn_hidden") if attrs.get(k)}
    if not shape:
        return plan
    plan = copy_plan(plan)
    plan.model["shape"] = shape
    return plan


def _fastest_fitting(plan, graph, target: str, clip: float):
    """The export whose one checkpointing mode gives the fastest nearest layout within the plan's
    memory limit (the most recomputing mode when none fits), and (its estimate, the plan's, limit)."""
    from autopar.solve.reprice import plan_cluster, plan_estimate

    cluster = plan_cluster(plan)
    limit = (plan.solver or {}).get("memory_limit_bytes") or cluster.device_profile.usable_memory_bytes
    own = plan_estimate(graph, plan, cluster)
    best = None
    for mode in CHECKPOINT_STRENGTH:
        result = export(plan, target, clip, checkpoint=mode)
        est = plan_estimate(graph, result.nearest, cluster)
        fits = max(est.peak_memory_bytes, default=0.0) <= limit
        key = (not fits, est.step_time_s if fits else -CHECKPOINT_STRENGTH.index(mode))
        if best is None or key < best[0]:
            best = (key, result, est)
    return best[1], (best[2], own, limit)


def _report(plan, result, priced, graph, no_graph_why) -> list[str]:
    lines = []
    if result.notes:
        lines.append(f"not expressible in {result.target} (the file says so too):")
        lines += [f"  - {n}" for n in result.notes]
        lines.append(f"nearest expressible layout: {describe(result.nearest)}")
    else:
        lines.append(f"every choice of the plan is expressed exactly in {result.target}")
    if priced is None:
        why = no_graph_why or "no model to capture"
        lines.append(f"predicted step time of this layout: not available here ({why}); the plan predicted "
                     f"{plan.predicted.step_time_s:.3f} s/step for its own layout")
        return lines
    est, own, limit = priced
    peak = max(est.peak_memory_bytes, default=0.0)
    change = est.step_time_s / own.step_time_s - 1 if own.step_time_s else 0.0
    fits = "fits" if peak <= limit else "does NOT fit"
    lines.append(f"predicted {est.step_time_s:.3f} s/step (autopar's plan: {own.step_time_s:.3f} s/step, "
                 f"{change:+.1%}); peak memory {peak / GB:.1f} GB per GPU, {fits} the plan's limit {limit / GB:.1f} GB")
    if result.notes and any("activation checkpointing" in n for n in result.notes):
        lines.append("  (the checkpointing mode written is the fastest uniform one that fits, by cost_models.estimate)")
    return lines
