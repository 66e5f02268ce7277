"""The "This run" section: a training run's metrics file beside the plan it ran.

`autopar report --plan plan.json --metrics m.jsonl` adds it to the page: the
loss, step time and memory per step as the run measured them (read by
`autopar.metrics_file`, the same series and medians the run's own PNG draws),
each against the Plan's prediction, and the run in a few numbers. The page
still predicts nothing: the only arithmetic here is the median step time, the
peak, the throughput it implies and each ratio measured / predicted.
"""
from __future__ import annotations

from autopar.metrics_file import (MEMORY_NOT_MEASURED, RunSeries, axis_top, predictions, read_rows, run_facts,
                                  series)
from autopar.report import format as fmt
from autopar.report.chart import Reference, Series, line_chart
from autopar.report.context import rate_unit, rate_value
from autopar.report.palette import RUN


def run_section(plan, metrics_path: str) -> dict:
    """What the template's "This run" section shows, from the metrics file at `metrics_path`."""
    run = series(read_rows(metrics_path), plan.global_batch_size)
    predicted = predictions(plan.predicted)
    facts = run_facts(run, predicted)
    steps = (facts["first_step"] or 0, facts["last_step"] or 0)  # the step axis the three charts share
    return {"source": metrics_path, "facts": facts, "rows": fact_rows(plan, facts), "notes": _notes(run, predicted),
            "loss_svg": loss_chart(run, steps), "time_svg": time_chart(run, predicted, steps),
            "memory_svg": memory_chart(run, predicted, steps)}


def _row(what: str, measured: str, predicted: str = fmt.DASH, ratio=None) -> dict:
    return {"what": what, "measured": measured, "predicted": predicted,
            "ratio": fmt.DASH if ratio is None else f"{ratio:.2f}\u00d7"}


def fact_rows(plan, facts: dict) -> list[dict]:
    """The table: what, measured, predicted, measured / predicted."""
    median, pred_t, unit = facts["median_step_time_s"], facts["predicted_step_time_s"], rate_unit(plan)
    per_step = plan.global_batch_size * ((plan.seq_len or 1) if unit == "tok/s" else 1)
    rate, pred_rate = (per_step / median if median else None), (rate_value(plan) if pred_t else None)
    peak = facts["peak_memory_bytes"]
    rows = [_row("steps run", f"{facts['steps']} (steps {facts['first_step']} to {facts['last_step']})"),
            _row("step time (median after the first, the slowest rank's)", fmt.seconds(median), fmt.seconds(pred_t),
                 facts["step_time_ratio"]),
            _row("throughput (global batch / median step)", fmt.si(rate, unit), fmt.si(pred_rate, unit),
                 rate / pred_rate if rate and pred_rate else None),
            _row("peak memory (measured: rank 0; predicted: the fullest pp rank)",
                 fmt.bytes_(peak) if peak else "not measured (CPU ranks)",
                 fmt.bytes_(facts["predicted_peak_memory_bytes"]), facts["memory_ratio"]),
            _row("last training loss", fmt.number(facts["last_loss"]))]
    if facts["last_eval_loss"] is not None:
        rows.append(_row("last held-out loss", fmt.number(facts["last_eval_loss"])))
    return rows


def _notes(run: RunSeries, predicted: dict) -> list[str]:
    """Sentences the reader needs before trusting the comparison."""
    notes = []
    if not predicted["step_time_s"]:
        notes.append("The plan holds no prediction (a hand-written plan): the charts show the measurements alone.")
    recorded = run.recorded["step_time_s"]
    if recorded and predicted["step_time_s"] and abs(recorded / predicted["step_time_s"] - 1) > 0.005:
        notes.append(f"The run wrote its metrics beside a predicted step time of {fmt.seconds(recorded)}, and "
                     f"this plan predicts {fmt.seconds(predicted['step_time_s'])}: is it the plan the run trained?")
    return notes


def loss_chart(run: RunSeries, steps: tuple):
    values = [v for _, v in run.loss + run.eval_loss]
    return line_chart([Series("training loss", run.loss, RUN["measured"]),
                       Series("held-out loss (--eval-data)", run.eval_loss, RUN["held_out"], markers=True)],
                      None, steps=steps, top=max(values, default=1.0) * 1.08, fmt_value=lambda v: f"{v:.3g}",
                      y_label="loss", label="training loss per step", empty="no finite loss recorded")


def _against(points, predicted, steps: tuple, *, fmt_value, what: str, measured: str, missing: str):
    """Measured `points` under the plan's prediction, a warm-up first step above the scale said so."""
    values = [v for _, v in points]
    top, clipped = axis_top(values, predicted)
    notes = (f"\u2191 step {points[0][0]}: {fmt_value(values[0])} (warm-up), above the scale",) if clipped else ()
    reference = Reference("predicted by the plan", predicted, RUN["predicted"]) if predicted else None
    return line_chart([Series(measured, points, RUN["measured"])], reference, steps=steps, top=top,
                      fmt_value=fmt_value, y_label=what, notes=notes, empty=missing,
                      label=f"{what} per step, measured beside the plan's prediction")


def time_chart(run: RunSeries, predicted: dict, steps: tuple):
    return _against(run.step_time_s, predicted["step_time_s"], steps, fmt_value=fmt.seconds, what="step time",
                    measured="measured, the slowest rank's", missing="no step time recorded")


def memory_chart(run: RunSeries, predicted: dict, steps: tuple):
    return _against(run.peak_memory_bytes, predicted["peak_memory_bytes"], steps, fmt_value=fmt.bytes_,
                    what="peak memory", measured="measured: rank 0's peak allocated so far",
                    missing=MEMORY_NOT_MEASURED)
