"""The pipeline schedule of a layout: layers cut into stages, each stage's
forward and backward time per micro-batch and its sends to the next, and the
schedule simulated over them (cost_models/pipeline.py).

Without a pipeline (pp = 1) this is one stage running the micro-batches one
after another, simulated the same way, so every layout's step comes from
the same clock.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import comm as C
from cost_models.compute import fast
from cost_models.errors import CostModelError
from cost_models.pipeline import PipelineResult, simulate_cached


def balance_stages(weights: list, num_stages: int) -> list:
    """Contiguous split of `weights` into `num_stages` non-empty runs minimising the
    heaviest run (binary search on the bottleneck, greedy fill). Returns counts."""
    n = len(weights)
    if num_stages > n:
        raise CostModelError(f"{num_stages} pipeline stages but only {n} layers")
    if num_stages == 1:
        return [n]

    base, last = n - num_stages, num_stages - 1
    tails: dict = {}  # first layer of the last run -> its load, summed left to right from 0.0

    def split(limit: float):
        counts, loads, load, count = [], [], 0.0, 0
        for i, w in enumerate(weights):
            # cut when the run would pass the limit, or when every later stage needs a
            # layer of what is left (n - i < num_stages - cuts so far)
            if count and (load + w > limit or i - len(counts) > base):
                counts.append(count)
                loads.append(load)
                if len(counts) == last:  # the last run takes every layer left
                    break
                load, count = 0.0, 0
            load += w
            count += 1
        else:
            counts.append(count)
            loads.append(load)
            return counts, loads
        if i not in tails:
            tails[i] = sum(weights[i:], 0.0)
        counts.append(n - i)
        loads.append(tails[i])
        return counts, loads

    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        counts, loads = split(mid)
        # (each run's load summed left to right, as sum() over its slice would)
        fits = len(counts) <= num_stages and max(loads) <= mid * (1 + 1e-12)
        # a round that leaves (lo, hi) as they were (mid rounds onto one of them) repeats
        # itself to the last one: stop there, with the same hi
        if (hi if fits else lo) == mid:
            break
        if fits:
            hi = mid
        else:
            lo = mid
    counts, _ = split(hi)
    while len(counts) < num_stages:  # too few runs: split the heaviest multi-layer run
        j = max((k for k in range(len(counts)) if counts[k] > 1), key=lambda k: counts[k])
        counts[j:j + 1] = [counts[j] // 2, counts[j] - counts[j] // 2]
    return counts


@dataclass
class Pipeline:
    """The stages of a layout and their simulated schedule. Per stage (execution order;
    stage i runs on pp rank i % pp): forward and backward seconds per micro-batch, the
    send to the next stage, activation bytes per micro-batch."""

    virtual_stages: int
    bounds: list  # stage i holds layers bounds[i] .. bounds[i + 1] - 1
    ranks: list  # per pp rank, the indices of the layers it holds
    fwd_s: list
    bwd_s: list
    p2p_s: list
    activation_bytes: list
    same_node: bool  # pipeline neighbours share a node
    place: C.GroupPlacement
    sim: PipelineResult

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1


def _stage_bounds(costs: list, layout, n: int, n_stages: int) -> list:
    if layout.pp == 1:
        counts = [n]
    elif layout.stage_layers is not None:
        counts = list(layout.stage_layers)
    else:
        counts = balance_stages([c.fwd_s + c.bwd_s + c.recompute_s + c.tp_comm_s for c in costs], n_stages)
    return [sum(counts[:i]) for i in range(n_stages + 1)]


def _sends(layers: list, bounds: list, layout, cluster, same_node: bool, b: int, s1: int, byte_scale: float) -> list:
    """Seconds of each stage's send of its last layer's output to the next stage."""
    p2p = []
    n_stages = len(bounds) - 1
    for i in range(n_stages):
        if i < n_stages - 1 and bounds[i + 1] > bounds[i]:
            out = fast(layers[bounds[i + 1] - 1].output_bytes)(b, s1) * byte_scale
            if layout.sequence_parallel and layout.tp > 1:
                out /= layout.tp  # Megatron scatter/gather: send one tp shard, all-gather on arrival
            p2p.append(C.p2p_time(out, same_node or layout.pp == 1, cluster))
        else:
            p2p.append(0.0)
    return p2p


def _stage_work(costs: list, bounds: list, layout, device) -> tuple[list, list, list]:
    """(forward s, backward s, activation bytes) of each stage per micro-batch: its layers'
    compute with their exposed tp and dp communication."""
    fwd, bwd, act = [], [], []
    # torch.distributed.pipelining's host time per schedule action (measured by calibrate):
    # on a CPU it adds to the stage's work; a GPU runs the stage while the host issues it
    action_s = device.measured.pipeline_action_s if layout.pp > 1 and device.measured is not None else 0.0
    for i in range(len(bounds) - 1):
        cs = costs[bounds[i]:bounds[i + 1]]
        f_s = sum(c.fwd_s + c.tp_comm_fwd_s + c.dp_fwd_exposed_s for c in cs)
        b_s = sum(c.bwd_s + c.recompute_s + (c.tp_comm_s - c.tp_comm_fwd_s) + c.dp_bwd_exposed_s for c in cs)
        if action_s:
            f_s, b_s = ((f_s + action_s, b_s + action_s) if device.vendor == "cpu"
                        else (max(f_s, action_s), max(b_s, action_s)))
        fwd.append(f_s)
        bwd.append(b_s)
        act.append(sum(c.activation_bytes for c in cs))
    return fwd, bwd, act


def pipeline(model, layout, cluster, costs: list, byte_scale: float) -> Pipeline:
    """Cut `model`'s layers into the layout's stages (its `stage_layers`, or balanced on
    the layers' costs), price each stage and its sends, and simulate the schedule."""
    layers, pp = model.layers, layout.pp
    n = len(layers)
    # Without a pipeline there is one stage, whatever the schedule says.
    v = layout.virtual_stages if layout.schedule == "interleaved" and pp > 1 else 1
    bounds = _stage_bounds(costs, layout, n, pp * v)
    stage_of = [0] * n
    for i in range(pp * v):
        for j in range(bounds[i], bounds[i + 1]):
            stage_of[j] = i
    same_node = C.pp_neighbours_same_node(layout.tp, layout.dp, cluster)
    place = C.group_placement("pp", layout.tp, layout.dp, layout.pp, cluster)
    b, s1 = layout.micro_batch_size, model.seq_len or 1
    p2p = _sends(layers, bounds, layout, cluster, same_node, b, s1, byte_scale)
    fwd, bwd, act = _stage_work(costs, bounds, layout, cluster.device_profile)
    sim = simulate_cached(layout.schedule if pp > 1 else "1f1b", pp, layout.num_micro_batches, fwd, bwd, p2p,
                          virtual_stages=v, activation_bytes=act, blocking_p2p=layout.p2p_blocking)
    ranks = [[j for j in range(n) if stage_of[j] % pp == r] for r in range(pp)]
    return Pipeline(v, bounds, ranks, fwd, bwd, p2p, act, same_node, place, sim)
