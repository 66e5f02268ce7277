"""`autopar plan model.py[:factory] --gpus N`: search the layout and print it.

Prints the plan as tables a person reads top to bottom (what was planned,
the mesh, how fast and how full, the stages, the per-layer choices with runs
of identical layers collapsed, the alternatives and why they lost);
`--json` prints the Plan's JSON instead, `--html FILE` also writes the
report. A spinner on stderr shows progress when stderr is a terminal.
"""
from __future__ import annotations

import re
import sys
import threading
import time

from autopar.commands.common import add_plan_arguments, check_report_path, plan_from_args, stderr_is_tty
from autopar.engine import priced_for
from autopar.errors import AutoparError
from autopar.report.format import bytes_
from autopar.report.tables import not_offered

GB = 1e9


def add_arguments(parser) -> None:
    add_plan_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the Plan as JSON on stdout (nothing else)")
    parser.add_argument("--top", type=int, default=5, metavar="K", help="alternatives to keep and show (default 5)")
    parser.add_argument("--html", default=None, metavar="FILE", help="also write the HTML report of the plan to FILE")
    from autopar.commands.export_config import add_plan_export_arguments
    add_plan_export_arguments(parser)


def run(args) -> int:
    # Checked before minutes of planning, not after.
    if args.top < 0:
        raise AutoparError(f"--top must be >= 0, got {args.top}")
    if args.html:
        check_report_path(args.html, "--html")
    from autopar.commands.export_config import check_plan_export, plan_export
    check_plan_export(args)
    t0 = time.perf_counter()
    plan, graph = _plan_with_progress(args)
    wall = time.perf_counter() - t0
    if args.html:
        _write_html(plan, args.html, graph)
    plan_export(args, plan, graph)  # --export-config: to stderr under --json, stdout stays the Plan
    if args.json:
        sys.stdout.write(plan.to_json() + "\n")
        return 0
    from rich.console import Console

    console = Console()
    render(plan, console, top=args.top, wall_s=wall)
    if args.html:
        console.print(f"report written to [bold]{args.html}[/]")
    return 0


def _plan_with_progress(args):
    if not stderr_is_tty():  # a log file or a CI runner: lines, once the work has taken a few seconds
        progress = progress_lines(sys.stderr)
        # capture reports no progress: say it is under way if it is still going after a while
        timer = threading.Timer(progress.quiet_s, lambda: progress("capturing the model and pricing", 0, 0, None))
        timer.daemon = True
        timer.start()
        try:
            return plan_from_args(args, progress=progress)
        finally:
            timer.cancel()
    from rich.console import Console

    err = Console(stderr=True)
    with err.status("capturing the model...") as status:
        def progress(phase, done, total, best_s):
            best = f", best {best_s:.3f} s/step" if best_s else ""
            status.update(f"{phase} layouts: {done}/{total}{best}")
        return plan_from_args(args, progress=progress)


def progress_lines(stream, every_s: float = 5.0, quiet_s: float = 3.0):
    """progress(phase, done, total, best_s) writing a line to `stream` when the phase
    changes, at the end of a phase and at most every `every_s` seconds between, once
    the work has taken `quiet_s` (a quick answer, or an error, stays one clean message):
    long planning says it is alive where no spinner can draw (stderr not a terminal)."""
    t0, state = time.monotonic(), {"phase": None, "at": -every_s}
    lock = threading.Lock()  # the capture timer calls it from its own thread

    def progress(phase, done, total, best_s):
        now = time.monotonic()
        with lock:
            if now - t0 < quiet_s or (phase == state["phase"] and done < total and now - state["at"] < every_s):
                return
            state.update(phase=phase, at=now)
            best = f", best {best_s:.3f} s/step" if best_s else ""
            count = f" layouts {done}/{total}" if total else " ..."
            stream.write(f"autopar plan: {phase}{count}{best} ({now - t0:.0f} s)\n")
            stream.flush()
    progress.quiet_s = quiet_s
    return progress


def _write_html(plan, path, graph) -> None:
    try:
        import autopar.report as report
    except ImportError as exc:  # pragma: no cover - the package ships with autopar
        raise AutoparError(f"--html needs autopar.report: {exc}") from exc
    if hasattr(report, "write_html"):
        report.write_html(plan, path, graph)
    elif hasattr(report, "render_html"):
        with open(path, "w") as f:
            f.write(report.render_html(plan, graph))
    else:
        raise AutoparError("this autopar has no HTML report yet (autopar.report.write_html is missing)")


# -- terminal rendering ---------------------------------------------------------
def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def _fmt_count(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def name_range(names: list[str]) -> str:
    """'blocks.0'..'blocks.11' -> 'blocks.0-11'; otherwise 'first .. last'."""
    if len(names) == 1:
        return names[0]
    parts = [re.fullmatch(r"(.*?)(\d+)", n) for n in names]
    if all(parts) and len({p.group(1) for p in parts}) == 1:
        nums = [int(p.group(2)) for p in parts]
        if nums == list(range(nums[0], nums[0] + len(nums))):
            return f"{parts[0].group(1)}{nums[0]}-{nums[-1]}"
    return f"{names[0]} .. {names[-1]}"


def collapse_runs(layers) -> list[tuple[list, object]]:
    """Consecutive layers with the same kind and choices, as (layers, first)."""
    runs = []
    for c in layers:
        key = (c.kind, c.zero, c.checkpoint, c.offload, c.tp_style, len(c.float8 or []))
        if runs and runs[-1][0] == key:
            runs[-1][1].append(c)
        else:
            runs.append((key, [c]))
    return [(group, group[0]) for _, group in runs]


def _bar(used: float, capacity: float, width: int = 24) -> str:
    frac = used / capacity if capacity else 0.0
    filled = min(width, int(round(frac * width)))
    color = "green" if frac <= 0.85 else "yellow" if frac <= 1.0 else "red"
    return f"[{color}]{'#' * filled}[/][dim]{'.' * (width - filled)}[/] {frac:.0%}"


def render(plan, console, top: int = 5, wall_s: float | None = None) -> None:
    """The plan as tables read top to bottom: what was planned, the mesh, how fast, how
    full, the stages and per-layer choices, the alternatives, the solver's account."""
    _print_heading(plan, console)
    _print_layout(plan, console)
    _print_speed(plan, console)
    _print_baselines(plan, console)
    _print_memory(plan, console)
    _print_stages(plan, console)
    if plan.alternatives and top:
        _print_alternatives(plan, console, top)
    limits = not_offered(plan)
    if limits:
        console.print("[bold]Not offered[/] (autopar cannot lower them for this model):")
        for line in limits:
            console.print(f"  {line}", markup=False)
    _print_solver(plan, console, wall_s)


def _print_heading(plan, console) -> None:
    """The model, the cluster, the batch and precision; what was pinned; who it is priced for."""
    m, cl = plan.model, plan.cluster
    world = plan.mesh.world_size
    seq = f", seq {plan.seq_len}" if plan.seq_len else ""  # images and MLPs have no sequence axis
    nodes = cl.get("nodes")
    console.print(f"[bold]{m.get('name')}[/] ({_fmt_count(m.get('total_params', 0))} parameters, "
                  f"{m.get('num_layers')} layers{seq}) on {world} x {cl.get('device')} "
                  f"({nodes} node{'s' if nodes != 1 else ''} x {cl.get('gpus_per_node')}), "
                  f"global batch {plan.global_batch_size}, {plan.precision}")
    if plan.constraints:
        console.print("pinned: " + ", ".join(f"{k}={v}" for k, v in sorted(plan.constraints.items())))
    console.print("priced for: " + priced_for(plan), markup=False)


def _table(title: str, columns, justify: str | None = None):
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    for col in columns:
        if justify:
            table.add_column(col, justify=justify)
        else:
            table.add_column(col)
    return table


def _print_layout(plan, console) -> None:
    mesh = _table("Layout", ("pp", "dp", "tp", "seq. parallel", "schedule", "micro-batch", "count"), "right")
    sched = plan.schedule if plan.schedule != "interleaved" else f"interleaved (V={plan.virtual_stages})"
    dp = plan.mesh.dp_text().removeprefix("dp ")  # "8 = 2 replicas x 4 shards" under HSDP
    mesh.add_row(str(plan.mesh.pp), dp, str(plan.mesh.tp), "on" if plan.sequence_parallel else "off",
                 sched, str(plan.micro_batch_size), str(plan.num_micro_batches))
    console.print(mesh)
    for key in ("ep", "hsdp", "cp", "compression"):  # why the plan splits experts / shards / cuts sequences as it does, the reduction dtype
        why = (plan.solver or {}).get(key) if isinstance(plan.solver, dict) else None
        if why:
            console.print(why, markup=False)


def _print_speed(plan, console) -> None:
    p = plan.predicted
    # tokens/s only for token models (the captured inputs have a sequence axis); samples/s always
    tokens = [_fmt_count(p.tokens_per_s)] if plan.token_model and p.tokens_per_s is not None else []
    speed = _table("Predicted", ("step time", "samples/s", *(["tokens/s"] if tokens else []), "TFLOP/s per GPU",
                                 "MFU"), "right")
    tflops = f"{p.tflops_per_gpu:.0f}" if p.tflops_per_gpu >= 10 else f"{p.tflops_per_gpu:.2g}"
    speed.add_row(_fmt_time(p.step_time_s), _fmt_count(p.samples_per_s), *tokens, tflops, f"{p.mfu:.1%}")
    console.print(speed)
    if p.time_breakdown:
        parts = [f"{k.removesuffix('_s').replace('_', ' ')} {_fmt_time(v)}" for k, v in p.time_breakdown.items()
                 if k.endswith("_s") and k != "step_time_s" and isinstance(v, (int, float)) and v > 0]
        console.print("per step: " + ", ".join(parts))


def _print_baselines(plan, console) -> None:
    """What a user of DeepSpeed or FSDP alone would run (Plan.baselines), beside the plan's step time."""
    if not plan.baselines:
        return  # a plan saved before the comparison existed
    console.print(f"[bold]Beside one stack alone[/] (its fastest layout that fits, same cost model; "
                  f"autopar's plan: {_fmt_time(plan.predicted.step_time_s)} per step):")
    for b in plan.baselines:
        console.print(f"  {b['name']}: {_baseline_verdict(b)}", markup=False)
        if b.get("config"):
            peak = max(b.get("predicted", {}).get("peak_memory_bytes") or [0.0])
            console.print(f"    {b['config']}; dp {b['gpus']}, peak {bytes_(peak, 1)} per GPU", markup=False,
                          style="dim")
        if b.get("status") != "oom":  # an oom verdict already says why
            console.print(f"    {b['why']}", markup=False, style="dim")


def _baseline_verdict(b: dict) -> str:
    """'39.99 s per step, 2.02x slower than autopar's plan', or why it does not run."""
    step, ratio = (b.get("predicted") or {}).get("step_time_s"), b.get("vs_plan")
    if not b.get("fits"):
        return b.get("why", "does not fit")
    if not ratio:
        return f"{_fmt_time(step)} per step"
    if abs(ratio - 1) < 0.005:
        return f"{_fmt_time(step)} per step, ties autopar's plan (within 0.5%)"
    if ratio > 1:
        return f"{_fmt_time(step)} per step, {ratio:.2f}x slower than autopar's plan"
    return f"{_fmt_time(step)} per step, {1 / ratio:.2f}x faster than autopar's plan (a planner bug: please report it)"


def _print_memory(plan, console) -> None:
    p = plan.predicted
    # One unit for the whole table, chosen by its largest number: GB for real models,
    # MB / kB for the tiny ones people try first (0.0 GB everywhere reads as a bug).
    largest = max(p.peak_memory_bytes, default=0.0)
    unit, scale = next(((u, s) for u, s in (("GB", GB), ("MB", 1e6), ("kB", 1e3)) if largest >= s), ("B", 1.0))
    memt = _table(f"Memory per GPU ({unit})",
                  ("pp rank", "model states", "activations", "buffers", "total", "of capacity"), "right")
    for r, peak in enumerate(p.peak_memory_bytes):
        b = p.memory_breakdown[r] if r < len(p.memory_breakdown) else {}
        cap = b.get("capacity") or 0.0
        states = sum(b.get(k, 0.0) for k in ("params", "grads", "optimizer"))
        memt.add_row(str(r), f"{states / scale:.1f}", f"{b.get('activations', 0.0) / scale:.1f}",
                     f"{b.get('buffers', 0.0) / scale:.1f}", f"{peak / scale:.1f}",
                     _bar(peak, cap, 10) + (f" of {bytes_(cap, 0)}" if cap else ""))
    console.print(memt)
    line = memory_limit_line(plan)
    if line:
        console.print(line)


def _print_stages(plan, console) -> None:
    float8 = any(c.float8 for c in plan.layer_choices)  # the column only for a plan that runs float8
    st = _table("Stages and per-layer choices", ("stage", "rank", "layers", "zero", "checkpoint", "offload",
                                                  "tensor parallel") + (("float8 Linears",) if float8 else ()))
    for stage in plan.stages:
        for i, (group, c) in enumerate(collapse_runs(stage.layers)):
            label = name_range([x.name for x in group]) + (f" ({len(group)})" if len(group) > 1 else "")
            st.add_row(str(stage.index) if i == 0 else "", str(stage.pp_rank) if i == 0 else "", label,
                       str(c.zero), c.checkpoint, c.offload, c.tp_style,
                       *((str(len(c.float8)) if c.float8 else "-",) if float8 else ()))
    console.print(st)
    account = plan.assumptions.get("float8") if isinstance(plan.assumptions, dict) else None
    for layer, why in sorted(((account or {}).get("kept_bf16") or {}).items()):
        console.print(f"  {layer} keeps bf16: {why}", markup=False)


def _print_alternatives(plan, console, top: int) -> None:
    alt = _table("Alternatives considered (fastest first)", ("#", "layout", "step time", "why it lost"))
    for i, a in enumerate(plan.alternatives[:top], 1):
        sched = a["schedule"] + (f":{a['virtual_stages']}" if a["schedule"] == "interleaved" else "")
        layout = (f"{a['mesh']['pp']}x{a['mesh']['dp']}x{a['mesh']['tp']}"
                  + (f" cp{a['mesh']['cp']}" if a["mesh"].get("cp") else "")
                  + (" SP" if a.get("sequence_parallel") else "")
                  + f", {sched}, mb {a['micro_batch_size']}x{a['num_micro_batches']}")
        step = a.get("predicted", {}).get("step_time_s")
        why = f"[red]{a['why']}[/]" if a["status"] == "oom" else a["why"]
        alt.add_row(str(i), layout, _fmt_time(step) if step else "-", why)
    console.print(alt)


def _print_solver(plan, console, wall_s: float | None) -> None:
    s = plan.solver
    gap = s.get("gap", 0)
    console.print(f"[dim]solver: {s.get('status')}" + (f" (gap {gap:.2%})" if gap is not None else "")
                  + f", {s.get('candidates')} candidate "
                  f"layouts, {s.get('solved')} solved, {s.get('pruned_by_bound')} pruned by bound, "
                  f"{s.get('oom')} out of memory"
                  + (f"; planned in {wall_s:.1f} s (capture included)" if wall_s is not None else "") + "[/]")
    if s.get("note"):  # the Plan is not the solver's own answer: say why, and that nothing is proven
        console.print(f"[dim]chosen: {s['note']}[/]")


def memory_limit_line(plan) -> str | None:
    """'memory limit 70.6 GB per GPU: usable 78.5 GB less the 10% headroom' (plans that record one)."""
    s = plan.solver or {}
    limit, headroom = s.get("memory_limit_bytes"), s.get("memory_headroom")
    if not isinstance(limit, (int, float)) or not isinstance(headroom, (int, float)):
        return None  # a plan saved before the headroom existed
    caps = [b.get("capacity") for b in plan.predicted.memory_breakdown if b.get("capacity")]
    usable = f"usable {bytes_(caps[0], 1)} less the {headroom:.0%} headroom" if caps else f"{headroom:.0%} headroom"
    fullest = max(plan.predicted.peak_memory_bytes, default=0.0)
    return (f"memory limit {bytes_(limit, 1)} per GPU ({usable}, --memory-headroom); "
            f"fullest GPU {fullest / limit:.0%} of it")
