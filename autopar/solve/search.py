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

import math
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
    s = _Search(build_problem, keep=keep,
                solve=solver or (lambda p, limit, beat=None: solve_cpsat(p, time_limit_s=limit, beat=beat)),
                order_key=order_key or (lambda c: c), distinct=distinct)
    results = s.bound_all(candidates, bound, progress)
    # Deterministic order: by sweep, bound, then the candidate itself.
    results.sort(key=lambda r: (sweep(r.candidate) if sweep else 0, r.lower_bound_s, s.order_key(r.candidate)))
    unexplored = s.first_pass(results, time_limit_s, quick_limit_s, first_pass_budget, progress)
    unexplored = s.rank_unexplored(unexplored)
    s.close_gaps(time_limit_s, work_budget)
    return s.result(unexplored, len(candidates), time.perf_counter() - t0)


class _Search:
    """The state one search shares between its passes: the candidates solved so far
    (best first), those that cannot fit, and the solver's wall time and work."""

    def __init__(self, build_problem: Callable, *, keep: int, solve: Callable, order_key: Callable,
                 distinct: Callable | None):
        self.build_problem, self.keep, self.solve = build_problem, keep, solve
        self.order_key, self.distinct = order_key, distinct
        self.solved: list[CandidateResult] = []
        self.oom: list[CandidateResult] = []
        self.stats = {"pruned": 0, "wall": 0.0, "work": 0.0}

    def bound_all(self, candidates: list, bound: Callable | None, progress: Callable | None) -> list:
        """Every candidate's lower bound (the cheap `bound`, else the built problem's);
        those that cannot fit go to `oom`, the others are returned."""
        results = []
        total = len(candidates)
        for i, cand in enumerate(candidates):
            if bound is not None:
                r = CandidateResult(cand, None, bound(cand))
            else:
                problem = self.build_problem(cand)
                lb = lower_bound(problem)
                r = CandidateResult(cand, problem, None if lb is None else lb * NS / problem.virtual_stages)
            if r.lower_bound_s is None:
                r.status = "oom"
                self.oom.append(r)
            else:
                results.append(r)
            if progress and (i % 64 == 0 or i == total - 1):
                progress("bounding", i + 1, total, None)
        return results

    def cutoff(self) -> float | None:
        """The `keep`-th best step time among distinct solved layouts: a bound at least
        this cannot enter the kept ones."""
        seen, count = set(), 0
        for x in self.solved:
            key = self.distinct(x.candidate) if self.distinct else id(x)
            if key not in seen:
                seen.add(key)
                count += 1
                if count == self.keep:
                    return x.step_s
        return None

    def _rank(self) -> None:
        self.solved.sort(key=lambda x: (x.step_s, self.order_key(x.candidate)))

    def run(self, r: CandidateResult, limit: float, beat_s: float | None = None) -> None:
        """Solve `r` with `limit` work units and keep the better of its answers; with
        `beat_s`, only layouts faster than that step time are searched for (a proof
        that none exists raises r's bound to it)."""
        vs = r.problem.virtual_stages
        if beat_s is None:
            sol = self.solve(r.problem, limit)
        else:
            sol = self.solve(r.problem, limit, beat=math.ceil(beat_s / NS * vs - 1e-9))
        self.stats["wall"] += sol.wall_s
        self.stats["work"] += sol.work
        if sol.status == "cannot_beat":
            r.lower_bound_s = max(r.lower_bound_s, sol.bound * NS / vs)
            if r.solution is not None and r.solution.objective is not None:
                r.solution.bound = max(r.solution.bound or 0, sol.bound)
                if r.solution.bound >= r.solution.objective:
                    r.solution.status = "optimal"
            return
        if sol.objective is None:
            if sol.status == "infeasible":
                r.status = "oom"
                r.solution = sol
                self.oom.append(r)
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
            self.solved.append(r)
        if r.solution.bound is not None and r.solution.bound >= r.solution.objective:
            r.solution.status = "optimal"
        self._rank()

    def warm(self, r: CandidateResult) -> bool:
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
        self.solved.append(r)
        self._rank()
        return True

    def _prune(self, r: CandidateResult) -> bool:
        """Mark `r` pruned when its bound cannot enter the kept layouts."""
        cutoff = self.cutoff()
        if cutoff is not None and r.lower_bound_s >= cutoff:
            r.status = "pruned"
            self.stats["pruned"] += 1
            return True
        return False

    def first_pass(self, results: list, time_limit_s: float, quick_limit_s: float, first_pass_budget: float,
                   progress: Callable | None) -> list:
        """Every candidate that survives the bounds, in order, with a short solve (or its
        warm start when it can only be a runner-up). Returns the candidates left
        unexplored when the budget ran out whose bounds still beat the cutoff."""
        for idx, r in enumerate(results):
            if self.stats["work"] >= first_pass_budget and self.cutoff() is not None:
                # Out of solver budget: what is left stays unexplored, and its best bound is the gap.
                unexplored = [x for x in results[idx:] if x.lower_bound_s < self.cutoff()]
                for rest in results[idx:]:
                    rest.status = "unsolved" if rest in unexplored else "pruned"
                self.stats["pruned"] += len(results) - idx - len(unexplored)
                return unexplored
            # the cutoff only falls: a later, lower bound in another sweep may still beat it
            if self._prune(r):
                continue
            if r.problem is None:
                r.problem = self.build_problem(r.candidate)
                lb = lower_bound(r.problem)
                if lb is None:
                    r.status = "oom"
                    self.oom.append(r)
                    continue
                r.lower_bound_s = max(r.lower_bound_s, lb * NS / r.problem.virtual_stages)
                if self._prune(r):
                    continue
            # A candidate whose bound cannot beat the best found can only be a runner-up:
            # the warm start's hand-made layout ranks it well enough (the estimate
            # re-prices the alternatives anyway), and deep interleaved meshes, which
            # CP-SAT rarely proves in 0.2 units, do not eat the budget. Only when
            # no warm start fits does it get (a quarter of) a CP-SAT solve.
            best = self.solved[0].step_s if self.solved else None
            if best is not None and r.lower_bound_s < best:
                # Can it beat the best? CP-SAT's relaxation mostly answers "no" at once, where
                # searching for this candidate's own optimum ran its whole limit unproven
                # (GPT-3 175B's interleaved meshes: 17 solves, 12 s). A "no" leaves it a runner-up.
                self.run(r, min(quick_limit_s, time_limit_s), beat_s=best)
            if r.status != "ok" and (best is None or not self.warm(r)):
                self.run(r, min(quick_limit_s if best is None else quick_limit_s / 4, time_limit_s))
            if progress:
                progress("solving", idx + 1, len(results), self.solved[0].step_s if self.solved else None)
        return []

    def rank_unexplored(self, unexplored: list) -> list:
        """Candidates the first pass had no budget for still get the warm start's layout
        (a hand-made feasible layout, milliseconds each): a cheap candidate that is
        never reached (a 1F1B mesh behind many interleaved ones of similar bound)
        must not simply vanish from the ranking. They stay unresolved in the gap;
        returns those that still have no layout."""
        for r in unexplored:
            if r.problem is None:
                r.problem = self.build_problem(r.candidate)
            self.warm(r)
        return [r for r in unexplored if r.status != "ok"]

    def close_gaps(self, time_limit_s: float, work_budget: float) -> None:
        """Pass 2: re-solve with the full limit, best bound first, the unproven candidates
        whose bound could still change the winner (what `all_optimal` and the gap
        report); runners-up keep their first-pass answers."""
        open_ = sorted((r for r in self.solved if r.solution.status != "optimal"),
                       key=lambda r: (r.lower_bound_s, self.order_key(r.candidate)))
        for r in open_:
            if self.stats["work"] >= work_budget or r.lower_bound_s >= self.solved[0].step_s:
                continue
            self.run(r, time_limit_s, beat_s=self.solved[0].step_s)

    def result(self, unexplored: list, total: int, wall_s: float) -> SearchResult:
        """The ranking with its gap: the best step time against the lowest bound left unresolved."""
        solved, stats = self.solved, self.stats
        unresolved = [r for r in solved if r.solution.status != "optimal"] + unexplored
        best = solved[0].step_s if solved else None
        global_lb = min([best] + [r.lower_bound_s for r in unresolved]) if best else None
        max_gap = (best - global_lb) / best if best else 0.0
        return SearchResult(ranked=solved, oom=self.oom, pruned=stats["pruned"], solved=len(solved),
                            candidates=total, wall_s=wall_s, solve_wall_s=stats["wall"], max_gap=max(0.0, max_gap),
                            all_optimal=not any(r.lower_bound_s < best for r in unresolved) if best else True,
                            stats={"cpsat_work_units": round(stats["work"], 3), "unresolved": len(unresolved),
                                   "unexplored": len(unexplored)})
