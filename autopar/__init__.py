"""autopar: capture -> cost -> solve -> lower -> report.

Public entry points:
    autopar.capture(model, example_inputs)      -> ModelGraph     (autopar/capture/)
    autopar.plan(model, cluster_spec, ...)      -> Plan           (autopar/solve/)
    autopar.compile(model, cluster_spec, ...)   -> ParallelModel  (autopar/lower/)
    autopar.Plan, autopar.ClusterSpec, autopar.AutoparError

Everything that imports torch, sympy or ortools (capture, the solver, the
lowering stack) loads on first use, so `autopar --help` and a mistyped flag
answer at once (tests/test_cli_startup.py checks that nothing heavy loads).

Note: `capture` and `plan` are also the names of a subpackage and a module.
Python sets a package attribute when a submodule is first loaded, so
`autopar.plan` (the module) is loaded below before the function of the same
name is defined, and the subpackage `autopar.capture` is callable: it is the
function too (autopar/capture/__init__.py). Inside autopar, always write
`from autopar.plan import Plan` (never `import autopar.plan as ...`).
"""
from __future__ import annotations

__version__ = "0.1.0"

from autopar.errors import AutoparError  # noqa: E402
from autopar.plan import Plan  # noqa: E402  (loads the module autopar.plan first)

__all__ = ["capture", "ModelGraph", "plan", "compile", "ParallelModel", "Plan", "ClusterSpec", "AutoparError"]


def plan(model, cluster_spec, *args, **kwargs) -> Plan:
    """Search for the best layout: `autopar.solve.plan` (see its docstring).
    precision= ('bf16' default, 'fp16', 'fp32') is the training compute dtype."""
    from autopar.plan import check_precision
    from autopar.solve import plan as solve_plan

    from autopar.lower.what_runs import limits

    if "precision" in kwargs:
        check_precision(kwargs["precision"])
    kwargs.setdefault("check_lowering", limits)  # offer only layouts the lowering runs for this model
    return solve_plan(model, cluster_spec, *args, **kwargs)


def __getattr__(name: str):
    # Loaded on first use (torch, sympy): compile and ParallelModel from autopar.lower,
    # ClusterSpec from cost_models, capture (the callable subpackage) and ModelGraph.
    if name in ("compile", "ParallelModel"):
        import autopar.lower as lower

        return getattr(lower, name)
    if name == "ClusterSpec":
        from cost_models.hardware import ClusterSpec

        return ClusterSpec
    if name in ("capture", "ModelGraph"):
        import importlib

        package = importlib.import_module("autopar.capture")  # binds autopar.capture to the package
        return package if name == "capture" else package.ModelGraph
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
