"""Pipeline timeline as an SVG Gantt chart: one row per pp rank.

Forward boxes are blue, backward (with recomputation) orange, the p2p send
after each box a thin green strip under it, and the grey row background
shows through wherever a rank waits: the bubbles. Each box carries its
micro-batch number (and chunk, when interleaved) when it is wide enough to
read, and a tooltip with exact times always.
"""
from __future__ import annotations

from markupsafe import Markup

from autopar.report import svg
from autopar.report.format import seconds
from autopar.report.palette import PHASE
from autopar.report.timeline import Event

WIDTH = 1000
ROW_H = 22
LEFT = 58
TOP = 8
TICKS = 8


def _nice_step(span: float, ticks: int) -> float:
    raw = span / max(ticks, 1)
    if raw <= 0:
        return 1.0
    mag = 10 ** int(f"{raw:e}".split("e")[1])
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def gantt_svg(events: list[Event], pp: int, p2p_s: list[float], interleaved: bool) -> Markup:
    end = max((e.end_s for e in events), default=0.0)
    plot_w = WIDTH - LEFT - 10
    scale = plot_w / end if end > 0 else 0.0
    height = TOP + pp * (ROW_H + 6) + 46
    parts = []
    for r in range(pp):
        y = TOP + r * (ROW_H + 6)
        parts.append(svg.text(LEFT - 6, y + ROW_H * 0.7, f"pp {r}", class_="axis-label", text_anchor="end"))
        parts.append(svg.rect(LEFT, y, plot_w, ROW_H, class_="lane"))  # idle = bubble
    for e in events:
        y = TOP + e.pp_rank * (ROW_H + 6)
        x, w = LEFT + e.start_s * scale, (e.end_s - e.start_s) * scale
        label = f"{e.micro_batch}" if not interleaved else f"{e.micro_batch}.{e.stage // max(pp, 1)}"
        tip = (f"pp rank {e.pp_rank}, stage {e.stage}, micro-batch {e.micro_batch}: {e.phase} "
               f"{seconds(e.start_s)} - {seconds(e.end_s)} ({seconds(e.end_s - e.start_s)})")
        box = [svg.title(tip), svg.rect(x, y, w, ROW_H, fill=PHASE.get(e.phase, PHASE["comm"]), class_=f"op {e.phase}")]
        if w >= 7 * len(label) + 4:
            box.append(svg.text(x + w / 2, y + ROW_H * 0.68, label, class_="op-label", text_anchor="middle"))
        parts.append(svg.group(box))
        # The send to the next stage (fwd) or previous stage (bwd) follows the box.
        p2p = p2p_s[e.stage] if e.stage < len(p2p_s) else 0.0
        sends = (e.phase == "fwd" and e.stage < len(p2p_s) - 1) or (e.phase == "bwd" and e.stage > 0)
        if p2p > 0 and sends:
            parts.append(svg.rect(x + w, y + ROW_H - 4, p2p * scale, 4, class_="p2p", fill=PHASE["comm"]))
    # time axis
    axis_y = TOP + pp * (ROW_H + 6) + 4
    parts.append(svg.line(LEFT, axis_y, LEFT + plot_w, axis_y, class_="axis"))
    if end > 0:
        step = _nice_step(end, TICKS)
        k = 0
        while k * step <= end * 1.0001:
            x = LEFT + k * step * scale
            parts.append(svg.line(x, axis_y, x, axis_y + 4, class_="axis"))
            parts.append(svg.text(x, axis_y + 16, seconds(k * step), class_="tick", text_anchor="middle"))
            k += 1
    # legend
    ly = axis_y + 34
    for i, (name, key) in enumerate((("forward", "fwd"), ("backward (+ recompute)", "bwd"), ("p2p send", "comm"), ("idle (bubble)", "idle"))):
        x = LEFT + i * 190
        parts.append(svg.rect(x, ly - 10, 12, 12, fill=PHASE[key], class_="swatch"))
        parts.append(svg.text(x + 16, ly, name, class_="legend"))
    return svg.document(WIDTH, height, parts, class_="chart gantt",
                        label=f"pipeline schedule over {pp} pipeline ranks")
