"""Price a Plan again on its captured graph: the estimate the planner made for it, and the
same for an edited copy (another target's nearest layout, autopar export-config).

The planner prices layouts on the captured graph charged with what the lowering runs
and the fused chains (planner.lowered_graph, planner.fused_graph); a Plan records both
(`solver.lowering_limits`, `fusions`) and its engine, so `plan_estimate(graph, plan)` is
`estimate(charged graph, layout_of(plan), cluster)` exactly as the plan was priced.
"""
from __future__ import annotations

from cost_models.estimate import estimate
from cost_models.hardware import ClusterSpec

from autopar.engine import plan_engine
from autopar.solve.layout import layout_of
from autopar.solve.planner import fused_graph, lowered_graph, model_spec


def plan_cluster(plan) -> ClusterSpec:
    """The ClusterSpec a Plan records (`Plan.cluster`, as ClusterSpec.to_dict wrote it)."""
    data = dict(plan.cluster)
    data.pop("world_size", None)  # derived; from_dict checks it against nodes x gpus_per_node
    return ClusterSpec.from_dict(data)


def plan_estimate(graph, plan, cluster: ClusterSpec | None = None):
    """cost_models' Estimate of `plan` on `graph` (the model it was planned for, captured at
    the plan's precision), charged as the planner charged it."""
    cluster = cluster or plan_cluster(plan)
    spec = model_spec(graph, seq_len=plan.seq_len)
    engine = plan_engine(plan)
    limits = (plan.solver or {}).get("lowering_limits") if isinstance(plan.solver, dict) else None
    spec, _ = fused_graph(lowered_graph(spec, limits, engine), cluster, limits, plan.fusions or [], engine)
    return estimate(spec, layout_of(plan), cluster)
