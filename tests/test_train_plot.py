"""Issue 32: the run at its end, measured beside the plan's predictions: a PNG beside
the metrics file (train.py --metrics FILE -> FILE.png, --plot, --no-plot) and a
"This run" section in the report (autopar report --plan plan.json --metrics FILE)."""
import io
import json
import os
import re
from contextlib import redirect_stderr, redirect_stdout

import pytest

from autopar.errors import AutoparError
from autopar.metrics_file import axis_top, predictions, read_rows, run_facts, series
from dist_utils import run_world

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _plan(tmp_path, step_time_s=0.02, peak_bytes=3e8, name="plan.json") -> str:
    """gpt_tiny on dp 2 (a hand plan), with the predictions a planned one carries."""
    from train_worlds import write_plan
    path = write_plan(str(tmp_path / name), dp=2, zero=3, micro_batch_size=2)
    data = json.loads(open(path).read())
    data["predicted"].update(step_time_s=step_time_s, peak_memory_bytes=[peak_bytes, peak_bytes / 2])
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def _metrics(tmp_path, steps=12, peak=None, name="m.jsonl") -> str:
    """Rows as train.py writes them: a slow first step, a held-out loss every 4th, a cut last line."""
    path = tmp_path / name
    with open(path, "w") as f:
        for s in range(steps):
            row = {"step": s, "loss": 5.0 - 0.2 * s, "step_time_s": {0: 0.5, 5: 0.03}.get(s, 0.025),
                   "predicted_step_time_s": 0.02, "peak_memory_bytes": peak and peak * (1 + s / 100),
                   "predicted_peak_memory_bytes": 3e8}
            if s % 4 == 3:
                row["eval_loss"] = row["loss"] + 0.1
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 12, "loss": 2.')  # a crash mid-line
    return str(path)


def _decode_png(path) -> tuple:
    import matplotlib.image
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    return matplotlib.image.imread(path).shape


def _report(plan, metrics, out) -> str:
    from autopar.cli import main
    assert main(["report", "--plan", plan, "--metrics", metrics, "-o", str(out)]) == 0
    return out.read_text()


def _run_section(html: str) -> str:
    return html[html.index('<section id="run">'):html.index('<section id="mesh">')]


def test_the_metrics_file_reads_one_row_per_step_and_the_same_facts_for_both_drawings(tmp_path):
    rows = read_rows(_metrics(tmp_path, peak=2e8))
    assert [r["step"] for r in rows] == list(range(12))  # the cut line is passed over
    run = series(rows)
    assert [s for s, _ in run.eval_loss] == [3, 7, 11]
    facts = run_facts(run, predictions({"step_time_s": 0.02, "peak_memory_bytes": [3e8, 1e8]}))
    assert facts["steps"] == 12 and facts["median_step_time_s"] == pytest.approx(0.025)  # after the first
    assert facts["step_time_ratio"] == pytest.approx(1.25)
    assert facts["peak_memory_bytes"] == pytest.approx(2e8 * 1.11) and facts["predicted_peak_memory_bytes"] == 3e8
    assert axis_top([0.5, 0.025, 0.026], 0.02) == (pytest.approx(0.026 * 1.15), True)  # warm-up off the scale
    assert axis_top([0.03, 0.025], 0.02)[1] is False
    (tmp_path / "other.jsonl").write_text('{"loss": 1.0}\nnot json\n')
    with pytest.raises(AutoparError, match="holds no step"):
        read_rows(str(tmp_path / "other.jsonl"))
    with pytest.raises(AutoparError, match="cannot read"):
        read_rows(str(tmp_path / "missing.jsonl"))


def test_the_png_has_three_panels_and_a_plot_that_fails_costs_one_line(tmp_path, capsys):
    from autopar.plan import Plan
    from autopar.train.plot import plot_path, plot_run
    metrics, plan = _metrics(tmp_path, peak=2e8), Plan.load(_plan(tmp_path))
    assert plot_path(None, False, metrics) == str(tmp_path / "m.png")
    assert plot_path("x.png", False, metrics) == "x.png" and plot_path(None, True, metrics) is None
    assert plot_path(None, False, None) is None
    assert plot_run(metrics, str(tmp_path / "m.png"), plan) == str(tmp_path / "m.png")
    height, width, _ = _decode_png(tmp_path / "m.png")
    assert (width, height) == (800, 900)
    blocked = str(tmp_path / "m.jsonl" / "plot.png")  # a folder that is a file: cannot be written
    assert plot_run(metrics, blocked, plan) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"autopar: no plot written to {blocked}")


def test_the_report_shows_the_run_beside_the_plans_predictions(tmp_path):
    import html5lib
    html = _report(_plan(tmp_path), _metrics(tmp_path, peak=2e8), tmp_path / "run.html")
    html5lib.HTMLParser(strict=True).parse(html)
    run = _run_section(html)
    assert '<a href="#run">This run</a>' in html and "<h2>This run" in run
    assert run.count("<svg") == 3 and run.count('class="run-ref"') >= 3  # a prediction line in both charts + legend
    cells = re.findall(r'<td class="num">([^<]*)</td>', run)
    assert "12 (steps 0 to 11)" in cells
    assert cells[cells.index("25 ms"):][:3] == ["25 ms", "20 ms", "1.25\u00d7"]  # median after the first vs predicted
    # rank 0's measured peak against the fullest pp rank's predicted one
    assert cells[cells.index("222.0 MB"):][:3] == ["222.0 MB", "300.0 MB", "0.74\u00d7"]
    assert "step 0: 500 ms (warm-up), above the scale" in run
    assert not re.search(r'(src|href)="(?!#)', html)  # still one self-contained file


def test_the_run_section_follows_the_plans_prediction(tmp_path):
    """The predicted line and the table come from the plan: another prediction, another page."""
    metrics = _metrics(tmp_path)
    first = _run_section(_report(_plan(tmp_path, step_time_s=0.02), metrics, tmp_path / "a.html"))
    second = _run_section(_report(_plan(tmp_path, step_time_s=0.05, name="slow.json"), metrics,
                                  tmp_path / "b.html"))
    assert "predicted by the plan: 20 ms" in first and "predicted by the plan: 50 ms" in second
    assert "1.25\u00d7" in first and "0.50\u00d7" in second
    ref = [re.search(r'<line x1="78" y1="([\d.]+)" x2="980" y2="\1" stroke="#c0392b"', s).group(1)
           for s in (first, second)]
    assert ref[0] != ref[1]  # the dashed line moved
    # the metrics were written beside 20 ms: a plan predicting 50 ms is said not to be the run's
    assert "is it the plan the run trained?" in second and "is it the plan the run trained?" not in first
    assert "not measured" in first  # CPU rows hold no peak


def test_the_report_refuses_a_metrics_file_that_is_not_one(tmp_path, capsys):
    from autopar.cli import main
    (tmp_path / "notes.txt").write_text("hello\n")
    rc = main(["report", "--plan", _plan(tmp_path), "--metrics", str(tmp_path / "notes.txt"),
               "-o", str(tmp_path / "r.html")])
    assert rc != 0 and "holds no step" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def captured_world(rank, world, spec, plan_path, argv, stop_after=None):
    """train.py on this rank, its output captured; with `stop_after`, every rank sends
    itself SIGTERM after that step, as a scheduler's preemption notice would."""
    import signal

    from autopar.train import run
    from train_worlds import main_world
    if stop_after is not None:
        step = run._step

        def step_then_signal(*args, **kwargs):
            out = step(*args, **kwargs)
            if args[5] == stop_after:  # _step(args, pm, batches, metrics, stop, step, ...)
                os.kill(os.getpid(), signal.SIGTERM)
            return out
        run._step = step_then_signal
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main_world(rank, world, spec, plan_path, argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_stopped_by_sigterm_plots_and_the_report_reads_its_metrics(tmp_path):
    """Two ranks stop after step 1 of 6 on SIGTERM: the snapshot, then the PNG beside the
    metrics file, its path in the summary, and the report's "This run" of the same file."""
    from train_worlds import GPT_TINY
    plan, metrics = _plan(tmp_path), tmp_path / "m.jsonl"
    argv = ["--synthetic", "--steps", "6", "--metrics", str(metrics), "--save-dir", str(tmp_path / "ckpt"), "--quiet"]
    (rc, out, err), (rc1, _, _) = run_world(captured_world, 2, GPT_TINY, plan, argv, 0, timeout=250)
    assert (rc, rc1) == (0, 0), err
    assert "stopped by signal after step 2" in err and os.path.isdir(tmp_path / "ckpt" / "step-00000002")
    assert f"plot        {tmp_path / 'm.png'}" in out
    assert _decode_png(tmp_path / "m.png")[:2] == (900, 800)
    run = _run_section(_report(plan, str(metrics), tmp_path / "run.html"))
    assert "2 (steps 0 to 1)" in run and "20 ms" in run  # the plan's prediction beside the run's


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plot_that_cannot_be_written_does_not_fail_the_run(tmp_path):
    from train_worlds import GPT_TINY
    (tmp_path / "file").write_text("")
    blocked = str(tmp_path / "file" / "run.png")
    argv = ["--synthetic", "--steps", "2", "--metrics", str(tmp_path / "m.jsonl"), "--plot", blocked,
            "--save-dir", str(tmp_path / "ckpt"), "--quiet"]
    (rc, out, err), (rc1, _, _) = run_world(captured_world, 2, GPT_TINY, _plan(tmp_path), argv, timeout=250)
    assert (rc, rc1) == (0, 0) and os.path.isdir(tmp_path / "ckpt" / "step-00000002")
    said = [line for line in err.splitlines() if "no plot" in line]
    assert len(said) == 1 and said[0].startswith(f"autopar: no plot written to {blocked}"), err
    assert "predicted vs measured" in out and "plot  " not in out


def test_plot_without_a_metrics_file_is_refused_before_training(tmp_path, capsys):
    from autopar.train import main
    from train_worlds import GPT_TINY
    assert main(GPT_TINY, _plan(tmp_path), ["--synthetic", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot draws the metrics file" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one or the other
        main(GPT_TINY, _plan(tmp_path), ["--plot", "p.png", "--no-plot"])
