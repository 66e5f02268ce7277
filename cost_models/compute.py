"""Compute time of one op: a roofline with a size-dependent GEMM efficiency.

time = max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x sustained
fraction)), floored by one kernel launch per kernel. Efficiency is not a
fitted constant; it is the product of three physical losses below the
device's best measured GEMM rate (`gemm_max_efficiency`, the MAMF figure):

- tile quantisation: the GEMM is cut into output tiles (cuBLAS/CUTLASS pick
  from a few sizes, e.g. 256x128, 128x128, 128x64, 64x64); the last row and
  column of tiles are partly empty but cost a full tile;
- wave quantisation: tiles run in waves of one tile per SM; a last, partial
  wave leaves SMs idle (108 SMs on A100, 132 on H100);
- short reductions: each tile pays a prologue (first loads) and an epilogue
  (write-back) worth about K0 = 64 elements of its main loop, so
  efficiency scales as K / (K + K0).

Smaller tiles waste less in quantisation but re-read operands more often
(lower arithmetic intensity per byte of shared memory), which caps them
below the big tile's rate; the best candidate tile wins, as cuBLAS's
heuristic does. FlashAttention's efficiency comes from the profile (its
published rates), on the FLOPs it actually executes.
"""
from __future__ import annotations

import math
from functools import lru_cache

from cost_models.errors import CostModelError
from cost_models.devices import DeviceProfile
from cost_models.workload import OpSpec
from cost_models.workload import fast as _lambdified

_FN_CACHE: dict = {}


def fast(expr):
    """workload.fast, memoised on the expression object itself: printing a sympy
    expression to find its cached lambda costs more than the lambda."""
    try:
        return _FN_CACHE[expr]
    except KeyError:
        fn = _lambdified(expr)
        if len(_FN_CACHE) > 100_000:
            _FN_CACHE.clear()
        _FN_CACHE[expr] = fn
        return fn
    except TypeError:  # unhashable: no memo
        return _lambdified(expr)

# (tile_m, tile_n, relative throughput of that tile shape when it is full).
# A 256x128 tile reaches the device's MAMF rate; halving a tile side halves
# its operand reuse, which costs a few percent per halving on Ampere/Hopper
# (CUTLASS profiler tables).
TILES = ((256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.93), (128, 64, 0.82), (64, 64, 0.65))
K_OVERHEAD = 64  # prologue + epilogue per tile, in reduction elements

# FlashAttention's backward recomputes the score matrix QK^T: 5 GEMM-sized
# products, 2.5x the forward's 2. (FlopCounterMode's SDPA backward formula
# counts the same 5; Megatron's model-FLOPs convention counts 4.) Priced from
# the forward FLOPs so either convention in the workload gives the same time.
FLASH_BWD_FACTOR = 2.5
# Fused attention kernels of other generations, as a fraction of FlashAttention-2's
# (forward, backward) speed, which the device profile's attention efficiencies are.
# Dao, "FlashAttention-2" (arXiv 2307.08691), section 4.1, A100: FlashAttention-2 is
# "around 2x faster than FlashAttention" (v1, CUDA) and "around 1.3-1.5x faster than
# FlashAttention in Triton in the forward pass and around 2x faster in the backward
# pass" (the 2022 Triton kernel MPT's attn_impl='triton' runs; the midpoint 1.4 is
# used). The same ratios are assumed on Hopper, where neither older kernel was tuned.
ATTENTION_IMPL_SPEED = {None: (1.0, 1.0), "flash2": (1.0, 1.0), "flash1": (0.5, 0.5),
                        "flash-triton": (1 / 1.4, 0.5)}


def attention_speed(op: OpSpec) -> tuple[float, float]:
    """(forward, backward) speed of `op`'s attention kernel relative to FlashAttention-2."""
    impl = getattr(op, "impl", None)
    if impl not in ATTENTION_IMPL_SPEED:
        raise CostModelError(f"attention op '{op.name}': unknown kernel implementation {impl!r} "
                             f"(known: {', '.join(sorted(k for k in ATTENTION_IMPL_SPEED if k))})")
    return ATTENTION_IMPL_SPEED[impl]


# Causal masking: a FlashAttention kernel skips the tiles above the diagonal, so it
# executes about half of the unmasked FLOPs the workload counts; but it computes the
# tiles on the diagonal whole. With n = s / 128 query tiles (the 128-row tile of
# FlashAttention-2's forward and of the 2022 Triton kernel; the backward's 128-column
# kv tile gives the same count) it runs n (n + 1) / 2 of n^2 tiles: 0.625 of the
# unmasked work at s = 512, 0.53 at 2048, 0.5 in the limit.
CAUSAL_FRACTION = 0.5
CAUSAL_TILE = 128


def causal_fraction(seq: int) -> float:
    """Fraction of the unmasked attention FLOPs a tiled causal kernel executes at `seq`."""
    n = max(1, math.ceil(seq / CAUSAL_TILE))
    return CAUSAL_FRACTION * (1 + 1 / n)


@lru_cache(maxsize=200_000)
def gemm_efficiency(m: int, n: int, k: int, num_sms: int, max_efficiency: float) -> float:
    """Fraction of dense peak one (m x k) @ (k x n) GEMM sustains."""
    m, n, k = max(1, int(m)), max(1, int(n)), max(1, int(k))
    best = 0.0
    for tm, tn, tile_rate in TILES:
        tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
        tiles = tiles_m * tiles_n
        tile_eff = (m * n) / (tiles_m * tm * tiles_n * tn)
        waves = math.ceil(tiles / num_sms)
        wave_eff = tiles / (waves * num_sms)
        best = max(best, tile_rate * tile_eff * wave_eff)
    return max_efficiency * best * (k / (k + K_OVERHEAD))


def _peak(device: DeviceProfile, dtype: str) -> float:
    # Tensor-core rate at the clock the GPU sustains under a long dense load.
    return device.peak(dtype) * device.sustained_clock_fraction


def op_times(op: OpSpec, batch: int, seq: int | None, device: DeviceProfile, *, dtype: str = "bf16",
             work_divisor: float = 1.0, byte_scale: float = 1.0, gemm_split: int = 1) -> tuple[float, float]:
    """(forward_s, backward_s) of `op` for one micro-batch on one device.

    work_divisor: how many devices share the op's work (tp, when tensor or
    sequence parallelism divides it). byte_scale: bytes at the training dtype
    relative to the captured dtype. gemm_split: tp degree applied to the
    GEMM's shape (for tile/wave quantisation of the local shard).
    """
    s = seq if seq is not None else 1
    fwd_flops = fast(op.fwd_flops)(batch, s) / work_divisor
    bwd_flops = fast(op.bwd_flops)(batch, s) / work_divisor
    fwd_bytes = fast(op.fwd_bytes)(batch, s) * byte_scale / work_divisor
    bwd_bytes = fast(op.bwd_bytes)(batch, s) * byte_scale / work_divisor
    if device.measured is not None:
        return _measured_op_times(op, batch, s, device, dtype, fwd_flops, fwd_bytes, bwd_bytes, gemm_split)
    peak = _peak(device, dtype)
    mem_bw = device.memory_bandwidth * device.memory_efficiency
    launch = device.kernel_launch_s * max(1, op.count)

    if op.kind == "gemm" and op.gemm is not None:
        m, n, k, nb = gemm_dims(op, batch, s, gemm_split)
        eff = lambda a, b, c: gemm_efficiency(round(a), round(b), round(c), device.num_sms, device.gemm_max_efficiency)
        # C = A @ B (m x k @ k x n). backward = dA = dC @ B^T (m x k, reduce over n)
        # + dB = A^T @ dC (k x n, reduce over m); independent matrices of a batch tile side by side.
        fwd_t = fwd_flops / (peak * eff(nb * m, n, k))
        bwd_t = 0.5 * bwd_flops / (peak * eff(nb * m, k, n)) + 0.5 * bwd_flops / (peak * eff(nb * k, n, m))
        if not _aligned(n, k, dtype):
            fwd_t, bwd_t = fwd_t * device.unaligned_gemm_slowdown, bwd_t * device.unaligned_gemm_slowdown
        return max(fwd_t, fwd_bytes / mem_bw, launch), max(bwd_t, bwd_bytes / mem_bw, 2 * launch)
    if op.kind == "attention":
        causal = causal_fraction(s) if getattr(op, "causal", None) in (None, True) else 1.0
        speed_f, speed_b = attention_speed(op)
        fwd_t = fwd_flops * causal / (peak * device.attention_fwd_efficiency * speed_f)
        bwd_t = fwd_flops * FLASH_BWD_FACTOR * causal / (peak * device.attention_bwd_efficiency * speed_b)
        return max(fwd_t, fwd_bytes / mem_bw, launch), max(bwd_t, bwd_bytes / mem_bw, launch)
    # Memory-bound ops: bytes decide; FLOPs run on the vector units (fp32 peak).
    vector_peak = device.peak_flops.get("fp32", peak / 16)
    fwd_t = max(fwd_bytes / mem_bw, fwd_flops / vector_peak)
    bwd_t = max(bwd_bytes / mem_bw, bwd_flops / vector_peak)
    return max(fwd_t, launch), max(bwd_t, launch)


ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def _aligned(n: float, k: float, dtype: str) -> bool:
    """Whether a GEMM's rows (n and k elements) are multiples of 16 bytes, as the fast
    tensor-core kernels need (a vocabulary of 50257, or a head split unevenly, is not)."""
    per = 16 // ITEMSIZE.get(dtype, 2)
    return all(abs(x - round(x)) > 1e-9 or round(x) % per == 0 for x in (n, k))
# op kinds of the workload -> the op class whose measured bandwidth prices them
_BYTES_CLASS = {"norm": "norm", "softmax": "softmax", "embedding": "embedding"}


def splits_columns(op: OpSpec, n: float, k: float) -> bool:
    """Whether tp splits this GEMM's n (column-parallel) rather than its k (row): as the
    capture's dataflow found it, or (a hand-written model) guessed from the shape."""
    return op.tp_split == "column" or (not op.tp_split and n > k)


def gemm_dims(op: OpSpec, batch: int, s: int, gemm_split: int) -> tuple:
    """(m, n, k, batch of matrices) of the local shard of a GEMM op: tp degree
    `gemm_split` shards the matrices (heads), or n (column-parallel), or k (row)."""
    dims = [fast(x)(batch, s) for x in op.gemm]
    m, n, k = dims[:3]
    nb = dims[3] if len(dims) > 3 else 1.0  # optional 4th entry: batch of a batched matmul
    if gemm_split > 1:
        if len(dims) > 3:  # heads are split: fewer matrices per rank
            nb = nb / gemm_split
        elif splits_columns(op, n, k):  # column-parallel shards n
            n = n / gemm_split
        else:  # row-parallel shards k
            k = k / gemm_split
    return m, n, k, nb


def _measured_op_times(op: OpSpec, batch: int, s: int, device: DeviceProfile, dtype: str, fwd_flops: float,
                       fwd_bytes: float, bwd_bytes: float, gemm_split: int) -> tuple[float, float]:
    """op_times from a calibrated profile: the work alone (the rate the profile
    measured for this kind of op at this size); `op.count` identical calls each do
    1/count of the op's work. Host time is charged per layer (`host_times`)."""
    meas = device.measured
    calls = max(1, op.count)
    fwd = bwd = None
    if op.kind == "gemm" and op.gemm is not None:
        m, n, k, nb = gemm_dims(op, batch, s, gemm_split)
        one = meas.gemm_time(nb * m, n, k, dtype)
        if one is not None and m * n * k > 0:
            # as many calls of this shape as the counted FLOPs hold (op.count, or fewer under tp)
            share = fwd_flops / (2 * nb * m * n * k) if fwd_flops > 0 else calls
            # dA = dC B^T (m x n @ n x k), dB = A^T dC (k x m @ m x n)
            fwd = share * one
            bwd = share * (meas.gemm_time(nb * m, k, n, dtype) + meas.gemm_time(nb * k, n, m, dtype))
            if not _aligned(n, k, dtype):  # every pass of this GEMM has the short row in it
                slow = meas.unaligned_gemm_slowdown(2 * nb * m * n * k, dtype)
                fwd, bwd = fwd * slow, bwd * slow
            if op.name.endswith("addmm"):
                # the bias: broadcast into the output before the GEMM accumulates onto it
                # (write, then read again), and summed over the rows in backward
                out_bytes = share * nb * m * n * ITEMSIZE.get(dtype, 2)
                fwd += meas.bytes_time("copy", 2 * out_bytes, "copy") or 0.0
                bwd += meas.bytes_time("elementwise", out_bytes, "add") or 0.0
    elif op.kind == "attention":
        causal = getattr(op, "causal", None) in (None, True)
        f1, b1 = (meas.attention_time(fwd_flops / calls, causal, d, dtype, seq=s) for d in ("fwd", "bwd"))
        if f1 is not None and b1 is not None:
            speed_f, speed_b = attention_speed(op)  # the profile timed today's SDPA kernel
            fwd, bwd = calls * f1 / speed_f, calls * b1 / speed_b
    if fwd is None or bwd is None:  # memory-bound ops, or work the profile did not time
        cls, name = _BYTES_CLASS.get(op.kind, "elementwise"), op.name.rpartition(":")[2]
        f1 = meas.bytes_time(cls, fwd_bytes / calls, name)
        b1 = meas.bytes_time(cls, bwd_bytes / calls, name, direction="bwd")
        if f1 is None or b1 is None:
            raise CostModelError(f"measured profile of '{device.name}' has no bandwidth table for {cls} ops")
        fwd, bwd = calls * f1, calls * b1
    return fwd, bwd


def host_times(layer, device: DeviceProfile, *, dtensor: bool, activation_bytes: float = 0.0) -> tuple[float, float]:
    """(forward, backward) host seconds of one micro-batch of `layer`: every op it
    dispatches (capture counts them, views included; for a layer without that
    count, its ops and twice as many backward) at the time per eager op with
    autograd, or per DTensor op when tensor parallelism runs the layer as DTensors.
    Those times come from the calibrated profile, else from the device's physics
    defaults (devices.yaml: measured on an H100 host; none for a CPU preset).
    DTensor's time per op is read at `activation_bytes` (what the layer's blocks
    carry per micro-batch) where the profile timed it by size: on a CPU it grows
    with the data (measured; see autopar.calibrate.measure_dtensor_overhead)."""
    meas = device.measured
    if meas is None and device.host_op_fwd_s <= 0:
        return 0.0, 0.0
    n_ops = sum(max(1, op.count) for op in layer.ops) or 1
    n_fwd = layer.attrs.get("host_ops_fwd", n_ops)
    n_bwd = layer.attrs.get("host_ops_bwd", 2 * n_ops)
    if meas is None:  # uncalibrated: eager dispatch (DTensor's extra is not in the physics defaults)
        return n_fwd * device.host_op_fwd_s, n_bwd * device.host_op_bwd_s
    if dtensor:
        per_fwd, per_bwd = meas.dtensor_op_s(activation_bytes)
        return n_fwd * per_fwd, n_bwd * per_bwd
    return n_fwd * meas.op_overhead_fwd_s, n_bwd * meas.op_overhead_bwd_s


def executed_flops(op: OpSpec, batch: int, seq: int | None) -> tuple[float, float]:
    """FLOPs the hardware runs (causal attention halved, flash bwd recompute added)."""
    s = seq if seq is not None else 1
    f, b = fast(op.fwd_flops)(batch, s), fast(op.bwd_flops)(batch, s)
    if op.kind == "attention":
        causal = causal_fraction(s) if getattr(op, "causal", None) in (None, True) else 1.0
        return f * causal, f * FLASH_BWD_FACTOR * causal
    return f, b
