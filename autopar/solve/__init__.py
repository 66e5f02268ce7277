"""Solve stage: ModelGraph x ClusterSpec -> Plan.

One file per concern: `constraints.py` (what the user pinned),
`search_space.py` (meshes, micro-batching, schedules), `table.py` (integer
cost tables from the cost model), `problem.py` (the stage problem and its
bounds), `cpsat.py` (the CP-SAT model), `brute_force.py` (the reference),
`search.py` (branch and bound over candidates), `planner.py` (`plan`: the
steps from a model to the Plan), `plan_build.py` (the Plan written from the
winner's estimate), `alternatives.py` (how the layout was chosen, why the
others lost), `refine.py` (uniform layouts, stage-boundary moves),
`what_fits.py` (what would fit when nothing does), `layout.py` (Plan ->
cost_models Layout), `fusion_costs.py` (fused kernels in the Plan and their
bytes in the cost model). See docs/planner.md.
"""
from __future__ import annotations

from autopar.solve.constraints import ConstraintError, Constraints, parse_constraints


def plan(model, cluster_spec, example_inputs=None, global_batch_size=None, constraints=None, seq_len=None,
         precision="bf16", top_k=5, **kwargs):
    """Search the best parallel layout; see `autopar.solve.planner.plan`."""
    from autopar.solve.planner import plan as _plan  # imported on use: keeps `import autopar` light
    return _plan(model, cluster_spec, example_inputs=example_inputs, global_batch_size=global_batch_size,
                 constraints=constraints, seq_len=seq_len, precision=precision, top_k=top_k, **kwargs)


def layout_of(plan):
    """The cost model's Layout of a Plan (what cost_models.estimate prices)."""
    from autopar.solve.layout import layout_of as _layout_of
    return _layout_of(plan)


__all__ = ["plan", "layout_of", "Constraints", "ConstraintError", "parse_constraints"]
