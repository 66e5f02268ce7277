"""The outer search: price every candidate's lower bound, then solve the
candidates in order of that bound and stop once no unsolved bound can beat
the best answers found (branch and bound over meshes).

This module knows nothing about layers or hardware: it takes candidates and
a function that builds each one's integer `StageProblem` (`table.py` does
that from the cost model; tests pass random tables), so the same loop runs
against CP-SAT and against the brute-force reference.

Why it is exact: a candidate is skipped only when its lower bound is at
least the `keep`-th best objective already proven, and a lower bound never
exceeds the candidate's optimum; a candidate whose bound is at least the
best found is ranked by its warm start (`warm_start.py`) instead of a solve,
since it cannot be the winner. So the winner is the optimum of the whole
space (under the solvers' own proven gaps); the runners-up are good layouts,
not necessarily their candidates' optima.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from autopar.solve.cpsat import solve_cpsat
from autopar.solve.problem import NS, StageProblem, StageSolution, evaluate, lower_bound
from autopar.solve.warm_start import warm_start


@dataclass
class CandidateResult:
    candidate: object
    problem: StageProblem | None
    lower_bound_s: float | None  # None: cannot fit in memory (or no stage layout exists)
    solution: StageSolution | None = None
    status: str = "pending"  # ok | oom | pruned | unsolved

    @property
    def step_s(self) -> float | None:
        if self.solution is None or self.solution.objective is None:
            return None
        return self.solution.objective * NS / self.problem.virtual_stages


@dataclass
class SearchResult:
    ranked: list  # CandidateResult with status ok, best first
    oom: list  # CandidateResult that cannot fit (bound or solver)
    pruned: int = 0
    solved: int = 0
    candidates: int = 0
    wall_s: float = 0.0
    solve_wall_s: float = 0.0
    max_gap: float = 0.0
    all_optimal: bool = True
    stats: dict = field(default_factory=dict)

    @property
    def best(self) -> CandidateResult | None:
        return self.ranked[0] if self.ranked else None


def search(candidates: list, build_problem: Callable, *, keep: int = 1, solver: Callable | None = None,
           bound: Callable | None = None, time_limit_s: float = 1.0, quick_limit_s: float = 0.2,
           work_budget: float = 5.0, first_pass_budget: float = 15.0, progress: Callable | None = None,
           order_key: Callable | None = None, distinct: Callable | None = None,
           sweep: Callable | None = None) -> SearchResult:
    """Solve `candidates` (objects with a total order) to the best `keep` of them.

    build_problem(candidate) -> StageProblem. bound(candidate) -> seconds or
    None (cannot fit): an optional cheaper lower bound that never exceeds the
    candidate's optimum; without it the bound of the built problem is used.
    solver(problem, time_limit_s) -> StageSolution (default CP-SAT).

    Two passes: every candidate that survives the bounds is solved with a
    short limit (`quick_limit_s`; a quarter of it when its bound cannot beat
    the best found, since it can only be a runner-up), in order of its
    bound, so good incumbents appear early and most solves end proven
    optimal; candidates left unproven whose solver bound still beats the
    best are then re-solved with `time_limit_s` each while the deterministic
    `work_budget` lasts.
    The first pass stops after `first_pass_budget` work units; candidates it
    did not reach count in the reported gap with their bounds.
    Limits are CP-SAT work units, so the result does not depend on load.
    progress(phase, done, total, best_s) is called as the search advances.
    distinct(candidate) -> key: `keep` counts distinct keys (e.g. meshes), so
    the runners-up are other layouts, not the winner with another micro-batch.
    sweep(candidate) -> int: the first pass visits sweep 0 (by bound), then
    sweep 1, ...: the planner puts the candidates whose problems CP-SAT proves
    in milliseconds (no interleaving) first, so their incumbents prune the
    costly interleaved variants before the work budget runs out.
    """
    t0 = time.perf_counter()
    solve = solver or (lambda p, limit: solve_cpsat(p, time_limit_s=limit))
    order_key = order_key or (lambda c: c)
    results = []
    oom = []
    total = len(candidates)
    for i, cand in enumerate(candidates):
        if bound is not None:
            r = CandidateResult(cand, None, bound(cand))
        else:
            problem = build_problem(cand)
            lb = lower_bound(problem)
            r = CandidateResult(cand, problem, None if lb is None else lb * NS / problem.virtual_stages)
        if r.lower_bound_s is None:
            r.status = "oom"
            oom.append(r)
        else:
            results.append(r)
        if progress and (i % 64 == 0 or i == total - 1):
            progress("bounding", i + 1, total, None)
    # Deterministic order: by sweep, bound, then the candidate itself.
    results.sort(key=lambda r: (sweep(r.candidate) if sweep else 0, r.lower_bound_s, order_key(r.candidate)))
    solved: list[CandidateResult] = []
    stats = {"pruned": 0, "wall": 0.0, "work": 0.0}

    def cutoff():
        seen, count = set(), 0
        for x in solved:
            key = distinct(x.candidate) if distinct else id(x)
            if key not in seen:
                seen.add(key)
                count += 1
                if count == keep:
                    return x.step_s
        return None

    def run(r, limit):
        sol = solve(r.problem, limit)
        stats["wall"] += sol.wall_s
        stats["work"] += sol.work
        if sol.objective is None:
            if sol.status == "infeasible":
                r.status = "oom"
                r.solution = sol
                oom.append(r)
            elif r.solution is None:
                r.status = "unsolved"
            return
        if r.solution is None or r.solution.objective is None or sol.objective <= r.solution.objective:
            better_bound = max(sol.bound or 0, r.solution.bound or 0) if r.solution else sol.bound
            sol.bound = better_bound
            r.solution = sol
        if sol.bound is not None:
            r.lower_bound_s = max(r.lower_bound_s, sol.bound * NS / r.problem.virtual_stages)
        if r.status != "ok":
            r.status = "ok"
            solved.append(r)
        if r.solution.bound is not None and r.solution.bound >= r.solution.objective:
            r.solution.status = "optimal"
        solved.sort(key=lambda x: (x.step_s, order_key(x.candidate)))

    def warm(r) -> bool:
        """Rank `r` by its warm start (no solver); False when none fits."""
        start = warm_start(r.problem)
        if start is None:
            return False
        r.solution = StageSolution(objective=evaluate(r.problem, *start), stage_of_layer=list(start[0]),
                                   option_of_layer=list(start[1]), status="feasible",
                                   bound=int(r.lower_bound_s / NS * r.problem.virtual_stages))
        if r.solution.bound >= r.solution.objective:
            r.solution.status = "optimal"
        r.status = "ok"
        solved.append(r)
        solved.sort(key=lambda x: (x.step_s, order_key(x.candidate)))
        return True

    unexplored = []
    for idx, r in enumerate(results):
        if stats["work"] >= first_pass_budget and cutoff() is not None:
            # Out of solver budget: what is left stays unexplored, and its best bound is the gap.
            unexplored = [x for x in results[idx:] if x.lower_bound_s < cutoff()]
            for rest in results[idx:]:
                rest.status = "unsolved" if rest in unexplored else "pruned"
            stats["pruned"] += len(results) - idx - len(unexplored)
            break
        if cutoff() is not None and r.lower_bound_s >= cutoff():
            r.status = "pruned"  # the cutoff only falls: a later, lower bound in another sweep may still beat it
            stats["pruned"] += 1
            continue
        if r.problem is None:
            r.problem = build_problem(r.candidate)
            lb = lower_bound(r.problem)
            if lb is None:
                r.status = "oom"
                oom.append(r)
                continue
            r.lower_bound_s = max(r.lower_bound_s, lb * NS / r.problem.virtual_stages)
            if cutoff() is not None and r.lower_bound_s >= cutoff():
                r.status = "pruned"
                stats["pruned"] += 1
                continue
        # A candidate whose bound cannot beat the best found can only be a runner-up:
        # the warm start's hand-made layout ranks it well enough (the estimate
        # re-prices the alternatives anyway), and deep interleaved meshes, which
        # CP-SAT rarely proves in 0.2 units, do not eat the budget. Only when
        # no warm start fits does it get (a quarter of) a CP-SAT solve.
        best = solved[0].step_s if solved else None
        if best is not None and r.lower_bound_s >= best and warm(r):
            continue
        run(r, min(quick_limit_s if best is None or r.lower_bound_s < best else quick_limit_s / 4, time_limit_s))
        if progress:
            progress("solving", idx + 1, len(results), solved[0].step_s if solved else None)

    # Candidates the first pass had no budget for still get the warm start's layout
    # (a hand-made feasible layout, milliseconds each): a cheap candidate that is
    # never reached (a 1F1B mesh behind many interleaved ones of similar bound)
    # must not simply vanish from the ranking. They stay unresolved in the gap.
    for r in unexplored:
        if r.problem is None:
            r.problem = build_problem(r.candidate)
        warm(r)
    unexplored = [r for r in unexplored if r.status != "ok"]

    # Pass 2: close the gaps that could still change the answer, best bound first.
    open_ = sorted((r for r in solved if r.solution.status != "optimal"),
                   key=lambda r: (r.lower_bound_s, order_key(r.candidate)))
    for r in open_:
        # only gaps that could change the winner (what `all_optimal` and the gap report);
        # runners-up keep their first-pass answers
        if stats["work"] >= work_budget or r.lower_bound_s >= solved[0].step_s:
            continue
        run(r, time_limit_s)
    unresolved = [r for r in solved if r.solution.status != "optimal"] + unexplored
    best = solved[0].step_s if solved else None
    global_lb = min([best] + [r.lower_bound_s for r in unresolved]) if best else None
    max_gap = (best - global_lb) / best if best else 0.0
    return SearchResult(ranked=solved, oom=oom, pruned=stats["pruned"], solved=len(solved), candidates=total,
                        wall_s=time.perf_counter() - t0, solve_wall_s=stats["wall"], max_gap=max(0.0, max_gap),
                        all_optimal=not any(r.lower_bound_s < best for r in unresolved) if best else True,
                        stats={"cpsat_work_units": round(stats["work"], 3), "unresolved": len(unresolved),
                               "unexplored": len(unexplored)})
