"""Rows for the report's tables, read straight from the Plan.

Nothing here predicts anything: it groups, sums and formats what the solver
wrote. Runs of identical layers are collapsed (`blocks.0 .. blocks.95`, 96
layers) so a 96-layer model is one row per pipeline stage, not 96, which
keeps the 1,024-GPU report small and readable.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from autopar.report.format import DASH, bytes_, number, percent, seconds, si

_INDEXED = re.compile(r"^(.*?)(\d+)$")


@dataclass
class LayerRun:
    stage: int
    pp_rank: int
    first: str
    last: str
    n: int
    kind: str
    zero: int
    reshard_after_forward: bool
    checkpoint: str
    offload: str
    tp_style: str
    module_paths: list[str] = field(default_factory=list)
    params: int | None = None

    @property
    def names(self) -> str:
        return self.first if self.n == 1 else f"{self.first} \u2026 {self.last}"


def _continues(prev: str, name: str) -> bool:
    """True if `name` is the next index of `prev` (blocks.4 after blocks.3)."""
    a, b = _INDEXED.match(prev), _INDEXED.match(name)
    return bool(a and b and a.group(1) == b.group(1) and int(b.group(2)) == int(a.group(2)) + 1)


def layer_runs(plan, graph=None) -> list[LayerRun]:
    params = {l.name: l.params for l in getattr(graph, "layers", [])} if graph is not None else {}
    runs: list[LayerRun] = []
    for st in sorted(plan.stages, key=lambda s: s.index):
        for c in st.layers:
            key = (c.kind, c.zero, c.reshard_after_forward, c.checkpoint, c.offload, c.tp_style)
            prev = runs[-1] if runs else None
            if (prev and prev.stage == st.index and _continues(prev.last, c.name)
                    and (prev.kind, prev.zero, prev.reshard_after_forward, prev.checkpoint, prev.offload, prev.tp_style) == key):
                prev.last, prev.n = c.name, prev.n + 1
                prev.module_paths.extend(c.module_paths)
                if prev.params is not None and c.name in params:
                    prev.params += params[c.name]
                continue
            runs.append(LayerRun(st.index, st.pp_rank, c.name, c.name, 1, *key,
                                 module_paths=list(c.module_paths), params=params.get(c.name)))
    return runs


def stage_rows(plan) -> list[dict]:
    rows = []
    for st in sorted(plan.stages, key=lambda s: s.index):
        p = st.predicted or {}
        names = st.layer_names
        rows.append({
            "index": st.index,
            "pp_rank": st.pp_rank,
            "layers": len(names),
            "span": (names[0] if len(names) == 1 else f"{names[0]} \u2026 {names[-1]}") if names else DASH,
            "fwd": seconds(p.get("fwd_s")),
            "bwd": seconds(p.get("bwd_s")),
            "recompute": seconds(p.get("recompute_s")),
            "tp_comm": seconds(p.get("tp_comm_s")),
            "ep_comm": seconds(p.get("ep_comm_s")) if p.get("ep_comm_s") else DASH,
            "p2p": seconds(p.get("p2p_s")),
            "memory": bytes_(p.get("memory_bytes")),
            "act_per_mb": bytes_(p.get("activation_bytes_per_micro_batch")),
        })
    return rows


TIME_PARTS = (
    ("compute_s", "compute (forward + backward)"),
    ("recompute_s", "recomputation (checkpointing)"),
    ("tp_comm_s", "tensor-parallel collectives"),
    ("ep_comm_s", "expert-parallel all-to-alls (blocking)"),
    ("pp_comm_s", "pipeline p2p"),
    ("dp_comm_exposed_s", "data-parallel comm, exposed (incl. SMs NCCL holds under compute)"),
    ("bubble_s", "pipeline bubble"),
    ("optimizer_s", "optimizer step"),
    ("straggler_s", "slowest GPU of the job (clock spread)"),
)


def time_rows(plan) -> list[dict]:
    tb = plan.predicted.time_breakdown or {}
    step = plan.predicted.step_time_s
    rows = []
    for key, label in TIME_PARTS:
        if key in tb:
            rows.append({"key": key, "label": label, "time": seconds(tb[key]),
                         "share": percent(tb[key] / step) if step else DASH})
    if "dp_comm_s" in tb:  # total DP traffic time, most of it hidden under backward
        rows.append({"key": "dp_comm_s", "label": "data-parallel comm, total (overlapped)",
                     "time": seconds(tb["dp_comm_s"]), "share": "not additive"})
    if tb.get("nccl_contention_s"):  # already inside the exposed DP time above
        rows.append({"key": "nccl_contention_s", "label": "of which: compute slowed by SMs NCCL holds",
                     "time": seconds(tb["nccl_contention_s"]), "share": "included above"})
    return rows


def comm_rows(plan) -> list[dict]:
    """Per mesh axis and link tier: collectives, bytes, time, exposed time (sums)."""
    groups: dict[tuple, dict] = {}
    order = {"tp": 0, "dp": 1, "pp": 2}
    for c in plan.predicted.comm:
        key = (c.get("axis", "?"), c.get("tier", "?"))
        g = groups.setdefault(key, {"axis": key[0], "tier": key[1], "collectives": [], "bytes": 0.0,
                                    "time_s": 0.0, "exposed_s": 0.0, "has_exposed": False})
        coll = c.get("collective")
        if coll and coll not in g["collectives"]:
            g["collectives"].append(coll)
        g["bytes"] += float(c.get("bytes", 0.0) or 0.0)
        g["time_s"] += float(c.get("time_s", 0.0) or 0.0)
        if c.get("exposed_s") is not None:
            g["exposed_s"] += float(c["exposed_s"])
            g["has_exposed"] = True
    rows = []
    for key in sorted(groups, key=lambda k: (order.get(k[0], 9), k)):
        g = groups[key]
        rows.append({"axis": g["axis"], "tier": g["tier"].replace("_", " "),
                     "collectives": ", ".join(g["collectives"]) or DASH,
                     "bytes": bytes_(g["bytes"]), "time": seconds(g["time_s"]),
                     "exposed": seconds(g["exposed_s"]) if g["has_exposed"] else DASH})
    return rows


def _mesh_text(mesh) -> str:
    if mesh is None:
        return DASH
    get = mesh.get if isinstance(mesh, dict) else lambda k, d=None: getattr(mesh, k, d)
    shard = get("dp_shard")  # HSDP: "dp8 (2 replicas x 4 shards)"
    dp = f"dp{get('dp', 1)}" + (f" ({get('dp', 1) // shard} replicas \u00d7 {shard} shards)"
                                if shard and shard < get("dp", 1) else "")
    return f"pp{get('pp', 1)} \u00d7 {dp} \u00d7 tp{get('tp', 1)}"


def _choice(v) -> str:
    """A layout-wide choice: one value, a mix of per-layer values, or unknown."""
    if v is None or v == []:
        return DASH
    if isinstance(v, (list, tuple)):
        return "/".join(str(x) for x in v) + " by layer"
    return str(v)


def alternative_rows(plan, unit: str = "tok/s") -> list[dict]:
    best = plan.predicted.step_time_s
    rows = []
    for i, a in enumerate(plan.alternatives):
        p = a.get("predicted") or {}
        tps = p.get("tokens_per_s") if unit == "tok/s" else p.get("samples_per_s", p.get("tokens_per_s"))
        peak = p.get("peak_memory_bytes")
        if isinstance(peak, (list, tuple)):
            peak = max(peak) if peak else None
        sched = a.get("schedule", DASH)
        if sched == "interleaved" and a.get("virtual_stages"):
            sched = f"interleaved (V={a['virtual_stages']})"
        rows.append({
            "rank": i + 1,  # numbered as `autopar plan` numbers them
            "mesh": _mesh_text(a.get("mesh")) + (" +SP" if a.get("sequence_parallel") else ""),
            "schedule": sched,
            "micro_batch": f"{a.get('micro_batch_size', DASH)} \u00d7 {a.get('num_micro_batches', DASH)}",
            "zero": _choice(a.get("zero")),
            "checkpoint": _choice(a.get("checkpoint")),
            "step": seconds(p.get("step_time_s")),
            "tokens": si(tps, unit),
            "vs_best": percent(p["step_time_s"] / best - 1, sign=True) if (p.get("step_time_s") and best) else DASH,
            "mfu": percent(p.get("mfu")),
            "peak": bytes_(peak),
            "status": a.get("status", DASH),
            "why": a.get("why", ""),
        })
    return rows


def baseline_rows(plan, unit: str = "tok/s") -> list[dict]:
    """What a user of one stack alone would run (`Plan.baselines`), one row each."""
    rows = []
    for b in plan.baselines if isinstance(plan.baselines, list) else []:
        p = b.get("predicted") or {}
        tps = p.get("tokens_per_s") if unit == "tok/s" else p.get("samples_per_s")
        ratio = b.get("vs_plan")
        rows.append({
            "name": b.get("name", b.get("stack", DASH)),
            "config": b.get("config") or DASH,
            "gpus": b.get("gpus", DASH),
            # a layout that does not fit has no step time a user could see
            "step": seconds(p.get("step_time_s")) if b.get("fits") else DASH,
            "vs_plan": f"{ratio:.2f}\u00d7" if isinstance(ratio, (int, float)) and b.get("fits") else DASH,
            "tokens": si(tps, unit) if b.get("fits") else DASH,
            "mfu": percent(p.get("mfu")) if b.get("fits") else DASH,
            "peak": bytes_(max(p["peak_memory_bytes"])) if p.get("peak_memory_bytes") else DASH,
            "status": "ok" if b.get("fits") else "oom",
            "why": b.get("why", ""),
        })
    return rows


def flatten(d, prefix: str = "") -> list[tuple[str, str]]:
    """Nested assumptions dict -> [('device.peak_tflops', '312'), ...] in key order."""
    out = []
    if isinstance(d, dict):
        for k in sorted(d, key=str):
            out.extend(flatten(d[k], f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(d, (list, tuple)) and d and all(isinstance(x, (dict, list, tuple)) for x in d):
        for i, x in enumerate(d):
            out.extend(flatten(x, f"{prefix}[{i}]"))
    elif isinstance(d, (list, tuple)):
        out.append((prefix, ", ".join(number(x) for x in d)))
    else:
        out.append((prefix, number(d)))
    return out



def not_offered(plan) -> list[str]:
    """Layouts the planner did not offer because the lowering cannot run them
    for this model (`plan.solver["lowering_limits"]`, autopar/lower/what_runs.py),
    one sentence each; or why they were not checked."""
    limits = plan.solver.get("lowering_limits") if isinstance(plan.solver, dict) else None
    if not isinstance(limits, dict):
        return []
    if not limits.get("checked"):
        return [f"layouts were not checked against the lowering here: {limits.get('why', 'no reason recorded')}"]
    out = []
    if limits.get("pipeline"):
        out.append(f"pipeline parallelism: {limits['pipeline']}")
    for tp, why in sorted((limits.get("tp") or {}).items(), key=lambda kv: int(kv[0])):
        out.append(f"tensor parallelism over {tp}: {why}")
    for tp, why in sorted((limits.get("sequence_parallel") or {}).items(), key=lambda kv: int(kv[0])):
        out.append(f"sequence parallelism over {tp}: {why}")
    for layer, why in sorted((limits.get("runs_whole") or {}).items()):
        out.append(f"a vocabulary split of layer {layer}: {why}")
    return out
