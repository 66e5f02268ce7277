"""Measured profiles: what `autopar calibrate` timed on a machine, as tables
the cost model reads in place of the physics defaults.

A profile is a versioned JSON file (never pickled) with three parts:

- `device`: the fields of a device profile (devices.yaml) derived from the
  measurements: the largest GEMM's rate as the peak, the largest copy's rate
  as memory bandwidth, eager host time per op as the launch floor, and the
  share of a collective that hides under compute (`collective_overlap`);
- `compute`: tables, each a measurement of one kind of work, dispatch time
  taken out (the cost model charges host time per op a layer dispatches):
    gemm       FLOP/s on a grid of (m, n, k) per dtype (trilinear in log2)
    bandwidth  bytes/s of memory-bound ops by name and by class, by bytes
               per call (log-log); `NAME.bwd`: the op's backward kernels
    attention  FLOP/s of scaled_dot_product_attention, forward and backward,
               causal and full, by FLOPs per call (counted unmasked, as the
               workload counts them); with `seq` (the sequence length of
               each point), by sequence length: the rate of a kernel's tiles
               along the sequence, whatever the batch x heads it runs over
    op_overhead_*, dtensor_overhead_*  host time per dispatched op: eager
               forward with autograd, backward, forward without autograd;
               DTensor forward and backward
    dtensor_by_activation  DTensor's time per op (eager's own included) by the
               bytes of the activation the blocks carried: toy blocks on a
               one-rank mesh less the same plain blocks, per op
    optimizer  seconds per step, per parameter tensor and per element of
               torch's default AdamW / SGD, plain and on DTensor shards
    fsdp       FSDP2's seconds per all-gather and per reduce-scatter of a
               unit, collectives included, by unit bytes
    pipeline_action_s  host seconds torch.distributed.pipelining adds to
               each schedule action (a stage's forward or backward of one
               micro-batch), beyond the stage's work and its transfers
- `collectives`: seconds by (collective, group size, bytes), measured over
  torch.distributed on the backend the machine trains with.

Interpolation never invents a trend the table does not show: inside a table
it interpolates, beyond the largest size it extends the last measured
bandwidth (time grows with bytes or FLOPs at the largest size's rate), below
the smallest it keeps the smallest size's time as a floor (small work is
bound by fixed costs, not by its size). A group size that was not measured
is priced by the ring formula with the latency and bus bandwidth fitted to
the largest measured group (cost_models/comm.py's physics).

This module never imports autopar; `autopar calibrate` writes the files.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property

from cost_models.errors import ProfileError

SCHEMA = "autopar-profile/1"
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")


# -- one-dimensional tables ------------------------------------------------------
def _interp_log(xs: tuple, ys: tuple, x: float) -> float:
    """log-log linear interpolation of y(x) inside xs (sorted, positive), clamped at the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp((1 - w) * math.log(y0) + w * math.log(y1))


def time_for_size(sizes: tuple, rates: tuple, size: float) -> float:
    """Seconds for work of `size` (bytes or FLOPs) from rates measured at `sizes`:
    the interpolated rate inside the table; below it the smallest size's time
    (a floor); above it the largest size's rate."""
    if size <= 0:
        return 0.0
    if size <= sizes[0]:
        return sizes[0] / rates[0]
    return size / _interp_log(sizes, rates, size)


@dataclass(frozen=True)
class GemmGrid:
    """FLOP/s of (m x k) @ (k x n) at every point of ms x ns x ks (row-major m, n, k)."""

    ms: tuple
    ns: tuple
    ks: tuple
    rates: tuple  # len(ms) * len(ns) * len(ks)

    def rate(self, m: float, n: float, k: float) -> float:
        # Trilinear in log2 of each side, clamped to the grid; the clamp below the grid
        # is paid for in `time` (the smallest measured GEMM's time is a floor).
        def locate(axis, x):
            x = min(max(x, axis[0]), axis[-1])
            i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2) if len(axis) > 1 else 0
            if len(axis) == 1:
                return 0, 0, 0.0
            w = (math.log2(x) - math.log2(axis[i])) / (math.log2(axis[i + 1]) - math.log2(axis[i]))
            return i, i + 1, w

        (i0, i1, wi), (j0, j1, wj), (l0, l1, wl) = locate(self.ms, m), locate(self.ns, n), locate(self.ks, k)
        nn, nk = len(self.ns), len(self.ks)
        total = 0.0
        for i, a in ((i0, 1 - wi), (i1, wi)):
            for j, b in ((j0, 1 - wj), (j1, wj)):
                for l, c in ((l0, 1 - wl), (l1, wl)):
                    if a * b * c:
                        total += a * b * c * math.log(self.rates[(i * nn + j) * nk + l])
        return math.exp(total)

    def time(self, m: float, n: float, k: float) -> float:
        m, n, k = max(1.0, m), max(1.0, n), max(1.0, k)
        t = 2 * m * n * k / self.rate(m, n, k)
        fm, fn, fk = max(m, self.ms[0]), max(n, self.ns[0]), max(k, self.ks[0])
        if (fm, fn, fk) != (m, n, k):  # below the grid: not faster than the smallest GEMM measured there
            t = max(t, 2 * fm * fn * fk / self.rate(fm, fn, fk))
        return t


def _digest(d) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


# -- compute ---------------------------------------------------------------------
# precisions the planner prices -> the dtype whose table stands in when the precision
# itself was not measured (fp16 and bf16 run the same tensor-core / vector paths)
_DTYPE_STAND_IN = {"fp16": "bf16", "bf16": "fp16"}


@dataclass(frozen=True, repr=False)
class MeasuredCompute:
    gemm: tuple = ()  # ((dtype, GemmGrid), ...)
    bandwidth: tuple = ()  # ((op class, sizes in bytes, bytes/s), ...)
    # ((causal, 'fwd' | 'bwd', FLOPs per call, FLOP/s, dtype or None, seq per point or None), ...)
    attention: tuple = ()
    op_overhead_fwd_s: float = 0.0  # host time of one op forward, autograd recording
    op_overhead_bwd_s: float = 0.0  # host time of one autograd node backward
    op_overhead_no_grad_s: float = 0.0  # the same op with autograd off (taken out of the tables)
    dtensor_overhead_fwd_s: float = 0.0  # host time of one DTensor op forward (tensor parallelism)
    dtensor_overhead_bwd_s: float = 0.0
    dtensor_collective_overhead_s: float = 0.0  # a DTensor redistribution's collective beyond plain c10d
    # DTensor's time per op by the bytes of the activation a block carries: ((bytes, ...),
    # (forward s, ...), (backward s, ...)); empty: the two scalars above at every size
    dtensor_by_activation: tuple = ()
    # torch.distributed.pipelining's host time per schedule action (one stage's forward or
    # backward of one micro-batch: its send/recv bookkeeping, the stage call, autograd.grad)
    pipeline_action_s: float = 0.0
    optimizer: tuple = ()  # ((name, per_step_s, per_tensor_s, per_param_s), ...): adam, sgd
    # FSDP2's whole cost per unit, its collectives included, by the unit's unsharded
    # parameter bytes: (ranks, unit bytes, seconds per all-gather, per reduce-scatter,
    # seconds per extra parameter tensor per all-gather, per reduce-scatter)
    fsdp: tuple = ()
    # (dtype, FLOPs per GEMM, slowdown when n or k is not a multiple of 16 bytes)
    gemm_unaligned: tuple = ()
    digest: str = ""

    def __repr__(self) -> str:  # cache keys print devices: a digest, not the tables
        return f"MeasuredCompute({self.digest})"

    # Lookups by name, built once per profile (every op of every priced layer asks).
    @cached_property
    def _gemm_by_dtype(self) -> dict:
        return dict(self.gemm)

    @cached_property
    def _bandwidth_by_name(self) -> dict:
        return {c: (sizes, rates) for c, sizes, rates in self.bandwidth}

    @cached_property
    def _optimizer_by_name(self) -> dict:
        return {n: (per_step, per_tensor, per_param) for n, per_step, per_tensor, per_param in self.optimizer}

    def gemm_time(self, m: float, n: float, k: float, dtype: str) -> float | None:
        grids = self._gemm_by_dtype
        grid = grids.get(dtype) or grids.get(_DTYPE_STAND_IN.get(dtype, ""))
        return None if grid is None else grid.time(m, n, k)

    def bytes_time(self, op_class: str, nbytes: float, op_name: str | None = None,
                   direction: str = "fwd") -> float | None:
        """Seconds of a memory-bound op moving `nbytes`: its own table when the profile
        timed it by name (`gelu`), else its class's (`norm`), else `elementwise`. For
        the backward (`direction="bwd"`), the op's or its class's backward table
        (`gelu.bwd`: its backward kernels, by the bytes they move) comes first."""
        tables = self._bandwidth_by_name
        names = ([f"{op_name}.bwd", f"{op_class}.bwd"] if direction == "bwd" else []) + \
            [op_name or "", op_class, "elementwise"]
        table = next((tables[n] for n in names if n in tables), None)
        return None if table is None else time_for_size(table[0], table[1], nbytes)

    def dtensor_op_s(self, activation_bytes: float = 0.0) -> tuple[float, float]:
        """(forward, backward) seconds DTensor takes per op of a tensor-parallel layer
        whose blocks carry `activation_bytes` per micro-batch: linear between the sizes
        calibrate timed, the nearest end outside them (a time per op measured on one
        machine's blocks, not a law to extrapolate); the host-only scalars without a table."""
        if not self.dtensor_by_activation:
            return self.dtensor_overhead_fwd_s, self.dtensor_overhead_bwd_s
        sizes, fwd, bwd = self.dtensor_by_activation
        x = min(max(activation_bytes, sizes[0]), sizes[-1])
        i = min(max(bisect.bisect_right(sizes, x) - 1, 0), len(sizes) - 2) if len(sizes) > 1 else 0
        if len(sizes) == 1:
            return fwd[0], bwd[0]
        w = (x - sizes[i]) / (sizes[i + 1] - sizes[i])
        return fwd[i] + w * (fwd[i + 1] - fwd[i]), bwd[i] + w * (bwd[i + 1] - bwd[i])

    def optimizer_time(self, name: str, params: float, tensors: float, *, dtensor: bool = False) -> float | None:
        """One optimizer step over `params` elements in `tensors` tensors (the per-step
        constant is charged once per step by the caller, not here). `dtensor`: the
        parameters are DTensors (FSDP2 shards, tp splits); timed so when the profile
        has that table, else each per-tensor op pays DTensor's dispatch instead of
        eager's (the number of ops per tensor read off the plain per-tensor time)."""
        fits = self._optimizer_by_name
        if dtensor and name + ":dtensor" in fits:
            _, per_tensor, per_param = fits[name + ":dtensor"]
            return per_tensor * tensors + per_param * params
        if name not in fits:
            return None
        _, per_tensor, per_param = fits[name]
        if dtensor and self.op_overhead_fwd_s > 0:
            ops_per_tensor = per_tensor / self.op_overhead_fwd_s
            per_tensor += ops_per_tensor * max(0.0, self.dtensor_overhead_fwd_s - self.op_overhead_fwd_s)
        return per_tensor * tensors + per_param * params

    def fsdp_unit_s(self, nbytes: float, tensors: int = 1) -> tuple[int, float, float] | None:
        """(ranks timed, seconds per all-gather, per reduce-scatter) FSDP2 spends on a
        unit of nbytes in `tensors` parameters, collectives included; linear in bytes
        between and beyond the sizes timed, plus the time per extra parameter."""
        if not self.fsdp:
            return None
        ranks, sizes, gather, reduce, tensor_gather, tensor_reduce = self.fsdp
        extra = max(0, tensors - 1)

        def at(values):
            if len(sizes) == 1:
                return values[0]
            slope = (values[-1] - values[0]) / (sizes[-1] - sizes[0])
            return max(0.0, values[0] + slope * (nbytes - sizes[0]))
        return ranks, at(gather) + extra * tensor_gather, at(reduce) + extra * tensor_reduce

    def optimizer_step_constant(self, name: str) -> float:
        return self._optimizer_by_name.get(name, (0.0,))[0]

    def attention_time(self, flops: float, causal: bool, direction: str, dtype: str | None = None,
                       seq: float | None = None) -> float | None:
        """Seconds of SDPA doing `flops`, from the table of this dtype (then its stand-in,
        then a table of no stated dtype, as profiles before per-dtype tables had).

        With `seq` and a table that records its points' sequence lengths, the rate is
        the one measured at that sequence length: a calibration call is one sequence of
        a few heads, a training call is micro-batch x heads of them, and a kernel's
        speed follows the length of the rows and columns it tiles, not the total work
        (on one CPU core, 16 sequences of 64 run at the 64-long rate, 1.6x slower than
        the one sequence of 256 with the same FLOPs). More sequences could fill more of
        a GPU at short lengths; that is not credited. Without them, by FLOPs per call."""
        rows = {dt: (sizes, rates, seqs) for c, d, sizes, rates, dt, seqs in self.attention
                if c == causal and d == direction}
        if not rows:
            return None
        key = next((k for k in (dtype, _DTYPE_STAND_IN.get(dtype or "", ""), None) if k in rows), next(iter(rows)))
        sizes, rates, seqs = rows[key]
        if seq is not None and seqs:
            return flops / _interp_log(seqs, rates, seq)
        return time_for_size(sizes, rates, flops)

    def unaligned_gemm_slowdown(self, flops: float, dtype: str) -> float:
        """How many times longer a GEMM of `flops` takes when a row is not 16-byte aligned."""
        tables = {dt: (f, s) for dt, f, s in self.gemm_unaligned}
        table = tables.get(dtype) or tables.get(_DTYPE_STAND_IN.get(dtype, ""))
        return 1.0 if table is None else max(1.0, _interp_log(table[0], table[1], flops))

    # -- file form ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "gemm": {dt: {"m": list(g.ms), "n": list(g.ns), "k": list(g.ks), "flops_per_s": list(g.rates)}
                     for dt, g in self.gemm},
            "bandwidth": {c: {"bytes": list(s), "bytes_per_s": list(r)} for c, s, r in self.bandwidth},
            "attention": [{**({"dtype": dt} if dt else {}), "causal": c, "direction": d, "flops": list(s),
                           "flops_per_s": list(r), **({"seq": list(q)} if q else {})}
                          for c, d, s, r, dt, q in self.attention],
            **({"gemm_unaligned": {dt: {"flops": list(f), "slowdown": list(x)} for dt, f, x in self.gemm_unaligned}}
               if self.gemm_unaligned else {}),
            "op_overhead_fwd_s": self.op_overhead_fwd_s,
            "op_overhead_bwd_s": self.op_overhead_bwd_s,
            "op_overhead_no_grad_s": self.op_overhead_no_grad_s,
            "dtensor_overhead_fwd_s": self.dtensor_overhead_fwd_s,
            "dtensor_overhead_bwd_s": self.dtensor_overhead_bwd_s,
            "dtensor_collective_overhead_s": self.dtensor_collective_overhead_s,
            **({"dtensor_by_activation": {"bytes": list(self.dtensor_by_activation[0]),
                                          "fwd_s": list(self.dtensor_by_activation[1]),
                                          "bwd_s": list(self.dtensor_by_activation[2])}}
               if self.dtensor_by_activation else {}),
            "pipeline_action_s": self.pipeline_action_s,
            "optimizer": {n: {"per_step_s": a, "per_tensor_s": b, "per_param_s": c} for n, a, b, c in self.optimizer},
            **({"fsdp": {"ranks": self.fsdp[0], "unit_bytes": list(self.fsdp[1]), "gather_s": list(self.fsdp[2]),
                         "reduce_s": list(self.fsdp[3]), "tensor_gather_s": self.fsdp[4],
                         "tensor_reduce_s": self.fsdp[5]}} if self.fsdp else {}),
        }

    @classmethod
    def from_dict(cls, d: dict, file: str = "<dict>", where: str = "compute") -> "MeasuredCompute":
        d = _mapping(d, where, file)
        gemm = []
        for dt, g in sorted(_mapping(d.get("gemm", {}), f"{where}.gemm", file).items()):
            w = f"{where}.gemm.{dt}"
            g = _mapping(g, w, file)
            ms, ns, ks = (_sizes(g, key, w, file) for key in ("m", "n", "k"))
            rates = _positives(g, "flops_per_s", w, file)
            if len(rates) != len(ms) * len(ns) * len(ks):
                raise ProfileError(f"has {len(rates)} rates for a {len(ms)} x {len(ns)} x {len(ks)} grid",
                                   field=f"{w}.flops_per_s", file=file)
            gemm.append((dt, GemmGrid(ms, ns, ks, rates)))
        bandwidth = []
        for c, t in sorted(_mapping(d.get("bandwidth", {}), f"{where}.bandwidth", file).items()):
            w = f"{where}.bandwidth.{c}"
            t = _mapping(t, w, file)
            sizes, rates = _sizes(t, "bytes", w, file), _positives(t, "bytes_per_s", w, file)
            _same_length(sizes, rates, f"{w}.bytes_per_s", file)
            bandwidth.append((c, sizes, rates))
        attention = []
        for i, a in enumerate(d.get("attention", []) or []):
            w = f"{where}.attention[{i}]"
            a = _mapping(a, w, file)
            if a.get("direction") not in ("fwd", "bwd") or not isinstance(a.get("causal"), bool):
                raise ProfileError("needs causal (true/false) and direction ('fwd' or 'bwd')", field=w, file=file)
            sizes, rates = _sizes(a, "flops", w, file), _positives(a, "flops_per_s", w, file)
            _same_length(sizes, rates, f"{w}.flops_per_s", file)
            dt = a.get("dtype")
            if dt is not None and not isinstance(dt, str):
                raise ProfileError(f"must be a dtype name ('bf16'), got {dt!r}", field=f"{w}.dtype", file=file)
            seqs = None
            if a.get("seq") is not None:
                seqs = _sizes(a, "seq", w, file)
                _same_length(sizes, seqs, f"{w}.seq", file)
            attention.append((a["causal"], a["direction"], sizes, rates, dt, seqs))
        optimizer = []
        for n, o in sorted(_mapping(d.get("optimizer", {}), f"{where}.optimizer", file).items()):
            o = _mapping(o, f"{where}.optimizer.{n}", file)
            optimizer.append((n, *(_nonnegative(o, key, f"{where}.optimizer.{n}", file)
                                   for key in ("per_step_s", "per_tensor_s", "per_param_s"))))
        unaligned = []
        for dt, t in sorted(_mapping(d.get("gemm_unaligned", {}) or {}, f"{where}.gemm_unaligned", file).items()):
            w = f"{where}.gemm_unaligned.{dt}"
            t = _mapping(t, w, file)
            sizes, slow = _sizes(t, "flops", w, file), _positives(t, "slowdown", w, file)
            _same_length(sizes, slow, f"{w}.slowdown", file)
            unaligned.append((dt, sizes, slow))
        over = {"optimizer": tuple(optimizer), "fsdp": (), "gemm_unaligned": tuple(unaligned),
                "dtensor_by_activation": ()}
        if d.get("dtensor_by_activation") is not None:
            w = f"{where}.dtensor_by_activation"
            t = _mapping(d["dtensor_by_activation"], w, file)
            sizes, fwd, bwd = _sizes(t, "bytes", w, file), _positives(t, "fwd_s", w, file), \
                _positives(t, "bwd_s", w, file)
            _same_length(sizes, fwd, f"{w}.fwd_s", file)
            _same_length(sizes, bwd, f"{w}.bwd_s", file)
            over["dtensor_by_activation"] = (sizes, fwd, bwd)
        if d.get("fsdp") is not None:
            w = f"{where}.fsdp"
            f = _mapping(d["fsdp"], w, file)
            sizes, gather, reduce = (_sizes(f, "unit_bytes", w, file), _positives(f, "gather_s", w, file),
                                     _positives(f, "reduce_s", w, file))
            _same_length(sizes, gather, f"{w}.gather_s", file)
            _same_length(sizes, reduce, f"{w}.reduce_s", file)
            ranks = f.get("ranks")
            if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
                raise ProfileError("must be the group size timed (an integer >= 1)", field=f"{w}.ranks", file=file)
            over["fsdp"] = (ranks, sizes, gather, reduce,
                            *(_nonnegative(f, key, w, file, 0.0) for key in ("tensor_gather_s", "tensor_reduce_s")))
        for key in ("op_overhead_fwd_s", "op_overhead_bwd_s", "op_overhead_no_grad_s", "dtensor_overhead_fwd_s",
                    "dtensor_overhead_bwd_s", "dtensor_collective_overhead_s", "pipeline_action_s"):
            over[key] = _nonnegative(d, key, where, file, 0.0)
        body = cls(tuple(gemm), tuple(bandwidth), tuple(attention), **over).to_dict()
        return cls(tuple(gemm), tuple(bandwidth), tuple(attention), **over, digest=_digest(body))


# -- collectives -------------------------------------------------------------------
def ring_terms(kind: str, n: int) -> tuple[float, float]:
    """(latency steps, bytes factor) of the ring algorithm for `kind` over n ranks
    (nccl-tests' size convention; the same physics as cost_models/comm.py)."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n
    if kind == "broadcast":
        return n - 1, 1.0
    return 1, 1.0  # p2p


@dataclass(frozen=True, repr=False)
class MeasuredCollectives:
    table: tuple = ()  # ((kind, ranks, sizes in bytes, seconds), ...)
    digest: str = ""

    def __repr__(self) -> str:
        return f"MeasuredCollectives({self.digest})"

    def fit(self, kind: str) -> tuple[float, float] | None:
        """(alpha seconds per ring step, bus bandwidth B/s) fitted by least squares
        to the largest measured group of `kind`."""
        rows = [r for r in self.table if r[0] == kind]
        if not rows:
            return None
        _, n, sizes, secs = max(rows, key=lambda r: r[1])
        steps, factor = ring_terms(kind, n)
        xs = [factor * s for s in sizes]
        mx, my = sum(xs) / len(xs), sum(secs) / len(secs)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, secs)) / var if var > 0 else my / max(mx, 1.0)
        slope = max(slope, 1e-15)
        intercept = max(0.0, my - slope * mx)
        return intercept / steps, 1.0 / slope

    def time(self, kind: str, n: int, nbytes: float) -> float | None:
        for k, ranks, sizes, secs in self.table:
            if k == kind and ranks == n:
                if nbytes <= sizes[0]:
                    return secs[0]
                if nbytes >= sizes[-1]:  # extend the last segment's bandwidth
                    if len(sizes) == 1:
                        return secs[-1] * nbytes / sizes[-1]
                    slope = (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2])
                    return secs[-1] + max(slope, secs[-1] / sizes[-1] * 0.5) * (nbytes - sizes[-1])
                return _interp_log(sizes, secs, nbytes)
        fitted = self.fit(kind)
        if fitted is None:
            return None
        alpha, busbw = fitted
        steps, factor = ring_terms(kind, n)
        return steps * alpha + factor * nbytes / busbw

    def to_dict(self) -> dict:
        out: dict = {}
        for kind, n, sizes, secs in self.table:
            out.setdefault(kind, {})[str(n)] = {"bytes": list(sizes), "seconds": list(secs)}
        return out

    @classmethod
    def from_dict(cls, d: dict, file: str = "<dict>", where: str = "collectives") -> "MeasuredCollectives":
        d = _mapping(d, where, file)
        table = []
        for kind, groups in sorted(d.items()):
            if kind not in COLLECTIVE_KINDS:
                raise ProfileError(f"unknown collective (known: {', '.join(COLLECTIVE_KINDS)})",
                                   field=f"{where}.{kind}", file=file)
            for n, t in sorted(_mapping(groups, f"{where}.{kind}", file).items(), key=lambda x: int(x[0])):
                w = f"{where}.{kind}.{n}"
                if not str(n).isdigit() or int(n) < 2:
                    raise ProfileError("group sizes are integers >= 2", field=w, file=file)
                t = _mapping(t, w, file)
                sizes, secs = _sizes(t, "bytes", w, file), _positives(t, "seconds", w, file)
                _same_length(sizes, secs, f"{w}.seconds", file)
                table.append((kind, int(n), sizes, secs))
        body = cls(tuple(table)).to_dict()
        return cls(tuple(table), digest=_digest(body))


# -- readers that name the field ------------------------------------------------------
def _mapping(d, where: str, file: str) -> dict:
    if not isinstance(d, dict):
        raise ProfileError(f"must be a mapping, got {type(d).__name__}", field=where, file=file)
    return d


def _positives(d: dict, key: str, where: str, file: str) -> tuple:
    values = d.get(key)
    if not isinstance(values, list) or not values or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v)
            for v in values):
        raise ProfileError("must be a non-empty list of positive numbers", field=f"{where}.{key}", file=file)
    return tuple(float(v) for v in values)


def _nonnegative(d: dict, key: str, where: str, file: str, default=None) -> float:
    """d[key] as a finite number >= 0 (`default` when absent; None: required)."""
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v):
        raise ProfileError(f"must be a number >= 0, got {v!r}", field=f"{where}.{key}", file=file)
    return float(v)


def _sizes(d: dict, key: str, where: str, file: str) -> tuple:
    values = _positives(d, key, where, file)
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ProfileError("must be strictly increasing", field=f"{where}.{key}", file=file)
    return values


def _same_length(a: tuple, b: tuple, where: str, file: str) -> None:
    if len(a) != len(b):
        raise ProfileError(f"has {len(b)} values for {len(a)} sizes", field=where, file=file)


# -- the profile file -------------------------------------------------------------------
@dataclass
class Profile:
    """One machine's measurements (see the module docstring)."""

    device_name: str
    device: dict  # devices.yaml fields derived from the measurements
    compute: MeasuredCompute
    collectives: dict = field(default_factory=dict)  # 'intra_node' | 'inter_node' -> MeasuredCollectives
    machine: dict = field(default_factory=dict)  # where and how it was measured (informational)
    source: str = "<dict>"

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "machine": self.machine, "device_name": self.device_name, "device": self.device,
                "compute": self.compute.to_dict(),
                "collectives": {tier: c.to_dict() for tier, c in sorted(self.collectives.items())}}

    def save(self, path: str) -> None:
        import os
        import tempfile

        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:  # written whole, then renamed: never a half-written profile
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, d: dict, file: str = "<dict>") -> "Profile":
        d = _mapping(d, "profile", file)
        if d.get("schema") != SCHEMA:
            raise ProfileError(f"is {d.get('schema')!r}, this autopar reads {SCHEMA!r} (re-run autopar calibrate)",
                               field="schema", file=file)
        name = d.get("device_name")
        if not isinstance(name, str) or not name:
            raise ProfileError("must be a non-empty string", field="device_name", file=file)
        from cost_models.hardware import DeviceProfile

        device = _mapping(d.get("device"), "device", file)
        DeviceProfile.from_dict(name, device, file)  # validates the derived fields now
        collectives = {}
        for tier, c in _mapping(d.get("collectives", {}), "collectives", file).items():
            if tier not in ("intra_node", "inter_node"):
                raise ProfileError("tiers are intra_node and inter_node", field=f"collectives.{tier}", file=file)
            collectives[tier] = MeasuredCollectives.from_dict(c, file, f"collectives.{tier}")
        return cls(device_name=name, device=dict(device),
                   compute=MeasuredCompute.from_dict(d.get("compute", {}), file),
                   collectives=collectives, machine=dict(d.get("machine") or {}), source=file)

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise ProfileError(f"cannot read profile file: {exc.strerror}", file=str(path)) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"not valid JSON: {exc}", file=str(path)) from None
        return cls.from_dict(data, str(path))


def median_profile(profiles: list) -> Profile:
    """One profile from several calibrations of the same machine: every measured number
    the median of its repeats. A shared machine (a VM, a node with neighbours) runs
    slow spells that one calibration can land in; the median of a few, taken at the
    times the work runs, is what the machine does. Entries whose shape differs between
    repeats (a grid one repeat cut short) keep the first profile's."""
    import statistics

    if not profiles:
        raise ValueError("median_profile: no profiles")

    def med(values):
        first = values[0]
        if isinstance(first, dict):
            if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
                return first
            return {k: med([v[k] for v in values]) for k in first}
        if isinstance(first, list):
            if any(not isinstance(v, list) or len(v) != len(first) for v in values):
                return first
            return [med([v[i] for v in values]) for i in range(len(first))]
        if isinstance(first, (int, float)) and not isinstance(first, bool) \
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            # counts (group sizes, grid points) stay integers: the lower median is one of them
            return statistics.median_low(values) if all(isinstance(v, int) for v in values) \
                else statistics.median(values)
        return first

    dicts = [p.to_dict() for p in profiles]
    merged = med(dicts)
    probes = [d["machine"]["speed_probe_s"] for d in dicts if d.get("machine", {}).get("speed_probe_s")]
    merged["machine"] = {**dicts[0].get("machine", {}), "calibrations": len(profiles),
                         **({"speed_probe_s": statistics.median(probes)} if probes else {}),
                         "created": [d.get("machine", {}).get("created") for d in dicts]}
    return Profile.from_dict(merged, profiles[0].source)


def apply_profile(cluster, profile: Profile):
    """`cluster` with its device and links replaced by the measured ones (node
    counts, host memory and everything else kept)."""
    from cost_models.hardware import ClusterSpec, DeviceProfile, LinkProfile

    device = DeviceProfile.from_dict(profile.device_name, profile.device, profile.source)
    device = DeviceProfile(**{**vars(device), "measured": profile.compute})
    d = cluster.to_dict()
    d.pop("world_size", None)
    d.pop("devices", None)
    d.pop("links", None)
    spec = ClusterSpec.from_dict(d, file=cluster.source)
    spec.devices = {**cluster.devices, profile.device_name: device}
    spec.links = dict(cluster.links)
    spec.device = profile.device_name
    for tier, attr in (("intra_node", "intra_node_link"), ("inter_node", "inter_node_link")):
        measured = profile.collectives.get(tier)
        if measured is None:
            continue
        base = cluster.intra_link if tier == "intra_node" else cluster.inter_link
        fitted = measured.fit("all_reduce") or measured.fit("all_gather")
        bandwidth, latency = (base.bandwidth, base.latency_s) if fitted is None else (fitted[1], fitted[0])
        name = f"{profile.device_name}:{tier}"
        # built from the file form (6 digits), so a plan's copy of the cluster prices identically
        link = LinkProfile.from_dict(name, {"bandwidth_gbs": float(f"{bandwidth / 1e9:.6g}"), "bus_efficiency": 1.0,
                                            "latency_us": float(f"{latency * 1e6:.6g}"),
                                            "source": f"measured: {profile.source}"}, profile.source)
        spec.links[name] = LinkProfile(**{**vars(link), "measured": measured})
        setattr(spec, attr, name)
    spec.validate()
    return spec
