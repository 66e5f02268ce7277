"""The tables of a measured profile (cost_models/measured.py describes the file):
GEMM rates on a grid of shapes, memory-bound and attention rates by size, host
time per op, optimizer, FSDP2 and pipeline host times (`MeasuredCompute`), and
collective times by group size and bytes (`MeasuredCollectives`).

A device profile carries its compute tables and a link profile its collective
tables (devices.py); the profile file (measured.py) holds both.

Interpolation never invents a trend the table does not show: inside a table
it interpolates, beyond the largest size it extends the last measured
bandwidth, below the smallest it keeps the smallest size's time as a floor.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property

from cost_models.errors import ProfileError
from cost_models.fields import check_same_length, read_mapping, read_nonnegative, read_positives, read_sizes

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
        d = read_mapping(d, where, file)
        gemm = []
        for dt, g in sorted(read_mapping(d.get("gemm", {}), f"{where}.gemm", file).items()):
            w = f"{where}.gemm.{dt}"
            g = read_mapping(g, w, file)
            ms, ns, ks = (read_sizes(g, key, w, file) for key in ("m", "n", "k"))
            rates = read_positives(g, "flops_per_s", w, file)
            if len(rates) != len(ms) * len(ns) * len(ks):
                raise ProfileError(f"has {len(rates)} rates for a {len(ms)} x {len(ns)} x {len(ks)} grid",
                                   field=f"{w}.flops_per_s", file=file)
            gemm.append((dt, GemmGrid(ms, ns, ks, rates)))
        bandwidth = []
        for c, t in sorted(read_mapping(d.get("bandwidth", {}), f"{where}.bandwidth", file).items()):
            w = f"{where}.bandwidth.{c}"
            t = read_mapping(t, w, file)
            sizes, rates = read_sizes(t, "bytes", w, file), read_positives(t, "bytes_per_s", w, file)
            check_same_length(sizes, rates, f"{w}.bytes_per_s", file)
            bandwidth.append((c, sizes, rates))
        attention = []
        for i, a in enumerate(d.get("attention", []) or []):
            w = f"{where}.attention[{i}]"
            a = read_mapping(a, w, file)
            if a.get("direction") not in ("fwd", "bwd") or not isinstance(a.get("causal"), bool):
                raise ProfileError("needs causal (true/false) and direction ('fwd' or 'bwd')", field=w, file=file)
            sizes, rates = read_sizes(a, "flops", w, file), read_positives(a, "flops_per_s", w, file)
            check_same_length(sizes, rates, f"{w}.flops_per_s", file)
            dt = a.get("dtype")
            if dt is not None and not isinstance(dt, str):
                raise ProfileError(f"must be a dtype name ('bf16'), got {dt!r}", field=f"{w}.dtype", file=file)
            seqs = None
            if a.get("seq") is not None:
                seqs = read_sizes(a, "seq", w, file)
                check_same_length(sizes, seqs, f"{w}.seq", file)
            attention.append((a["causal"], a["direction"], sizes, rates, dt, seqs))
        optimizer = []
        for n, o in sorted(read_mapping(d.get("optimizer", {}), f"{where}.optimizer", file).items()):
            o = read_mapping(o, f"{where}.optimizer.{n}", file)
            optimizer.append((n, *(read_nonnegative(o, key, f"{where}.optimizer.{n}", file)
                                   for key in ("per_step_s", "per_tensor_s", "per_param_s"))))
        unaligned = []
        for dt, t in sorted(read_mapping(d.get("gemm_unaligned", {}) or {}, f"{where}.gemm_unaligned", file).items()):
            w = f"{where}.gemm_unaligned.{dt}"
            t = read_mapping(t, w, file)
            sizes, slow = read_sizes(t, "flops", w, file), read_positives(t, "slowdown", w, file)
            check_same_length(sizes, slow, f"{w}.slowdown", file)
            unaligned.append((dt, sizes, slow))
        over = {"optimizer": tuple(optimizer), "fsdp": (), "gemm_unaligned": tuple(unaligned),
                "dtensor_by_activation": ()}
        if d.get("dtensor_by_activation") is not None:
            w = f"{where}.dtensor_by_activation"
            t = read_mapping(d["dtensor_by_activation"], w, file)
            sizes, fwd, bwd = read_sizes(t, "bytes", w, file), read_positives(t, "fwd_s", w, file), \
                read_positives(t, "bwd_s", w, file)
            check_same_length(sizes, fwd, f"{w}.fwd_s", file)
            check_same_length(sizes, bwd, f"{w}.bwd_s", file)
            over["dtensor_by_activation"] = (sizes, fwd, bwd)
        if d.get("fsdp") is not None:
            w = f"{where}.fsdp"
            f = read_mapping(d["fsdp"], w, file)
            sizes, gather, reduce = (read_sizes(f, "unit_bytes", w, file), read_positives(f, "gather_s", w, file),
                                     read_positives(f, "reduce_s", w, file))
            check_same_length(sizes, gather, f"{w}.gather_s", file)
            check_same_length(sizes, reduce, f"{w}.reduce_s", file)
            ranks = f.get("ranks")
            if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
                raise ProfileError("must be the group size timed (an integer >= 1)", field=f"{w}.ranks", file=file)
            over["fsdp"] = (ranks, sizes, gather, reduce,
                            *(read_nonnegative(f, key, w, file, 0.0) for key in ("tensor_gather_s", "tensor_reduce_s")))
        for key in ("op_overhead_fwd_s", "op_overhead_bwd_s", "op_overhead_no_grad_s", "dtensor_overhead_fwd_s",
                    "dtensor_overhead_bwd_s", "dtensor_collective_overhead_s", "pipeline_action_s"):
            over[key] = read_nonnegative(d, key, where, file, 0.0)
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
        d = read_mapping(d, where, file)
        table = []
        for kind, groups in sorted(d.items()):
            if kind not in COLLECTIVE_KINDS:
                raise ProfileError(f"unknown collective (known: {', '.join(COLLECTIVE_KINDS)})",
                                   field=f"{where}.{kind}", file=file)
            for n, t in sorted(read_mapping(groups, f"{where}.{kind}", file).items(), key=lambda x: int(x[0])):
                w = f"{where}.{kind}.{n}"
                if not str(n).isdigit() or int(n) < 2:
                    raise ProfileError("group sizes are integers >= 2", field=w, file=file)
                t = read_mapping(t, w, file)
                sizes, secs = read_sizes(t, "bytes", w, file), read_positives(t, "seconds", w, file)
                check_same_length(sizes, secs, f"{w}.seconds", file)
                table.append((kind, int(n), sizes, secs))
        body = cls(tuple(table)).to_dict()
        return cls(tuple(table), digest=_digest(body))
