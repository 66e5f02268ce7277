"""Per-layer compute: the seconds one layer's forward, backward, recomputation
and optimizer step take on one GPU, per micro-batch (the optimizer per step).

Each op is priced by cost_models/compute.py (a roofline with the GEMM's own
efficiency, or the measured tables); this adds them up per layer, with the
host time that dispatches them, what the plan's fused kernels save, the
memory-bound passes gradient accumulation adds, and what checkpointing
redoes. Communication is cost_models/layer_comm.py's; what of it hides
behind this compute is cost_models/overlap.py's.
"""
from __future__ import annotations

import sympy

from cost_models.compute import fast, host_times, op_times
from cost_models.fingerprint import layer_fingerprint
from cost_models.float8 import converts, linear_times
from cost_models.memory import fp32_main_grads, state_bytes_per_param
from cost_models.workload import S, LayerSpec, OpSpec


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


def tp_for(layer: LayerSpec, tp: int) -> int:
    """A layer that cannot be split tp ways runs replicated on every tp rank."""
    return tp if tp in tuple(layer.tp_degrees or (1,)) else 1


def _op_parts(layer: LayerSpec, batch: int, seq, device, dtype: str, tp: int, sp: bool, byte_scale: float,
              float8: bool = False):
    """The layer's ops summed: forward and backward seconds, and the shares that
    checkpointing and fusion read (attention core, GEMMs, cheap ops, memory-bound bytes).
    `float8`: its nn.Linear GEMMs run in float8 (cost_models/float8.py)."""
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
        split = tp if op.tp_sharded else 1
        if float8 and converts(op, batch, seq, split):
            f, b = linear_times(op, batch, seq, device, hp=dtype, work_divisor=divisor, byte_scale=byte_scale,
                                gemm_split=split)
        else:
            f, b = op_times(op, batch, seq, device, dtype=dtype, work_divisor=divisor, byte_scale=byte_scale,
                            gemm_split=split)
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
    _add_host_time(layer, parts, batch, seq, device, tp, byte_scale)
    return parts


def _add_host_time(layer: LayerSpec, parts: dict, batch: int, seq, device, tp: int, byte_scale: float) -> None:
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


def fused_savings_s(layer: LayerSpec, parts: dict, batch: int, seq: int) -> tuple[float, float]:
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


def layer_times(layer: LayerSpec, layout, device, seq, zero: int, tp: int, sp: bool,
                byte_scale: float, float8: bool = False) -> tuple[float, float, dict]:
    """(forward s, backward s, parts) of one micro-batch through `layer` on one GPU:
    its ops less what fused kernels save, plus the gradient passes accumulation adds."""
    b, s1, m = layout.micro_batch_size, seq or 1, layout.num_micro_batches
    parts = _op_parts(layer, b, seq, device, layout.precision, tp, sp, byte_scale, float8)
    if layer.ops:
        save_fwd, save_bwd = fused_savings_s(layer, parts, b, s1)
        parts["fwd"] -= save_fwd
        parts["bwd"] -= save_bwd
        parts["cheap_fwd"] = max(0.0, parts["cheap_fwd"] - save_fwd)
    fwd_s, bwd_s = parts["fwd"], parts["bwd"]
    hbm = device.memory_bandwidth * device.memory_efficiency
    fp32_main = fp32_main_grads(layout)
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
    return fwd_s, bwd_s, parts


def recompute(layer: LayerSpec, checkpoint: str, fwd_s: float, tp_fwd_s: float, parts: dict, b: int, s1: int,
              tp: int) -> tuple[float, float]:
    """(seconds, FLOPs) per micro-batch that checkpointing redoes in backward."""
    if checkpoint == "full":
        return fwd_s + tp_fwd_s, fast(layer.fwd_flops)(b, s1) / tp
    if checkpoint != "selective":
        return 0.0, 0.0
    recompute_flops = fast(layer.selective_recompute_flops)(b, s1) / tp
    if parts["core_flops"] > 0:
        # Korthikanti: the attention core (the ops that grow with s^2) is redone
        recompute_s = parts["core_fwd"] * min(1.0, recompute_flops / parts["core_flops"])
    elif fast(layer.activation_bytes_selective)(b, s1) > 0:
        # op-level policy: the cheap ops are redone, plus any matmuls it chose to drop
        recompute_s = parts["cheap_fwd"] + parts["gemm_fwd"] * min(1.0, recompute_flops / max(parts["gemm_flops"], 1.0))
    else:
        recompute_s = 0.0
    return recompute_s, recompute_flops


# Bytes per parameter one step of torch's foreach optimizer moves (torch/optim/adam.py
# `_multi_tensor_adam`, weight decay decoupled, not capturable; fp32 states): param *=
# (1 - lr wd) 8, exp_avg.lerp_(grad) 12, exp_avg_sq *= beta2 8, exp_avg_sq.addcmul_(grad,
# grad) 12, sqrt(exp_avg_sq) into a temporary 8, /= bias correction 8, += eps 8,
# param.addcdiv_(exp_avg, temporary) 16: 80. SGD with momentum (`_multi_tensor_sgd`):
# buf *= momentum, buf += grad 12 + 8, param += -lr buf 12: 32.
FOREACH_STEP_BYTES = {"adam": 80.0, "sgd": 32.0}


def optimizer_step_s(layer: LayerSpec, layout, cluster, zero: int, offload: str, tp: int, opt_params: float,
                     state_bytes: tuple) -> float:
    """Seconds per step of the optimizer over this layer's `opt_params` local elements: torch's
    own optimizer as timed on the device, its memory passes, or on the CPU with offload.
    `state_bytes`: (param, gradient, optimizer state) bytes per parameter as held."""
    device = cluster.device_profile
    p_bytes, g_bytes, k_bytes = state_bytes
    touched = 2 * p_bytes + g_bytes + 2 * k_bytes  # read+write param, read grad, read+write states
    measured_opt = None
    if device.measured is not None and offload == "none":
        # torch's own optimizer timed on this device, per element and per tensor; sharded
        # (FSDP2) and tp-split parameters are DTensors
        measured_opt = device.measured.optimizer_time(
            layout.optimizer, opt_params, layer.attrs.get("param_tensors", 1 if layer.params else 0),
            dtensor=zero >= 1 or tp > 1)
    if measured_opt is not None:
        return measured_opt
    if offload == "none":
        if layout.optimizer_impl == "foreach":
            # torch's multi-tensor optimizer: one kernel per arithmetic step, each a pass
            # over fp32 tensors (FOREACH_STEP_BYTES counts them from torch's source)
            touched = FOREACH_STEP_BYTES[layout.optimizer]
        return opt_params * touched / (device.memory_bandwidth * device.memory_efficiency)
    host_bw = cluster.host_memory_bandwidth / cluster.gpus_per_node
    transfer = opt_params * (g_bytes + p_bytes) / cluster.host_link_profile.bus_bandwidth  # grads down, params up
    return opt_params * (touched + 2 * p_bytes) / host_bw + transfer
