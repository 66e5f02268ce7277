"""The run at its end as one PNG: loss, step time and memory per step, measured
beside the plan's predictions.

`train.py --metrics FILE` writes FILE with the suffix .png when the run ends or
stops on a signal (rank 0; `--plot PATH` elsewhere, `--no-plot` none). Three
panels share the step axis: the training loss (and the held-out loss with
--eval-data); the step time, the slowest rank's, against the plan's predicted
step time; rank 0's peak allocated memory (CUDA only) against the plan's
predicted peak of its fullest pipeline rank. The series and the predictions come
from `autopar.metrics_file`, as the report's "This run" section does.

matplotlib draws on its Agg canvas (no display, no pyplot state) and is imported
only here, when a plot is written. A plot that fails never fails the run: the
snapshot is saved before it, and `plot_run` prints one line instead of raising.
"""
from __future__ import annotations

import os
import sys

from autopar.metrics_file import (MEMORY_NOT_MEASURED, RunSeries, axis_top, predictions, read_rows, run_facts,
                                  series)

MEASURED, PREDICTED, HELD_OUT = "#4c78a8", "#c0392b", "#f58518"  # the report's "This run" colours
TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "\u00b5s"))
BYTE_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B"))  # decimal, as the report


def plot_path(plot: str | None, no_plot: bool, metrics_path: str | None) -> str | None:
    """Where the PNG goes: --plot, else the metrics file with the suffix .png; None
    with --no-plot or without a metrics file to draw."""
    if no_plot or not metrics_path:
        return None
    if plot:
        return plot
    path = os.path.splitext(metrics_path)[0] + ".png"
    return path if path != metrics_path else path + ".png"  # never over the metrics themselves


def plot_run(metrics_path: str, png_path: str, plan) -> str | None:
    """Draw the metrics file beside `plan`'s predictions into `png_path` -> the path, or
    None after one line on stderr saying why not (any failure: the run is not lost)."""
    try:
        return write_png(series(read_rows(metrics_path), plan.global_batch_size), png_path,
                         predictions(plan.predicted), _title(plan))
    except Exception as exc:  # noqa: BLE001 - a plot is never worth the run's exit code
        print(f"autopar: no plot written to {png_path} ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return None


def _title(plan) -> str:
    m = plan.mesh
    return (f"{plan.model.get('name') or 'model'} on {m.world_size} ranks (pp {m.pp} x dp {m.dp} x tp {m.tp}): "
            "measured beside the plan's prediction")


def write_png(run: RunSeries, path: str, predicted: dict, title: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8.0, 9.0), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss, time, memory = fig.subplots(3, 1, sharex=True)
    fig.suptitle(title, fontsize=10)
    _loss_panel(loss, run)
    median = _show(run_facts(run, predicted)["median_step_time_s"], TIME_UNITS)
    _against_panel(time, run.step_time_s, predicted["step_time_s"], TIME_UNITS, "step time",
                   measured=f"measured, the slowest rank's (median after the first: {median})",
                   missing="no step time recorded")
    _against_panel(memory, run.peak_memory_bytes, predicted["peak_memory_bytes"], BYTE_UNITS, "peak memory",
                   measured="measured: rank 0's peak allocated so far",
                   missing=MEMORY_NOT_MEASURED)
    memory.set_xlabel("step")
    memory.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by the three panels
    fig.savefig(path)
    return path


def _loss_panel(ax, run: RunSeries) -> None:
    if run.loss:
        ax.plot(*zip(*run.loss), color=MEASURED, linewidth=1.2, label="training loss")
    if run.eval_loss:
        ax.plot(*zip(*run.eval_loss), "o-", color=HELD_OUT, markersize=4, label="held-out loss (--eval-data)")
    ax.set_title("loss per step", fontsize=10)
    ax.set_ylabel("loss")
    _finish_axes(ax, bool(run.loss or run.eval_loss), "no finite loss recorded")


def _against_panel(ax, points, predicted, units, what: str, *, measured: str, missing: str) -> None:
    """`points` against the horizontal line of the prediction, in one unit that suits both."""
    values = [v for _, v in points]
    top, clipped = axis_top(values, predicted)
    scale, unit = _unit([top], units)
    if points:
        ax.plot([s for s, _ in points], [v / scale for v in values], color=MEASURED, linewidth=1.2,
                marker="." if len(points) < 40 else None, label=measured)
    if clipped:
        ax.text(0.01, 0.92, f"\u2191 step {points[0][0]}: {values[0] / scale:.3g} {unit} (warm-up), above the scale",
                transform=ax.transAxes, fontsize=8, color=MEASURED)
    if predicted:
        ax.axhline(predicted / scale, color=PREDICTED, linestyle="--", linewidth=1.5,
                   label=f"predicted by the plan: {predicted / scale:.3g} {unit}")
    ax.set_title(f"{what} per step", fontsize=10)
    ax.set_ylabel(f"{what} ({unit})")
    ax.set_ylim(0, top / scale)
    _finish_axes(ax, bool(points or predicted), missing)
    if points and not predicted:
        ax.text(0.01, 0.04, "the plan has no prediction (a hand-written plan)", transform=ax.transAxes, fontsize=8)
    elif predicted and not points:
        ax.text(0.5, 0.3, missing, transform=ax.transAxes, ha="center", fontsize=8)


def _finish_axes(ax, drawn: bool, missing: str) -> None:
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, missing, transform=ax.transAxes, ha="center", fontsize=9)


def _unit(values: list, units) -> tuple[float, str]:
    """The largest unit the largest value reaches (0.004 s -> ms, 3e9 B -> GB)."""
    top = max((abs(v) for v in values), default=0.0)
    return next(((scale, name) for scale, name in units if top >= scale), units[-1])


def _show(value, units) -> str:
    if value is None:
        return "none"
    scale, unit = _unit([value], units)
    return f"{value / scale:.3g} {unit}"
