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

Objective (Megatron's step-time model, Narayanan et al. 2021 s.2.2,
generalised to uneven stages and interleaving): with R_r the per-micro-batch
time of pp rank r (the sum of its V stages), t_s the per-micro-batch time of
stage s and D_r the rank's per-step tail,

    step = m * max_r R_r  +  (pp - 1) * max_s t_s  +  max_r D_r

(steady state paced by the slowest rank; the fill and drain bubble is pp - 1
passes of the slowest stage, which is (pp - 1) / V * R for equal chunks:
Megatron's formula). Charging the bubble to the slowest *stage*, not to R / V,
is what makes the solver balance a rank's V chunks: the cost model's pipeline
simulation punishes a rank whose chunk 0 holds 7 layers and chunk 1 holds 1
far more than their sum suggests. The solvers minimise the integer form
V * step. Memory on pp rank r, exact per chunk:

    sum(static) + sum_t max(peaks[t]) + sum_k c[k] * act(chunk k) <= capacity_r
    sum(static) + sum(step_mem) <= capacity_r   (the optimizer step)
        for every count vector c in chunk_counts[r]

where chunk k of rank r is stage k * pp + r, act(chunk) the activation bytes
one micro-batch leaves in that stage, and c[k] how many micro-batches of
chunk k the rank holds at one of its possible peaks (torch's interleaved
order keeps chunk 0 longest; `cost_models.memory.in_flight_chunk_counts`).
This is the rule `cost_models.estimate` applies through its pipeline
simulation, so a layout the solver calls feasible fits in the estimate too.
With V = 1 there is one vector, (micro-batches in flight,).

Integer scaling: times are rounded *up* to whole nanoseconds and memory *up*
to whole KiB, once, when the table is built; CP-SAT and the brute-force
reference then work on the same integers, so "equal to the optimum" is exact.
Rounding up keeps the table conservative (memory never under-counted by it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

NS = 1e-9  # seconds per time unit
STABLE_ROUNDS = 4  # interleaved count vectors are the same for every m = k pp, k >= 2
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
    # KiB alive only during the optimizer step (foreach Adam's temporary): a second
    # memory moment, sum(static + step_mem) <= capacity_r, when activations are gone
    step_mem: int = 0


@dataclass
class StageProblem:
    layer_group: list  # group (signature) index of each layer, in execution order
    group_options: list  # per group: list[OptionCost] (non-empty)
    pp: int
    virtual_stages: int
    num_micro_batches: int
    in_flight_num: list  # per pp rank: micro-batches in flight x V, closed form (reporting, V = 1 memory)
    capacity: list  # per pp rank: KiB available to layers
    stage_time_overhead: int = 0  # per stage per micro-batch (p2p send of its output) when pp > 1
    option_labels: list = field(default_factory=list)  # option index -> (zero, checkpoint, offload)
    # per pp rank: the undominated in-flight count vectors (len V each); None derives them
    # from (pp, V, m): interleaved 1F1B's order when V > 1, (in_flight_num[r],) when V = 1
    chunk_counts: list | None = None

    def __post_init__(self):
        if self.chunk_counts is None:  # derived: already sorted integer vectors
            self.chunk_counts = chunk_count_vectors(self.pp, self.virtual_stages, self.num_micro_batches,
                                                    self.in_flight_num)
        else:
            self.chunk_counts = [sorted(tuple(int(x) for x in c) for c in vecs) for vecs in self.chunk_counts]
        self._group_counts = None  # (layer_group it was counted for, counts)
        self._cheapest: dict = {}  # "time" / "step" -> (group_options it was read from, per group): _cheapest
        if len(self.chunk_counts) != self.pp or any(
                not vecs or any(len(c) != self.virtual_stages for c in vecs) for vecs in self.chunk_counts):
            raise ValueError(f"chunk_counts needs, per pp rank ({self.pp}), count vectors of length "
                             f"{self.virtual_stages}; got {self.chunk_counts}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def time_weight(self) -> int:
        """Weight of max R in a *lower bound* of V * step: V * (pp - 1) * max t >= (pp - 1) * max R."""
        return self.virtual_stages * self.num_micro_batches + self.pp - 1

    @property
    def rank_weight(self) -> int:
        """Weight of max_r R_r in V * step."""
        return self.virtual_stages * self.num_micro_batches

    @property
    def stage_weight(self) -> int:
        """Weight of max_s t_s in V * step."""
        return self.virtual_stages * (self.pp - 1)

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
        """(group, number of layers) for every group, in group order. Kept while
        layer_group is unchanged: the bounds ask it ~10 times per problem."""
        key = tuple(self.layer_group)
        if self._group_counts is None or self._group_counts[0] != key:
            counts: dict = {}
            for g in key:
                counts[g] = counts.get(g, 0) + 1
            self._group_counts = (key, sorted(counts.items()))
        return list(self._group_counts[1])

    def to_seconds(self, objective: int) -> float:
        return objective * NS / self.virtual_stages


@dataclass
class StageSolution:
    objective: int | None  # V * step time in ns; None when infeasible
    stage_of_layer: list = field(default_factory=list)
    option_of_layer: list = field(default_factory=list)  # index into group_options[group]
    status: str = "optimal"  # optimal | feasible | infeasible | unknown | cannot_beat (nothing below `beat`)
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


def chunk_count_vectors(pp: int, virtual_stages: int, num_micro_batches: int, in_flight_num=None,
                        schedule: str | None = None) -> list[list[tuple]]:
    """Per pp rank, the undominated (micro-batches of chunk 0, ..., chunk V-1) vectors
    the rank can hold at its activation peak. V > 1 is torch's interleaved 1F1B
    (`cost_models.memory.in_flight_chunk_counts`, the same order the cost model
    simulates); V = 1 is one vector, the schedule's in-flight count."""
    v = virtual_stages
    if v > 1 and pp > 1:
        m = num_micro_batches
        # With m a multiple of pp the vectors stop changing from m = 2 pp on (the
        # warm-up is under (V + 2) pp chunk-forwards and the steady state repeats
        # every pp micro-batches; tested up to 8 pp): walking m = 4 pp instead of
        # m = 1536 keeps bounding thousands of candidates cheap.
        if m % pp == 0 and m > STABLE_ROUNDS * pp:
            m = STABLE_ROUNDS * pp
        return [list(vecs) for vecs in _interleaved_vectors(pp, v, m)]
    nums = in_flight_num if in_flight_num is not None else in_flight_numerators(schedule or "1f1b", pp, v,
                                                                               num_micro_batches)
    if pp == 1:
        return [[tuple([1] * v)]]  # gradient accumulation: one micro-batch of every stage
    return [[(n // v,) * v] for n in nums]


@lru_cache(maxsize=1024)
def _interleaved_vectors(pp: int, v: int, m: int) -> tuple:
    # cached: the planner builds problems for thousands of candidates sharing (pp, V, m)
    from cost_models.memory import in_flight_chunk_counts

    return tuple(tuple(sorted(tuple(int(x) for x in c) for c in in_flight_chunk_counts("interleaved", pp, m, r, v)))
                 for r in range(pp))


def _valid_partition(problem: StageProblem, stage_of_layer, option_of_layer) -> bool:
    n, stages = problem.num_layers, problem.num_stages
    if len(stage_of_layer) != n or len(option_of_layer) != n:
        return False
    if stage_of_layer[0] != 0 or stage_of_layer[-1] != stages - 1:
        return False
    return all(b - a in (0, 1) for a, b in zip(stage_of_layer, stage_of_layer[1:]))  # contiguous, non-empty


def rank_memory(problem: StageProblem, stage_of_layer, option_of_layer) -> list[int]:
    """KiB each pp rank needs at its peak: static + peak terms + the worst count
    vector's activations (chunk by chunk)."""
    p = problem
    rank_static = [0] * p.pp
    rank_step = [0] * p.pp  # the optimizer step's moment: static + its temporaries
    stage_act = [0] * p.num_stages
    rank_peak = [dict() for _ in range(p.pp)]
    for layer, (s, k) in enumerate(zip(stage_of_layer, option_of_layer)):
        o = p.group_options[p.layer_group[layer]][k]
        r = s % p.pp
        rank_static[r] += o.static_mem
        rank_step[r] += o.step_mem
        stage_act[s] += o.act_mem
        for t, value in enumerate(o.peaks):
            rank_peak[r][t] = max(rank_peak[r].get(t, 0), value)
    out = []
    for r in range(p.pp):
        chunks = [stage_act[k * p.pp + r] for k in range(p.virtual_stages)]
        act = max(sum(c * a for c, a in zip(vec, chunks)) for vec in p.chunk_counts[r])
        out.append(max(rank_static[r] + sum(rank_peak[r].values()) + act, rank_static[r] + rank_step[r]))
    return out


def evaluate(problem: StageProblem, stage_of_layer, option_of_layer) -> int | None:
    """Objective of one full assignment, or None if it breaks a rule or memory."""
    p = problem
    if not _valid_partition(p, stage_of_layer, option_of_layer):
        return None
    if any(need > cap for need, cap in zip(rank_memory(p, stage_of_layer, option_of_layer), p.capacity)):
        return None
    overhead = p.stage_time_overhead if p.pp > 1 else 0
    stage_time = [overhead] * p.num_stages
    rank_step = [0] * p.pp
    for layer, (s, k) in enumerate(zip(stage_of_layer, option_of_layer)):
        o = p.group_options[p.layer_group[layer]][k]
        stage_time[s] += o.time
        rank_step[s % p.pp] += o.step
    rank_time = [sum(stage_time[r::p.pp]) for r in range(p.pp)]
    return p.rank_weight * max(rank_time) + p.stage_weight * max(stage_time) + p.step_weight * max(rank_step)


def time_lower_bound(problem: StageProblem) -> int:
    """Objective bound ignoring memory: every layer at its fastest option,
    perfectly balanced over pp ranks; the step tail at its smallest, spread
    evenly."""
    p = problem
    counts = p.group_counts()
    fastest, least_step = _cheapest(p, "time"), _cheapest(p, "step")
    min_time = sum(c * fastest[g] for g, c in counts)
    min_step = sum(c * least_step[g] for g, c in counts)
    overhead = p.virtual_stages * p.stage_time_overhead if p.pp > 1 else 0
    t_lb, d_lb = pigeonhole_bounds(p)
    t_lb = max(-(-min_time // p.pp) + overhead, t_lb)
    d_lb = max(-(-min_step // p.pp), d_lb)
    return p.rank_weight * t_lb + p.stage_weight * stage_time_bound(p, t_lb) + p.step_weight * d_lb


def water_fill(base: list[int], count: int, unit: int) -> int:
    """Least possible heaviest bin when `count` items of size `unit` join bins
    already loaded `base` (integer items: some bin takes the rounding)."""
    # bins of equal load counted once: beside the pinned first and last layers every
    # bin holds the same, so a 32-stage fill sums 3 terms, not 32
    loads: dict = {}
    for b in base:
        loads[b] = loads.get(b, 0) + 1
    return _water_fill(loads, count, unit)


def _water_fill(loads: dict, count: int, unit: int) -> int:
    """water_fill over {load: number of bins}."""
    top = max(loads)
    if count <= 0 or unit <= 0:
        return top
    # lo: perfectly spread; hi: spread plus one item, where rounding down in every bin still
    # places at least `count` items (floor(x) > x - 1 summed over the bins)
    lo = max(top, -(-(sum(b * n for b, n in loads.items()) + count * unit) // sum(loads.values())))
    hi = max(top, lo + unit)
    # The answer is the least x in [lo, hi] whose bins take `count` items (x = hi if none
    # below it does): sum n * floor((x - b) / unit) over the bins under x. On (lo, lo + unit]
    # each bin's term rises by one, once, where x - b is a multiple of unit; so walk those
    # rises in order (what a bisection over x finds, in one step per distinct load).
    have = sum(n * ((lo - b) // unit) for b, n in loads.items() if lo > b)
    if have >= count:
        return lo
    for x, n in sorted((lo + unit - (lo - b) % unit, n) for b, n in loads.items()):
        have += n
        if have >= count:
            return min(x, hi)
    return hi


def pinned_stage(problem: StageProblem) -> list:
    """Per layer, its stage when contiguity forces it (layer i of n sits in stage
    i - (n - S) .. i: the first layer in stage 0, the last in stage S - 1), else None."""
    p = problem
    slack = p.num_layers - p.num_stages
    return [i if slack == 0 else 0 if i == 0 else p.num_stages - 1 if i == p.num_layers - 1 else None
            for i in range(p.num_layers)]


@lru_cache(maxsize=1024)
def _pinned_pairs(n: int, stages: int) -> tuple:
    slack = n - stages
    if slack == 0:
        return tuple((i, i) for i in range(n))
    return ((0, 0), (n - 1, stages - 1)) if n > 1 else ((0, 0),)


def _cheapest(p: StageProblem, attr: str) -> list:
    """Per group, the least `attr` ("time" or "step") among its options; kept on the
    problem while its group_options is the same list (the bounds ask ~5 times)."""
    hit = p._cheapest.get(attr)
    if hit is None or hit[0] is not p.group_options:
        hit = p._cheapest[attr] = (p.group_options, [min(getattr(o, attr) for o in opts) for opts in p.group_options])
    return hit[1]


def _fill_bound(problem: StageProblem, bins: int, bin_of_stage, base: int, cost: str) -> int:
    """Heaviest-bin bound over all groups: each group's layers are whole items
    water-filled into `bins` bins that already hold the *other* groups' layers
    whose stage is forced (each at its cheapest `cost`). Without it a bound
    spreads 32 blocks and a head over 4 ranks as 8.25 blocks each, when some
    rank must run 9 blocks or the head and 8: a 7 % gap CP-SAT could not close."""
    p = problem
    pinned = _pinned_pairs(p.num_layers, p.num_stages)
    counts = p.group_counts()
    cheapest = _cheapest(p, cost)
    best = 0
    for g, c in counts:
        extra: dict = {}  # bin -> what the other groups' pinned layers put in it
        for i, s in pinned:
            if p.layer_group[i] != g:
                b = bin_of_stage(s)
                extra[b] = extra.get(b, 0) + cheapest[p.layer_group[i]]
        loads = {base: bins - len(extra)} if bins > len(extra) else {}
        for add in extra.values():
            loads[base + add] = loads.get(base + add, 0) + 1
        best = max(best, _water_fill(loads, c, cheapest[g]))
    return best


def stage_time_bound(problem: StageProblem, rank_time_bound: int) -> int:
    """Bound on the slowest stage: some stage of the slowest rank takes at least
    1/V of it; all layers at their fastest spread over every stage; and whole
    layers water-filled into stages (`_fill_bound`)."""
    p = problem
    stages = p.num_stages
    overhead = p.stage_time_overhead if p.pp > 1 else 0
    counts = p.group_counts()
    fastest = _cheapest(p, "time")
    spread = -(-sum(c * fastest[g] for g, c in counts) // stages) + overhead
    whole = _fill_bound(p, stages, lambda s: s, overhead, "time")
    return max(-(-rank_time_bound // p.virtual_stages), spread, whole)


def pigeonhole_bounds(problem: StageProblem) -> tuple:
    """(max rank time, max rank tail) bounds from whole layers: each group's
    layers water-filled into the pp ranks beside the layers pinned to a rank
    (`_fill_bound`; for one group alone: some rank holds ceil(N / pp) of N).
    This is the integrality the LP relaxation misses (105 blocks on 70 ranks:
    some rank runs 2 blocks, not 1.5), and without it deep pipelines never prove optimal."""
    p = problem
    overhead = p.virtual_stages * p.stage_time_overhead if p.pp > 1 else 0
    rank = lambda s: s % p.pp  # noqa: E731
    t_lb = _fill_bound(p, p.pp, rank, overhead, "time")
    d_lb = _fill_bound(p, p.pp, rank, 0, "step")
    return t_lb, d_lb


def stage_act_weights(problem: StageProblem) -> list[float]:
    """Per stage, micro-batches of it a valid memory bound may charge.

    A rank's activation peak is max over its count vectors c of c . act, which
    is at least w . act for any convex combination w of them; per rank we take
    the one (a vector or their mean) whose smallest entry is largest, since the
    bounds below do not know which chunk a layer lands in. The last stage of a
    pipeline holds one micro-batch (its backward follows its forward at once):
    that is the truth, and why the weight of a layer is taken only over the
    stages it can reach (`layer_act_weights`)."""
    return list(_stage_weights(problem.pp, problem.virtual_stages, _vectors_key(problem)))


def _vectors_key(problem: StageProblem) -> tuple:
    return tuple(tuple(vecs) for vecs in problem.chunk_counts)


@lru_cache(maxsize=4096)
def _stage_weights(pp: int, v: int, chunk_counts: tuple) -> tuple:
    out = [0.0] * (pp * v)
    for r, vecs in enumerate(chunk_counts):
        choices = [tuple(float(x) for x in c) for c in vecs]
        choices.append(tuple(sum(c[k] for c in vecs) / len(vecs) for k in range(v)))
        best = max(choices, key=lambda w: (min(w), sum(w)))
        for k in range(v):
            out[k * pp + r] = best[k]
    return tuple(out)


def layer_act_weights(problem: StageProblem) -> list[float]:
    """Per layer, the smallest stage weight among the stages it can sit in: with n
    layers in S contiguous non-empty stages, layer i is in stage i - (n - S) .. i."""
    p = problem
    return list(_layer_weights(p.num_layers, p.pp, p.virtual_stages, _vectors_key(p)))


@lru_cache(maxsize=4096)
def _layer_weights(n: int, pp: int, v: int, chunk_counts: tuple) -> tuple:
    w = _stage_weights(pp, v, chunk_counts)
    stages = pp * v
    slack = n - stages
    return tuple(min(w[max(0, i - slack):min(i, stages - 1) + 1]) for i in range(n))


def _layer_classes(problem: StageProblem) -> list[tuple[int, float, int]]:
    """(group, activation weight, number of layers), merged, in a fixed order."""
    p = problem
    return list(_classes(tuple(p.layer_group), p.pp, p.virtual_stages, _vectors_key(p)))


layer_classes = _layer_classes  # public name: refine.py bounds uniform layouts with memory_floor's terms


@lru_cache(maxsize=4096)
def _classes(layer_group: tuple, pp: int, v: int, chunk_counts: tuple) -> tuple:
    counts: dict = {}
    for g, w in zip(layer_group, _layer_weights(len(layer_group), pp, v, chunk_counts)):
        counts[(g, w)] = counts.get((g, w), 0) + 1
    return tuple((g, w, c) for (g, w), c in sorted(counts.items()))


def memory_floor(problem: StageProblem) -> int:
    """KiB per GPU no assignment can go below: every layer at its smallest
    footprint (its activation counted as often as the least-holding stage it
    can reach holds it), spread perfectly over the pp ranks, and no less than
    the biggest single layer."""
    p = problem
    smallest = [(min(o.static_mem + w * o.act_mem for o in p.group_options[g]), c) for g, w, c in _layer_classes(p)]
    total = sum(x * c for x, c in smallest)
    return int(math.ceil(max(total / p.pp, max(x for x, _ in smallest)) - 1e-6))


def lagrangian_bound(problem: StageProblem) -> int:
    """Objective bound that feels memory pressure (weak Lagrangian duality).

    Relax the per-rank memory limits into their sum (every layer's footprint,
    activations weighted by `layer_act_weights`, must fit into all ranks'
    capacity together) and the max over ranks into the average; then for any
    multiplier lam >= 0

        bound(lam) = sum over layers of min over options (cost_k + lam * mem_k) - lam * capacity

    is below the optimum. Without it, a model that must checkpoint to fit
    gets a bound that assumes no recomputation, and nothing gets pruned.
    The best lam is found on a log grid, then refined (any lam is valid).
    """
    import numpy as np

    p = problem
    pp = p.pp
    classes = _layer_classes(p)
    tw, sw = p.time_weight, p.step_weight
    rows = {}  # group -> (objective weight per layer, static KiB, activation KiB) per option
    for g in {g for g, _, _ in classes}:
        opts = p.group_options[g]
        rows[g] = (np.array([(tw * o.time + sw * o.step) / pp for o in opts], float),
                   np.array([o.static_mem for o in opts], float), np.array([o.act_mem for o in opts], float))
    # every class's options in one array (class i's rows start at starts[i]): a few numpy
    # ops per grid instead of five per class, the same floats (min is exact, and the
    # classes are still added one after another, in order)
    starts = np.cumsum([0] + [len(rows[g][0]) for g, _, _ in classes[:-1]])
    weights = np.array([c for _, _, c in classes], float)[:, None]
    cost = np.concatenate([rows[g][0] for g, _, _ in classes])[:, None]
    mem = np.concatenate([rows[g][1] + w * rows[g][2] for g, w, _ in classes])[:, None]
    capacity = float(sum(p.capacity))
    overhead = p.time_weight * (p.virtual_stages * p.stage_time_overhead if pp > 1 else 0)

    def g_of(lams):
        total = np.full(lams.shape, -capacity) * lams
        for term in weights * np.minimum.reduceat(cost + mem * lams[None, :], starts, axis=0):
            total += term
        return total

    scale = max(float(cost.max()), 1.0) / max(float(mem.max()), 1.0)
    lams = np.concatenate([[0.0], scale * _log_grid()])
    vals = g_of(lams)
    i = int(np.argmax(vals))
    lo, hi = lams[max(i - 1, 0)], lams[min(i + 1, len(lams) - 1)]
    fine = np.linspace(lo, hi, 65)
    best = max(float(vals.max()), float(g_of(fine).max()))
    # floor, minus one unit for float rounding: the bound must never exceed the optimum
    return max(0, int(math.floor(best + overhead)) - 1)


@lru_cache(maxsize=1)
def _log_grid():
    import numpy as np

    return np.logspace(-6, 6, 97)  # the multipliers lagrangian_bound tries, times its scale


def lower_bound(problem: StageProblem) -> int | None:
    """A cheap bound on the optimum, or None when no assignment can exist:
    fewer layers than stages, or memory_floor above the capacity."""
    p = problem
    if p.num_layers < p.num_stages:
        return None
    if memory_floor(p) > max(p.capacity):
        return None
    return max(time_lower_bound(p), lagrangian_bound(p))
