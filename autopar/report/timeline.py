"""Pipeline schedule events for the Gantt chart, from the Plan's per-stage times.

The events come from the cost model's own schedule simulation
(`cost_models.pipeline.timeline`, docs/INTERFACES.md section 8), fed with the
per-stage times the solver wrote into the Plan, so the chart shows the same
schedule whose step time the Plan reports; the report only chooses how many
micro-batches to draw. An event is `(pp_rank, micro_batch, phase, start_s,
end_s, stage)` with phase 'fwd' or 'bwd'.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import pipeline
from cost_models.errors import CostModelError

# Drawing every micro-batch of a 192-micro-batch step gives thousands of
# boxes nobody can read; the steady state repeats, so a few rounds show it.
MAX_DRAWN_ROUNDS = 2
# A deep interleaved pipeline draws 2 x pp x V boxes per micro-batch (pp 16,
# V 6: 192), so two rounds would be 6,000 boxes, each ~2 px wide on a
# 1,000 px chart and a 1.6 MB page. Fewer micro-batches are drawn when the
# box count would pass this; gantt.py then merges back-to-back slivers.
MAX_DRAWN_BOXES = 3000


@dataclass(frozen=True)
class Event:
    pp_rank: int
    micro_batch: int
    phase: str  # 'fwd' | 'bwd'
    start_s: float
    end_s: float
    stage: int = 0


def drawn_micro_batches(plan) -> int:
    """How many micro-batches the chart shows: all, or enough for warm-up, steady
    state and drain, and no more than MAX_DRAWN_BOXES boxes allow.

    Drawing fewer changes only the picture: the step time, bubble and every
    other number come from the Plan, which simulated all of them.
    """
    pp, m = plan.mesh.pp, plan.num_micro_batches
    v = plan.virtual_stages if plan.schedule == "interleaved" else 1
    boxes_per_micro_batch = 2 * pp * v  # a forward and a backward per stage
    limit = min(max(8, MAX_DRAWN_ROUNDS * pp), max(1, MAX_DRAWN_BOXES // boxes_per_micro_batch))
    if m <= limit:
        return m
    if plan.schedule == "interleaved" and pp > 1:  # Megatron's interleaving needs a multiple of pp
        return max(pp, (limit // pp) * pp)
    return limit


def stage_times(plan) -> list[tuple[float, float, float]]:
    """(fwd_s, bwd_s, p2p_s) per stage and micro-batch, as the cost model simulated them.

    `sim_fwd_s` / `sim_bwd_s` (written by cost_models.estimate) are the times the
    simulator was fed: compute plus the tensor-parallel and exposed data-parallel
    communication inside each pass, recomputation in the backward. Plans without
    them fall back to compute alone (fwd; bwd + recompute).
    """
    out = []
    for st in sorted(plan.stages, key=lambda s: s.index):
        p = st.predicted or {}
        fwd = p.get("sim_fwd_s", p.get("fwd_s", 0.0))
        bwd = p.get("sim_bwd_s", float(p.get("bwd_s", 0.0)) + float(p.get("recompute_s", 0.0)))
        out.append((float(fwd), float(bwd), float(p.get("p2p_s", 0.0))))
    return out


def schedule_events(plan) -> tuple[list[Event], int]:
    """(events, micro-batches drawn) for the plan's pipeline; no events without per-stage times."""
    times = stage_times(plan)
    v = plan.virtual_stages if plan.schedule == "interleaved" else 1
    if not times or len(times) != plan.mesh.pp * v:
        return [], 0
    m = drawn_micro_batches(plan)
    # Without a pipeline the cost model runs micro-batches 1F1B (forward then backward
    # of each, gradient accumulation) whatever the plan's schedule field says.
    schedule = plan.schedule if plan.mesh.pp > 1 else "1f1b"
    try:
        raw = pipeline.timeline(schedule, plan.mesh.pp, m, plan.virtual_stages,
                                fwd_s=[t[0] for t in times], bwd_s=[t[1] for t in times], p2p_s=[t[2] for t in times])
    except CostModelError:  # a plan the simulator cannot lay out (hand-edited): draw nothing rather than fail
        return [], 0
    events = [Event(e["pp_rank"], e["micro_batch"], e["phase"], e["start_s"], e["end_s"], e.get("stage", e["pp_rank"]))
              for e in raw]
    return events, m
