"""autopar: capture -> cost -> solve -> lower -> report.

Public entry points:
    autopar.capture(model, example_inputs)      -> ModelGraph     (autopar/capture/)
    autopar.plan(model, cluster_spec, ...)      -> Plan           (autopar/solve/)
    autopar.compile(model, cluster_spec, ...)   -> ParallelModel  (autopar/lower/)
    autopar.Plan, autopar.ClusterSpec, autopar.AutoparError

Note: `capture`, `plan` and `compile` are also the names of subpackages /
modules. The imports below run after those modules load, so the package
attributes are the functions. Inside autopar, always write
`from autopar.plan import Plan` (never `import autopar.plan as ...`).
"""
from __future__ import annotations

__version__ = "0.1.0"

from autopar.errors import AutoparError  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from cost_models.hardware import ClusterSpec  # noqa: E402
from autopar.capture import ModelGraph, capture  # noqa: E402
from autopar.solve import plan  # noqa: E402
from autopar.lower import ParallelModel, compile  # noqa: E402

__all__ = ["capture", "ModelGraph", "plan", "compile", "ParallelModel", "Plan", "ClusterSpec", "AutoparError"]
