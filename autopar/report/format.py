"""Human-readable numbers for the report (and anyone else printing a Plan).

Units are fixed so a reader can compare numbers across reports and with
`autopar plan`'s terminal output: bytes in decimal units (1 GB = 1e9 B, as
the terminal, the planner's explanations and the ZeRO paper write them),
times in the largest unit that keeps one to three integer digits, rates with
SI prefixes. Missing values (None, NaN) print as an em dash rather than 0,
so an absent prediction never reads as a free one.
"""
from __future__ import annotations

import math

DASH = "\u2014"


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def bytes_(n, digits: int = 1) -> str:
    if _missing(n):
        return DASH
    n = float(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def seconds(t) -> str:
    if _missing(t):
        return DASH
    t = float(t)
    if t == 0:
        return "0 s"
    a = abs(t)
    if a >= 100:
        return f"{t:.0f} s"
    if a >= 1:
        return f"{t:.2f} s"
    if a >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} \u00b5s"


def si(x, unit: str = "", digits: int = 3) -> str:
    """1234567 -> '1.23 M' (+unit)."""
    if _missing(x):
        return DASH
    x = float(x)
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g} {prefix}{unit}".rstrip()
    return f"{x:.{digits}g} {unit}".rstrip()


def tflops(x) -> str:
    if _missing(x) or not x:
        return DASH
    return f"{x:.1f} TFLOP/s" if x >= 10 else f"{x:.3g} TFLOP/s"


def count(n) -> str:
    """Parameter counts the way papers write them: 175B, 8.03B, 350M."""
    if _missing(n):
        return DASH
    n = float(n)
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def percent(x, digits: int = 1, sign: bool = False) -> str:
    """0.4321 -> '43.2%'; tiny non-zero values keep two significant digits ('0.0042%')."""
    if _missing(x):
        return DASH
    v = 100 * float(x)
    plus = "+" if sign else ""
    if v != 0 and abs(v) < 10 ** -digits:
        return f"{v:{plus}.2g}%"
    return f"{v:{plus}.{digits}f}%"


def number(x, digits: int = 4) -> str:
    """A plain number for the assumptions table: ints as ints, floats trimmed."""
    if _missing(x):
        return DASH
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)
