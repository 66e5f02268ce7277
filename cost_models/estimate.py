"""The estimate API: price one layout of one model on one cluster.

`estimate` composes the phases, each its own module:

    1. every layer under the layout          cost_models/layer.py (layer_cost):
         compute                             cost_models/layer_compute.py
         communication                       cost_models/layer_comm.py
         overlap (what hides behind what)    cost_models/overlap.py
         its own memory                      cost_models/memory.py
    2. the pipeline schedule                 cost_models/stages.py (and pipeline.py)
    3. per pp rank, memory by phase          cost_models/peak_memory.py
    4. per pp rank, the end of the step: the data-parallel exposure and the
       optimizer step; the slowest rank's step, stretched by the slowest GPU
       (cost_models/stragglers.py); the breakdown                  (here)

A planner that builds per-layer tables from `layer_cost` therefore agrees
with the final `estimate` by construction.
"""
from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field

from cost_models import comm as C
from cost_models.compute import fast
from cost_models.context_parallel import cp_view
from cost_models.errors import CostModelError
from cost_models.fingerprint import layer_fingerprint  # also importable from here (docs/INTERFACES.md)
from cost_models.hardware import ClusterSpec
from cost_models.issue_order import last_backward_exposed
from cost_models.layer import DTYPE_BYTES, LayerCost, layer_cost  # noqa: F401 - the layer API, importable from here
from cost_models.layout import Layout
from cost_models.memory import FRAGMENTATION
from cost_models.peak_memory import RankLayers, rank_memory
from cost_models.stages import Pipeline, balance_stages, pipeline  # noqa: F401 - balance_stages: importable from here
from cost_models.stragglers import slowest_gpu_slowdown
from cost_models.workload import ModelSpec


@dataclass
class Estimate:
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (no recomputation)
    mfu: float
    peak_memory_bytes: list  # per pp rank
    memory_breakdown: list  # per pp rank: params, grads, optimizer, activations, buffers, capacity, host
    time_breakdown: dict
    comm: list
    fits: bool
    per_stage: list
    hardware_tflops_per_gpu: float = 0.0  # incl. recomputation
    model_flops_per_step: float = 0.0
    global_batch_size: int = 0
    peak_in_flight: list = field(default_factory=list)  # micro-batches per pp rank (simulated)
    why_not_fit: str = ""
    assumptions: dict = field(default_factory=dict)
    layer_float8: list = field(default_factory=list)  # per layer: its Linears priced in float8

    def to_dict(self) -> dict:
        return asdict(self)


def _resolve_per_layer(values, default, n):
    if values is None:
        return [default] * n
    return [default if v is None else v for v in values]


@dataclass
class _Step:
    """The slowest pp rank's step and how its time splits."""

    step_s: float
    critical: int  # the pp rank that paces the step
    rank_optimizer_s: list
    pp_exposed_s: float  # the critical rank's waits for pipeline sends
    p2p_s: float  # the critical rank's sends per micro-batch
    straggler_s: float
    dp_tail_s: float = 0.0  # the critical rank's gradient reduction past its last backward (issue_order.py)


def _step(pipe: Pipeline, costs: list, layout: Layout, device) -> _Step:
    """Per pp rank: its schedule's finish plus the end-of-step data-parallel exposure and the
    optimizer step; the slowest rank paces the step, and the slowest GPU stretches it."""
    pp, m, sim, p2p = layout.pp, layout.num_micro_batches, pipe.sim, pipe.p2p_s
    rank_total, rank_opt, tails = [], [], []
    for r in range(pp):
        idx = pipe.ranks[r]
        step_exp = sum(costs[j].dp_step_exposed_s for j in idx)
        tails.append(_issue_order_tail(costs, idx, m))
        step_exp += tails[-1]
        opt = sum(costs[j].optimizer_s for j in idx)
        if device.measured is not None and idx:  # the optimizer's fixed cost per step (measured)
            opt += device.measured.optimizer_step_constant(layout.optimizer)
        rank_opt.append(opt)
        rank_total.append(sim.finish_s[r] + step_exp + opt)
    crit = max(range(pp), key=lambda r: rank_total[r])
    step = rank_total[crit]
    idx = pipe.ranks[crit]
    n_stages = pipe.num_stages
    p2p_rank = sum(p2p[i] for i in range(n_stages) if i % pp == crit) + sum(
        p2p[i - 1] for i in range(1, n_stages) if i % pp == crit)
    # The simulation's idle time (finish - busy) holds both waiting for transfers and the
    # bubble proper: report the transfers as pipeline communication, what is left as bubble,
    # so the parts of the breakdown add up to the step.
    pp_exposed = min(m * p2p_rank, sim.bubble_s[crit])
    # The slowest GPU of the job paces every synchronous step (stragglers.py): the
    # compute-paced part of the step (compute, recompute, bubble, optimizer) stretches;
    # communication time does not depend on SM clocks.
    comm_exposed = (m * sum(costs[j].tp_comm_s + costs[j].ep_comm_s for j in idx) + pp_exposed
                    + sum(costs[j].dp_comm_exposed_s for j in idx) + tails[crit])
    straggler_s = max(0.0, step - comm_exposed) * (
        slowest_gpu_slowdown(layout.world_size, device.clock_spread) - 1.0)
    return _Step(step + straggler_s, crit, rank_opt, pp_exposed, p2p_rank, straggler_s, tails[crit])


def _issue_order_tail(costs: list, idx: list, m: int) -> float:
    """What the rank's last backward, run in issue order, exposes beyond the layers' own
    exposures of it (cost_models/issue_order.py): never negative."""
    order = idx[::-1]
    if not any(costs[j].dp_last_reduce_s for j in order):
        return 0.0
    queued = last_backward_exposed([costs[j].bwd_s + costs[j].recompute_s + costs[j].tp_comm_s - costs[j].tp_comm_fwd_s
                                    for j in order], [costs[j].dp_bwd_gather_s for j in order],
                                   [costs[j].dp_last_reduce_s for j in order])
    priced = sum(costs[j].dp_step_exposed_s + costs[j].dp_bwd_exposed_s for j in idx)
    return max(0.0, queued - priced)


def _why_not_fit(peaks: list, memory: list, capacity: float, host_per_gpu: float, cluster: ClusterSpec) -> str:
    why = ""
    over = [r for r in range(len(peaks)) if peaks[r] > capacity]
    if over:
        r = over[0]
        why = (f"pp rank {r} needs {peaks[r] / 2**30:.1f} GiB of {capacity / 2**30:.1f} GiB usable "
               f"(activations {memory[r]['activations'] / 2**30:.1f}, model states "
               f"{(memory[r]['params'] + memory[r]['grads'] + memory[r]['optimizer']) / 2**30:.1f})")
    host_need = host_per_gpu * cluster.gpus_per_node
    if host_need > cluster.host_memory_bytes:
        why = why or (f"offload needs {host_need / 2**30:.0f} GiB of host memory per node, "
                      f"the node has {cluster.host_memory_bytes / 2**30:.0f} GiB")
    return why


def _time_breakdown(costs: list, idx: list, st: _Step, pipe: Pipeline, m: int) -> dict:
    ep = m * sum(costs[j].ep_comm_s for j in idx)
    return ({"ep_comm_s": ep} if ep else {}) | {
        # ep's all-to-alls block the compute stream: booked in fwd_s / bwd_s, shown apart
        "compute_s": m * sum(costs[j].fwd_s + costs[j].bwd_s - costs[j].ep_comm_s for j in idx),
        "recompute_s": m * sum(costs[j].recompute_s for j in idx),
        "tp_comm_s": m * sum(costs[j].tp_comm_s for j in idx),
        "pp_comm_s": st.pp_exposed_s,
        "dp_comm_s": sum(costs[j].dp_comm_s for j in idx),
        "dp_comm_exposed_s": sum(costs[j].dp_comm_exposed_s for j in idx) + st.dp_tail_s,
        # part of dp_comm_exposed_s: compute slowed by the SMs hidden DP collectives hold
        "nccl_contention_s": sum(costs[j].nccl_contention_s for j in idx),
        "bubble_s": pipe.sim.bubble_s[st.critical] - st.pp_exposed_s,
        "optimizer_s": st.rank_optimizer_s[st.critical],
        "straggler_s": st.straggler_s,
        "step_time_s": st.step_s,
        "critical_pp_rank": st.critical,
    }


def _comm_rows(model: ModelSpec, layout: Layout, cluster: ClusterSpec, costs: list, pipe: Pipeline, st: _Step,
               dp_exposed_s: float, byte_scale: float) -> list:
    """The critical rank's collectives per mesh axis: what they move, take and leave exposed."""
    m, pp, idx, layers = layout.num_micro_batches, layout.pp, pipe.ranks[st.critical], model.layers
    comm = []
    if layout.tp > 1:
        tp_place = C.group_placement("tp", layout.tp, layout.dp, layout.pp, cluster)
        t = m * sum(costs[j].tp_comm_s for j in idx)
        nbytes = m * sum(costs[j].tp_comm_bytes for j in idx)
        calls: collections.Counter = collections.Counter()
        for j in idx:
            for kind, n in costs[j].tp_calls:
                calls[kind] += m * n
        label = ", ".join(f"{kind} x{n:,}" for kind, n in sorted(calls.items())) or "none"
        comm.append({"axis": "tp", "collective": label, "bytes": nbytes, "time_s": t, "exposed_s": t,
                     "tier": tp_place.tier})
    if layout.dp > 1:
        comm += _dp_rows(layout, cluster, costs, idx, dp_exposed_s)
    if layout.ep > 1:
        t = m * sum(costs[j].ep_comm_s for j in idx)
        calls = 4 * m * sum(1 for j in idx if costs[j].ep_comm_s)
        tier = next((costs[j].tier["ep"] for j in idx if "ep" in costs[j].tier), "intra_node")
        comm.append({"axis": "ep", "collective": f"all_to_all x{calls:,}", "time_s": t, "exposed_s": t,
                     "bytes": m * sum(costs[j].ep_comm_bytes for j in idx), "tier": tier})
    if pp > 1:
        b, s1, bounds = layout.micro_batch_size, model.seq_len or 1, pipe.bounds
        nbytes = 2 * m * sum(fast(layers[bounds[i + 1] - 1].output_bytes)(b, s1) * byte_scale
                             for i in range(pipe.num_stages - 1) if i % pp == st.critical)
        comm.append({"axis": "pp", "collective": "p2p", "bytes": nbytes, "time_s": m * st.p2p_s,
                     "exposed_s": st.pp_exposed_s, "tier": "intra_node" if pipe.same_node else pipe.place.tier})
    return comm


def _dp_rows(layout: Layout, cluster: ClusterSpec, costs: list, idx, dp_exposed_s: float) -> list:
    """The dp axis's rows, one per collective kind. Under HSDP the gathers and
    reduce-scatters run over the dp_shard group and the gradient shards' all-reduce over
    dp_replicate: each row says its own group and the links it crosses."""
    place = {axis: C.group_placement(axis, layout.tp, layout.dp, layout.pp, cluster, layout.dp_shard)
             for axis in ("dp", "dp_shard", "dp_replicate")}
    by_kind: dict = {}
    for j in idx:
        for kind, nbytes, t in costs[j].dp_collectives:
            e = by_kind.setdefault(kind, [0.0, 0.0])
            e[0] += nbytes
            e[1] += t
    total_t = sum(t for _, t in by_kind.values()) or 1.0
    rows = []
    for kind, (nbytes, t) in sorted(by_kind.items()):
        axis = ("dp_replicate" if kind == "all_reduce" else "dp_shard") if layout.hsdp else "dp"
        rows.append({"axis": axis, "collective": kind, "bytes": nbytes, "time_s": t,
                     "exposed_s": dp_exposed_s * t / total_t, "tier": place[axis].tier})
    return rows


def _per_stage(layers: list, costs: list, pipe: Pipeline, pp: int, peaks: list) -> list:
    per_stage = []
    bounds = pipe.bounds
    for i in range(pipe.num_stages):
        cs = costs[bounds[i]:bounds[i + 1]]
        per_stage.append({
            "index": i, "pp_rank": i % pp, "layers": [layers[j].name for j in range(bounds[i], bounds[i + 1])],
            "fwd_s": sum(c.fwd_s for c in cs), "bwd_s": sum(c.bwd_s for c in cs),
            "recompute_s": sum(c.recompute_s for c in cs), "tp_comm_s": sum(c.tp_comm_s for c in cs),
            **({"ep_comm_s": sum(c.ep_comm_s for c in cs)} if any(c.ep_comm_s for c in cs) else {}),
            "p2p_s": pipe.p2p_s[i], "sim_fwd_s": pipe.fwd_s[i], "sim_bwd_s": pipe.bwd_s[i],
            "memory_bytes": peaks[i % pp], "activation_bytes_per_micro_batch": pipe.activation_bytes[i],
        })
    return per_stage


def _model_flops(layers: list, ckpts: list, layout: Layout, s1: int) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step. FLOPs of one micro-batch through every
    layer, times the micro-batches of a step. Model FLOPs, the MFU convention (PaLM,
    Megatron, torchtitan): 3 x forward, attention unmasked, no recomputation, whatever
    the workload counts for its backward; hardware FLOPs add the recomputation."""
    b, m = layout.micro_batch_size, layout.num_micro_batches
    mb_flops = 3 * sum(fast(layer.fwd_flops)(b, s1) for layer in layers)
    mb_recompute = sum(fast(layer.fwd_flops)(b, s1) if c == "full" else
                       fast(layer.selective_recompute_flops)(b, s1) if c == "selective" else 0.0
                       for layer, c in zip(layers, ckpts))
    return mb_flops * m * layout.dp, (mb_flops + mb_recompute) * m * layout.dp


def estimate(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> Estimate:
    """Step time, throughput and per-rank memory of `layout` for `model` on `cluster`."""
    layers = model.layers
    n = len(layers)
    layout.validate(n)
    if layout.world_size > cluster.world_size:
        raise CostModelError(f"layout needs tp x pp x dp x cp = {layout.world_size} GPUs, "
                             f"the cluster has {cluster.world_size}")
    device = cluster.device_profile
    peak = device.peak(layout.precision)
    zeros = _resolve_per_layer(layout.layer_zero, layout.zero, n)
    ckpts = _resolve_per_layer(layout.layer_checkpoint, layout.checkpoint, n)
    offs = _resolve_per_layer(layout.layer_offload, layout.offload, n)
    float8 = _resolve_per_layer(layout.layer_float8, None, n)  # None: the faster, where layout.float8
    # layers equal by construction (a stack's blocks) under the same options share their cost:
    # layer_cost's own memo key differs only in the layer's fingerprint within one estimate
    same: dict = {}
    costs = []
    for layer, z, c, o, f in zip(layers, zeros, ckpts, offs, float8):
        key = (layer_fingerprint(layer), z, c, o, f)
        if key not in same:
            same[key] = layer_cost(layer, model, layout, cluster, zero=z, checkpoint=c, offload=o, float8=f)
        costs.append(same[key])
    # under context parallelism what follows prices one cp rank's share (cp_view): seq / cp
    # tokens a sequence, dp x cp ranks; the whole job's batch and FLOPs from `whole`
    whole, (model, layout) = (model, layout), cp_view(model, layout)
    byte_scale = DTYPE_BYTES[layout.precision] / (model.dtype_bytes or 2)
    pipe = pipeline(model, layout, cluster, costs, byte_scale)

    b, s1 = layout.micro_batch_size, model.seq_len or 1
    root_held = model.tied_layers()
    peaks, memory = [], []
    for r in range(layout.pp):
        rank = RankLayers(pipe.ranks[r], costs, layers, zeros, offs, layout, b, s1, byte_scale)
        total, breakdown = rank_memory(rank, pipe.sim.peak_activation_bytes[r], root_held, device)
        peaks.append(total)
        memory.append(breakdown)
    host_per_gpu = max([0.0] + [mem["host"] for mem in memory])
    st = _step(pipe, costs, layout, device)
    step = st.step_s

    model_flops, hw_flops = _model_flops(layers, ckpts, whole[1], whole[0].seq_len or 1)
    world = layout.world_size
    why = _why_not_fit(peaks, memory, device.usable_memory_bytes, host_per_gpu, cluster)
    time_breakdown = _time_breakdown(costs, pipe.ranks[st.critical], st, pipe, layout.num_micro_batches)
    gbs = whole[1].global_batch_size
    return Estimate(
        step_time_s=step,
        tokens_per_s=gbs * (whole[0].tokens_per_sample or whole[0].seq_len or 1) / step,
        tflops_per_gpu=model_flops / step / world / 1e12,
        mfu=model_flops / (step * world * peak),
        peak_memory_bytes=peaks,
        memory_breakdown=memory,
        time_breakdown=time_breakdown,
        comm=_comm_rows(model, layout, cluster, costs, pipe, st, time_breakdown["dp_comm_exposed_s"], byte_scale),
        fits=not why,
        per_stage=_per_stage(layers, costs, pipe, layout.pp, peaks),
        hardware_tflops_per_gpu=hw_flops / step / world / 1e12,
        model_flops_per_step=model_flops,
        global_batch_size=gbs,
        peak_in_flight=list(pipe.sim.peak_in_flight),
        why_not_fit=why,
        layer_float8=[c.float8 for c in costs],
        assumptions={"device": cluster.device, "peak_flops": peak, "precision": layout.precision,
                     "grad_reduce_overlap": C.GRAD_REDUCE_OVERLAP, "fsdp_prefetch_overlap": C.FSDP_PREFETCH_OVERLAP,
                     "tp_overlap": C.TP_OVERLAP, "fragmentation": FRAGMENTATION,
                     "sustained_clock_fraction": device.sustained_clock_fraction,
                     "clock_spread": device.clock_spread, "main_grads": layout.main_grads},
    )
