"""Pipeline timeline as an SVG Gantt chart: one row per pp rank.

Forward boxes are blue, backward (with recomputation) orange, the p2p send
after each box a thin green strip under it, and the grey row background
shows through wherever a rank waits: the bubbles. Each box carries its
micro-batch number (and chunk, when interleaved) when it is wide enough to
read, and a tooltip with exact times always. Passes too narrow to read that
run back to back are merged into one box (MERGE_BELOW_PX) so a deep
interleaved pipeline stays a small file; the times drawn are unchanged.
"""
from __future__ import annotations

from markupsafe import Markup

from autopar.report import svg
from autopar.report.chart import nice_step
from autopar.report.format import seconds
from autopar.report.palette import PHASE
from autopar.report.timeline import Event

WIDTH = 1000
ROW_H = 22
LEFT = 58
TOP = 8
TICKS = 8


# Boxes narrower than this carry no label and read as texture; back-to-back
# runs of them (an interleaved warm-up: 100 forwards in a row) are drawn as
# one box whose tooltip lists the run. Wider boxes are never merged, so a
# readable chart keeps one labelled box per pass.
MERGE_BELOW_PX = 6.0
GAP_PX = 0.5  # closer than this on screen counts as back to back


def _label(e: Event, pp: int, interleaved: bool) -> str:
    return f"{e.micro_batch}" if not interleaved else f"{e.micro_batch}.{e.stage // max(pp, 1)}"


def merge_slivers(events: list[Event], scale: float) -> list[list[Event]]:
    """Events grouped into drawn boxes: each group is one pass, or a back-to-back
    run of same-phase passes on one rank that are each too narrow to read."""
    boxes: list[list[Event]] = []
    last: dict[int, list[Event]] = {}  # pp rank -> its latest box
    for e in sorted(events, key=lambda e: (e.pp_rank, e.start_s, e.stage)):
        run = last.get(e.pp_rank)
        narrow = (e.end_s - e.start_s) * scale < MERGE_BELOW_PX
        if (run and narrow and run[-1].phase == e.phase and (run[-1].end_s - run[-1].start_s) * scale < MERGE_BELOW_PX
                and (e.start_s - run[-1].end_s) * scale < GAP_PX):
            run.append(e)
            continue
        last[e.pp_rank] = [e]
        boxes.append(last[e.pp_rank])
    return boxes


def _tooltip(run: list[Event], pp: int, interleaved: bool) -> str:
    first, final = run[0], run[-1]
    span = f"{seconds(first.start_s)} - {seconds(final.end_s)} ({seconds(final.end_s - first.start_s)})"
    if len(run) == 1:
        return f"pp rank {first.pp_rank}, stage {first.stage}, micro-batch {first.micro_batch}: {first.phase} {span}"
    what = "micro-batch.chunk" if interleaved else "micro-batch"
    return (f"pp rank {first.pp_rank}: {len(run)} {first.phase} passes back to back, {span}; {what} "
            f"{_label(first, pp, interleaved)} to {_label(final, pp, interleaved)}")


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
    for run in merge_slivers(events, scale):
        e = run[-1]
        y = TOP + e.pp_rank * (ROW_H + 6)
        x, w = LEFT + run[0].start_s * scale, (e.end_s - run[0].start_s) * scale
        label = _label(e, pp, interleaved)
        box = [svg.title(_tooltip(run, pp, interleaved)),
               svg.rect(x, y, w, ROW_H, fill=PHASE.get(e.phase, PHASE["comm"]), class_=f"op {e.phase}")]
        if len(run) == 1 and w >= 7 * len(label) + 4:
            box.append(svg.text(x + w / 2, y + ROW_H * 0.68, label, class_="op-label", text_anchor="middle"))
        parts.append(svg.group(box))
        # The send to the next stage (fwd) or previous stage (bwd) follows the box
        # (inside a merged run the sends overlap the next pass, so only the last shows).
        p2p = p2p_s[e.stage] if e.stage < len(p2p_s) else 0.0
        sends = (e.phase == "fwd" and e.stage < len(p2p_s) - 1) or (e.phase == "bwd" and e.stage > 0)
        if p2p * scale >= GAP_PX and sends:  # a thinner strip is invisible and only adds bytes
            parts.append(svg.rect(x + w, y + ROW_H - 4, p2p * scale, 4, class_="p2p", fill=PHASE["comm"]))
    # time axis
    axis_y = TOP + pp * (ROW_H + 6) + 4
    parts.append(svg.line(LEFT, axis_y, LEFT + plot_w, axis_y, class_="axis"))
    if end > 0:
        step = nice_step(end, TICKS)
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
