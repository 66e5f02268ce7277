"""Why the Plan's layout, and why not the others: how it was chosen (solver optimum,
runner-up, uniform layout, stage boundaries moved; whether "optimal" may be
claimed) and the alternatives a reader compares it with, each saying how much
slower it is, what it changes, or why it cannot fit.

Reads only what the planner priced (`planner.py`): it searches and prices
nothing itself.
"""
from __future__ import annotations

from autopar.solve.problem import KIB, NS, memory_floor, time_lower_bound
from autopar.solve.refine import assignment_of, fits
from autopar.solve.search import SearchResult
from autopar.solve.search_space import Candidate, mesh_key

GB = 1e9


def how_chosen(result: SearchResult, solver_pick, chosen, winner, uniform, uniform_priced: int, moves: int) -> dict:
    """How the returned layout was chosen, and whether "optimal" may be claimed: only when
    the solver proved its optimum, the Plan is that optimum, and neither a uniform layout
    nor a stage-boundary move priced faster under the cost model (what the Plan reports)."""
    is_solver_best = chosen[0].status != "uniform" and result.best is not None and (
        chosen[0].candidate == result.best.candidate)
    if chosen[0].status == "uniform":
        how = "uniform layout"
    elif chosen[0].status == "hsdp":
        how = "HSDP variant of a priced layout"  # solve/hsdp.py: not a layout the solver saw
    elif is_solver_best:
        how = "solver optimum"
    else:
        how = "solver runner-up"  # the pipeline simulation re-ranked the solver's best few
    if moves:
        how += " + stage boundaries moved"
    pick = solver_pick[2].step_time_s
    out = {"selected": how, "solver_pick_step_time_s": pick,
           "uniform_layouts_priced": uniform_priced,
           "best_uniform_step_time_s": uniform[0][2].step_time_s if uniform else None,
           "stage_moves": moves,
           "proven_optimal": bool(result.all_optimal and is_solver_best and not moves)}
    if winner[2].step_time_s < pick:
        out["note"] = (f"{how}: {1 - winner[2].step_time_s / pick:.1%} faster than the solver's pick "
                       f"({pick * 1e3:.1f} ms) under the cost model's pipeline simulation, which the solver's "
                       "closed-form step model does not follow exactly; optimality is not proven")
    return out



def mesh_dict(c: Candidate) -> dict:
    """A candidate's mesh as the Plan's JSON writes it (dp_shard only under HSDP)."""
    return {"pp": c.pp, "dp": c.dp, "tp": c.tp, **({"dp_shard": c.dp_shard} if c.dp_shard else {}),
            **({"ep": c.ep} if c.ep else {}), **({"cp": c.cp} if c.cp > 1 else {})}


def mesh_text(mesh: dict) -> str:
    dp = f"dp{mesh['dp']}" + (f" ({mesh['dp'] // mesh['dp_shard']} replicas x {mesh['dp_shard']} shards)"
                              if mesh.get("dp_shard") else "") + (f" (ep {mesh['ep']})" if mesh.get("ep") else "")
    cp = f" x cp{mesh['cp']}" if mesh.get("cp", 1) > 1 else ""
    return f"pp{mesh['pp']} x {dp}{cp} x tp{mesh['tp']}"


def layout_summary(c: Candidate, choices) -> dict:
    zeros = sorted({z for z, _, _ in choices})
    ckpts = sorted({k for _, k, _ in choices})
    return {"mesh": mesh_dict(c), "schedule": c.schedule, "virtual_stages": c.virtual_stages,
            "micro_batch_size": c.micro_batch_size, "num_micro_batches": c.num_micro_batches,
            "sequence_parallel": c.sequence_parallel,
            "zero": zeros[0] if len(zeros) == 1 else zeros, "checkpoint": ckpts[0] if len(ckpts) == 1 else ckpts}


_TIME_WORDS = {"compute_s": "compute", "recompute_s": "recomputation", "tp_comm_s": "tensor-parallel communication",
               "ep_comm_s": "expert-parallel all-to-alls",
               "pp_comm_s": "pipeline communication", "dp_comm_exposed_s": "exposed data-parallel communication",
               "bubble_s": "pipeline bubble", "optimizer_s": "optimizer step"}


def _sched(a: dict) -> str:
    # pp = 1 is schedule `accumulate` (autopar.plan.ACCUMULATE), its one name everywhere
    return a["schedule"] + (f":{a['virtual_stages']}" if a["schedule"] == "interleaved" else "")


def _differences(alt: dict, best: dict) -> list[str]:
    """What the alternative changes against the plan, in the plan's words ('schedule
    interleaved:2 (plan interleaved:3)'); empty when only the stage split / per-layer mix differs."""
    out = []
    for what, value in (("mesh", lambda a: mesh_text(a["mesh"])), ("schedule", _sched),
                        ("micro-batch", lambda a: f"{a['micro_batch_size']} x {a['num_micro_batches']}"),
                        ("sequence parallel", lambda a: "on" if a["sequence_parallel"] else "off"),
                        ("zero", lambda a: str(a["zero"])), ("checkpoint", lambda a: str(a["checkpoint"]))):
        if value(alt) != value(best):
            out.append(f"{what} {value(alt)} (plan {value(best)})")
    return out


def _why_slower(est, best, diffs: list[str]) -> str:
    slower = est.step_time_s / best.step_time_s - 1 if best.step_time_s else 0.0
    deltas = {k: est.time_breakdown.get(k, 0.0) - best.time_breakdown.get(k, 0.0) for k in _TIME_WORDS}
    key = max(sorted(deltas), key=lambda k: deltas[k])
    digits = 1 if slower >= 0.001 else 3  # a near-tie still shows a difference
    text = f"{slower:.{digits}%} slower (+{(est.step_time_s - best.step_time_s) * 1e3:.{digits}f} ms per step)"
    if deltas[key] > 0:
        text += f": more {_TIME_WORDS[key]} (+{deltas[key] * 1e3:.{digits}f} ms)"
    what = ("; ".join(diffs) if diffs else
            "same mesh, schedule and micro-batching, other stage split / per-layer choices")
    return f"{text}; {what}"


def predicted_dict(est) -> dict:
    return {"step_time_s": float(est.step_time_s), "tokens_per_s": float(est.tokens_per_s),
            "tflops_per_gpu": float(est.tflops_per_gpu), "mfu": float(est.mfu),
            "peak_memory_bytes": [float(x) for x in est.peak_memory_bytes]}


def list_alternatives(winner, others, result: SearchResult, top_k: int, limit_bytes: float) -> list[dict]:
    """Runners-up, fastest first: the priced layouts (the solver's best few and the best
    uniform ones) that fit, by predicted step time, each saying how much slower it is and
    what differs from the plan; then the priced ones over the memory limit (by step time);
    then candidates whose memory bound alone rules them out (by the step time their bound
    allows). Which layouts make the list: one per mesh first (a reader compares layouts,
    not micro-batch sizes), then the rest."""
    r0, layout0, best_est = winner
    best = layout_summary(r0.candidate, assignment_of(layout0))

    def identity(x):  # the same layout reached twice (a uniform layout the solver also found)
        return x[0].candidate, tuple(x[1].stage_layers or ()), tuple(assignment_of(x[1]))

    unique, seen_layouts = [], {identity(winner)}
    for x in others:
        if identity(x) not in seen_layouts:
            seen_layouts.add(identity(x))
            unique.append(x)
    ranked = sorted(unique, key=lambda x: (not fits(x[2], limit_bytes), x[2].step_time_s, x[0].candidate))
    seen, picked = {mesh_key(r0.candidate)}, []
    for x in ranked:
        if mesh_key(x[0].candidate) not in seen:
            seen.add(mesh_key(x[0].candidate))
            picked.append(x)
    picked += [x for x in ranked if x not in picked]
    picked = sorted(picked[:top_k], key=lambda x: (not fits(x[2], limit_bytes), x[2].step_time_s, x[0].candidate))
    out = []
    for r, layout, est in picked:
        alt = layout_summary(r.candidate, assignment_of(layout))
        alt["predicted"] = predicted_dict(est)
        alt["source"] = {"uniform": "uniform layout", "hsdp": "HSDP variant"}.get(r.status, "solver")
        alt["slower_by"] = est.step_time_s / best_est.step_time_s - 1 if best_est.step_time_s else 0.0
        alt["differs"] = _differences(alt, best)
        if fits(est, limit_bytes) and est.step_time_s <= best_est.step_time_s:
            what = "; ".join(alt["differs"]) or "another stage split / per-layer choices"
            alt.update(status="ok", why=f"ties the plan ({est.step_time_s * 1e3:.1f} ms per step); {what}")
        elif fits(est, limit_bytes):
            alt.update(status="slower", why=_why_slower(est, best_est, alt["differs"]))
        else:
            peak = max(est.peak_memory_bytes)
            alt.update(status="oom", why=f"out of memory: needs {peak / GB:.1f} GB on its fullest GPU (cost model), "
                                         f"over the {limit_bytes / GB:.1f} GB limit")
        out.append(alt)
    # The most promising layouts that cannot fit (by bound), so a reader sees why they are absent.
    # Ordered by the step time they could reach if memory allowed.
    oom = sorted((r for r in result.oom if r.problem is not None and r.problem.num_layers >= r.problem.num_stages),
                 key=lambda r: (time_lower_bound(r.problem) * NS / r.problem.virtual_stages, r.candidate))
    for r in oom[:max(0, top_k - len(out)) or 2]:
        p = r.problem
        need = memory_floor(p) * KIB
        alt = {"mesh": mesh_dict(r.candidate),
               "schedule": r.candidate.schedule, "virtual_stages": r.candidate.virtual_stages,
               "micro_batch_size": r.candidate.micro_batch_size, "num_micro_batches": r.candidate.num_micro_batches,
               "sequence_parallel": r.candidate.sequence_parallel, "zero": None, "checkpoint": None,
               "predicted": {}, "status": "oom", "source": "memory bound",
               "bound_step_time_s": time_lower_bound(p) * NS / p.virtual_stages,
               "why": f"out of memory: needs at least {need / GB:.1f} GB per GPU for layers alone, "
                      f"{p.capacity[0] * KIB / GB:.1f} GB available to layers"}
        out.append(alt)
    return out
