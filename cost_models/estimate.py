"""The estimate API: price one layout of one model on one cluster.

`layer_cost` prices a single layer under a layout (per micro-batch times,
per-GPU memory, per-step data-parallel traffic); `estimate` is nothing but
`layer_cost` for every layer + the pipeline simulation + the end-of-step
data-parallel exposure and optimizer step. A planner that builds per-layer
tables from `layer_cost` therefore agrees with the final `estimate` by
construction.
"""
from __future__ import annotations

import collections
import itertools
import weakref
from dataclasses import asdict, dataclass, field

import sympy

from cost_models import comm as C
from cost_models.compute import fast, host_times, op_times
from cost_models.errors import CostModelError
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout
from cost_models.memory import (FRAGMENTATION, activation_bytes, model_state_bytes,
                                recompute_working_bytes, state_bytes_per_param)
from cost_models.pipeline import simulate_cached
from cost_models.stragglers import slowest_gpu_slowdown
from cost_models.workload import S, LayerSpec, ModelSpec, OpSpec

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass
class LayerCost:
    """One layer under one layout. Times are per micro-batch unless marked per step."""

    fwd_s: float
    bwd_s: float
    recompute_s: float  # extra forward work in backward (full: incl. its TP all-reduces)
    tp_comm_s: float  # forward + backward TP collectives, not overlapped
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # kept per micro-batch in flight
    dp_comm_s: float  # per step, all DP/FSDP collectives before overlap
    dp_comm_exposed_s: float  # per step, what compute does not hide
    # -- finer parts estimate() composes (same units as above) -------------
    tp_comm_fwd_s: float = 0.0
    tp_comm_bytes: float = 0.0  # per micro-batch, what this GPU sends in TP collectives (fwd + bwd)
    tp_calls: tuple = ()  # ((collective, calls per micro-batch), ...): what `tp_comm_s` prices
    dp_fwd_exposed_s: float = 0.0  # per micro-batch, FSDP all-gather not hidden by forward
    dp_bwd_exposed_s: float = 0.0  # per micro-batch, FSDP all-gather not hidden by backward
    dp_step_exposed_s: float = 0.0  # per step, gradient reduction etc. at the end of the step
    # per step, included in the exposed times above: compute slowed while hidden collectives
    # hold SMs (cost_models.comm.contention_s)
    nccl_contention_s: float = 0.0
    optimizer_s: float = 0.0  # per step
    working_bytes: float = 0.0  # transient: recomputed activations of this one layer in backward
    host_bytes: float = 0.0  # offloaded to CPU memory
    # DDP's buckets: a second copy of the gradients (torch DDP, gradient_as_bucket_view=False,
    # the default: "the saved memory size will be equal to the total gradients size")
    bucket_bytes: float = 0.0
    # alive only during the optimizer step: foreach Adam's temporary (section 4's second peak)
    optimizer_temp_bytes: float = 0.0
    # alive at the loss's first backward op: two logits-sized gradients (the layer with the loss)
    loss_grad_bytes: float = 0.0
    params_local: float = 0.0  # parameters this GPU holds before ZeRO sharding
    model_flops: float = 0.0  # per micro-batch per GPU, fwd + bwd, no recomputation
    recompute_flops: float = 0.0  # per micro-batch per GPU
    dp_collectives: tuple = ()  # ((collective, bytes per step, time per step), ...)
    tier: dict = field(default_factory=dict)  # axis -> 'intra_node' | 'inter_node'

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_s

    def to_dict(self) -> dict:
        return asdict(self)


# -------------------------------------------------------------------------------
def _is_attention_core(op: OpSpec) -> bool:
    """Ops that materialise s^2 tensors (unfused scores, their softmax and dropout):
    what Korthikanti's selective checkpointing recomputes. A FlashAttention
    kernel never writes an s^2 tensor (its bytes grow with s), so it is not one."""
    for expr in (op.fwd_bytes,):
        if isinstance(expr, sympy.Basic) and S in expr.free_symbols:
            try:
                if sympy.Poly(sympy.expand(expr), S).degree() >= 2:
                    return True
            except sympy.PolynomialError:
                continue
    return False


_CORE_CACHE: dict = {}


def _core_flags(layer: LayerSpec) -> list:
    key = layer_fingerprint(layer)
    if key not in _CORE_CACHE:
        _CORE_CACHE[key] = [_is_attention_core(op) for op in layer.ops]
    return _CORE_CACHE[key]


def _tp_for(layer: LayerSpec, tp: int) -> int:
    """A layer that cannot be split tp ways runs replicated on every tp rank."""
    return tp if tp in tuple(layer.tp_degrees or (1,)) else 1


def _layer_compute(layer: LayerSpec, batch: int, seq, device, dtype: str, tp: int, sp: bool, byte_scale: float):
    parts = {"fwd": 0.0, "bwd": 0.0, "core_fwd": 0.0, "core_flops": 0.0, "cheap_fwd": 0.0, "gemm_fwd": 0.0,
             "gemm_flops": 0.0}
    # memory-bound ops (what fused kernels shrink): unsharded bytes, local byte time, time above launch floor
    mb = {"fwd_bytes": 0.0, "bwd_bytes": 0.0, "fwd_bytes_s": 0.0, "bwd_bytes_s": 0.0, "fwd_room": 0.0,
          "bwd_room": 0.0}
    parts["memory_bound"] = mb
    hbm = device.memory_bandwidth * device.memory_efficiency
    if not layer.ops:  # a layer without an op breakdown: one GEMM-like block at the large-GEMM rate
        f = fast(layer.fwd_flops)(batch, seq or 1) / tp
        b = fast(layer.bwd_flops)(batch, seq or 1) / tp
        rate = device.peak(dtype) * device.gemm_max_efficiency * device.sustained_clock_fraction
        parts.update(fwd=f / rate, bwd=b / rate, gemm_fwd=f / rate, gemm_flops=f)
        return parts
    for op, core in zip(layer.ops, _core_flags(layer)):
        # sequence parallelism splits what tp leaves whole, except what tp had to gather
        divisor = tp if (op.tp_sharded or (sp and not op.tp_replicated)) else 1
        f, b = op_times(op, batch, seq, device, dtype=dtype, work_divisor=divisor, byte_scale=byte_scale,
                        gemm_split=tp if op.tp_sharded else 1)
        parts["fwd"] += f
        parts["bwd"] += b
        if core:
            parts["core_fwd"] += f
            parts["core_flops"] += fast(op.fwd_flops)(batch, seq or 1) / divisor
        elif op.kind == "gemm":
            parts["gemm_fwd"] += f
            parts["gemm_flops"] += fast(op.fwd_flops)(batch, seq or 1) / divisor
        elif op.kind != "attention":
            parts["cheap_fwd"] += f
        if op.kind not in ("gemm", "attention", "embedding"):
            launch = device.kernel_launch_s * max(1, op.count)
            for phase, t, expr in (("fwd", f, op.fwd_bytes), ("bwd", b, op.bwd_bytes)):
                nbytes = fast(expr)(batch, seq or 1)
                mb[phase + "_bytes"] += nbytes
                mb[phase + "_bytes_s"] += nbytes * byte_scale / divisor / hbm
                mb[phase + "_room"] += max(0.0, t - launch)
    if device.measured is not None or device.host_op_fwd_s > 0:
        # Host time per dispatched op (measured, or the device's physics default; DTensor's
        # when tp runs the layer as DTensors).
        # On a CPU the host is the device, so it adds; a GPU runs kernels while the host
        # issues the next ones, so the slower of the two paces the layer.
        host_f, host_b = host_times(layer, device, dtensor=tp > 1,
                                    activation_bytes=fast(layer.output_bytes)(batch, seq or 1) * byte_scale)
        if device.vendor == "cpu":
            parts["fwd"] += host_f
            parts["bwd"] += host_b
            parts["cheap_fwd"] += host_f
        else:
            parts["fwd"], parts["bwd"] = max(parts["fwd"], host_f), max(parts["bwd"], host_b)
    return parts


def _fused_savings_s(layer: LayerSpec, parts: dict, batch: int, seq: int) -> tuple[float, float]:
    """(forward, backward) seconds the plan's fused kernels take off this layer.

    The saved bytes (LayerSpec.fused_bytes_saved_*, unsharded) are a share of
    the layer's memory-bound op bytes; that share of those ops' local byte
    time goes, so tensor/sequence parallelism divides it as it divides the
    ops. Capped by the time those ops spend above their launch floor: a
    fused kernel still launches, and it cannot save what is not there."""
    out = []
    mb = parts["memory_bound"]
    for phase, expr in (("fwd", layer.fused_bytes_saved_fwd), ("bwd", layer.fused_bytes_saved_bwd)):
        saved = fast(expr)(batch, seq) if expr is not None else 0.0
        total = mb[phase + "_bytes"]
        if saved <= 0 or total <= 0:
            out.append(0.0)
            continue
        out.append(min(mb[phase + "_room"], mb[phase + "_bytes_s"] * min(1.0, saved / total)))
    return out[0], out[1]


# -- memoising layer_cost ---------------------------------------------------------
# The cache key holds *everything* `_layer_cost` reads, derived from the objects'
# fields rather than listed by hand: a layer's content (every LayerSpec field but its
# name and module paths, ops included), the model's scalars, every Layout field except
# those known not to change one layer's cost, and the cluster's cache key. A field
# added later to LayerSpec, OpSpec, ModelSpec or Layout therefore enters the key by
# default (a signature that forgot `fused_qkv` once returned another layer's cost).
_LAYER_FIELDS_NOT_READ = frozenset({"name", "module_paths", "signature"})
_MODEL_FIELDS_NOT_READ = frozenset({"name", "layers"})
# whole-model / per-layer layout fields: layer_cost receives its zero/checkpoint/offload
# as arguments, and schedule / virtual stages / stage split only matter to the pipeline
_LAYOUT_FIELDS_NOT_READ = frozenset({"schedule", "virtual_stages", "stage_layers", "layer_zero", "layer_checkpoint",
                                     "layer_offload", "zero", "checkpoint", "offload", "extra"})
_FINGERPRINT_IDS: dict = {}  # layer content -> small int (never reused: see _next_id)
_next_id = itertools.count()
_FINGERPRINT_MEMO: dict = {}  # id(layer) -> (weakref, identity of its field values, fingerprint id)


def _hashable(x):
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted(((k, _hashable(v)) for k, v in x.items()), key=repr))
    if isinstance(x, set):
        return tuple(sorted((_hashable(v) for v in x), key=repr))
    if hasattr(x, "__dataclass_fields__"):
        return (type(x).__name__,) + tuple((k, _hashable(v)) for k, v in vars(x).items())
    return x


def layer_fingerprint(layer: LayerSpec) -> int:
    """A small int equal for layers whose costs are equal by construction: same
    content in every field the cost model may read (all but name / module paths /
    signature, ops compared op by op). Memoised per layer object; re-derived when
    any field (or any op of its list) is replaced."""
    ident = tuple(map(id, vars(layer).values())) + tuple(map(id, layer.ops))
    memo = _FINGERPRINT_MEMO.get(id(layer))
    if memo is not None and memo[0]() is layer and memo[1] == ident:
        return memo[2]
    content = tuple((k, _hashable(v)) for k, v in vars(layer).items() if k not in _LAYER_FIELDS_NOT_READ)
    fid = _FINGERPRINT_IDS.get(content)
    if fid is None:
        if len(_FINGERPRINT_IDS) > 100_000:  # a cleared content gets a fresh id: a cache miss, never a collision
            _FINGERPRINT_IDS.clear()
        fid = _FINGERPRINT_IDS[content] = next(_next_id)
    if len(_FINGERPRINT_MEMO) > 100_000:
        _FINGERPRINT_MEMO.clear()
    _FINGERPRINT_MEMO[id(layer)] = (weakref.ref(layer), ident, fid)
    return fid


def _fields_key(obj, names: tuple) -> tuple:
    return tuple([getattr(obj, k) for k in names])


# the cost model's own types: fields a subclass adds (capture's ModelGraph: its op graph) are not read
_MODEL_KEY_FIELDS = tuple(k for k in ModelSpec.__dataclass_fields__ if k not in _MODEL_FIELDS_NOT_READ)
_LAYOUT_KEY_FIELDS = tuple(k for k in Layout.__dataclass_fields__ if k not in _LAYOUT_FIELDS_NOT_READ)


_LAYER_CACHE: dict = {}


# Bytes per parameter one step of torch's foreach optimizer moves (torch/optim/adam.py
# `_multi_tensor_adam`, weight decay decoupled, not capturable; fp32 states): param *=
# (1 - lr wd) 8, exp_avg.lerp_(grad) 12, exp_avg_sq *= beta2 8, exp_avg_sq.addcmul_(grad,
# grad) 12, sqrt(exp_avg_sq) into a temporary 8, /= bias correction 8, += eps 8,
# param.addcdiv_(exp_avg, temporary) 16: 80. SGD with momentum (`_multi_tensor_sgd`):
# buf *= momentum, buf += grad 12 + 8, param += -lr buf 12: 32.
FOREACH_STEP_BYTES = {"adam": 80.0, "sgd": 32.0}
# The temporary foreach Adam allocates for sqrt(exp_avg_sq), all tensors at once: a
# second memory peak during the optimizer step (4 bytes per fp32 state element)
FOREACH_TEMP_BYTES = {"adam": 4.0, "sgd": 0.0}


def _loss_grad_bytes(layer, b: int, s1: int, byte_scale: float, tp: int) -> float:
    """Two logits-sized gradients at the loss's first backward op, in the dtype the loss
    computes its log-softmax in (fp32 where it upcasts the logits, as Hugging Face's
    causal-LM loss does): the log-softmax op reads and writes the logits once each, so
    one logits tensor is half its bytes. Measured with FSDPMemTracker on Qwen2 0.5B:
    18.55 GiB of temporaries at the peak, 2 x its 9.28 GiB fp32 logits. A vocab-split
    head computes the loss on its shard (loss_parallel): each rank holds 1/tp of them."""
    if not layer.attrs.get("loss"):
        return 0.0
    sm = [op for op in layer.ops if op.kind == "softmax" and op.name.startswith("loss:")]
    return sum(fast(op.fwd_bytes)(b, s1) / (tp if op.tp_sharded else 1)
               for op in sm) * byte_scale  # 2 x (bytes / 2)


def _backward_peak(layer: LayerSpec, activations: float, grads: float) -> float:
    """The most a layer's own backward holds at once of its saved activations (all of
    them, recomputed ones included, when it starts) and its weight gradients (all of
    them when it ends): capture's walk through its autograd nodes (LayerSpec.attrs
    "bwd_walk", [[alive share, gradient share], ...]); without one, the larger end."""
    walk = layer.attrs.get("bwd_walk") or ((1.0, 0.0), (0.0, 1.0))
    return max(max(a * activations + g * grads for a, g in walk), activations, grads)


def _optimizer_temp_bytes(layout, device, opt_params: float, offload: str) -> float:
    """Bytes foreach Adam allocates at once during the step for this layer's state
    elements. torch runs foreach by default only on GPUs; a CPU's default loops over
    the tensors, each temporary freed before the next (nothing to speak of)."""
    if layout.optimizer_impl != "foreach" or offload != "none" or device.vendor == "cpu":
        return 0.0
    return FOREACH_TEMP_BYTES[layout.optimizer] * opt_params


def _fsdp_one_rank_s(unit_bytes: float, tensors: int, device) -> float:
    """Seconds FSDP2 adds per all-gather (or reduce-scatter) of a unit of
    `unit_bytes` fp32 parameters in `tensors` tensors on a one-rank mesh (hooks, per-
    parameter copy views, gradient DTensors): calibrated when the profile timed FSDP2
    on one rank, else the device's physics defaults."""
    if device.measured is not None:
        unit = device.measured.fsdp_unit_s(unit_bytes, tensors)
        if unit is not None and unit[0] == 1:
            return (unit[1] + unit[2]) / 2
    return device.fsdp_unit_host_s + max(0, tensors - 1) * device.fsdp_tensor_host_s


# SMs Transformer Engine's TP overlap takes from the GEMMs it runs under, as a share of an
# H100's 132: NeMo's userbuffers config for GPT-3 175B (tp4, bf16, H100; NVIDIA/NeMo
# nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py) gives the forward's four
# collectives 1, 24, 1, 1 SMs (ring exchange 1, the pipelined reduce-scatter 24): 6.75 on
# average; the backward's 2-4 (bulk overlaps) and 1 (ring exchange): about 3.
TP_OVERLAP_SM_SHARE = {"fwd": 6.75 / 132, "bwd": 3 / 132}


def _tp_overlapped(comm_s: float, gemm_s: float, tp: int, phase: str) -> float:
    """Exposed time of a layer's tp collectives run chunk by chunk under its GEMMs: the
    first of tp chunks cannot overlap, the rest hide behind the GEMMs up to their length,
    and the GEMMs run on fewer SMs while they carry the overlap."""
    first = comm_s / tp
    rest = comm_s - first
    hidden = min(rest, gemm_s)
    return first + (rest - hidden) + hidden * TP_OVERLAP_SM_SHARE[phase]


def _tp_collectives(layer: LayerSpec, tp: int, b: int, s1: int, byte_scale: float, sp: bool) -> list:
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


def _copy_s(nbytes: float, device) -> float:
    """A memory-bound copy of nbytes (read + write): measured copy rate, or HBM physics."""
    if device.measured is not None:
        t = device.measured.bytes_time("copy", nbytes, "copy")
        if t is not None:
            return t
    return nbytes / (device.memory_bandwidth * device.memory_efficiency)


def _batch_norm_sync(layer: LayerSpec, dp: int, dp_place, cluster) -> tuple[float, float]:
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


def _exposed(comm_s: float, window_s: float, device) -> float:
    """What a collective of comm_s adds to the step when compute of window_s could
    hide it: at most the device's hideable share of it (collective_overlap) hides,
    and no more than the window."""
    return comm_s - min(device.collective_overlap * comm_s, max(0.0, window_s))


def layer_cost(layer: LayerSpec, model: ModelSpec, layout: Layout, cluster: ClusterSpec, *, zero: int | None = None,
               checkpoint: str | None = None, offload: str | None = None) -> LayerCost:
    """Cost of `layer` under `layout` on `cluster` (see LayerCost for units)."""
    zero = layout.zero if zero is None else zero
    checkpoint = layout.checkpoint if checkpoint is None else checkpoint
    offload = layout.offload if offload is None else offload
    key = (layer_fingerprint(layer), _fields_key(model, _MODEL_KEY_FIELDS), _fields_key(layout, _LAYOUT_KEY_FIELDS),
           zero, checkpoint, offload, cluster.cache_key())
    try:
        hit = _LAYER_CACHE.get(key)
    except TypeError:  # a field holding a list or dict: compare its contents
        key = _hashable(key)
        hit = _LAYER_CACHE.get(key)
    if hit is not None:
        return hit
    cost = _layer_cost(layer, model, layout, cluster, zero, checkpoint, offload)
    if len(_LAYER_CACHE) > 200_000:
        _LAYER_CACHE.clear()
    _LAYER_CACHE[key] = cost
    return cost


def _layer_cost(layer, model, layout, cluster, zero, checkpoint, offload) -> LayerCost:
    if zero not in (0, 1, 2, 3):
        raise CostModelError(f"zero must be 0-3, got {zero!r} for layer '{layer.name}'")
    device = cluster.device_profile
    dtype = layout.precision
    byte_scale = DTYPE_BYTES[dtype] / (model.dtype_bytes or 2)
    b, seq = layout.micro_batch_size, model.seq_len
    s1 = seq or 1
    tp = _tp_for(layer, layout.tp)
    sp = layout.sequence_parallel and tp > 1
    m = layout.num_micro_batches

    parts = _layer_compute(layer, b, seq, device, dtype, tp, sp, byte_scale)
    if layer.ops:
        save_fwd, save_bwd = _fused_savings_s(layer, parts, b, s1)
        parts["fwd"] -= save_fwd
        parts["bwd"] -= save_bwd
        parts["cheap_fwd"] = max(0.0, parts["cheap_fwd"] - save_fwd)
    fwd_s, bwd_s = parts["fwd"], parts["bwd"]
    hbm = device.memory_bandwidth * device.memory_efficiency
    fp32_main = layout.main_grads != "same" and layout.precision != "fp32"
    if layout.main_grads == "fp32-unfused" and fp32_main and zero < 3 and layer.params:
        # DeepSpeed's BF16 optimizer: after every micro-batch's backward, hp_grad += lp_grad.float()
        # (read 2 + read 4 + write 4 bytes per local parameter), on the compute stream.
        bwd_s += (2 + 4 + 4) * layer.params / tp / hbm
    elif m > 1 and layer.params and not (fp32_main and zero < 3):
        # Gradient accumulation: from the second micro-batch on, autograd adds each new
        # gradient into .grad (read both, write one): a memory-bound pass per micro-batch.
        # (fp32 main gradients accumulate inside the weight-gradient GEMM instead.)
        g_acc = state_bytes_per_param(layout.precision, layout.optimizer)[1]
        bwd_s += (m - 1) / m * 3 * g_acc * layer.params / tp / hbm
    core_fwd_s, core_flops = parts["core_fwd"], parts["core_flops"]
    cheap_fwd_s, gemm_fwd_s, gemm_fwd_flops = parts["cheap_fwd"], parts["gemm_fwd"], parts["gemm_flops"]

    # Tensor parallel: the collectives one micro-batch issues (`_tp_collectives`),
    # each priced on the tp group's link, plus DTensor's measured cost per collective.
    tp_place = C.group_placement("tp", layout.tp, layout.dp, layout.pp, cluster)
    issued = _tp_collectives(layer, tp, b, s1, byte_scale, sp) if tp > 1 else []
    per_call = device.measured.dtensor_collective_overhead_s if device.measured is not None else 0.0
    tp_fwd, tp_bwd = (sum((C.collective_time(kind, nbytes, tp_place, cluster) + per_call
                           for kind, nbytes, when in issued if when == phase), 0.0) for phase in ("fwd", "bwd"))
    tp_bytes = sum(nbytes * (2 if kind == "all_reduce" else 1) for kind, nbytes, _ in issued) * (tp - 1) / tp
    tp_calls = tuple(sorted(collections.Counter(kind for kind, _, _ in issued).items()))
    if layout.tp_comm_overlap and tp > 1 and tp_fwd + tp_bwd > 0:
        # the backward's GEMMs (input and weight gradients) are twice the forward's
        tp_fwd, tp_bwd = (_tp_overlapped(tp_fwd, gemm_fwd_s, tp, "fwd"),
                          _tp_overlapped(tp_bwd, 2 * gemm_fwd_s, tp, "bwd"))
    tp_comm = tp_fwd + tp_bwd

    # Recomputation in backward.
    if checkpoint == "full":
        recompute_s = fwd_s + tp_fwd
        recompute_flops = fast(layer.fwd_flops)(b, s1) / tp
    elif checkpoint == "selective":
        recompute_flops = fast(layer.selective_recompute_flops)(b, s1) / tp
        if core_flops > 0:
            # Korthikanti: the attention core (the ops that grow with s^2) is redone
            recompute_s = core_fwd_s * min(1.0, recompute_flops / core_flops)
        elif fast(layer.activation_bytes_selective)(b, s1) > 0:
            # op-level policy: the cheap ops are redone, plus any matmuls it chose to drop
            recompute_s = cheap_fwd_s + gemm_fwd_s * min(1.0, recompute_flops / max(gemm_fwd_flops, 1.0))
        else:
            recompute_s = 0.0
    else:
        recompute_s, recompute_flops = 0.0, 0.0

    # Model states. Parameters of a layer tensor parallelism splits are divided by tp
    # (norm weights, replicated, are a rounding error of a block).
    params_local = layer.params / tp
    states = model_state_bytes(params_local, precision=layout.precision, optimizer=layout.optimizer, zero=zero,
                               dp=layout.dp, offload=offload)
    p_bytes, g_bytes, k_bytes = state_bytes_per_param(layout.precision, layout.optimizer)
    if fp32_main:  # fp32 main gradients: 4 bytes each where the gradients are held, and reduced in fp32
        states.grads *= 4 / g_bytes
        g_bytes = 4
    if zero >= 3 and layout.dp > 1 and layout.precision in ("bf16", "fp16") and offload == "none":
        # FSDP (what autopar lowers to, and torchtitan / MPT run) shards the fp32 parameter
        # itself: no 16-bit shard exists (the 16-bit copies are unsharded and transient, in
        # the FSDP buffer), and a gradient shard takes its parameter's dtype. 4 + 4 + 8
        # bytes per parameter / dp (FSDPMemTracker: sharded param, sharded grad, optimizer
        # state). DeepSpeed's stage 3 also keeps a 16-bit shard: not modelled.
        states.params = 4 * params_local / layout.dp
        states.grads = 4 * params_local / layout.dp
        states.optimizer = (k_bytes - 4) * params_local / layout.dp
    act = activation_bytes(layer, b, seq, tp=tp, sequence_parallel=sp, checkpoint=checkpoint, byte_scale=byte_scale)
    working = recompute_working_bytes(layer, b, seq, tp=tp, sequence_parallel=sp, checkpoint=checkpoint,
                                      byte_scale=byte_scale)

    # Data parallel traffic (nccl-tests sizes: the full, unsharded buffer).
    # Megatron's and DeepSpeed's pipeline engines reduce gradients (and ZeRO-1/2 gather the
    # updated parameters) only after the pipeline flush: nothing left to hide behind.
    overlap = 0.0 if (layout.pp > 1 and layout.p2p_blocking) else C.GRAD_REDUCE_OVERLAP
    dp_place = C.group_placement("dp", layout.tp, layout.dp, layout.pp, cluster)
    full_params = params_local * p_bytes
    full_grads = params_local * g_bytes
    bwd_window = bwd_s + recompute_s
    colls = []
    fwd_exp = bwd_exp = step_exp = 0.0
    contention = 0.0  # per step: compute slowed by the SMs hidden collectives hold (comm.contention_s)
    if layout.dp > 1 and params_local > 0:
        if zero == 0:
            ar = C.collective_time("all_reduce", full_grads, dp_place, cluster)
            colls.append(("all_reduce", 2 * full_grads * (layout.dp - 1) / layout.dp, ar))
            ar_exp = _exposed(ar, overlap * bwd_window, device)
            contention = C.contention_s(ar - ar_exp, dp_place, cluster)
            # DDP copies each gradient into its bucket before the all-reduce and back after
            # it (read + write each way), on the compute stream
            step_exp = ar_exp + contention + _copy_s(4 * full_grads, device)
        elif zero in (1, 2):
            rs = C.collective_time("reduce_scatter", full_grads, dp_place, cluster)
            ag = C.collective_time("all_gather", full_params, dp_place, cluster)
            frac = (layout.dp - 1) / layout.dp
            colls += [("reduce_scatter", full_grads * frac, rs), ("all_gather", full_params * frac, ag)]
            # grads reduce under the last backward; updated params gather under the next forward
            rs_exp, ag_exp = _exposed(rs, overlap * bwd_window, device), _exposed(ag, overlap * fwd_s, device)
            contention = C.contention_s(rs - rs_exp + ag - ag_exp, dp_place, cluster)
            step_exp = rs_exp + ag_exp + contention
        else:
            # FSDP2 copies a unit's shards into the all-gather buffer (on the gather's stream,
            # priced with the collective) and out of it into the unsharded parameters (on
            # the compute stream: exposed), and the gradients into the reduce-scatter buffer.
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
                copy_in, copy_out = _copy_s(2 * full_params / layout.dp, device), _copy_s(2 * full_params, device)
                rs_extra = _copy_s(2 * full_grads, device)
            ag = C.collective_time("all_gather", full_params, dp_place, cluster) + copy_in
            rs = max(0.0, C.collective_time("reduce_scatter", full_grads, dp_place, cluster) + rs_extra)
            frac = (layout.dp - 1) / layout.dp
            colls += [("all_gather", 2 * m * full_params * frac, 2 * m * ag), ("reduce_scatter", full_grads * frac, rs)]
            fwd_exp = _exposed(ag, C.FSDP_PREFETCH_OVERLAP * fwd_s, device)
            bwd_exp = _exposed(ag, C.FSDP_PREFETCH_OVERLAP * bwd_window, device)
            # the reduce-scatter shares the last backward's window with the all-gather
            step_exp = max(0.0, _exposed(ag + rs, C.FSDP_PREFETCH_OVERLAP * bwd_window, device) - bwd_exp)
            # every micro-batch's prefetched gathers slow the forward / backward they hide under;
            # the step's one reduce-scatter slows the last backward
            fwd_cont = C.contention_s(ag - fwd_exp, dp_place, cluster)
            bwd_cont = C.contention_s(ag - bwd_exp, dp_place, cluster)
            rs_cont = C.contention_s(rs - step_exp, dp_place, cluster)
            fwd_exp, bwd_exp, step_exp = (max(0.0, fwd_exp + fwd_cont + copy_out),
                                          max(0.0, bwd_exp + bwd_cont + copy_out), step_exp + rs_cont)
            contention = m * (fwd_cont + bwd_cont) + rs_cont

    if layout.fsdp_one_rank and layout.dp == 1 and layer.params > 0:
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
        per = _fsdp_one_rank_s(params_local * 4, layer.attrs.get("param_tensors", 1), device)
        fwd_exp = _copy_s(10 * params_local, device) + per
        step_exp = _copy_s(6 * params_local, device) + per

    # Offload: state moves over the host link, the optimizer runs on the CPU.
    host_link = cluster.host_link_profile
    opt_params = params_local / (layout.dp if zero >= 1 else 1)
    touched = 2 * p_bytes + g_bytes + 2 * k_bytes  # read+write param, read grad, read+write states
    measured_opt = None
    if device.measured is not None and offload == "none":
        # torch's own optimizer timed on this device, per element and per tensor; sharded
        # (FSDP2) and tp-split parameters are DTensors
        measured_opt = device.measured.optimizer_time(
            layout.optimizer, opt_params, layer.attrs.get("param_tensors", 1 if layer.params else 0),
            dtensor=zero >= 1 or tp > 1)
    if measured_opt is not None:
        optimizer_s = measured_opt
    elif offload == "none":
        if layout.optimizer_impl == "foreach":
            # torch's multi-tensor optimizer: one kernel per arithmetic step, each a pass
            # over fp32 tensors (FOREACH_STEP_BYTES counts them from torch's source)
            touched = FOREACH_STEP_BYTES[layout.optimizer]
        optimizer_s = opt_params * touched / (device.memory_bandwidth * device.memory_efficiency)
    else:
        host_bw = cluster.host_memory_bandwidth / cluster.gpus_per_node
        transfer = opt_params * (g_bytes + p_bytes) / host_link.bus_bandwidth  # grads down, params up
        optimizer_s = opt_params * (touched + 2 * p_bytes) / host_bw + transfer
        if offload == "params":
            # sharded params come up for every forward and backward
            h2d = (params_local / (layout.dp if zero >= 3 else 1)) * p_bytes / host_link.bus_bandwidth
            fwd_exp += _exposed(h2d, C.FSDP_PREFETCH_OVERLAP * fwd_s, device)
            bwd_exp += _exposed(h2d, C.FSDP_PREFETCH_OVERLAP * bwd_window, device)

    bn_s, bn_bytes = _batch_norm_sync(layer, layout.dp, dp_place, cluster)
    if bn_s:
        colls.append(("all_reduce", 2 * m * bn_bytes, 2 * m * bn_s))
        fwd_exp, bwd_exp = fwd_exp + bn_s, bwd_exp + bn_s
    dp_total = sum(t for _, _, t in colls)
    model_flops = 3 * fast(layer.fwd_flops)(b, s1) / tp
    return LayerCost(
        fwd_s=fwd_s, bwd_s=bwd_s, recompute_s=recompute_s, tp_comm_s=tp_comm,
        param_bytes=states.params, grad_bytes=states.grads, optimizer_bytes=states.optimizer,
        activation_bytes=act, dp_comm_s=dp_total, dp_comm_exposed_s=m * (fwd_exp + bwd_exp) + step_exp,
        tp_comm_fwd_s=tp_fwd, tp_comm_bytes=tp_bytes, tp_calls=tp_calls,
        dp_fwd_exposed_s=fwd_exp, dp_bwd_exposed_s=bwd_exp, dp_step_exposed_s=step_exp,
        nccl_contention_s=contention,
        optimizer_s=optimizer_s, working_bytes=working, host_bytes=states.host, params_local=params_local,
        bucket_bytes=states.grads if zero == 0 and layout.dp > 1 else 0.0,
        optimizer_temp_bytes=_optimizer_temp_bytes(layout, device, opt_params, offload),
        loss_grad_bytes=_loss_grad_bytes(layer, b, s1, byte_scale, tp),
        model_flops=model_flops, recompute_flops=recompute_flops, dp_collectives=tuple(colls),
        tier={"tp": tp_place.tier, "dp": dp_place.tier},
    )


# -------------------------------------------------------------------------------
def balance_stages(weights: list, num_stages: int) -> list:
    """Contiguous split of `weights` into `num_stages` non-empty runs minimising the
    heaviest run (binary search on the bottleneck, greedy fill). Returns counts."""
    n = len(weights)
    if num_stages > n:
        raise CostModelError(f"{num_stages} pipeline stages but only {n} layers")
    if num_stages == 1:
        return [n]

    def split(limit: float):
        counts, loads, load, count = [], [], 0.0, 0
        for i, w in enumerate(weights):
            left_layers = n - i
            left_stages = num_stages - len(counts)
            must_cut = count > 0 and left_layers < left_stages  # keep a layer for every later stage
            if count > 0 and (load + w > limit or must_cut) and len(counts) < num_stages - 1:
                counts.append(count)
                loads.append(load)
                load, count = 0.0, 0
            load += w
            count += 1
        counts.append(count)
        loads.append(load)
        return counts, loads

    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        counts, loads = split(mid)
        # (each run's load summed left to right, as sum() over its slice would)
        fits = len(counts) <= num_stages and max(loads) <= mid * (1 + 1e-12)
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

    def to_dict(self) -> dict:
        return asdict(self)


def _resolve_per_layer(values, default, n):
    if values is None:
        return [default] * n
    return [default if v is None else v for v in values]


def estimate(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> Estimate:
    """Step time, throughput and per-rank memory of `layout` for `model` on `cluster`."""
    layers = model.layers
    n = len(layers)
    layout.validate(n)
    if layout.world_size > cluster.world_size:
        raise CostModelError(f"layout needs tp x pp x dp = {layout.world_size} GPUs, "
                             f"the cluster has {cluster.world_size}")
    device = cluster.device_profile
    peak = device.peak(layout.precision)
    zeros = _resolve_per_layer(layout.layer_zero, layout.zero, n)
    ckpts = _resolve_per_layer(layout.layer_checkpoint, layout.checkpoint, n)
    offs = _resolve_per_layer(layout.layer_offload, layout.offload, n)
    costs = [layer_cost(layer, model, layout, cluster, zero=z, checkpoint=c, offload=o)
             for layer, z, c, o in zip(layers, zeros, ckpts, offs)]

    pp, m = layout.pp, layout.num_micro_batches
    # Without a pipeline there is one stage, whatever the schedule says.
    v = layout.virtual_stages if layout.schedule == "interleaved" and pp > 1 else 1
    n_stages = pp * v
    if pp == 1:
        counts = [n]
    elif layout.stage_layers is not None:
        counts = list(layout.stage_layers)
    else:
        counts = balance_stages([c.fwd_s + c.bwd_s + c.recompute_s + c.tp_comm_s for c in costs], n_stages)
    bounds = [sum(counts[:i]) for i in range(n_stages + 1)]
    stage_of = [0] * n
    for i in range(n_stages):
        for j in range(bounds[i], bounds[i + 1]):
            stage_of[j] = i

    byte_scale = DTYPE_BYTES[layout.precision] / (model.dtype_bytes or 2)
    same_node = C.pp_neighbours_same_node(layout.tp, layout.dp, cluster)
    pp_place = C.group_placement("pp", layout.tp, layout.dp, layout.pp, cluster)
    b, s1 = layout.micro_batch_size, model.seq_len or 1
    fwd, bwd, p2p, act = [], [], [], []
    for i in range(n_stages):
        if i < n_stages - 1 and bounds[i + 1] > bounds[i]:
            out = fast(layers[bounds[i + 1] - 1].output_bytes)(b, s1) * byte_scale
            if layout.sequence_parallel and layout.tp > 1:
                out /= layout.tp  # Megatron scatter/gather: send one tp shard, all-gather on arrival
            p2p.append(C.p2p_time(out, same_node or pp == 1, cluster))
        else:
            p2p.append(0.0)
    # torch.distributed.pipelining's host time per schedule action (measured by calibrate):
    # on a CPU it adds to the stage's work; a GPU runs the stage while the host issues it
    action_s = device.measured.pipeline_action_s if pp > 1 and device.measured is not None else 0.0
    for i in range(n_stages):
        cs = costs[bounds[i]:bounds[i + 1]]
        f_s = sum(c.fwd_s + c.tp_comm_fwd_s + c.dp_fwd_exposed_s for c in cs)
        b_s = sum(c.bwd_s + c.recompute_s + (c.tp_comm_s - c.tp_comm_fwd_s) + c.dp_bwd_exposed_s for c in cs)
        if action_s:
            f_s, b_s = ((f_s + action_s, b_s + action_s) if device.vendor == "cpu"
                        else (max(f_s, action_s), max(b_s, action_s)))
        fwd.append(f_s)
        bwd.append(b_s)
        act.append(sum(c.activation_bytes for c in cs))

    sim = simulate_cached(layout.schedule if pp > 1 else "1f1b", pp, m, fwd, bwd, p2p, virtual_stages=v,
                          activation_bytes=act, blocking_p2p=layout.p2p_blocking)

    # Per pp rank: the end-of-step data-parallel exposure and the optimizer step.
    ranks = [[j for j in range(n) if stage_of[j] % pp == r] for r in range(pp)]
    rank_total, rank_opt, memory, peaks = [], [], [], []
    capacity = device.usable_memory_bytes
    host_per_gpu = 0.0
    tp_place = C.group_placement("tp", layout.tp, layout.dp, layout.pp, cluster)
    root_held = model.tied_layers()
    for r in range(pp):
        idx = ranks[r]
        step_exp = sum(costs[j].dp_step_exposed_s for j in idx)
        opt = sum(costs[j].optimizer_s for j in idx)
        if device.measured is not None and idx:  # the optimizer's fixed cost per step (measured)
            opt += device.measured.optimizer_step_constant(layout.optimizer)
        rank_opt.append(opt)
        rank_total.append(sim.finish_s[r] + step_exp + opt)
        params = sum(costs[j].param_bytes for j in idx)
        grads = sum(costs[j].grad_bytes for j in idx)
        optim = sum(costs[j].optimizer_bytes for j in idx)
        # A tied output layer on another rank than its embedding keeps its own copy (Megatron).
        for j in idx:
            tied = layers[j].attrs.get("tied_param_count", 0) if layers[j].shared_params else 0
            if tied and not any(layers[k].kind == "embedding" for k in idx):
                extra = model_state_bytes(tied / _tp_for(layers[j], layout.tp), precision=layout.precision,
                                          optimizer=layout.optimizer, zero=zeros[j], dp=layout.dp, offload=offs[j])
                params, grads, optim = params + extra.params, grads + extra.grads, optim + extra.optimizer
        activations = sim.peak_activation_bytes[r] + max((costs[j].working_bytes for j in idx), default=0.0)
        # Buffers: FSDP holds the unsharded params of the layer it runs and the one it
        # prefetches plus one layer's unsharded grads; DDP its buckets; TP its output.
        z3 = [j for j in idx if zeros[j] >= 3]
        p_b, g_b, _ = state_bytes_per_param(layout.precision, layout.optimizer)
        fsdp_buf = fsdp_fwd_buf = 0.0
        if z3 and layout.dp > 1:
            # FSDP2 holds the unsharded parameters of the unit it runs and of the one it
            # prefetches (its neighbour in execution order), and in backward the running
            # unit's unsharded gradients: the largest such neighbouring pair of the rank
            # (a 128k-vocabulary head beside a block, not the head twice)
            units = [costs[j].params_local if zeros[j] >= 3 else 0.0 for j in sorted(idx)]
            pairs = list(zip(units, units[1:])) or [(units[0], 0.0)]
            fsdp_buf = max((a + c) * p_b + max(a, c) * g_b for a, c in pairs)
            fsdp_fwd_buf = max((a + c) * p_b for a, c in pairs)
        ddp_buf = sum(costs[j].bucket_bytes for j in idx)
        tp_buf = (max((fast(layers[j].output_bytes)(b, s1) for j in idx), default=0.0) * byte_scale
                  if layout.tp > 1 else 0.0)
        if m == 1:
            # One micro-batch: the activations peak at the end of the forward, before any
            # gradient exists, and shrink as the backward produces the gradients: the two
            # never peak together, the larger counts. FSDP holds the running and the
            # prefetched unit's unsharded parameters in forward; its unit gradients and
            # reduce-scatter buffers belong to the backward's moments (below).
            if z3 and layout.dp > 1:
                fsdp_buf = fsdp_fwd_buf
            grads_fb, act_fb = (0.0, activations) if activations >= grads else (grads, 0.0)
        else:
            grads_fb, act_fb = grads, activations
        frag = FRAGMENTATION * (act_fb + grads_fb)
        buffers = fsdp_buf + ddp_buf + tp_buf + frag
        total = params + grads_fb + optim + act_fb + buffers
        # The optimizer step is a second peak: activations are gone, the gradients are
        # all alive, and foreach Adam holds a temporary of every state element at once.
        opt_temp = sum(costs[j].optimizer_temp_bytes for j in idx)
        # The first backward op of the loss is a third: every saved activation is alive,
        # plus two logits-sized gradients (the loss's gradient output and its log-softmax
        # gradient input, in the dtype the loss computes in), and with one micro-batch no
        # gradient exists yet. No recompute working set, no gradient buffers then.
        loss_grads = sum(costs[j].loss_grad_bytes for j in idx)
        grads_then = grads if m > 1 else 0.0
        act_then = sim.peak_activation_bytes[r] + loss_grads
        # ZeRO-3 units were resharded after their forward and are gathered again only
        # by their own backward hooks, after the loss's: no FSDP buffer at that moment
        at_loss = (params + grads_then + optim + act_then + tp_buf + ddp_buf
                   + FRAGMENTATION * (act_then + grads_then)) if loss_grads else 0.0
        at_step = params + grads + optim + ddp_buf + opt_temp
        # FSDP's backward, one micro-batch (m = 1), unit by unit from the last: while unit u
        # computes, its unsharded parameters and gradient are alive beside the parameters
        # FSDP2 prefetched for the next unit; then it reshards its parameters and copies its
        # gradient into a reduce-scatter input in the reduce dtype, with the output shard
        # beside it. The units before u still hold their activations, the units after it
        # already hold their gradient shards, and ZeRO-2 units not yet reached keep their
        # unsharded parameters. FSDPMemTracker puts the peak of short-sequence LLM steps at
        # the LM head's reduce-scatter: 2 + 4 + 4/dp bytes per head parameter on top of
        # every block's activations.
        at_rs, rs_parts = 0.0, None
        order = sorted(idx)
        units = [j for j in order if zeros[j] >= 2 and costs[j].params_local > 0 and offs[j] == "none"]
        if m == 1 and layout.dp > 1 and units and layout.pp == 1:
            lp = 4 if layout.precision == "fp32" else 2
            red = 4 if (layout.main_grads != "same" or layout.precision == "fp32") else lp
            # Layers holding an end of a tied weight run in FSDP2's root unit (the lowering
            # keeps one parameter in one unit): never resharded, and their gradients stay
            # unsharded from the first of them the backward reaches (the head, which makes
            # the tied embedding's gradient) to the root's reduce-scatter after the last
            root = set(j for j in units if root_held[j])
            tied_grad = {j: layers[j].attrs.get("tied_param_count", 0) / _tp_for(layers[j], layout.tp) * lp
                         for j in root if layers[j].shared_params}
            own = [j for j in units if j not in root]

            def rs_buffers(n: float) -> float:  # a reduce-scatter's input and output shard
                return n * red * (1 + 1 / layout.dp)

            def moment(t: float, parts: tuple) -> None:
                nonlocal at_rs, rs_parts
                if t > at_rs:
                    at_rs, rs_parts = t, parts

            for u in units:
                pu = costs[u].params_local
                before = [j for j in order if j < u]
                params_u = sum(costs[j].param_bytes for j in order
                               if not (zeros[j] == 2 and j >= u and j not in root))  # ZeRO-2 units from u on: resharded
                grads_u = sum(costs[j].grad_bytes for j in order if j > u and j not in root)
                held_u = sum(costs[j].params_local * lp for j in root if j > u) \
                    + (sum(g for h, g in tied_grad.items() if h > u) if u not in root else 0.0)
                act_u = sum(costs[j].activation_bytes for j in before)
                nxt = max((j for j in units if j < u), default=None)
                prefetch = costs[nxt].params_local * p_b if nxt is not None and zeros[nxt] >= 3 \
                    and u != units[-1] else 0.0
                # the reduce-scatter of the unit before it in backward is still in flight: FSDP2
                # keeps one reduce-scatter's input alive until it issues the next
                prev = min((j for j in own if j > u), default=None)
                in_flight = rs_buffers(costs[prev].params_local) if prev is not None else 0.0
                # its gradients appear as its activations are consumed: the larger of the two,
                # beside the gradient of its output it reads throughout (logits-sized at a head:
                # its weight gradient is made while that is alive)
                out_grad = costs[u].loss_grad_bytes / 2 if costs[u].loss_grad_bytes \
                    else fast(layers[u].output_bytes)(b, s1) * byte_scale
                # A unit grouping several modules (a head's norm and output Linear, as the
                # lowering shards them) keeps its all-gather buffer through its backward
                # beside the unsharded parameters: FSDPMemTracker, torch 2.13 (a one-module
                # unit frees it once the parameters are copied out). A layer left to the root
                # unit (tied weights) is not sharded as a group of its own.
                grouped = pu * p_b if u not in root and layers[u].attrs.get("param_modules", 1) > 1 else 0.0
                computing = (pu * p_b if zeros[u] >= 3 else 0.0) + grouped + in_flight + out_grad \
                    + _backward_peak(layers[u], costs[u].activation_bytes + costs[u].working_bytes, pu * lp)
                reducing = 0.0 if u in root else pu * lp + rs_buffers(pu) + grouped
                unit_bufs = prefetch + max(computing, reducing) + held_u
                frag_u = FRAGMENTATION * (act_u + grads_u)
                moment(params_u + optim + grads_u + act_u + unit_bufs + tp_buf + ddp_buf + frag_u,
                       (params_u, grads_u, act_u, unit_bufs + tp_buf + ddp_buf + frag_u, frag_u))
            if root:
                # the root's reduce-scatter, after the whole backward: every other unit's
                # gradient is a shard, the root's are unsharded beside their reduce buffers
                grads_r = sum(costs[j].grad_bytes for j in order if j not in root)
                last = min(own, default=None)
                in_flight = rs_buffers(costs[last].params_local) if last is not None else 0.0
                held = sum(costs[j].params_local for j in root)
                bufs = held * lp + rs_buffers(held) + in_flight
                frag_r = FRAGMENTATION * grads_r
                moment(params + optim + grads_r + bufs + tp_buf + ddp_buf + frag_r,
                       (params, grads_r, 0.0, bufs + tp_buf + ddp_buf + frag_r, frag_r))
        if at_rs > max(total, at_loss, at_step):
            params, grads, activations, buffers, frag = rs_parts
            total = at_rs
        elif total >= max(at_loss, at_step):
            grads, activations = grads_fb, act_fb  # the breakdown describes the forward/backward moment
        elif at_loss > total and at_loss >= at_step:
            # the breakdown describes that moment (the loss's gradients under activations)
            grads, activations = grads_then, act_then
            frag = FRAGMENTATION * (act_then + grads_then)
            buffers = tp_buf + ddp_buf + frag
            total = at_loss
        elif at_step > total:
            # the breakdown describes the step's peak: no activations then
            activations, buffers, frag = 0.0, ddp_buf + opt_temp, 0.0
            total = at_step
        host = sum(costs[j].host_bytes for j in idx)
        host_per_gpu = max(host_per_gpu, host)
        peaks.append(total)
        # fragmentation: allocator blocks reserved but not allocated (in buffers; what
        # torch.cuda.max_memory_allocated does not count)
        memory.append({"params": params, "grads": grads, "optimizer": optim, "activations": activations,
                       "buffers": buffers, "fragmentation": frag, "capacity": capacity,
                       "reserve": device.reserve_bytes, "host": host})
    crit = max(range(pp), key=lambda r: rank_total[r])
    step = rank_total[crit]
    idx = ranks[crit]
    p2p_rank = sum(p2p[i] for i in range(n_stages) if i % pp == crit) + sum(
        p2p[i - 1] for i in range(1, n_stages) if i % pp == crit)
    # The simulation's idle time (finish - busy) holds both waiting for transfers and the
    # bubble proper: report the transfers as pipeline communication, what is left as bubble,
    # so the parts of the breakdown add up to the step.
    pp_exposed = min(m * p2p_rank, sim.bubble_s[crit])
    # The slowest GPU of the job paces every synchronous step (stragglers.py): the
    # compute-paced part of the step (compute, recompute, bubble, optimizer) stretches;
    # communication time does not depend on SM clocks.
    comm_exposed = (m * sum(costs[j].tp_comm_s for j in idx) + pp_exposed
                    + sum(costs[j].dp_comm_exposed_s for j in idx))
    straggler_s = max(0.0, step - comm_exposed) * (
        slowest_gpu_slowdown(layout.world_size, device.clock_spread) - 1.0)
    step += straggler_s

    gbs = layout.global_batch_size
    tokens = gbs * (model.tokens_per_sample or s1)
    # FLOPs of one micro-batch through every layer, times the micro-batches of a step
    # Model FLOPs, the MFU convention (PaLM, Megatron, torchtitan): 3 x forward, attention
    # unmasked, no recomputation, whatever the workload counts for its backward.
    mb_flops = 3 * sum(fast(layer.fwd_flops)(b, s1) for layer in layers)
    mb_recompute = sum(fast(layer.fwd_flops)(b, s1) if c == "full" else
                       fast(layer.selective_recompute_flops)(b, s1) if c == "selective" else 0.0
                       for layer, c in zip(layers, ckpts))
    model_flops = mb_flops * m * layout.dp
    hw_flops = (mb_flops + mb_recompute) * m * layout.dp
    world = layout.world_size

    why = ""
    over = [r for r in range(pp) if peaks[r] > capacity]
    if over:
        r = over[0]
        why = (f"pp rank {r} needs {peaks[r] / 2**30:.1f} GiB of {capacity / 2**30:.1f} GiB usable "
               f"(activations {memory[r]['activations'] / 2**30:.1f}, model states "
               f"{(memory[r]['params'] + memory[r]['grads'] + memory[r]['optimizer']) / 2**30:.1f})")
    host_need = host_per_gpu * cluster.gpus_per_node
    if host_need > cluster.host_memory_bytes:
        why = why or (f"offload needs {host_need / 2**30:.0f} GiB of host memory per node, "
                      f"the node has {cluster.host_memory_bytes / 2**30:.0f} GiB")

    dp_place = C.group_placement("dp", layout.tp, layout.dp, layout.pp, cluster)
    time_breakdown = {
        "compute_s": m * sum(costs[j].fwd_s + costs[j].bwd_s for j in idx),
        "recompute_s": m * sum(costs[j].recompute_s for j in idx),
        "tp_comm_s": m * sum(costs[j].tp_comm_s for j in idx),
        "pp_comm_s": pp_exposed,
        "dp_comm_s": sum(costs[j].dp_comm_s for j in idx),
        "dp_comm_exposed_s": sum(costs[j].dp_comm_exposed_s for j in idx),
        # part of dp_comm_exposed_s: compute slowed by the SMs hidden DP collectives hold
        "nccl_contention_s": sum(costs[j].nccl_contention_s for j in idx),
        "bubble_s": sim.bubble_s[crit] - pp_exposed,
        "optimizer_s": rank_opt[crit],
        "straggler_s": straggler_s,
        "step_time_s": step,
        "critical_pp_rank": crit,
    }
    comm = []
    if layout.tp > 1:
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
        by_kind: dict = {}
        for j in idx:
            for kind, nbytes, t in costs[j].dp_collectives:
                e = by_kind.setdefault(kind, [0.0, 0.0])
                e[0] += nbytes
                e[1] += t
        total_t = sum(t for _, t in by_kind.values()) or 1.0
        exposed = time_breakdown["dp_comm_exposed_s"]
        for kind, (nbytes, t) in sorted(by_kind.items()):
            comm.append({"axis": "dp", "collective": kind, "bytes": nbytes, "time_s": t,
                         "exposed_s": exposed * t / total_t, "tier": dp_place.tier})
    if pp > 1:
        nbytes = 2 * m * sum(fast(layers[bounds[i + 1] - 1].output_bytes)(b, s1) * byte_scale
                             for i in range(n_stages - 1) if i % pp == crit)
        comm.append({"axis": "pp", "collective": "p2p", "bytes": nbytes, "time_s": m * p2p_rank,
                     "exposed_s": pp_exposed, "tier": "intra_node" if same_node else pp_place.tier})

    per_stage = []
    for i in range(n_stages):
        cs = costs[bounds[i]:bounds[i + 1]]
        per_stage.append({
            "index": i, "pp_rank": i % pp, "layers": [layers[j].name for j in range(bounds[i], bounds[i + 1])],
            "fwd_s": sum(c.fwd_s for c in cs), "bwd_s": sum(c.bwd_s for c in cs),
            "recompute_s": sum(c.recompute_s for c in cs), "tp_comm_s": sum(c.tp_comm_s for c in cs),
            "p2p_s": p2p[i], "sim_fwd_s": fwd[i], "sim_bwd_s": bwd[i],
            "memory_bytes": peaks[i % pp], "activation_bytes_per_micro_batch": act[i],
        })
    return Estimate(
        step_time_s=step,
        tokens_per_s=tokens / step,
        tflops_per_gpu=model_flops / step / world / 1e12,
        mfu=model_flops / (step * world * peak),
        peak_memory_bytes=peaks,
        memory_breakdown=memory,
        time_breakdown=time_breakdown,
        comm=comm,
        fits=not why,
        per_stage=per_stage,
        hardware_tflops_per_gpu=hw_flops / step / world / 1e12,
        model_flops_per_step=model_flops,
        global_batch_size=gbs,
        peak_in_flight=list(sim.peak_in_flight),
        why_not_fit=why,
        assumptions={"device": cluster.device, "peak_flops": peak, "precision": layout.precision,
                     "grad_reduce_overlap": C.GRAD_REDUCE_OVERLAP, "fsdp_prefetch_overlap": C.FSDP_PREFETCH_OVERLAP,
                     "tp_overlap": C.TP_OVERLAP, "fragmentation": FRAGMENTATION,
                     "sustained_clock_fraction": device.sustained_clock_fraction,
                     "clock_spread": device.clock_spread, "main_grads": layout.main_grads},
    )
