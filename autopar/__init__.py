"""autopar: capture -> cost -> solve -> lower -> report.

Public entry points:
    autopar.capture(model, example_inputs)      -> ModelGraph     (autopar/capture/)
    autopar.plan(model, cluster_spec, ...)      -> Plan           (autopar/solve/)
    autopar.compile(model, cluster_spec, ...)   -> ParallelModel  (autopar/lower/)
    autopar.Plan, autopar.ClusterSpec, autopar.AutoparError

The solver (ortools) and the lowering stack (torch.distributed pipelining,
FSDP, DTensor) load on first use, so `autopar inspect` and `--help` do not
pay for them.

Note: `capture` and `plan` are also the names of a subpackage and a module.
Python sets a package attribute only when a submodule is first loaded, so
`autopar.plan` (the module) is loaded below before the function of the same
name is defined, and `autopar.capture` is imported before its function is
bound. Inside autopar, always write `from autopar.plan import Plan` (never
`import autopar.plan as ...`).
"""
from __future__ import annotations

__version__ = "0.1.0"

from autopar.errors import AutoparError  # noqa: E402
from autopar.plan import Plan  # noqa: E402  (loads the module autopar.plan first)
from cost_models.hardware import ClusterSpec  # noqa: E402
from autopar.capture import ModelGraph, capture  # noqa: E402

__all__ = ["capture", "ModelGraph", "plan", "compile", "ParallelModel", "Plan", "ClusterSpec", "AutoparError"]


def plan(model, cluster_spec, *args, **kwargs) -> Plan:
    """Search for the best layout: `autopar.solve.plan` (see its docstring)."""
    from autopar.solve import plan as solve_plan

    return solve_plan(model, cluster_spec, *args, **kwargs)


def __getattr__(name: str):
    # compile and ParallelModel live in autopar.lower, whose name clashes with
    # nothing here, so they can load lazily.
    if name in ("compile", "ParallelModel"):
        import autopar.lower as lower

        return getattr(lower, name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
