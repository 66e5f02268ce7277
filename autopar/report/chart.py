"""A line chart over steps, measured series against a predicted horizontal line.

The "This run" section draws its three panels (loss, step time, memory) with
`line_chart`; the axes and tick steps are the ones the Gantt chart uses
(`nice_step`). Long runs stay small: a series over MAX_POINTS steps keeps, of
each run of steps, the lowest and the highest point, so a spike still shows.
"""
from __future__ import annotations

from dataclasses import dataclass

from markupsafe import Markup

from autopar.report import svg

WIDTH = 1000
LEFT = 78
RIGHT = 20
TOP = 10
PLOT_H = 160
MAX_POINTS = 800  # per series: a 100,000-step run draws as small as an 800-step one
# Styled by attributes rather than report.css: the section brings its own look, so a
# report without a run (and every committed sample) renders as before, to the byte.
GRID = {"stroke": "#eceef1", "stroke_width": 1}
SOLID = {"stroke_width": 1.5}
DASHED = {"stroke_width": 2, "stroke_dasharray": "6 4"}
NOTE = {"font_size": 11, "fill": "#6b7280"}


def nice_step(span: float, ticks: int) -> float:
    """A round tick spacing (1, 2, 2.5 or 5 x 10^k) giving about `ticks` ticks over `span`."""
    raw = span / max(ticks, 1)
    if raw <= 0:
        return 1.0
    mag = 10 ** int(f"{raw:e}".split("e")[1])
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


@dataclass(frozen=True)
class Series:
    label: str
    points: list  # [(step, value)]
    color: str
    markers: bool = False  # a dot per point (sparse series: held-out losses)


@dataclass(frozen=True)
class Reference:
    """A horizontal line: the plan's prediction."""
    label: str
    value: float
    color: str


def thin(points: list, most: int = MAX_POINTS) -> list:
    """At most about `most` points: of each run of steps, its lowest and highest point, in step order."""
    if len(points) <= most:
        return list(points)
    size = -(-len(points) * 2 // most)
    out = []
    for i in range(0, len(points), size):
        run = points[i:i + size]
        low, high = min(run, key=lambda p: p[1]), max(run, key=lambda p: p[1])
        out.extend(sorted({low, high}))
    return out


@dataclass(frozen=True)
class Frame:
    """The plot area and its scales: step -> x, value -> y (values above `top` sit on the top edge)."""
    x0: float
    x1: float
    top: float

    def x(self, step) -> float:
        span = self.x1 - self.x0
        return LEFT + (step - self.x0) / span * (WIDTH - LEFT - RIGHT) if span else LEFT

    def y(self, value) -> float:
        return TOP + PLOT_H * (1 - min(value, self.top) / self.top)


def _axes(frame: Frame, fmt_value, y_label: str) -> list[str]:
    right, bottom = WIDTH - RIGHT, TOP + PLOT_H
    parts = []
    step = nice_step(frame.top, 4)
    k = 0
    while k * step <= frame.top * 1.0001:
        y = frame.y(k * step)
        parts.append(svg.line(LEFT, y, right, y, class_="grid", **GRID))
        parts.append(svg.text(LEFT - 6, y + 4, fmt_value(k * step), class_="tick", text_anchor="end"))
        k += 1
    parts += [svg.line(LEFT, bottom, right, bottom, class_="axis"), svg.line(LEFT, TOP, LEFT, bottom, class_="axis")]
    xstep = max(1, round(nice_step(frame.x1 - frame.x0, 8)))
    for s in range(-(-int(frame.x0) // xstep) * xstep, int(frame.x1) + 1, xstep):
        parts.append(svg.line(frame.x(s), bottom, frame.x(s), bottom + 4, class_="axis"))
        parts.append(svg.text(frame.x(s), bottom + 16, str(s), class_="tick", text_anchor="middle"))
    parts.append(svg.text(right, bottom + 32, "step", class_="axis-label", text_anchor="end"))
    parts.append(svg.text(14, TOP + PLOT_H / 2, y_label, class_="axis-label", text_anchor="middle",
                          transform=f"rotate(-90 14 {TOP + PLOT_H / 2:.1f})"))
    return parts


def _series(frame: Frame, s: Series, fmt_value) -> list[str]:
    points = thin(s.points)
    parts = [svg.polyline([(frame.x(x), frame.y(v)) for x, v in points], stroke=s.color, class_="run-line", **SOLID)]
    if s.markers:
        parts += [svg.with_title(svg.circle(frame.x(x), frame.y(v), 3, fill=s.color), f"step {x}: {fmt_value(v)}")
                  for x, v in points]
    return parts


def _legend(entries: list, y: float) -> list[str]:
    parts, x = [], LEFT
    for label, color, dashed in entries:
        parts.append(svg.line(x, y - 4, x + 22, y - 4, stroke=color, class_="run-ref" if dashed else "run-line",
                              **(DASHED if dashed else SOLID)))
        parts.append(svg.text(x + 28, y, label, class_="legend"))
        x += 40 + 6.2 * len(label)
    return parts


def line_chart(series: list, reference: Reference | None, *, steps: tuple, top: float, fmt_value, y_label: str,
               label: str, notes: tuple = (), empty: str = "") -> Markup:
    """`series` (drawn in order) under the `reference` line over `steps` (first, last),
    the value axis from 0 to `top`; `notes` are short lines written in the plot's top
    left corner, `empty` the sentence in its middle when no series has a point."""
    frame = Frame(steps[0], steps[1], top if top > 0 else 1.0)
    parts = _axes(frame, fmt_value, y_label)
    for s in series:
        if s.points:
            parts += _series(frame, s, fmt_value)
    entries = [(s.label, s.color, False) for s in series if s.points]
    if reference is not None:
        y, said = frame.y(reference.value), f"{reference.label}: {fmt_value(reference.value)}"
        parts.append(svg.with_title(svg.line(LEFT, y, WIDTH - RIGHT, y, stroke=reference.color, class_="run-ref",
                                             **DASHED), said))
        entries.append((said, reference.color, True))
    for i, note in enumerate(notes):
        parts.append(svg.text(LEFT + 8, TOP + 14 + 14 * i, note, class_="note", **NOTE))
    if empty and not any(s.points for s in series):
        parts.append(svg.text((LEFT + WIDTH - RIGHT) / 2, TOP + PLOT_H * 0.6, empty, class_="note",
                              text_anchor="middle", **NOTE))
    parts += _legend(entries, TOP + PLOT_H + 52)
    return svg.document(WIDTH, TOP + PLOT_H + 62, parts, class_="chart run", label=label)
