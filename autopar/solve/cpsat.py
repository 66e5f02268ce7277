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

from ortools.sat.python import cp_model

from autopar.solve.problem import (StageProblem, StageSolution, evaluate, lower_bound, pigeonhole_bounds,
                                   stage_time_bound)
from autopar.solve.warm_start import warm_start


def solve_cpsat(problem: StageProblem, *, time_limit_s: float = 10.0, workers: int = 1,
                seed: int = 0) -> StageSolution:
    t0 = time.perf_counter()
    p = problem
    n, S, pp, V = p.num_layers, p.num_stages, p.pp, p.virtual_stages
    if n < S:
        return StageSolution(objective=None, status="infeasible", wall_s=time.perf_counter() - t0)
    lb = lower_bound(p)
    if lb is None:
        return StageSolution(objective=None, status="infeasible", wall_s=time.perf_counter() - t0)
    runs = p.runs()
    m = cp_model.CpModel()

    # Stage boundaries; stage s can start no earlier than layer s and no later
    # than n - (S - s) (every stage needs at least one layer).
    b = [m.NewConstant(0)] + [m.NewIntVar(s, n - S + s, f"b{s}") for s in range(1, S)] + [m.NewConstant(n)]
    for s in range(S):
        m.Add(b[s + 1] >= b[s] + 1)

    # prefix[s][j]: layers of run j before boundary b[s] = clamp(b[s] - st_j, 0, len_j).
    # Counts are differences of prefixes (linear), and the prefixes of one
    # boundary add up to it: both keep the LP relaxation tight.
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

    stage_time = [[] for _ in range(S)]
    rank_step = [[] for _ in range(pp)]
    rank_static = [[] for _ in range(pp)]
    rank_step_mem = [[] for _ in range(pp)]  # the optimizer step's temporaries
    stage_act = [[] for _ in range(S)]  # activation KiB one micro-batch leaves in stage s
    n_peaks = max((len(o.peaks) for opts in p.group_options for o in opts), default=0)
    # rank_peak[r][t]: the largest peak-term t among the options used on rank r
    rank_peak = [[m.NewIntVar(0, max((o.peaks[t] for opts in p.group_options for o in opts if len(o.peaks) > t),
                                     default=0), f"peak{r}_{t}") for t in range(n_peaks)] for r in range(pp)]
    # Options are chosen per (stage, run) with interleaving, per (pp rank, run)
    # without (a rank is one stage then): how many of those layers use each
    # option. Per stage because the stage times set the bubble and the chunks'
    # activations are held unequally long (chunk 0 longest).
    parts = {}  # (rank, run) -> [(stage, count expression)]
    for s in range(S):
        for j, (st, en, g) in enumerate(runs):
            a, z = prefix[s][j], prefix[s + 1][j]
            if isinstance(a, int) and isinstance(z, int) and a == z:
                continue  # this run can never meet this stage
            parts.setdefault((s % pp, j), []).append((s, z - a))
    groups = []  # (rank, run, stages it covers, count expression)
    for (r, j), items in sorted(parts.items()):
        groups.extend((r, j, (s,), e) for s, e in items)
    used = {}  # (rank, run, option) -> BoolVar: some layer of the run on the rank takes the option
    uses = {}
    for r, j, stages, total in groups:
        st, en, g = runs[j]
        size = en - st
        opts = p.group_options[g]
        key = (r, j, stages)
        if len(opts) == 1:
            var = m.NewIntVar(0, size, f"uses{r}_{j}_{stages[0]}_0")
            m.Add(var == total)
            ks = [var]
        else:
            ks = [m.NewIntVar(0, size, f"uses{r}_{j}_{stages[0]}_{k}") for k in range(len(opts))]
            m.Add(sum(ks) == total)
        uses[key] = ks
        for k, (o, var) in enumerate(zip(opts, ks)):
            if any(o.peaks):
                if (r, j, k) not in used:
                    used[r, j, k] = m.NewBoolVar(f"used{r}_{j}_{k}")
                    for t, value in enumerate(o.peaks):
                        if value:
                            m.Add(rank_peak[r][t] >= value * used[r, j, k])
                m.Add(var <= size * used[r, j, k])  # used = 0 forces no layer of this option here
            stage_time[stages[0]].append(o.time * var)
            rank_step[r].append(o.step * var)
            rank_static[r].append(o.static_mem * var)
            if o.step_mem:
                rank_step_mem[r].append(o.step_mem * var)
            stage_act[stages[0]].append(o.act_mem * var)

    overhead = p.stage_time_overhead if pp > 1 else 0
    max_time = sum(max(o.time for o in p.group_options[g]) for g in p.layer_group) + V * overhead
    max_step = sum(max(o.step for o in p.group_options[g]) for g in p.layer_group)
    T = m.NewIntVar(0, max_time, "max_rank_time")
    D = m.NewIntVar(0, max_step, "max_rank_step")
    stage_sum = [sum(stage_time[s]) + overhead for s in range(S)]
    for r in range(pp):
        m.Add(T >= sum(stage_sum[r::pp]))
        m.Add(D >= sum(rank_step[r]))
        # exact activation peak: every count vector of the rank (problem.py)
        chunk_act = [sum(stage_act[k * pp + r]) for k in range(V)]
        for vec in p.chunk_counts[r]:
            m.Add(sum(rank_static[r]) + sum(rank_peak[r]) + sum(c * a for c, a in zip(vec, chunk_act))
                  <= p.capacity[r])
        if rank_step_mem[r]:  # the optimizer step: activations gone, its temporaries alive
            m.Add(sum(rank_static[r]) + sum(rank_step_mem[r]) <= p.capacity[r])
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
    # Warm start as an incumbent, not a hint: CP-SAT must beat the hand-made layout
    # (`warm_start.py`), and when it cannot within its limit that layout is the answer.
    # (Measured: as AddHint it pulls one worker's search towards the hint's
    # neighbourhood and leaves better layouts unfound as often as it helps.)
    start = warm_start(p)
    start_value = evaluate(p, *start) if start else None
    if start_value is not None:
        m.Add(objective <= start_value)

    solver = cp_model.CpSolver()
    solver.parameters.num_search_workers = workers
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.max_time_in_seconds = max(60.0, 20 * time_limit_s)  # backstop only: the deterministic limit binds
    code = solver.Solve(m)
    wall = time.perf_counter() - t0
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if start_value is not None:
            # CP-SAT found nothing better than the warm start in its limit: keep that
            bound = lb if code != cp_model.UNKNOWN else max(lb, int(math.ceil(solver.BestObjectiveBound() - 1e-6)))
            return StageSolution(objective=start_value, stage_of_layer=list(start[0]), option_of_layer=list(start[1]),
                                 status="optimal" if bound >= start_value else "feasible", bound=min(bound, start_value),
                                 wall_s=wall, work=solver.deterministic_time)
        status = "infeasible" if code == cp_model.INFEASIBLE else "unknown"
        return StageSolution(objective=None, status=status, wall_s=wall, work=solver.deterministic_time)

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
