"""After the solver: make the Plan the best layout *as the Plan prices it*.

The stage solver minimises a closed form of the step time (problem.py:
m x slowest rank + (pp - 1) x slowest stage + slowest tail); the Plan reports
`cost_models.estimate`, which simulates the schedule event by event. The two
disagree where the closed form is blind:

- it sees only maxima, so a layer on a rank that is not the slowest may take
  any option that fits (checkpointing with memory to spare) at no cost to the
  objective, while the simulation charges every stage's time: `tidy` gives
  each layer the fastest option that still fits, which never raises the
  objective;
- it charges the whole fill/drain bubble on top of the slowest rank, while in
  the simulation lighter ranks run ahead and hide most of it; and it misses
  the stalls some chunk orders cause in the steady state. On GPT-3 6.7B,
  16 x A100-80GB, pp 8, global batch 64, interleaved V=3, micro-batch 2,
  ZeRO-2: balanced uniform stages cost 2272 ms in the closed form and
  1999 ms in the simulation, CP-SAT's V=3 answer 2252 ms vs 2389 ms; so the
  solver ranked V=4 first and the Plan said 2073.7 ms "optimal, gap 0".
  No closed form linear enough for CP-SAT tracks the simulation (on random
  partitions the closed form errs -24 % to +70 %, the critical-path form
  max_r(m R_r + sum of the stages before r) -42 % to 0 %), so the planner
  keeps the solver for the search and lets `estimate` decide among:
- `uniform_layouts`: every candidate the search considered with every layer at
  the same (zero, checkpoint, offload), stages balanced by the cost model
  (branch and bound on a valid bound of the simulated step);
- `polish`: stage-boundary moves of the best layout, each priced by `estimate`.

Everything here is deterministic (counts, not wall-clock budgets).
"""
from __future__ import annotations

import dataclasses

from cost_models.errors import CostModelError
from cost_models.estimate import estimate

from autopar.engine import engine_of
from autopar.solve.layout import candidate_layout, checkpoints_that_run, root_held_layers
from autopar.solve.problem import NS, StageProblem, StageSolution, evaluate, layer_classes
from autopar.solve.warm_start import RankMemory

# Estimates the uniform-layout check may spend (a large space's likeliest winners first)
UNIFORM_ESTIMATES = 200


def fits(est, limit_bytes: float) -> bool:
    """The estimate fits (GPU and host memory) and every pp rank stays under the limit."""
    return bool(est.fits) and max(est.peak_memory_bytes) <= limit_bytes


# -- the solver's own space -----------------------------------------------------------
def tidy(problem: StageProblem, solution: StageSolution) -> StageSolution:
    """The same stages, each layer (in order) at the fastest option (time, then tail,
    then footprint) that keeps the assignment feasible and the objective no higher.
    The objective only sees maxima, so a layer off the critical rank can usually drop
    its checkpointing at no cost to it; the simulation, which times every stage, gains."""
    p = problem
    if solution is None or solution.objective is None:
        return solution
    stage_of, option_of = list(solution.stage_of_layer), list(solution.option_of_layer)
    objective = evaluate(p, stage_of, option_of)
    if objective is None:
        return solution
    trial = _Trials(p, stage_of, option_of)
    changed = False
    for i in range(p.num_layers):
        for k in faster_options(p.group_options[p.layer_group[i]], option_of[i]):
            value = trial.value(i, k)
            if value is not None and value <= objective:
                trial.keep(i, k)
                objective, changed = value, True
                break
    if not changed:
        return solution
    return dataclasses.replace(solution, objective=objective, option_of_layer=option_of)


def faster_options(opts: list, current: int) -> list[int]:
    """The options faster than opts[current] (time, then tail), fastest first, then the
    smaller footprint, then the lower index."""
    cur = opts[current]
    return sorted((k for k, o in enumerate(opts) if (o.time, o.step) < (cur.time, cur.step)),
                  key=lambda k: (opts[k].time, opts[k].step, opts[k].static_mem + opts[k].act_mem, k))


class _Trials:
    """`evaluate` of a feasible assignment with one layer's option changed, from tallies:
    the changed rank's memory (warm_start's RankMemory, the rule of problem.rank_memory;
    the other ranks are unchanged and fit) and the stage and tail sums, all integers, so
    the same value as evaluating it whole (tidy asks ~3000 times per plan). Peak terms
    below zero (never priced; rank_memory counts them as 0) take the whole evaluate."""

    def __init__(self, p: StageProblem, stage_of: list, option_of: list):
        self.p, self.stage_of, self.option_of = p, stage_of, option_of
        self.exact = all(v >= 0 for opts in p.group_options for o in opts for v in o.peaks)
        self.stage_time = [p.stage_time_overhead if p.pp > 1 else 0] * p.num_stages
        self.rank_step = [0] * p.pp
        for i, (s, k) in enumerate(zip(stage_of, option_of)):
            o = p.group_options[p.layer_group[i]][k]
            self.stage_time[s] += o.time
            self.rank_step[s % p.pp] += o.step
        self.mem = [RankMemory(p, r, [i for i, s in enumerate(stage_of) if s % p.pp == r], stage_of, option_of)
                    for r in range(p.pp)] if self.exact else None

    def value(self, i: int, k: int) -> int | None:
        p, s, opts = self.p, self.stage_of[i], self.p.group_options[self.p.layer_group[i]]
        r, old, new = s % p.pp, opts[self.option_of[i]], opts[k]
        if not self.exact:
            before, self.option_of[i] = self.option_of[i], k
            value = evaluate(p, self.stage_of, self.option_of)
            self.option_of[i] = before
            return value
        if self.mem[r].after(old, new, s // p.pp) > p.capacity[r]:
            return None
        stage_time, rank_step = list(self.stage_time), list(self.rank_step)
        stage_time[s] += new.time - old.time
        rank_step[r] += new.step - old.step
        rank_time = [sum(stage_time[q::p.pp]) for q in range(p.pp)]
        return p.rank_weight * max(rank_time) + p.stage_weight * max(stage_time) + p.step_weight * max(rank_step)

    def keep(self, i: int, k: int) -> None:
        p, s = self.p, self.stage_of[i]
        old, new = p.group_options[p.layer_group[i]][self.option_of[i]], p.group_options[p.layer_group[i]][k]
        self.stage_time[s] += new.time - old.time
        self.rank_step[s % p.pp] += new.step - old.step
        if self.exact:
            self.mem[s % p.pp].switch(old, new, s // p.pp)
        self.option_of[i] = k


# -- uniform layouts ------------------------------------------------------------------
def _option_bounds(problem: StageProblem) -> list[tuple[float, int]]:
    """Per option index k of a bound problem: (seconds no uniform layout at option k can
    beat in the simulation, k), for the options whose memory floor fits. The busiest
    rank computes m micro-batches of at least 1/pp of the layers' time, and of at least
    the slowest layer (p2p, bubble and tail left out: the simulation's busy time
    excludes transfers); the bound problem's times and memory under-estimate the real
    ones (TableBuilder.bound_problem)."""
    p = problem
    counts = p.group_counts()
    classes = layer_classes(p)  # (group, activation weight, layers): memory_floor's terms
    capacity = max(p.capacity)
    out = []
    for k in range(len(p.option_labels)):
        opt = {g: opts[k] for g, opts in enumerate(p.group_options)}
        total = sum(c * opt[g].time for g, c in counts)
        per_rank = max(-(-total // p.pp), max(opt[g].time for g, _ in counts))
        need = [(opt[g].static_mem + w * opt[g].act_mem, c) for g, w, c in classes]
        floor = max(sum(x * c for x, c in need) / p.pp, max(x for x, _ in need))
        if floor > capacity:  # memory_floor with every layer at option k
            continue
        out.append((p.num_micro_batches * per_rank * NS, k))
    return out


def _balanced(layout, est):
    """The layout with the stage split `estimate` balanced spelled out, so that
    layout_of(plan) prices exactly this estimate."""
    layout = dataclasses.replace(layout, stage_layers=[len(s["layers"]) for s in est.per_stage])
    n = sum(layout.stage_layers)
    layout.layer_zero = [layout.zero] * n
    layout.layer_checkpoint = list(layout.layer_checkpoint or [layout.checkpoint] * n)
    layout.layer_offload = [layout.offload] * n
    return layout


def price_uniform(model, cluster, cand, option: tuple, *, precision: str, optimizer: str):
    """(Layout, Estimate) of `cand` with every layer at `option` = (zero, checkpoint,
    offload), as the lowering runs it (ZeRO levels `lowered_zero_levels` gives, no
    recomputation where a layer cannot take it), stages balanced by the cost model;
    (layout, None) when the cost model refuses the layout."""
    zero, ckpt, off = option
    layout = candidate_layout(cand, precision=precision, optimizer=optimizer, zero=zero, checkpoint=ckpt,
                              offload=off, root_held=root_held_layers(model), engine=engine_of(model))
    layout.layer_checkpoint = checkpoints_that_run(model, ckpt)
    try:
        return layout, estimate(model, layout, cluster)
    except CostModelError:
        return layout, None


def uniform_order(candidates, options, *, bound_problem) -> list[tuple]:
    """Every uniform layout of the space that may fit, as (stretched bound, bound,
    candidate, option), in the order `uniform_layouts` visits them: by a valid lower
    bound of its simulated step (`_option_bounds`: busy time, no bubble) stretched by
    the textbook bubble, (1 + (pp - 1) / (V m)), so the likeliest winners come first."""
    scored = []
    for cand in candidates:
        problem = bound_problem(cand)
        if problem.num_layers < problem.num_stages:
            continue
        labels = list(problem.option_labels)
        stretch = 1 + (cand.pp - 1) / (cand.virtual_stages * cand.num_micro_batches)
        scored += [(bound * stretch, bound, cand, labels[k]) for bound, k in _option_bounds(problem)
                   if labels[k] in options]
    scored.sort(key=lambda x: (x[0], x[2], x[3]))
    return scored


def uniform_pricings(model, cluster, candidates, options, *, bound_problem, precision, optimizer, limit: int):
    """((candidate, option), price_uniform's answer) for the first `limit` layouts of
    `uniform_order`: what `uniform_layouts` will price, priced ahead by a second
    process while the search runs (autopar/two_processes.Beside; planner.py)."""
    for _, _, cand, option in uniform_order(candidates, options, bound_problem=bound_problem)[:limit]:
        yield (cand, option), price_uniform(model, cluster, cand, option, precision=precision, optimizer=optimizer)


def uniform_layouts(model, cluster, candidates, options, *, bound_problem, precision, optimizer, limit_bytes,
                    best_s: float = float("inf"), max_estimates: int = UNIFORM_ESTIMATES, known: dict | None = None):
    """The fastest fitting uniform layouts: (candidate, option, layout, estimate), fastest first.

    candidates: the search space; options: the (zero, checkpoint, offload) triples
    the solver could choose; bound_problem(candidate) -> a StageProblem whose
    option times under-estimate the real ones (TableBuilder.bound_problem).
    A (candidate, option) pair is skipped when a valid lower bound of its
    simulated step reaches the best found (or `best_s`, the solver's pick).
    Pairs are visited in `uniform_order`, so that when a large space exceeds
    `max_estimates` estimates the likeliest winners were priced; within the cap
    the check is exhaustive. `known`: {(candidate, option): price_uniform's
    answer} already priced (`uniform_pricings`), read instead of pricing again."""
    found, priced = [], 0
    best = best_s
    for _, bound, cand, option in uniform_order(candidates, options, bound_problem=bound_problem):
        if priced >= max_estimates:
            break
        if bound >= best:
            continue
        hit = known.get((cand, option)) if known else None
        layout, est = hit if hit is not None else price_uniform(model, cluster, cand, option, precision=precision,
                                                                optimizer=optimizer)
        if est is None:
            continue
        priced += 1
        if fits(est, limit_bytes):
            found.append((cand, option, _balanced(layout, est), est))
            best = min(best, est.step_time_s)
    found.sort(key=lambda x: (x[3].step_time_s, x[0], x[1]))
    return found, priced


# -- stage-boundary moves ---------------------------------------------------------------
def polish(model, cluster, layout, est, *, limit_bytes: float, max_estimates: int = 120):
    """Move stage boundaries one layer at a time (layers keep their options) while
    `estimate` finds the step faster and the layout fits: steepest descent, ties to
    the earlier boundary. Returns (layout, estimate, moves made)."""
    if layout.stage_layers is None or len(layout.stage_layers) < 2:
        return layout, est, 0
    counts = list(layout.stage_layers)
    priced, moves = 0, 0
    tried: set = {tuple(counts)}
    while priced < max_estimates:
        best = None
        for s in range(len(counts) - 1):
            for delta in (1, -1):  # boundary s moves right (stage s grows) or left
                new = list(counts)
                new[s] += delta
                new[s + 1] -= delta
                if min(new[s], new[s + 1]) < 1 or tuple(new) in tried or priced >= max_estimates:
                    continue
                tried.add(tuple(new))
                candidate = dataclasses.replace(layout, stage_layers=new)
                try:
                    e = estimate(model, candidate, cluster)
                except CostModelError:
                    continue
                priced += 1
                if fits(e, limit_bytes) and e.step_time_s < (best[1].step_time_s if best else est.step_time_s):
                    best = (candidate, e)
        if best is None:
            break
        layout, est = best
        counts = list(layout.stage_layers)
        moves += 1
    return layout, est, moves


def assignment_of(layout) -> list[tuple]:
    """Per-layer (zero, checkpoint, offload) of a layout with explicit per-layer lists."""
    return list(zip(layout.layer_zero, layout.layer_checkpoint, layout.layer_offload))


__all__ = ["fits", "tidy", "price_uniform", "uniform_order", "uniform_pricings", "uniform_layouts", "polish", "assignment_of"]
