"""Render a Plan as one self-contained HTML file.

`render_html(plan, graph=None, metrics=None) -> str` and `write_html(plan, path,
graph=None, metrics=None)`; `metrics`, a training run's metrics file, adds the
"This run" section (`run.py`).
The page carries its CSS and SVG inline and a Content-Security-Policy that
forbids every network fetch and every script, so opening it never touches
the network and a hostile module name can at worst print oddly. jinja2
autoescaping is on for the page; the SVG helpers escape their own text.
"""
from __future__ import annotations

import os
from functools import lru_cache

import jinja2

from autopar.errors import AutoparError
from autopar.report.context import build_context
from autopar.report.run import run_section

TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,  # every {{ value }} is HTML-escaped unless it is Markup (our SVG)
        undefined=jinja2.StrictUndefined,  # a typo in the template fails loudly, never prints ""
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render_html(plan, graph=None, metrics: str | None = None) -> str:
    """The report for `plan` as an HTML5 string (deterministic for a given plan and
    metrics file); with `metrics`, the run it names beside the plan's predictions."""
    env = _environment()
    context = build_context(plan, graph)
    context["run"] = run_section(plan, metrics) if metrics else None
    context["css"] = env.loader.get_source(env, "report.css")[0]
    return env.get_template("report.html.j2").render(**context)


def write_html(plan, path: str, graph=None, metrics: str | None = None) -> str:
    """Write the report to `path`; returns the path. Errors name the file."""
    text = render_html(plan, graph, metrics)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise AutoparError(f"cannot write report to {path}: {exc.strerror}",
                           hint="check that the folder exists and is writable") from exc
    return path
