"""report stage: a Plan as one self-contained HTML page (docs/report.md).

Reads the Plan (and optionally the ModelGraph for parameter counts); makes no
prediction of its own.
"""
__all__ = ["render_html", "write_html"]


def __getattr__(name: str):
    # jinja2 loads with the first report, not with `autopar plan --help` (which
    # imports autopar.report.format for its byte formatting).
    if name in __all__:
        from autopar.report import html

        return getattr(html, name)
    raise AttributeError(f"module 'autopar.report' has no attribute {name!r}")
