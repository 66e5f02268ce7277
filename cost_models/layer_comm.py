"""Per-layer communication: the collectives one layer issues under a layout,
how many bytes each moves and how long it takes on its group's links.

- tensor parallel: what one micro-batch issues over the tp group, as the
  lowering counted it or as capture's dataflow implies (`tp_collectives`);
- data parallel, per ZeRO level: DDP's gradient all-reduce, ZeRO-1/2's
  reduce-scatter and all-gather, FSDP's per-micro-batch all-gathers and
  per-step reduce-scatter, with the copies in and out of their buffers;
  HSDP's all-reduce of the gradient shards across replicas; every gradient
  reduction at the compressed width when the layout asks (compression.py);
  FSDP2 on one rank (its casts and hooks); BatchNorm statistics kept global;
  offloaded parameters coming up from the host.

The link physics is cost_models/comm.py's; which part of each collective
hides behind compute is cost_models/overlap.py's.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from cost_models import comm as C
from cost_models import compression
from cost_models.compute import fast
from cost_models.float8 import amax_all_reduces
from cost_models.overlap import (all_reduce_exposed, fsdp_exposed, gradient_window_share, prefetch_exposed,
                                 sharded_optimizer_exposed, sharded_optimizer_per_micro_batch_exposed, tp_overlapped)
from cost_models.workload import LayerSpec


def tp_collectives(layer: LayerSpec, tp: int, b: int, s1: int, byte_scale: float, sp: bool) -> list:
    """[(kind, bytes, 'fwd' | 'bwd'), ...] that one micro-batch of `layer`, split
    over tp ranks, issues. As the lowering check counted them on a fake process
    group (`LayerSpec.tp_collectives`), else inferred from capture's dataflow:
    `tp_allreduces` all-reduces of the output forward and as many backward
    (with sequence parallelism all-gather + reduce-scatter pairs, which a ring
    prices the same), and where the model cuts a sharded dim (GPT's fused qkv
    split) an all-gather forward and a reduce-scatter of its gradient backward."""
    out_bytes = fast(layer.output_bytes)(b, s1) * byte_scale
    counted = (layer.tp_collectives or {}).get(str(tp), {}).get("sp" if sp else "plain")
    if counted is not None:
        return [(kind, ratio * out_bytes, phase) for kind, ratio, phase in counted]
    gather = fast(layer.tp_gather_bytes)(b, s1) * byte_scale
    issued = []
    for phase, gather_kind in (("fwd", "all_gather"), ("bwd", "reduce_scatter")):
        issued += [("all_reduce", out_bytes, phase)] * layer.tp_allreduces
        issued += [(gather_kind, gather, phase)] if gather else []
    return issued


@dataclass
class TpComm:
    """One micro-batch's tensor-parallel collectives: exposed seconds forward and
    backward, bytes this GPU sends, ((collective, calls), ...) and the group's placement."""

    fwd_s: float
    bwd_s: float
    bytes: float
    calls: tuple
    place: C.GroupPlacement


def tp_comm(layer: LayerSpec, layout, cluster, tp: int, b: int, s1: int, byte_scale: float, sp: bool,
            gemm_fwd_s: float, float8: bool = False) -> TpComm:
    """The collectives one micro-batch issues (`tp_collectives`), each priced on the tp
    group's link, plus DTensor's measured cost per collective; with `float8`, the
    all-reduces of its tensorwise scales too (cost_models/float8.py)."""
    device = cluster.device_profile
    tp_place = C.group_placement("tp", layout.tp, layout.dp, layout.pp, cluster)
    issued = tp_collectives(layer, tp, b, s1, byte_scale, sp) if tp > 1 else []
    if float8:
        issued = issued + amax_all_reduces(layer, b, s1, tp)
    per_call = device.measured.dtensor_collective_overhead_s if device.measured is not None else 0.0
    tp_fwd, tp_bwd = (sum((C.collective_time(kind, nbytes, tp_place, cluster) + per_call
                           for kind, nbytes, when in issued if when == phase), 0.0) for phase in ("fwd", "bwd"))
    tp_bytes = sum(nbytes * (2 if kind == "all_reduce" else 1) for kind, nbytes, _ in issued) * (tp - 1) / tp
    tp_calls = tuple(sorted(collections.Counter(kind for kind, _, _ in issued).items()))
    if layout.tp_comm_overlap and tp > 1 and tp_fwd + tp_bwd > 0:
        # the backward's GEMMs (input and weight gradients) are twice the forward's
        tp_fwd, tp_bwd = (tp_overlapped(tp_fwd, gemm_fwd_s, tp, "fwd"),
                          tp_overlapped(tp_bwd, 2 * gemm_fwd_s, tp, "bwd"))
    return TpComm(tp_fwd, tp_bwd, tp_bytes, tp_calls, tp_place)


def copy_s(nbytes: float, device) -> float:
    """A memory-bound copy of nbytes (read + write): measured copy rate, or HBM physics."""
    if device.measured is not None:
        t = device.measured.bytes_time("copy", nbytes, "copy")
        if t is not None:
            return t
    return nbytes / (device.memory_bandwidth * device.memory_efficiency)


def fsdp_one_rank_s(unit_bytes: float, tensors: int, device) -> float:
    """Seconds FSDP2 adds per all-gather (or reduce-scatter) of a unit of
    `unit_bytes` fp32 parameters in `tensors` tensors on a one-rank mesh (hooks, per-
    parameter copy views, gradient DTensors): calibrated when the profile timed FSDP2
    on one rank, else the device's physics defaults."""
    if device.measured is not None:
        unit = device.measured.fsdp_unit_s(unit_bytes, tensors)
        if unit is not None and unit[0] == 1:
            return (unit[1] + unit[2]) / 2
    return device.fsdp_unit_host_s + max(0, tensors - 1) * device.fsdp_tensor_host_s


def batch_norm_sync(layer: LayerSpec, dp: int, dp_place, cluster) -> tuple[float, float]:
    """Forward (and again backward) time of keeping BatchNorm statistics global
    over dp, per micro-batch (autopar/lower/batch_norm.py, as SyncBatchNorm): per
    BatchNorm two fp32 all-reduces of about its channel count, the sums then the
    squared deviations (backward: their gradients). Each blocks the op after it,
    so none hides; a few KiB each, so the link's latency is most of it.
    Returns (seconds, bytes on the wire) of one pass."""
    channels = (layer.attrs or {}).get("batch_norm_channels") or ()
    if dp <= 1 or not channels:
        return 0.0, 0.0
    seconds = sum(C.collective_time("all_reduce", 4 * (c + 1), dp_place, cluster)
                  + C.collective_time("all_reduce", 4 * c, dp_place, cluster) for c in channels)
    return seconds, sum(2 * 4 * (2 * c + 1) for c in channels) * (dp - 1) / dp


@dataclass
class DpComm:
    """A layer's data-parallel traffic: ((collective, bytes per step, seconds per step), ...)
    before overlap, and what stays exposed: per micro-batch in forward and backward, per
    step at its end; `contention_s` (per step, inside the exposed times) is compute slowed
    by the SMs hidden collectives hold (cost_models/comm.contention_s)."""

    place: C.GroupPlacement
    collectives: list = field(default_factory=list)
    fwd_exposed_s: float = 0.0
    bwd_exposed_s: float = 0.0
    step_exposed_s: float = 0.0
    contention_s: float = 0.0
    replica_place: C.GroupPlacement | None = None  # HSDP: the group its gradient shards are all-reduced over
    # one backward's collectives in issue order (cost_models/issue_order.py): the gradient
    # reduction issued after the last backward, and the all-gather a backward waits for (FSDP2)
    last_reduce_s: float = 0.0
    bwd_gather_s: float = 0.0


def _ddp(dp: DpComm, full_grads: float, layout, cluster, bwd_window: float, bucket_bytes: float) -> None:
    """`full_grads`: the bytes the all-reduce moves; `bucket_bytes`: the gradients as held
    (they differ under compression: DDP's buckets hold the gradients' dtype, the hook casts)."""
    device = cluster.device_profile
    ar = C.collective_time("all_reduce", full_grads, dp.place, cluster)
    dp.collectives.append(("all_reduce", 2 * full_grads * (layout.dp - 1) / layout.dp, ar))
    dp.last_reduce_s = ar
    ar_exp, dp.contention_s = all_reduce_exposed(ar, bwd_window, gradient_window_share(layout), device, dp.place,
                                                 cluster)
    # DDP copies each gradient into its bucket before the all-reduce and back after
    # it (read + write each way), on the compute stream
    dp.step_exposed_s = ar_exp + dp.contention_s + copy_s(4 * bucket_bytes, device)


def _sharded_optimizer(dp: DpComm, full_params: float, full_grads: float, layout, cluster, fwd_s: float,
                       bwd_window: float, per_micro_batch: bool) -> None:
    rs = C.collective_time("reduce_scatter", full_grads, dp.place, cluster)
    ag = C.collective_time("all_gather", full_params, dp.place, cluster)
    frac = (layout.shard_ranks - 1) / layout.shard_ranks
    m = layout.num_micro_batches if per_micro_batch else 1
    # reduced every micro-batch, FSDP2 also reshards after every backward at pp = 1: m
    # all-gathers; a pipeline stage keeps ZeRO-2 units gathered until its last (ReducingStage)
    gathers = m if layout.pp == 1 else 1
    dp.collectives += [("reduce_scatter", m * full_grads * frac, m * rs),
                       ("all_gather", gathers * full_params * frac, gathers * ag)]
    device, share = cluster.device_profile, gradient_window_share(layout)
    dp.last_reduce_s = rs
    if m == 1:
        dp.step_exposed_s, dp.contention_s = sharded_optimizer_exposed(rs, ag, fwd_s, bwd_window, share, device,
                                                                       dp.place, cluster)
        return
    fwd, dp.bwd_exposed_s, dp.contention_s = sharded_optimizer_per_micro_batch_exposed(
        rs, ag, fwd_s, bwd_window, share, m, device, dp.place, cluster, gathers)
    if gathers == m:
        dp.fwd_exposed_s = fwd
    else:
        dp.step_exposed_s = fwd  # the step's one gather, under the first forward


def _fsdp(dp: DpComm, layer: LayerSpec, full_params: float, full_grads: float, layout, cluster, fwd_s: float,
          bwd_window: float, per_micro_batch: bool) -> None:
    # FSDP2 copies a unit's shards into the all-gather buffer (on the gather's stream,
    # priced with the collective) and out of it into the unsharded parameters (on
    # the compute stream: exposed), and the gradients into the reduce-scatter buffer.
    device = cluster.device_profile
    unit = (device.measured.fsdp_unit_s(full_params, layer.attrs.get("param_tensors", 1))
            if device.measured is not None else None)
    if unit is not None:
        # FSDP2 timed on this machine, collectives included: what it adds beyond the
        # collectives at the group size timed (exposed, on the compute stream); the
        # collectives themselves are priced at this group's size below
        ranks, gather_s, reduce_s = unit
        timed = C.GroupPlacement("dp", ranks, 1, ranks)
        copy_in, rs_extra = 0.0, reduce_s - C.collective_time("reduce_scatter", full_grads, timed, cluster)
        copy_out = gather_s - C.collective_time("all_gather", full_params, timed, cluster)
    else:
        copy_in, copy_out = copy_s(2 * full_params / layout.shard_ranks, device), copy_s(2 * full_params, device)
        rs_extra = copy_s(2 * full_grads, device)
    ag = C.collective_time("all_gather", full_params, dp.place, cluster) + copy_in
    rs = max(0.0, C.collective_time("reduce_scatter", full_grads, dp.place, cluster) + rs_extra)
    frac = (layout.shard_ranks - 1) / layout.shard_ranks
    m = layout.num_micro_batches
    reduces = m if per_micro_batch else 1
    dp.last_reduce_s, dp.bwd_gather_s = rs, ag
    dp.collectives += [("all_gather", 2 * m * full_params * frac, 2 * m * ag),
                       ("reduce_scatter", reduces * full_grads * frac, reduces * rs)]
    dp.fwd_exposed_s, dp.bwd_exposed_s, dp.step_exposed_s, dp.contention_s = fsdp_exposed(
        ag, rs, copy_out, fwd_s, bwd_window, m, device, dp.place, cluster, rs_per_micro_batch=per_micro_batch)


def _replica_all_reduce(dp: DpComm, full_grads: float, layout, cluster, bwd_window: float) -> None:
    """HSDP: the all-reduce of each gradient shard (1/dp_shard of the gradients) across the
    replicas, after the reduce-scatter inside the shard group. This is what torch's FSDP2
    runs on a 2-D (replicate, shard) mesh (torch.distributed.fsdp.fully_shard docs: "FSDP
    ... with a 2D mesh ... hybrid sharded data parallel, reduce-scatter then all-reduce";
    the FSDP paper, Zhao et al. 2023, section 3.2.2 "Hybrid Sharding": reduce-scatter
    within a shard group, all-reduce across replication groups). It crosses nodes while
    the reduce-scatter runs inside one, on other links, so it hides under the backward as
    DDP's all-reduce does (its own share of that window). Once per step, also when the
    reduce-scatters run every micro-batch: the lowering turns the all-reduce off until the
    last micro-batch (FSDPModule.set_requires_all_reduce: ParallelModel._accumulate at
    pp = 1, pipeline_parallel.ReducingStage under a pipeline), so the shard it sends holds
    every micro-batch's sum."""
    place = C.group_placement("dp_replicate", layout.tp, layout.dp, layout.pp, cluster, layout.dp_shard)
    shard = full_grads / layout.shard_ranks
    ar = C.collective_time("all_reduce", shard, place, cluster)
    dp.collectives.append(("all_reduce", 2 * shard * (layout.replicas - 1) / layout.replicas, ar))
    exposed_s, contention = all_reduce_exposed(ar, bwd_window, gradient_window_share(layout), cluster.device_profile,
                                               place, cluster)
    dp.step_exposed_s += exposed_s + contention
    dp.contention_s += contention
    dp.replica_place = place


def _fsdp_one_rank(dp: DpComm, layer: LayerSpec, params_local: float, device) -> None:
    # FSDP2's mixed precision on one rank (how autopar lowers a 16-bit plan with dp = 1):
    # per micro-batch each unit's fp32 parameters are cast into the all-gather buffer
    # (read 4, write 2 bytes) and copied out into the unsharded parameters (read 2,
    # write 2); once per step the 16-bit gradients are cast to fp32 (read 2, write 4).
    # Memory-bound copies on the device, not hidden by anything. Plus FSDP2's own work
    # per all-gather (one per micro-batch: at zero 0 parameters stay gathered from
    # forward to backward) and per reduce-scatter (one per step): exposed, not hidden
    # behind the kernels as plain host time is. On an H100 the GPU idled 46 ms of a
    # 208 ms Llama 1B step whose host ran ahead of the kernels on every layer except
    # at FSDP2's hooks (docs/cost_model.md section 9).
    per = fsdp_one_rank_s(params_local * 4, layer.attrs.get("param_tensors", 1), device)
    dp.fwd_exposed_s = copy_s(10 * params_local, device) + per
    dp.step_exposed_s = copy_s(6 * params_local, device) + per


def dp_comm(layer: LayerSpec, layout, cluster, zero: int, offload: str, params_local: float, state_bytes: tuple,
            fwd_s: float, bwd_window: float, float8_params: float = 0.0,
            place: C.GroupPlacement | None = None) -> DpComm:
    """The layer's data-parallel traffic under ZeRO level `zero` (nccl-tests sizes: the
    full, unsharded buffer), with what stays exposed. `state_bytes`: (param, gradient,
    optimizer) bytes per parameter as held; `bwd_window`: backward plus recomputation;
    `float8_params`: elements of float8 Linears' weights, which FSDP2 (ZeRO >= 2) all-gathers
    in float8, one byte each (cost_models/float8.py). `place`: the group, when it is not
    the layout's dp (an MoE layer's experts shard over the efsdp group: layer_ep.py)."""
    device = cluster.device_profile
    p_bytes, g_bytes, _ = state_bytes
    # ZeRO >= 1 under HSDP shards (gathers, reduce-scatters) inside the dp_shard group only
    hsdp = layout.hsdp and zero >= 1
    dp = DpComm(place or C.group_placement("dp_shard" if hsdp else "dp", layout.tp, layout.dp, layout.pp, cluster,
                                           layout.dp_shard))
    full_params = params_local * p_bytes
    wire = compression.wire_bytes(g_bytes, layout.grad_reduce_dtype)
    full_grads = params_local * wire  # what every gradient reduction moves (cost_models/compression.py)
    if layout.dp > 1 and params_local > 0:
        # FSDP2 (zero >= 2) gathers float8 weights in float8; ZeroRedundancyOptimizer (zero 1,
        # beside DDP) all-gathers the parameters as held
        saved = min(float8_params, params_local) * max(0.0, p_bytes - 1) if zero >= 2 else 0.0
        # Layout.grads_reduced_per_micro_batch: FSDP2 units (ZeRO >= 2) reduce every micro-batch
        per_mb = layout.grads_reduced_per_micro_batch and zero >= 2 and layout.num_micro_batches > 1
        if zero == 0:
            _ddp(dp, full_grads, layout, cluster, bwd_window, params_local * g_bytes)
        elif zero in (1, 2):
            _sharded_optimizer(dp, full_params - saved, full_grads, layout, cluster, fwd_s, bwd_window, per_mb)
        else:
            _fsdp(dp, layer, full_params - saved, full_grads, layout, cluster, fwd_s, bwd_window, per_mb)
        if hsdp:
            _replica_all_reduce(dp, full_grads, layout, cluster, bwd_window)
        # compression's casts, on the compute stream once per reduction (ZeRO >= 2: FSDP2's buffer)
        casts = compression.cast_bytes(params_local, g_bytes, wire, zero >= 2, layout.shard_ranks)
        if casts:
            dp.step_exposed_s += (layout.num_micro_batches if per_mb else 1) * copy_s(casts, device)
    if layout.fsdp_one_rank and layout.dp == 1 and layer.params > 0:
        _fsdp_one_rank(dp, layer, params_local, device)
    if offload == "params":
        # sharded params come up from the host for every forward and backward
        h2d = (params_local / (layout.shard_ranks if zero >= 3 else 1)) * p_bytes / cluster.host_link_profile.bus_bandwidth
        fwd_h2d, bwd_h2d = prefetch_exposed(h2d, fwd_s, bwd_window, device)
        dp.fwd_exposed_s += fwd_h2d
        dp.bwd_exposed_s += bwd_h2d
    bn_s, bn_bytes = batch_norm_sync(layer, layout.dp, dp.place, cluster)
    if bn_s:
        m = layout.num_micro_batches
        dp.collectives.append(("all_reduce", 2 * m * bn_bytes, 2 * m * bn_s))
        dp.fwd_exposed_s, dp.bwd_exposed_s = dp.fwd_exposed_s + bn_s, dp.bwd_exposed_s + bn_s
    return dp
