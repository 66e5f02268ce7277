"""Readers of profile and cluster files: each returns one field's value, or
raises ProfileError naming the field (`where.key`) and the file, because the
person who has to fix it is looking at that file.

Shared by the device and link profiles (devices.py), the measured tables
(measured_tables.py), the profile file (measured.py) and the cluster file
(hardware.py).
"""
from __future__ import annotations

import math
from typing import Any

from cost_models.errors import ProfileError


def read_number(d: dict, key: str, where: str, file: str, *, positive=True, allow_zero=False, default=None) -> float:
    if key not in d or d[key] is None:
        if default is not None:
            return float(default)
        raise ProfileError("missing required field", field=f"{where}.{key}", file=file)
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"must be a number, got {value!r}", field=f"{where}.{key}", file=file)
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise ProfileError(f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}",
                           field=f"{where}.{key}", file=file)
    return float(value)


def read_fraction(d: dict, key: str, where: str, file: str, default=None, allow_zero=False) -> float:
    value = read_number(d, key, where, file, default=default, allow_zero=allow_zero)
    if value > 1.0:
        raise ProfileError(f"is a fraction and must be <= 1, got {value!r}", field=f"{where}.{key}", file=file)
    return value


def read_str(d: dict, key: str, where: str, file: str, default: str | None = None) -> str:
    value = d.get(key, default)
    if value is None:
        raise ProfileError("missing required field", field=f"{where}.{key}", file=file)
    if not isinstance(value, str) or not value:
        raise ProfileError(f"must be a non-empty string, got {value!r}", field=f"{where}.{key}", file=file)
    return value


def read_mapping(d: Any, where: str, file: str) -> dict:
    if not isinstance(d, dict):
        raise ProfileError(f"must be a mapping, got {type(d).__name__}", field=where, file=file)
    return d


def read_positives(d: dict, key: str, where: str, file: str) -> tuple:
    values = d.get(key)
    if not isinstance(values, list) or not values or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v)
            for v in values):
        raise ProfileError("must be a non-empty list of positive numbers", field=f"{where}.{key}", file=file)
    return tuple(float(v) for v in values)


def read_nonnegative(d: dict, key: str, where: str, file: str, default=None) -> float:
    """d[key] as a finite number >= 0 (`default` when absent; None: required)."""
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v):
        raise ProfileError(f"must be a number >= 0, got {v!r}", field=f"{where}.{key}", file=file)
    return float(v)


def read_sizes(d: dict, key: str, where: str, file: str) -> tuple:
    values = read_positives(d, key, where, file)
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ProfileError("must be strictly increasing", field=f"{where}.{key}", file=file)
    return values


def check_same_length(a: tuple, b: tuple, where: str, file: str) -> None:
    if len(a) != len(b):
        raise ProfileError(f"has {len(b)} values for {len(a)} sizes", field=where, file=file)

