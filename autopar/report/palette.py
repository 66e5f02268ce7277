"""Colours shared by the charts, the legends and the CSS.

Pipeline ranks get evenly spaced hues so 16 or 64 stages stay tellable
apart; neighbours alternate lightness so adjacent stages never look alike.
Phase and memory colours are fixed (and repeated in report.css for legends).
"""
from __future__ import annotations

import colorsys

PHASE = {
    "fwd": "#4c78a8",  # forward
    "bwd": "#f58518",  # backward (incl. recomputation)
    "comm": "#54a24b",  # p2p / exposed communication
    "idle": "#eeeeee",  # bubble
}

# Distinct from the phase colours, so a screenshot test (and a reader) can
# tell the memory chart from the timeline.
MEMORY = {
    "params": "#2e5e8c",
    "grads": "#72b7b2",
    "optimizer": "#b279a2",
    "activations": "#e45756",
    "buffers": "#9d9da1",
}

# The "This run" charts (and the PNG a run writes, autopar/train/plot.py): what was
# measured, the plan's prediction as a dashed line (the capacity line's red), held-out loss.
RUN = {"measured": "#4c78a8", "predicted": "#c0392b", "held_out": "#f58518"}


def stage_color(i: int, n: int) -> str:
    """Fill colour of pp rank `i` of `n` (light enough for dark text on top)."""
    hue = (i / max(n, 1)) % 1.0
    lightness = 0.72 if i % 2 == 0 else 0.82
    r, g, b = colorsys.hls_to_rgb(hue, lightness, 0.55)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
