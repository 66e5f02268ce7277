"""A very small SVG writer: every attribute and text node is escaped.

The charts are built as strings in Python (jinja2 is a poor language for
geometry), so escaping cannot be left to the template: `text()` and every
attribute value go through markupsafe here, and the finished drawing is
returned as `Markup` so the template inserts it verbatim. A module named
`<script>` therefore reaches the SVG as `&lt;script&gt;`.

Coordinates are rounded to 0.1 px: enough for a crisp drawing, and it keeps
the 1,024-GPU report small and byte-for-byte deterministic.
"""
from __future__ import annotations

from markupsafe import Markup, escape


def _num(v) -> str:
    if isinstance(v, float):
        r = round(v, 1)
        return str(int(r)) if r == int(r) else f"{r:.1f}"
    return str(v)


def _attrs(attrs: dict) -> str:
    out = []
    for k, v in attrs.items():
        if v is None or v is False:
            continue
        name = k.rstrip("_").replace("_", "-")  # class_ -> class, font_size -> font-size
        out.append(f' {name}="{escape(_num(v))}"')
    return "".join(out)


def rect(x, y, w, h, **attrs) -> str:
    return f'<rect{_attrs(dict(x=x, y=y, width=max(w, 0.0), height=max(h, 0.0), **attrs))}/>'


def line(x1, y1, x2, y2, **attrs) -> str:
    return f'<line{_attrs(dict(x1=x1, y1=y1, x2=x2, y2=y2, **attrs))}/>'


def polyline(points, **attrs) -> str:
    """A line through `points` [(x, y)], unfilled."""
    coords = " ".join(f"{_num(float(x))},{_num(float(y))}" for x, y in points)
    return f'<polyline{_attrs(dict(points=coords, fill="none", **attrs))}/>'


def circle(cx, cy, r, **attrs) -> str:
    return f'<circle{_attrs(dict(cx=cx, cy=cy, r=r, **attrs))}/>'


def text(x, y, content, **attrs) -> str:
    return f"<text{_attrs(dict(x=x, y=y, **attrs))}>{escape(content)}</text>"


def title(content) -> str:
    """A hover tooltip for the enclosing element (also read by screen readers)."""
    return f"<title>{escape(content)}</title>"


def group(children: list[str], **attrs) -> str:
    return f"<g{_attrs(attrs)}>" + "".join(children) + "</g>"


def with_title(element: str, tooltip: str) -> str:
    """Wrap `element` in a <g> carrying a tooltip (rect/line cannot hold text)."""
    return f"<g>{title(tooltip)}{element}</g>"


def document(width, height, children: list[str], *, label: str, class_: str) -> Markup:
    """A standalone inline <svg> that scales to its container's width."""
    head = (f'<svg xmlns="http://www.w3.org/2000/svg"{_attrs(dict(class_=class_, viewBox=f"0 0 {_num(width)} {_num(height)}", width=width, height=height, role="img"))}'
            f' aria-label="{escape(label)}">')
    return Markup(head + title(label) + "".join(children) + "</svg>")
