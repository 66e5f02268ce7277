"""The per-step metrics file of a training run (`train.py --metrics FILE`), read back.

`autopar/train/metrics.py` writes it, one JSON object a line. Two readers draw
it: the plot at the end of the run (`autopar/train/plot.py`, a PNG) and the
report's "This run" section (`autopar/report/run.py`, inline SVG). Both take
their series, medians and the plan's predictions from here, so the PNG and the
page can never tell the same run two ways. Pure: json and statistics only.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass

from autopar.errors import AutoparError

Points = list  # [(step, value)], finite values only
MEMORY_NOT_MEASURED = "not measured: CPU ranks record no peak (CUDA's max_memory_allocated on GPUs)"


def read_rows(path: str) -> list[dict]:
    """One row per step, in step order. A line cut off by a crash is passed over, and
    a step written twice (a restart that replayed it) keeps its last row."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as exc:
        raise AutoparError(f"cannot read the metrics file {path}: {exc.strerror}",
                           hint="train.py --metrics FILE writes it (rank 0), one JSON line per step") from exc
    by_step = {}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    if not by_step:
        raise AutoparError(f"the metrics file {path} holds no step", hint="is it the file train.py --metrics wrote?")
    return [by_step[s] for s in sorted(by_step)]


def predictions(predicted) -> dict:
    """The numbers a run is held against, from a Plan's `predicted` (the dataclass or
    its JSON dict): None where the plan priced nothing (a hand-written plan has 0)."""
    if dataclasses.is_dataclass(predicted):
        predicted = dataclasses.asdict(predicted)
    pred = predicted or {}
    return {"step_time_s": pred.get("step_time_s") or None,
            "throughput": pred.get("tokens_per_s") or pred.get("samples_per_s") or None,
            "mfu": pred.get("mfu") or None,
            "peak_memory_bytes": max(pred.get("peak_memory_bytes") or [0]) or None}


def median_after_first(times: list) -> float | None:
    """The median step time over the steps after the first (which compiles and warms
    the allocator), or the one step there is; None without any."""
    times = list(times)
    return statistics.median(times[1:] or times) if times else None


def _points(rows: list[dict], key: str) -> Points:
    return [(r["step"], float(r[key])) for r in rows
            if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool) and math.isfinite(r[key])]


@dataclass(frozen=True)
class RunSeries:
    """What the three panels draw, measured, each as (step, value) points."""
    loss: Points
    eval_loss: Points
    step_time_s: Points
    peak_memory_bytes: Points  # rank 0's allocator peak so far; CUDA only (empty on CPU ranks)
    recorded: dict  # the predictions the rows were written beside (their last row's)
    priced_step_time_s: Points  # the step times of the steps run at the plan's global batch


def series(rows: list[dict], global_batch: int | None = None) -> RunSeries:
    """The run's points; `global_batch` (the plan's): which steps its step time prediction
    is for (a run's --batch-size / --batch-ramp steps at another batch are drawn, not compared)."""
    last = rows[-1] if rows else {}
    priced = [r for r in rows if global_batch is None or r.get("global_batch", global_batch) == global_batch]
    return RunSeries(loss=_points(rows, "loss"), eval_loss=_points(rows, "eval_loss"),
                     step_time_s=_points(rows, "step_time_s"), peak_memory_bytes=_points(rows, "peak_memory_bytes"),
                     recorded={"step_time_s": last.get("predicted_step_time_s"),
                               "peak_memory_bytes": last.get("predicted_peak_memory_bytes")},
                     priced_step_time_s=_points(priced, "step_time_s"))


def run_facts(run: RunSeries, predicted: dict) -> dict:
    """The run in a few numbers beside the plan's `predictions`: steps, the median step
    time after the first (of the steps at the plan's batch) and the peak memory, each
    with its ratio to the prediction."""
    steps = sorted({s for s, _ in run.loss + run.step_time_s})
    median = median_after_first([t for _, t in run.priced_step_time_s])
    peak = max((b for _, b in run.peak_memory_bytes), default=None)
    pred_t, pred_m = predicted.get("step_time_s"), predicted.get("peak_memory_bytes")
    return {"steps": len(steps), "first_step": steps[0] if steps else None, "last_step": steps[-1] if steps else None,
            "median_step_time_s": median, "predicted_step_time_s": pred_t,
            "step_time_ratio": median / pred_t if median and pred_t else None,
            "peak_memory_bytes": peak, "predicted_peak_memory_bytes": pred_m,
            "memory_ratio": peak / pred_m if peak and pred_m else None,
            "last_loss": run.loss[-1][1] if run.loss else None,
            "last_eval_loss": run.eval_loss[-1][1] if run.eval_loss else None}


def axis_top(values: list, predicted: float | None) -> tuple[float, bool]:
    """The top of a panel's value axis, for the PNG and the page alike -> (top, whether
    the first value is drawn off the scale): a first step that compiles and warms up
    (often ten times the rest) would flatten every later step and the prediction into
    the floor, so when it is over twice everything else the axis stops above the rest."""
    rest = list(values[1:]) + ([predicted] if predicted else [])
    top_rest = max(rest, default=0.0)
    if values and top_rest > 0 and values[0] > 2 * top_rest:
        return top_rest * 1.15, True
    return max(list(values) + rest, default=0.0) * 1.08 or 1.0, False
