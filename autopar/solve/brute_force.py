"""Exhaustive reference solver for small stage problems (tests only).

Tries every contiguous partition of the layers into pp*V non-empty stages and
every option of every layer, layer by layer (no run/count compression, no
bounds), and scores each with `problem.evaluate`. It shares nothing with the
CP-SAT model except the integer table, which is what makes it a reference.
"""
from __future__ import annotations

import itertools

from autopar.solve.problem import StageProblem, StageSolution, evaluate


def solve_brute_force(problem: StageProblem, *, max_assignments: int = 2_000_000) -> StageSolution:
    p = problem
    n, S = p.num_layers, p.num_stages
    if n < S:
        return StageSolution(objective=None, status="infeasible")
    option_ranges = [range(len(p.group_options[g])) for g in p.layer_group]
    size = 1
    for r in option_ranges:
        size *= len(r)
    partitions = list(itertools.combinations(range(1, n), S - 1))
    if size * len(partitions) > max_assignments:
        raise ValueError(f"brute force over {size * len(partitions)} assignments is too large")
    best = None
    for cuts in partitions:
        bounds = (0,) + cuts + (n,)
        stage_of_layer = [s for s in range(S) for _ in range(bounds[s], bounds[s + 1])]
        for options in itertools.product(*option_ranges):
            value = evaluate(p, stage_of_layer, options)
            if value is not None and (best is None or value < best[0]):
                best = (value, stage_of_layer, list(options))
    if best is None:
        return StageSolution(objective=None, status="infeasible")
    return StageSolution(objective=best[0], stage_of_layer=best[1], option_of_layer=best[2],
                         status="optimal", bound=best[0])
