"""Planner speed: wall time of `autopar plan` on the issue's two anchors, and
planning time against layers and GPUs.

    python benchmarks/planner.py            # writes benchmarks/results/planner.{md,json}
    python benchmarks/planner.py --quick    # anchors only

Anchors (issue 4): GPT-3 175B on 1,024 A100-80GB (128 nodes x 8), global
batch 1,536, seq 2,048, under 10 s; Llama-3 405B on 16,384 H100, under 30 s.
"Capture + plan" is the model file's capture on the meta device, then
`autopar.plan` on the captured graph (no lowering check).

Commands (issue 32): the same as a user types them, timed end to end in a
fresh process (Python and torch start-up, capture, the lowering's fake-tensor
checks of what can run split, the search): GPT-3 175B on 1,024 A100-80GB, and
Llama 3 405B on 8 A100-40GB, which does not fit and must say so in under 10 s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models.analytic import gpt  # noqa: E402
from cost_models.hardware import ClusterSpec  # noqa: E402

from autopar.capture import capture  # noqa: E402
from autopar.model_file import load_model  # noqa: E402
from autopar.solve import plan  # noqa: E402
from autopar.solve.planner import scaled_cluster  # noqa: E402

ANCHORS = [
    # label, model file spec, device, nodes, global batch, target seconds
    ("GPT-3 175B, 1,024 A100-80GB", "examples/gpt.py:gpt3_175b", "a100-80g", 128, 1536, 10.0),
    ("Llama-3 405B, 16,384 H100", "examples/llama.py:llama3_405b", "h100-sxm", 2048, 2048, 30.0),
]


def anchor(label, spec, device, nodes, batch, target):
    t0 = time.perf_counter()
    loaded = load_model(str(ROOT / spec))
    graph = capture(loaded.model, loaded.example_inputs, name=loaded.name)
    t1 = time.perf_counter()
    cluster = scaled_cluster(ClusterSpec.resolve(device), nodes)
    p = plan(graph, cluster, global_batch_size=batch)
    t2 = time.perf_counter()
    return {"run": label, "model": spec, "layers": len(graph.layers), "gpus": cluster.world_size,
            "global_batch": batch, "capture_s": round(t1 - t0, 2), "plan_s": round(t2 - t1, 2),
            "total_s": round(t2 - t0, 2), "target_s": target, "met": (t2 - t0) < target,
            "mesh": f"pp{p.mesh.pp} x dp{p.mesh.dp} x tp{p.mesh.tp}" + (" +SP" if p.sequence_parallel else ""),
            "schedule": p.schedule if p.schedule != "interleaved" else f"interleaved:{p.virtual_stages}",
            "micro_batch": f"{p.micro_batch_size} x {p.num_micro_batches}",
            "step_time_s": round(p.predicted.step_time_s, 3), "mfu": round(p.predicted.mfu, 4),
            "solver_status": p.solver["status"], "gap": p.solver["gap"], "candidates": p.solver["candidates"],
            "solved": p.solver["solved"], "pruned": p.solver["pruned_by_bound"],
            "layer_cost_calls": p.solver["layer_cost_calls"]}


COMMANDS = [
    # label, argv after `autopar plan`, target seconds, expected exit status
    ("GPT-3 175B, 1,024 A100-80GB", ["examples/gpt.py:gpt3_175b", "--gpus", "1024", "--device", "a100-80g",
                                     "--batch-size", "1536"], 10.0, 0),
    ("Llama 3 405B, 8 A100-40GB (does not fit)", ["examples/llama.py:llama3_405b", "--gpus", "8", "--device",
                                                  "a100-40g", "--batch-size", "16"], 10.0, 2),
]


def command(label, argv, target, expected_rc):
    """Wall time of `autopar plan ARGV` in a fresh process, and its first error line if any."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autopar", "plan", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    wall = time.perf_counter() - t0
    said = next((line for line in done.stderr.splitlines() if ": error: " in line), "")
    return {"run": label, "command": "autopar plan " + " ".join(argv), "wall_s": round(wall, 2),
            "target_s": target, "exit": done.returncode, "met": wall < target and done.returncode == expected_rc,
            "error": said.split(": error: ", 1)[-1][:160]}


def scaling():
    rows = []
    for layers in (24, 48, 96):
        model = gpt(f"gpt-h12288-l{layers}", hidden=12288, heads=96, layers=layers, seq_len=2048, vocab_size=50257)
        for gpus in (64, 256, 1024):
            cluster = scaled_cluster(ClusterSpec.resolve("a100-80g"), gpus // 8)
            t0 = time.perf_counter()
            p = plan(model, cluster, global_batch_size=1536)
            rows.append({"layers": layers + 2, "gpus": gpus, "plan_s": round(time.perf_counter() - t0, 2),
                         "candidates": p.solver["candidates"], "solved": p.solver["solved"],
                         "status": p.solver["status"],
                         "mesh": f"pp{p.mesh.pp} x dp{p.mesh.dp} x tp{p.mesh.tp}"})
            print(rows[-1], flush=True)
    return rows


def render(anchors, grid, commands=()) -> str:
    lines = ["# Planner speed", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other "
             "jobs while measured (load average "
             f"{os.getloadavg()[0]:.1f}); one CP-SAT worker. Command: `python benchmarks/planner.py`.", "",
             "## Anchors (issue 4)", "",
             "| run | layers | GPUs | capture s | plan s | total s | target s | met | plan | step s | MFU | "
             "solver | candidates / solved / pruned |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in anchors:
        lines.append(f"| {a['run']} | {a['layers']} | {a['gpus']} | {a['capture_s']} | {a['plan_s']} | "
                     f"{a['total_s']} | {a['target_s']} | {'yes' if a['met'] else 'NO'} | {a['mesh']}, "
                     f"{a['schedule']}, mb {a['micro_batch']} | {a['step_time_s']} | {a['mfu']:.1%} | "
                     f"{a['solver_status']} (gap {'n/a' if a['gap'] is None else format(a['gap'], '.1%')}) | {a['candidates']} / {a['solved']} / {a['pruned']} |")
    if commands:
        lines += ["", "## Commands, end to end in a fresh process (issue 32)", "",
                  "| run | command | wall s | target s | exit | met | error |", "|---|---|---|---|---|---|---|"]
        for c in commands:
            lines.append(f"| {c['run']} | `{c['command']}` | {c['wall_s']} | {c['target_s']} | {c['exit']} | "
                         f"{'yes' if c['met'] else 'NO'} | {c['error']} |")
    if grid:
        lines += ["", "## Planning time against layers and GPUs (analytic GPT, hidden 12288, batch 1536, A100-80GB)",
                  "", "| layers | GPUs | plan s | candidates | solved | status | mesh |", "|---|---|---|---|---|---|---|"]
        for r in grid:
            lines.append(f"| {r['layers']} | {r['gpus']} | {r['plan_s']} | {r['candidates']} | {r['solved']} | "
                         f"{r['status']} | {r['mesh']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="anchors and commands only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner"))
    args = ap.parse_args(argv)
    anchors = []
    for a in ANCHORS:
        anchors.append(anchor(*a))
        print(anchors[-1], flush=True)
    commands = []
    for c in COMMANDS:
        commands.append(command(*c))
        print(commands[-1], flush=True)
    grid = [] if args.quick else scaling()
    Path(args.out + ".json").write_text(json.dumps({"anchors": anchors, "commands": commands, "scaling": grid},
                                                   indent=2) + "\n")
    Path(args.out + ".md").write_text(render(anchors, grid, commands))
    print(render(anchors, grid, commands))
    return 0


if __name__ == "__main__":
    sys.exit(main())
