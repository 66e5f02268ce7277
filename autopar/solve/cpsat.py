"""CP-SAT model of one candidate's stage problem (see `problem.py`).

Identical layers share variables: the layers are cut into *runs* of
consecutive layers with one signature (96 GPT-3 blocks are one run), and the
model decides, per stage and run, only *how many* of the run's layers the
stage holds (`count[s, j]`) and how many of those take each option
(`uses[s, j, k]`). Layers of a run are interchangeable, so this loses no
solution and removes the permutation symmetry a per-layer model would have;
the model size is stages x runs x options, independent of the layer count.

Stage s covers layers [b[s], b[s+1]) with b[0] = 0, b[S] = n and
b[s+1] >= b[s] + 1; the part of run [st, en) inside it is
max(0, min(b[s+1], en) - max(b[s], st)).

Objective and memory are `problem.py`'s: m x slowest rank + (pp - 1) x
slowest stage + slowest tail, and per rank one linear memory constraint per
in-flight count vector (exact per-chunk activations). Redundant cuts the LP
relaxation cannot derive (whole-layer water-fill bounds on the slowest rank
and stage, the candidate's lower bound) and the warm start's objective as an
upper bound (`warm_start.py`) keep the short first-pass solves useful.

Determinism: one worker, a fixed seed, and a *deterministic* time limit
(CP-SAT's work units, about a second each on this class of machine), so the
same problem gives the same answer on any machine load. The returned
solution lists options per layer in a fixed order (within a stage and run,
lower option indices go to earlier layers).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from autopar.solve.problem import (StageProblem, StageSolution, evaluate, lower_bound, pigeonhole_bounds,
                                   stage_time_bound)
from autopar.solve.warm_start import warm_start


@dataclass
class _Terms:
    """The linear pieces of the model, summed per stage and per pp rank."""
    stage_time: list  # per stage: its layers' time terms
    rank_step: list  # per rank: the step-time terms (data-parallel communication, optimizer)
    rank_static: list  # per rank: parameters, gradients, optimizer states, buffers
    rank_step_mem: list  # per rank: the optimizer step's temporaries
    stage_act: list  # per stage: activation KiB one micro-batch leaves in it
    rank_peak: list  # rank_peak[r][t]: the largest peak-term t among the options used on rank r
    uses: dict  # (rank, run, stages) -> how many of the run's layers there take each option


def solve_cpsat(problem: StageProblem, *, time_limit_s: float = 10.0, workers: int = 1,
                seed: int = 0, beat: int | None = None) -> StageSolution:
    """The optimal (or best found within the limit) stage layout of `problem`.

    `beat`: only layouts with an objective below it are wanted (branch and bound:
    another candidate already reaches it). CP-SAT's relaxation then usually proves
    within milliseconds that none exists (status "cannot_beat", bound = beat),
    where searching for the candidate's own optimum ran out its limit unproven.

    The variables and constraints are made in one fixed order (boundaries,
    prefixes, per-rank peaks, option counts, objective, warm start): CP-SAT's
    search depends on that order, and the same problem must give the same answer."""
    t0 = time.perf_counter()
    p = problem
    if p.num_layers < p.num_stages:
        return StageSolution(objective=None, status="infeasible", wall_s=time.perf_counter() - t0)
    lb = lower_bound(p)
    if lb is None:
        return StageSolution(objective=None, status="infeasible", wall_s=time.perf_counter() - t0)
    runs = p.runs()
    m = cp_model.CpModel()
    b = _boundaries(m, p.num_layers, p.num_stages)
    prefix = _prefixes(m, b, runs, p.num_layers, p.num_stages)
    terms = _option_counts(m, p, runs, prefix)
    objective = _objective(m, p, terms, lb)
    # Warm start as an incumbent, not a hint: CP-SAT must beat the hand-made layout
    # (`warm_start.py`), and when it cannot within its limit that layout is the answer.
    # (Measured: as AddHint it pulls one worker's search towards the hint's
    # neighbourhood and leaves better layouts unfound as often as it helps.)
    start = warm_start(p)
    start_value = evaluate(p, *start) if start else None
    if start_value is not None:
        m.Add(objective <= start_value)
    if beat is not None and (start_value is None or start_value >= beat):
        m.Add(objective <= beat - 1)

    solver = cp_model.CpSolver()
    solver.parameters.num_search_workers = workers
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.max_time_in_seconds = max(60.0, 20 * time_limit_s)  # backstop only: the deterministic limit binds
    # Ctrl-C is the user's, not this one solve's: CP-SAT's default catches SIGINT and ends
    # only the current solve, so the search went on to the next candidate (a 175B plan ran
    # its 31 s to the end through two Ctrl-C); left to Python, it raises KeyboardInterrupt
    # as the solve returns (the CLI exits 130)
    solver.parameters.catch_sigint_signal = False
    code = solver.Solve(m)
    wall = time.perf_counter() - t0
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if beat is not None and (start_value is None or start_value >= beat):
            # nothing below `beat`: proven when infeasible; the warm start is kept if it fits
            bound = beat if code == cp_model.INFEASIBLE else lb
            if start_value is not None:
                return StageSolution(objective=start_value, stage_of_layer=list(start[0]),
                                     option_of_layer=list(start[1]), bound=min(bound, start_value),
                                     status="optimal" if bound >= start_value else "feasible",
                                     wall_s=wall, work=solver.deterministic_time)
            return StageSolution(objective=None, status="cannot_beat" if code == cp_model.INFEASIBLE else "unknown",
                                 bound=bound, wall_s=wall, work=solver.deterministic_time)
        return _no_solution(solver, code, lb, start, start_value, wall)
    return _read_solution(solver, code, p, runs, b, terms.uses, wall)


def _boundaries(m: cp_model.CpModel, n: int, S: int) -> list:
    """Stage boundaries b[0] = 0 < b[1] < ... < b[S] = n; stage s can start no earlier
    than layer s and no later than n - (S - s) (every stage needs at least one layer)."""
    b = [m.NewConstant(0)] + [m.NewIntVar(s, n - S + s, f"b{s}") for s in range(1, S)] + [m.NewConstant(n)]
    for s in range(S):
        m.Add(b[s + 1] >= b[s] + 1)
    return b


def _prefixes(m: cp_model.CpModel, b: list, runs: list, n: int, S: int) -> list:
    """prefix[s][j]: layers of run j before boundary b[s] = clamp(b[s] - st_j, 0, len_j),
    a plain int where the boundary's range decides it. Counts are differences of
    prefixes (linear), and the prefixes of one boundary add up to it: both keep the
    LP relaxation tight."""
    prefix = []
    for s in range(S + 1):
        row = []
        for j, (st, en, g) in enumerate(runs):
            size = en - st
            if s == 0:
                row.append(0)
                continue
            if s == S:
                row.append(size)
                continue
            lo_b, hi_b = s, n - S + s  # the range b[s] can take
            if hi_b <= st:
                row.append(0)
                continue
            if lo_b >= en:
                row.append(size)
                continue
            var = m.NewIntVar(max(0, lo_b - st), min(size, hi_b - st), f"prefix{s}_{j}")
            shifted = m.NewIntVar(-n, n, f"shift{s}_{j}")
            m.Add(shifted == b[s] - st)
            capped = m.NewIntVar(0, n, f"cap{s}_{j}")
            m.AddMaxEquality(capped, [shifted, 0])
            m.AddMinEquality(var, [capped, size])
            row.append(var)
        prefix.append(row)
        if 0 < s < S:
            m.Add(sum(row) == b[s])
    return prefix


def _groups(p: StageProblem, runs: list, prefix: list) -> list:
    """(rank, run, stages, count expression) for every (stage, run) that can meet:
    how many of the run's layers the stage holds. Options are chosen per stage (the
    stage times set the bubble and the chunks' activations are held unequally long,
    chunk 0 longest), grouped by the pp rank that runs the stage."""
    parts = {}  # (rank, run) -> [(stage, count expression)]
    for s in range(p.num_stages):
        for j, (st, en, g) in enumerate(runs):
            a, z = prefix[s][j], prefix[s + 1][j]
            if isinstance(a, int) and isinstance(z, int) and a == z:
                continue  # this run can never meet this stage
            parts.setdefault((s % p.pp, j), []).append((s, z - a))
    groups = []
    for (r, j), items in sorted(parts.items()):
        groups.extend((r, j, (s,), e) for s, e in items)
    return groups


def _option_counts(m: cp_model.CpModel, p: StageProblem, runs: list, prefix: list) -> _Terms:
    """How many layers of each (stage, run) take each option, and the time and memory
    terms those counts add to their stage and rank."""
    S, pp = p.num_stages, p.pp
    n_peaks = max((len(o.peaks) for opts in p.group_options for o in opts), default=0)
    rank_peak = [[m.NewIntVar(0, max((o.peaks[t] for opts in p.group_options for o in opts if len(o.peaks) > t),
                                     default=0), f"peak{r}_{t}") for t in range(n_peaks)] for r in range(pp)]
    terms = _Terms(stage_time=[[] for _ in range(S)], rank_step=[[] for _ in range(pp)],
                   rank_static=[[] for _ in range(pp)], rank_step_mem=[[] for _ in range(pp)],
                   stage_act=[[] for _ in range(S)], rank_peak=rank_peak, uses={})
    used = {}  # (rank, run, option) -> BoolVar: some layer of the run on the rank takes the option
    for r, j, stages, total in _groups(p, runs, prefix):
        st, en, g = runs[j]
        size = en - st
        opts = p.group_options[g]
        if len(opts) == 1:
            var = m.NewIntVar(0, size, f"uses{r}_{j}_{stages[0]}_0")
            m.Add(var == total)
            ks = [var]
        else:
            ks = [m.NewIntVar(0, size, f"uses{r}_{j}_{stages[0]}_{k}") for k in range(len(opts))]
            m.Add(sum(ks) == total)
        terms.uses[r, j, stages] = ks
        for k, (o, var) in enumerate(zip(opts, ks)):
            if any(o.peaks):
                if (r, j, k) not in used:
                    used[r, j, k] = m.NewBoolVar(f"used{r}_{j}_{k}")
                    for t, value in enumerate(o.peaks):
                        if value:
                            m.Add(rank_peak[r][t] >= value * used[r, j, k])
                m.Add(var <= size * used[r, j, k])  # used = 0 forces no layer of this option here
            terms.stage_time[stages[0]].append(o.time * var)
            terms.rank_step[r].append(o.step * var)
            terms.rank_static[r].append(o.static_mem * var)
            if o.step_mem:
                terms.rank_step_mem[r].append(o.step_mem * var)
            terms.stage_act[stages[0]].append(o.act_mem * var)
    return terms


def _objective(m: cp_model.CpModel, p: StageProblem, terms: _Terms, lb: int):
    """The slowest rank T, the slowest step D (and with interleaving the slowest stage),
    each rank's memory rule, the redundant cuts, and Minimize(objective)."""
    S, pp, V = p.num_stages, p.pp, p.virtual_stages
    overhead = p.stage_time_overhead if pp > 1 else 0
    max_time = sum(max(o.time for o in p.group_options[g]) for g in p.layer_group) + V * overhead
    max_step = sum(max(o.step for o in p.group_options[g]) for g in p.layer_group)
    T = m.NewIntVar(0, max_time, "max_rank_time")
    D = m.NewIntVar(0, max_step, "max_rank_step")
    stage_sum = [sum(terms.stage_time[s]) + overhead for s in range(S)]
    for r in range(pp):
        m.Add(T >= sum(stage_sum[r::pp]))
        m.Add(D >= sum(terms.rank_step[r]))
        # exact activation peak: every count vector of the rank (problem.py)
        chunk_act = [sum(terms.stage_act[k * pp + r]) for k in range(V)]
        for vec in p.chunk_counts[r]:
            m.Add(sum(terms.rank_static[r]) + sum(terms.rank_peak[r]) + sum(c * a for c, a in zip(vec, chunk_act))
                  <= p.capacity[r])
        if terms.rank_step_mem[r]:  # the optimizer step: activations gone, its temporaries alive
            m.Add(sum(terms.rank_static[r]) + sum(terms.rank_step_mem[r]) <= p.capacity[r])
    t_pigeon, d_pigeon = pigeonhole_bounds(p)  # redundant cuts the LP relaxation cannot see
    m.Add(T >= t_pigeon)
    m.Add(D >= d_pigeon)
    if V == 1:  # one stage per rank: the slowest stage is the slowest rank
        objective = (p.rank_weight + p.stage_weight) * T + p.step_weight * D
    else:
        Smax = m.NewIntVar(0, max_time, "max_stage_time")
        for s in range(S):
            m.Add(Smax >= stage_sum[s])
        m.Add(V * Smax >= T)  # redundant: some stage of the slowest rank takes 1/V of it
        m.Add(Smax >= stage_time_bound(p, t_pigeon))
        objective = p.rank_weight * T + p.stage_weight * Smax + p.step_weight * D
    m.Add(objective >= lb)  # redundant, helps the proof of optimality
    m.Minimize(objective)
    return objective


def _no_solution(solver: cp_model.CpSolver, code, lb: int, start, start_value, wall: float) -> StageSolution:
    """CP-SAT found nothing better than the warm start in its limit: keep that, else
    say infeasible (proven) or unknown."""
    if start_value is not None:
        bound = lb if code != cp_model.UNKNOWN else max(lb, int(math.ceil(solver.BestObjectiveBound() - 1e-6)))
        return StageSolution(objective=start_value, stage_of_layer=list(start[0]), option_of_layer=list(start[1]),
                             status="optimal" if bound >= start_value else "feasible", bound=min(bound, start_value),
                             wall_s=wall, work=solver.deterministic_time)
    status = "infeasible" if code == cp_model.INFEASIBLE else "unknown"
    return StageSolution(objective=None, status=status, wall_s=wall, work=solver.deterministic_time)


def _read_solution(solver: cp_model.CpSolver, code, p: StageProblem, runs: list, b: list, uses: dict,
                   wall: float) -> StageSolution:
    """Layers per stage from the boundaries, options per layer from the counts."""
    n, S = p.num_layers, p.num_stages
    bounds = [int(solver.Value(x)) for x in b]
    stage_of_layer = [0] * n
    option_of_layer = [0] * n
    for s in range(S):
        for layer in range(bounds[s], bounds[s + 1]):
            stage_of_layer[layer] = s
    # Hand out each rank's option counts to its layers of that run, in layer
    # order (lower option index first): deterministic and equivalent.
    for (r, j, stages), ks in uses.items():
        st, en, g = runs[j]
        pool = [k for k, var in enumerate(ks) for _ in range(int(solver.Value(var)))]
        members = [layer for layer in range(st, en) if stage_of_layer[layer] in stages]
        for layer, k in zip(members, pool):
            option_of_layer[layer] = k
    value = int(round(solver.ObjectiveValue()))
    return StageSolution(objective=value, stage_of_layer=stage_of_layer, option_of_layer=option_of_layer,
                         status="optimal" if code == cp_model.OPTIMAL else "feasible",
                         bound=int(math.ceil(solver.BestObjectiveBound() - 1e-6)), wall_s=wall,
                         work=solver.deterministic_time)
