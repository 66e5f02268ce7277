"""The stage problem one candidate poses, as an integer table.

Given a candidate (mesh, micro-batching, schedule), what is left to decide is
where the pipeline stage boundaries go and, per layer, one *option*: a
(zero, checkpoint, offload) triple. Each option of each layer has four costs:

- `time`: per micro-batch on its stage (forward + backward + recomputation +
  tensor-parallel communication), in nanoseconds;
- `step`: per optimizer step, not per micro-batch (exposed data-parallel
  communication + optimizer update), in nanoseconds;
- `static_mem`: parameters, gradients and optimizer state on one GPU, KiB;
- `act_mem`: activations one micro-batch leaves in flight, KiB;
- `peaks`: memory terms a rank pays once, at the largest value among its
  layers (the recomputation working set of one checkpointed layer, FSDP's
  unsharded buffers of one ZeRO-3 layer, one layer output for TP), KiB.

Objective (Megatron's step-time model, eq. 1, generalised to uneven stages
and interleaving): with R_r the per-micro-batch time of pp rank r (the sum of
its V stages) and D_r its per-step tail,

    step = (m + (pp - 1) / V) * max_r R_r  +  max_r D_r

which the solvers minimise in the integer form V * step =
(V*m + pp - 1) * max R + V * max D. Memory on pp rank r:

    sum(static) + in_flight_r * sum(act) + sum_t max(peaks[t]) <= capacity_r

with in_flight_r = in_flight_numerator(r) / V (see `in_flight_numerators`).

Integer scaling: times are rounded *up* to whole nanoseconds and memory *up*
to whole KiB, once, when the table is built; CP-SAT and the brute-force
reference then work on the same integers, so "equal to the optimum" is exact.
Rounding up keeps the table conservative (memory never under-counted by it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

NS = 1e-9  # seconds per time unit
KIB = 1024  # bytes per memory unit


def to_time_units(seconds: float) -> int:
    return int(math.ceil(max(0.0, seconds) / NS - 1e-6))


def to_mem_units(nbytes: float) -> int:
    return int(math.ceil(max(0.0, nbytes) / KIB - 1e-9))


@dataclass(frozen=True)
class OptionCost:
    option: int  # index into StageProblem.option_labels
    time: int
    step: int
    static_mem: int
    act_mem: int
    peaks: tuple = ()  # per peak term, KiB (a rank pays the max over its layers)


@dataclass
class StageProblem:
    layer_group: list  # group (signature) index of each layer, in execution order
    group_options: list  # per group: list[OptionCost] (non-empty)
    pp: int
    virtual_stages: int
    num_micro_batches: int
    in_flight_num: list  # per pp rank: micro-batches in flight x V (an integer)
    capacity: list  # per pp rank: KiB available to layers
    stage_time_overhead: int = 0  # per stage per micro-batch (p2p send of its output) when pp > 1
    option_labels: list = field(default_factory=list)  # option index -> (zero, checkpoint, offload)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def time_weight(self) -> int:
        return self.virtual_stages * self.num_micro_batches + self.pp - 1

    @property
    def step_weight(self) -> int:
        return self.virtual_stages

    def runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs of consecutive layers of one group: (start, end, group)."""
        out = []
        start = 0
        for i in range(1, self.num_layers + 1):
            if i == self.num_layers or self.layer_group[i] != self.layer_group[start]:
                out.append((start, i, self.layer_group[start]))
                start = i
        return out

    def group_counts(self) -> list[tuple[int, int]]:
        """(group, number of layers) for every group, in group order."""
        counts: dict = {}
        for g in self.layer_group:
            counts[g] = counts.get(g, 0) + 1
        return sorted(counts.items())

    def to_seconds(self, objective: int) -> float:
        return objective * NS / self.virtual_stages


@dataclass
class StageSolution:
    objective: int | None  # V * step time in ns; None when infeasible
    stage_of_layer: list = field(default_factory=list)
    option_of_layer: list = field(default_factory=list)  # index into group_options[group]
    status: str = "optimal"  # optimal | feasible | infeasible | unknown
    bound: int | None = None  # best proven lower bound of the objective
    wall_s: float = 0.0
    work: float = 0.0  # CP-SAT deterministic time spent (its work units, about seconds)

    @property
    def gap(self) -> float:
        if self.objective is None or self.bound is None or self.objective == 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


def in_flight_numerators(schedule: str, pp: int, virtual_stages: int, num_micro_batches: int) -> list[int]:
    """Micro-batches whose activations a pp rank holds at its peak, times V.

    GPipe runs all forwards first: m in flight. 1F1B: rank r holds
    min(m, pp - r). Interleaved 1F1B (Megatron's warm-up count): rank r holds
    min(m*V, 2*(pp - r - 1) + (V - 1)*pp + 1) chunk-micro-batches, each about
    1/V of the rank's layers, which is pp + (pp-1)/V micro-batches on rank 0
    (the (1 + (pp-1)/(pp V)) factor of Korthikanti et al.).
    """
    m, v = num_micro_batches, virtual_stages
    if pp == 1:  # gradient accumulation: one micro-batch's forward then its backward
        return [v]
    if schedule == "gpipe":
        return [m * v] * pp
    if schedule == "interleaved":
        return [min(m * v, 2 * (pp - r - 1) + (v - 1) * pp + 1) for r in range(pp)]
    return [min(m, pp - r) * v for r in range(pp)]


def evaluate(problem: StageProblem, stage_of_layer, option_of_layer) -> int | None:
    """Objective of one full assignment, or None if it breaks a rule or memory."""
    p = problem
    n, stages = p.num_layers, p.num_stages
    if len(stage_of_layer) != n or len(option_of_layer) != n:
        return None
    if stage_of_layer[0] != 0 or stage_of_layer[-1] != stages - 1:
        return None
    for a, b in zip(stage_of_layer, stage_of_layer[1:]):
        if b - a not in (0, 1):  # contiguous, every stage non-empty
            return None
    rank_time = [0] * p.pp
    rank_step = [0] * p.pp
    rank_static = [0] * p.pp
    rank_act = [0] * p.pp
    rank_peak = [dict() for _ in range(p.pp)]
    for layer, (s, k) in enumerate(zip(stage_of_layer, option_of_layer)):
        o = p.group_options[p.layer_group[layer]][k]
        r = s % p.pp
        rank_time[r] += o.time
        rank_step[r] += o.step
        rank_static[r] += o.static_mem
        rank_act[r] += o.act_mem
        for t, value in enumerate(o.peaks):
            rank_peak[r][t] = max(rank_peak[r].get(t, 0), value)
    if p.pp > 1:
        for r in range(p.pp):
            rank_time[r] += p.virtual_stages * p.stage_time_overhead
    v = p.virtual_stages
    for r in range(p.pp):
        static = rank_static[r] + sum(rank_peak[r].values())
        if v * static + p.in_flight_num[r] * rank_act[r] > v * p.capacity[r]:
            return None
    return p.time_weight * max(rank_time) + p.step_weight * max(rank_step)


def time_lower_bound(problem: StageProblem) -> int:
    """Objective bound ignoring memory: every layer at its fastest option,
    perfectly balanced over pp ranks; the step tail at its smallest, spread
    evenly."""
    p = problem
    counts = p.group_counts()
    fastest = {g: min(o.time for o in p.group_options[g]) for g, _ in counts}
    min_time = sum(c * fastest[g] for g, c in counts)
    min_step = sum(c * min(o.step for o in p.group_options[g]) for g, c in counts)
    overhead = p.virtual_stages * p.stage_time_overhead if p.pp > 1 else 0
    t_lb, d_lb = pigeonhole_bounds(p)
    t_lb = max(-(-min_time // p.pp) + overhead, t_lb)
    d_lb = max(-(-min_step // p.pp), d_lb)
    return p.time_weight * t_lb + p.step_weight * d_lb


def pigeonhole_bounds(problem: StageProblem) -> tuple[int, int]:
    """(max rank time, max rank tail) bounds from whole layers: some rank holds
    at least ceil(N_g / pp) layers of a group with N_g layers. This is the
    integrality the LP relaxation misses (105 blocks on 70 ranks: some rank
    runs 2 blocks, not 1.5), and without it deep pipelines never prove optimal."""
    p = problem
    overhead = p.virtual_stages * p.stage_time_overhead if p.pp > 1 else 0
    t_lb = d_lb = 0
    for g, c in p.group_counts():
        k = -(-c // p.pp)
        t_lb = max(t_lb, k * min(o.time for o in p.group_options[g]) + overhead)
        d_lb = max(d_lb, k * min(o.step for o in p.group_options[g]))
    return t_lb, d_lb


def memory_floor(problem: StageProblem) -> int:
    """KiB per GPU no assignment can go below: every layer at its smallest
    footprint (with the fewest micro-batches in flight any rank has), spread
    perfectly over the pp ranks, and no less than the biggest single layer."""
    p = problem
    v = p.virtual_stages
    least = min(p.in_flight_num)
    counts = p.group_counts()
    smallest = {g: min(v * o.static_mem + least * o.act_mem for o in p.group_options[g]) for g, _ in counts}
    total = sum(c * smallest[g] for g, c in counts)
    return -(-max(-(-total // p.pp), max(smallest.values())) // v)


def lagrangian_bound(problem: StageProblem) -> int:
    """Objective bound that feels memory pressure (weak Lagrangian duality).

    Relax the per-rank memory limits into their sum (every layer's footprint
    with the fewest micro-batches in flight any rank has must fit into all
    ranks' capacity together) and the max over ranks into the average; then
    for any multiplier lam >= 0

        bound(lam) = sum over layers of min over options (cost_k + lam * mem_k) - lam * capacity

    is below the optimum. Without it, a model that must checkpoint to fit
    gets a bound that assumes no recomputation, and nothing gets pruned.
    The best lam is found on a log grid, then refined (any lam is valid).
    """
    import numpy as np

    p = problem
    v, pp = p.virtual_stages, p.pp
    least = min(p.in_flight_num)
    cost_rows, mem_rows, weights = [], [], []
    for g, c in p.group_counts():
        opts = p.group_options[g]
        cost_rows.append(np.array([(p.time_weight * o.time + p.step_weight * o.step) / pp for o in opts], float))
        mem_rows.append(np.array([v * o.static_mem + least * o.act_mem for o in opts], float))
        weights.append(c)
    capacity = float(v * sum(p.capacity))
    overhead = p.time_weight * (v * p.stage_time_overhead if pp > 1 else 0)

    def g_of(lams):
        total = np.full(lams.shape, -capacity) * lams
        for cost, mem, w in zip(cost_rows, mem_rows, weights):
            total += w * np.min(cost[:, None] + mem[:, None] * lams[None, :], axis=0)
        return total

    scale = max(max(float(c.max()) for c in cost_rows), 1.0) / max(max(float(m.max()) for m in mem_rows), 1.0)
    lams = np.concatenate([[0.0], scale * np.logspace(-6, 6, 97)])
    vals = g_of(lams)
    i = int(np.argmax(vals))
    lo, hi = lams[max(i - 1, 0)], lams[min(i + 1, len(lams) - 1)]
    fine = np.linspace(lo, hi, 65)
    best = max(float(vals.max()), float(g_of(fine).max()))
    # floor, minus one unit for float rounding: the bound must never exceed the optimum
    return max(0, int(math.floor(best + overhead)) - 1)


def lower_bound(problem: StageProblem) -> int | None:
    """A cheap bound on the optimum, or None when no assignment can exist:
    fewer layers than stages, or memory_floor above the capacity."""
    p = problem
    if p.num_layers < p.num_stages:
        return None
    if memory_floor(p) > max(p.capacity):
        return None
    return max(time_lower_bound(p), lagrangian_bound(p))
