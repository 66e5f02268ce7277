"""Per-step metrics beside the plan's predictions, and alerts.

Every step rank 0 appends one JSON line (`--metrics FILE`): loss, gradient
norm, learning rate, loss scale, step time (the slowest rank's), tokens or
samples per second, measured MFU and peak memory, each with the plan's
predicted value next to it (`predicted_*`). TensorBoard gets the same scalars
when it is installed. Measured MFU uses the plan's own FLOP count: MFU_measured
= MFU_predicted x predicted step time / measured step time, so the two MFUs
differ exactly as the step times do.

Alerts call the registered callbacks (and print one line): a loss or gradient
norm that is NaN or Inf, a loss spike (above `spike_factor` x the median of the
last `window` losses), and a straggler (a rank whose step took more than
`straggler_factor` x the median rank's).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field

from autopar.metrics_file import median_after_first, predictions


@dataclass
class Alert:
    step: int
    kind: str  # "nonfinite" | "loss_spike" | "straggler"
    message: str


@dataclass
class Metrics:
    plan: object  # autopar.Plan
    path: str | None = None
    rank: int = 0
    spike_factor: float = 3.0
    straggler_factor: float = 1.5
    window: int = 20
    start_step: int = 0  # a resumed run: rows of later steps (replayed after the snapshot) are dropped
    callbacks: list = field(default_factory=list)  # callables(Alert)
    alerts: list = field(default_factory=list)
    _losses: list = field(default_factory=list)
    _times: list = field(default_factory=list)
    _priced_times: list = field(default_factory=list)  # of the steps at the plan's global batch
    _tb: object = None
    skipped: int = 0  # steps the fp16 loss scaler skipped

    def __post_init__(self):
        pred = self.plan.predicted or {}
        if dataclasses.is_dataclass(pred):
            pred = dataclasses.asdict(pred)  # a Plan's Predicted; 0 where nothing was priced
        self.predicted = predictions(pred)
        self.unit = "tokens" if pred.get("tokens_per_s") or getattr(self.plan, "seq_len", None) else "samples"
        per_sample = (self.plan.seq_len or 1) if self.unit == "tokens" else 1
        self.items_per_step = self.plan.global_batch_size * per_sample
        if self.rank == 0 and self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._keep_rows_before(self.start_step)
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional

                self._tb = SummaryWriter(os.path.join(os.path.dirname(os.path.abspath(self.path)), "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                self._tb = None

    def _keep_rows_before(self, step: int) -> None:
        """One row per step in the file: a new run starts it afresh, a resumed one keeps
        the rows up to its snapshot (the steps after it run again)."""
        if not os.path.exists(self.path):
            return
        kept = []
        if step > 0:
            with open(self.path) as f:
                for line in f:
                    try:
                        if json.loads(line).get("step", step) < step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except ValueError:  # a line cut off by a crash
                        continue
        with open(self.path, "w") as f:
            f.writelines(kept)

    def record(self, step: int, *, loss: float, step_time_s: float, rank_times: list | None = None,
               grad_norm: float | None = None, lr: float | None = None, loss_scale: float | None = None,
               skipped: bool = False, peak_memory_bytes: int | None = None, eval_loss: float | None = None,
               global_batch: int | None = None) -> dict:
        batch = global_batch or self.plan.global_batch_size
        share = batch / self.plan.global_batch_size  # of the plan's work (FLOPs) done this step
        throughput = self.items_per_step * share / step_time_s if step_time_s > 0 else None
        p = self.predicted
        mfu = p["mfu"] * p["step_time_s"] * share / step_time_s if p["mfu"] and p["step_time_s"] and \
            step_time_s > 0 else None
        if share != 1:  # --batch-size / --batch-ramp: the plan priced another batch, not this step
            p = {**p, "step_time_s": None, "throughput": None, "mfu": None}
        else:
            self._priced_times.append(step_time_s)
        row = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "loss_scale": loss_scale,
               "skipped": skipped, "step_time_s": step_time_s, "predicted_step_time_s": p["step_time_s"],
               f"{self.unit}_per_s": throughput, f"predicted_{self.unit}_per_s": p["throughput"],
               "mfu": mfu, "predicted_mfu": p["mfu"], "peak_memory_bytes": peak_memory_bytes,
               "predicted_peak_memory_bytes": p["peak_memory_bytes"], "global_batch": batch}
        if eval_loss is not None:  # --eval-data: the held-out loss after this step, and its perplexity
            row.update(eval_loss=eval_loss, eval_perplexity=math.exp(min(eval_loss, 700.0)))
        self._check(step, loss, None if skipped else grad_norm, rank_times)  # fp16 overflow: expected, skipped
        self.skipped += bool(skipped)
        if self.rank == 0:
            if self.path:
                with open(self.path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if self._tb is not None:
                for k in ("loss", "grad_norm", "lr", "loss_scale", "step_time_s", f"{self.unit}_per_s", "mfu",
                          "eval_loss"):
                    if isinstance(row.get(k), (int, float)) and math.isfinite(row[k]):
                        self._tb.add_scalar(k, row[k], step)
        self._times.append(step_time_s)
        return row

    def eta_s(self, steps_left: int) -> float | None:
        """Seconds the remaining steps take at the median of the last 20 steps' time
        (the first steps, compiling, count less as the run goes on); None before any."""
        recent = self._times[-20:]
        return statistics.median(recent) * steps_left if recent else None

    def _alert(self, step: int, kind: str, message: str) -> None:
        alert = Alert(step, kind, message)
        self.alerts.append(alert)
        if self.rank == 0:
            print(f"autopar alert, step {step}: {message}", file=sys.stderr, flush=True)
        for cb in self.callbacks:
            cb(alert)

    def _check(self, step, loss, grad_norm, rank_times) -> None:
        bad = [n for n, v in (("loss", loss), ("gradient norm", grad_norm)) if v is not None and not math.isfinite(v)]
        if bad:
            self._alert(step, "nonfinite", f"{' and '.join(bad)} not finite ({loss=}, {grad_norm=})")
        elif len(self._losses) >= min(self.window, 5):
            ref = statistics.median(self._losses[-self.window:])
            if ref > 0 and loss > self.spike_factor * ref:
                self._alert(step, "loss_spike", f"loss {loss:.4g} is {loss / ref:.1f}x the median of the last "
                                                f"{min(self.window, len(self._losses))} steps ({ref:.4g})")
        if math.isfinite(loss):
            self._losses.append(loss)
        if rank_times and len(rank_times) > 1:
            mid = statistics.median(rank_times)
            slow = max(range(len(rank_times)), key=lambda r: rank_times[r])
            if mid > 0 and rank_times[slow] > self.straggler_factor * mid:
                self._alert(step, "straggler", f"rank {slow} took {rank_times[slow]:.3f} s, "
                                               f"{rank_times[slow] / mid:.1f}x the median rank's {mid:.3f} s")

    def uncalibrated(self) -> str | None:
        """A sentence when the plan priced this CPU run with the generic CPU entry of the
        device table rather than a profile measured on the machine (`autopar calibrate`):
        such predictions are a rough guess (a CPU's speed varies tenfold by core, threads
        and dtype), not what the cost model claims for a calibrated machine."""
        cluster = getattr(self.plan, "cluster", None) or {}
        devices = cluster.get("devices") or {}
        if cluster.get("device") != "cpu" or not self.predicted["step_time_s"] or \
                any(isinstance(d, dict) and d.get("measured") for d in devices.values()):
            return None
        world = cluster.get("world_size") or "N"
        return ("the plan's predictions use the generic CPU profile, not this machine's: run `autopar calibrate "
                f"--device cpu --ranks {world} -o cpu.json` and compile with --profile cpu.json")

    def summary(self) -> str:
        """Predicted vs measured, over the steps after the first (warm-up)."""
        t = median_after_first(self._priced_times)
        if t is None:
            if self._times:  # every step ran at another batch (--batch-size): nothing was priced
                return (f"no step ran at the plan's global batch of {self.plan.global_batch_size}: its predictions "
                        f"are for that batch (median step {median_after_first(self._times):.4g} s measured)")
            return "no steps"
        p = self.predicted
        lines = ["predicted vs measured (median step after the first):"]
        if p["step_time_s"]:
            lines.append(f"  step time   {p['step_time_s']:.4g} s predicted, {t:.4g} s measured "
                         f"({p['step_time_s'] / t - 1:+.1%})")
            lines.append(f"  {self.unit}/s  {self.items_per_step / p['step_time_s']:,.0f} predicted, "
                         f"{self.items_per_step / t:,.0f} measured")
        else:
            lines.append(f"  step time   {t:.4g} s measured, {self.items_per_step / t:,.0f} {self.unit}/s "
                         "(the plan has no prediction: a hand-written plan)")
        if p["mfu"]:
            lines.append(f"  MFU         {p['mfu']:.1%} predicted, {p['mfu'] * p['step_time_s'] / t:.1%} measured")
        if self.skipped:
            lines.append(f"  {self.skipped} step(s) skipped by the fp16 loss scaler (gradient overflow)")
        note = self.uncalibrated()  # None for a plan without a prediction
        if note:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
