"""Memory per pp rank as stacked horizontal bars against the device capacity.

Reads `Plan.predicted.memory_breakdown` (docs/INTERFACES.md section 8): bytes
per GPU of params, grads, optimizer, activations and buffers, plus the usable
`capacity`. The dashed line is the capacity; the number at the end of each
bar is its total and its share of capacity, so headroom reads at a glance.
"""
from __future__ import annotations

from markupsafe import Markup

from autopar.report import svg
from autopar.report.format import bytes_, percent
from autopar.report.palette import MEMORY

PARTS = ("params", "grads", "optimizer", "activations", "buffers")
WIDTH = 1000
LEFT = 58
RIGHT = 150
ROW_H = 18


def memory_rows(breakdown: list[dict], capacity_default: float | None) -> list[dict]:
    rows = []
    for r, b in enumerate(breakdown):
        parts = {k: float(b.get(k, 0.0) or 0.0) for k in PARTS}
        total = sum(parts.values())
        cap = b.get("capacity", capacity_default)
        rows.append({"pp_rank": r, "parts": parts, "total": total, "capacity": cap,
                     "fraction": (total / cap) if cap else None,
                     "reserve": b.get("reserve"), "host": float(b.get("host", 0.0) or 0.0)})
    return rows


def memory_svg(rows: list[dict]) -> Markup:
    plot_w = WIDTH - LEFT - RIGHT
    caps = [r["capacity"] for r in rows if r["capacity"]]
    top_value = max([r["total"] for r in rows] + caps + [1.0]) * 1.02
    scale = plot_w / top_value
    top = 8
    height = top + len(rows) * (ROW_H + 5) + 40
    parts = []
    for i, row in enumerate(rows):
        y = top + i * (ROW_H + 5)
        parts.append(svg.text(LEFT - 6, y + ROW_H * 0.72, f"pp {row['pp_rank']}", class_="axis-label", text_anchor="end"))
        x = LEFT
        for k in PARTS:
            w = row["parts"][k] * scale
            if w <= 0:
                continue
            parts.append(svg.with_title(svg.rect(x, y, w, ROW_H, fill=MEMORY[k], class_=f"mem {k}"),
                                        f"pp rank {row['pp_rank']}: {k} {bytes_(row['parts'][k])}"))
            x += w
        over = row["capacity"] and row["total"] > row["capacity"]
        label = bytes_(row["total"]) + (f" ({percent(row['fraction'], 0)})" if row["fraction"] is not None else "")
        # Labels sit in the right margin, clear of the bars and the capacity line.
        parts.append(svg.text(LEFT + plot_w + 8, y + ROW_H * 0.72, label, class_="bar-label over" if over else "bar-label"))
        if row["capacity"]:
            cx = LEFT + row["capacity"] * scale
            parts.append(svg.with_title(svg.line(cx, y - 2, cx, y + ROW_H + 2, class_="capacity"),
                                        f"usable capacity {bytes_(row['capacity'])}"))
    ly = top + len(rows) * (ROW_H + 5) + 22
    for i, k in enumerate(PARTS + ("capacity",)):
        x = LEFT + i * 130
        if k == "capacity":
            parts.append(svg.line(x + 6, ly - 11, x + 6, ly + 3, class_="capacity"))
        else:
            parts.append(svg.rect(x, ly - 10, 12, 12, fill=MEMORY[k], class_="swatch"))
        parts.append(svg.text(x + 16, ly, k, class_="legend"))
    return svg.document(WIDTH, height, parts, class_="chart memory",
                        label="predicted memory per GPU on each pipeline rank")
