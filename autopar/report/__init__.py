"""report stage: a Plan as one self-contained HTML page (docs/report.md).

Reads the Plan (and optionally the ModelGraph for parameter counts); makes no
prediction of its own.
"""
from autopar.report.html import render_html, write_html

__all__ = ["render_html", "write_html"]
