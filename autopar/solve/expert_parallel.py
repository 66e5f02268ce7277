"""Expert parallelism in the planner: why the plan splits its experts as it does.

ep is searched inside the mesh enumeration (search_space.ep_choices: for a model
with MoE layers, on meshes of data parallelism alone, every divisor of dp that
divides the experts), so each ep degree's per-layer table is priced by
cost_models/layer_ep.py like any other candidate. This module only writes the
sentence `Plan.solver["ep"]` holds: the ep layout chosen against the best one
without ep, or why no ep layout won.
"""
from __future__ import annotations

GB = 1e9


def account(winner, pool: list, experts: int) -> str | None:
    """`Plan.solver["ep"]`: why the winner splits (or keeps) its experts. `pool`: the layouts
    priced exactly as (CandidateResult, Layout, Estimate), fastest first."""
    if not experts:
        return None
    c, est = winner[0].candidate, winner[2]
    plain = next((x for x in pool if not x[0].candidate.ep), None)
    split = next((x for x in pool if x[0].candidate.ep), None)
    if c.ep:
        text = (f"ep {c.ep}: each MoE layer's {experts} experts split over {c.ep} dp ranks ({experts // c.ep} each), "
                f"their states sharded over efsdp = {c.dp // c.ep}; {_parts(est)}")
        if plain is not None:
            gain = 1 - est.step_time_s / plain[2].step_time_s
            more = (max(est.peak_memory_bytes) - max(plain[2].peak_memory_bytes)) / GB
            text += (f"; {gain:.1%} faster than the best layout without ep ({plain[2].step_time_s * 1e3:.1f} ms, "
                     f"{plain[0].candidate.describe()}), {more:+.1f} GB on the fullest GPU")
        else:
            text += "; no layout without ep fits among those priced exactly"
        return text
    if split is None:
        return (f"ep 1: no ep layout among the {len(pool)} priced exactly (ep is searched on meshes without tp; "
                f"the fastest here uses pp {c.pp} x tp {c.tp})")
    lost = split[2].step_time_s / est.step_time_s - 1
    return (f"ep 1: the best ep layout ({split[0].candidate.describe()}, {split[2].step_time_s * 1e3:.1f} ms; "
            f"{_parts(split[2])}) is {lost:.1%} slower than this one")


def _parts(est) -> str:
    """The all-to-alls of the busiest stage per micro-batch (the critical pp rank may hold
    no MoE layer) and the step's exposed data-parallel comm."""
    a2a = max([s.get("ep_comm_s", 0.0) for s in est.per_stage] or [0.0])
    return (f"all-to-alls {a2a * 1e3:.1f} ms per micro-batch on the busiest stage of a "
            f"{est.step_time_s * 1e3:.1f} ms step, exposed data-parallel comm "
            f"{est.time_breakdown.get('dp_comm_exposed_s', 0.0) * 1e3:.1f} ms")
