"""Everything the template shows, gathered from the Plan (and the ModelGraph).

One function, `build_context(plan, graph)`, turns the Plan into plain values
and pre-drawn SVG for the template; it makes no prediction of its own (the
only arithmetic is grouping, unit conversion and the hand-check rows, which
recombine numbers the Plan already holds so a reader can verify them).
"""
from __future__ import annotations

from autopar.engine import priced_for
from autopar.report import format as fmt
from autopar.report import gantt, memory, mesh, tables, timeline


def _name(x) -> str:
    """A profile given by name or as a dict with a `name` field."""
    if isinstance(x, dict):
        return str(x.get("name") or x.get("device") or fmt.DASH)
    return str(x) if x is not None else fmt.DASH


def _device(plan) -> dict:
    d = plan.cluster.get("device")
    return d if isinstance(d, dict) else {}


def _capacity(plan) -> float | None:
    """Usable device bytes: per-rank `capacity` from the plan, else the profile's memory."""
    for b in plan.predicted.memory_breakdown:
        if b.get("capacity"):
            return float(b["capacity"])
    dev = _device(plan)
    for k in ("memory_bytes", "hbm_bytes", "memory"):
        if isinstance(dev.get(k), (int, float)):
            return float(dev[k])
    return None


def _peak_flops(plan) -> float | None:
    """Dense peak FLOP/s of one GPU at the plan's precision, as the plan recorded it.

    Looked up in the plan's assumptions (top level or a `device`/`hardware`
    profile inside them) and in a device profile the cluster defined inline;
    never in today's profile files, which may differ from the ones planned with.
    """
    sources = [plan.assumptions, plan.assumptions.get("device"), plan.assumptions.get("hardware"), _device(plan)]
    devices = plan.cluster.get("devices")
    if isinstance(devices, dict) and isinstance(plan.cluster.get("device"), str):
        sources.append(devices.get(plan.cluster["device"]))
    for src in sources:
        if not isinstance(src, dict):
            continue
        for key, scale in (("peak_flops", 1.0), ("peak_tflops", 1e12)):
            v = src.get(key)
            if isinstance(v, dict):
                v = v.get(plan.precision)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return float(v) * scale
    return None


def summary(plan) -> dict:
    m, c, p = plan.model, plan.cluster, plan.predicted
    nodes, gpn = int(c.get("nodes", 1) or 1), int(c.get("gpus_per_node", 8) or 8)
    seq = plan.seq_len or m.get("seq_len")
    sched = plan.schedule + (f" (V={plan.virtual_stages})" if plan.schedule == "interleaved" else "")
    peak_mem = max(p.peak_memory_bytes) if p.peak_memory_bytes else None
    cap = _capacity(plan)
    dp_text = plan.mesh.dp_text().replace(" x ", " \u00d7 ")  # under HSDP "dp 8 = 2 replicas x 4 shards"
    return {
        "model_name": m.get("name") or fmt.DASH,
        "model_source": m.get("source") or "",
        "params": fmt.count(m.get("total_params")),
        "num_layers": m.get("num_layers", len(plan.layer_choices)),
        "seq_len": seq,
        "cluster": f"{nodes} \u00d7 {gpn} {_name(c.get('device'))}",
        "world": nodes * gpn,
        "links": f"{_name(c.get('intra_node_link'))} in node, {_name(c.get('inter_node_link'))} across nodes",
        "mesh": f"pp {plan.mesh.pp} \u00d7 {dp_text} \u00d7 tp {plan.mesh.tp}",
        "mesh_world": plan.mesh.world_size,
        "schedule": sched,
        "batch": (f"{plan.global_batch_size} samples = dp {plan.mesh.dp} \u00d7 micro-batch "
                  f"{plan.micro_batch_size} \u00d7 {plan.num_micro_batches} micro-batches"),
        "sequence_parallel": "on" if plan.sequence_parallel else "off",
        "precision": plan.precision,
        "step_time": fmt.seconds(p.step_time_s),
        "tokens_per_s": fmt.si(rate_value(plan), rate_unit(plan)),
        "tokens_per_s_per_gpu": (fmt.si(rate_value(plan) / plan.mesh.world_size, rate_unit(plan)) if rate_value(plan)
                                 else fmt.DASH),
        "tflops": fmt.tflops(p.tflops_per_gpu),
        "mfu": fmt.percent(p.mfu),
        "peak_memory": fmt.bytes_(peak_mem),
        "capacity": fmt.bytes_(cap),
        "headroom": fmt.percent(1 - peak_mem / cap) if (peak_mem and cap) else fmt.DASH,
        "solver": plan.solver,
        "fusions": len(plan.fusions),
    }


def _additivity_note(parts_s: float, step_s: float) -> str:
    gap = parts_s / step_s - 1
    if abs(gap) <= 0.005:
        return ""
    if gap > 0:
        return (f"the parts add up to {fmt.percent(gap)} more than the step time: some of them overlap "
                f"(e.g. a p2p wait is also idle time)")
    return (f"the parts add up to {fmt.percent(-gap)} less than the step time: the plan's breakdown "
            f"leaves {fmt.seconds(step_s - parts_s)} per step unattributed")


def hand_checks(plan) -> list[dict]:
    """Identities between the Plan's own numbers, written out with the values filled in."""
    p, out = plan.predicted, []
    seq = plan.seq_len or plan.model.get("seq_len")
    if p.step_time_s and seq:
        tokens = plan.global_batch_size * seq
        out.append({"what": "tokens/s",
                    "formula": "global_batch_size \u00d7 seq_len / step_time",
                    "filled": f"{plan.global_batch_size} \u00d7 {seq} / {p.step_time_s:.4g} s",
                    "value": fmt.si(tokens / p.step_time_s, "tok/s"), "plan": fmt.si(p.tokens_per_s, "tok/s"), "note": ""})
    elif p.step_time_s:
        out.append({"what": "samples/s", "formula": "global_batch_size / step_time",
                    "filled": f"{plan.global_batch_size} / {p.step_time_s:.4g} s",
                    "value": fmt.si(plan.global_batch_size / p.step_time_s, "samples/s"),
                    "plan": fmt.si(p.samples_per_s, "samples/s"), "note": ""})
    peak = _peak_flops(plan)
    if peak and p.tflops_per_gpu:
        out.append({"what": "MFU", "formula": "model TFLOP/s per GPU / peak TFLOP/s",
                    "filled": f"{p.tflops_per_gpu:.4g} / {peak / 1e12:.4g}",
                    "value": fmt.percent(p.tflops_per_gpu * 1e12 / peak), "plan": fmt.percent(p.mfu), "note": ""})
    tb = p.time_breakdown or {}
    parts = [k for k, _ in tables.TIME_PARTS if k in tb]
    if parts and p.step_time_s:
        total = sum(float(tb[k]) for k in parts)
        out.append({"what": "step time", "formula": " + ".join(parts),
                    "filled": " + ".join(f"{float(tb[k]):.4g}" for k in parts),
                    "value": fmt.seconds(total), "plan": fmt.seconds(p.step_time_s),
                    # Said plainly rather than hidden: a simulated step need not be a plain sum.
                    "note": _additivity_note(total, p.step_time_s)})
    if plan.mesh.pp > 1 and tb.get("bubble_s") is not None and p.step_time_s:
        v = plan.virtual_stages if plan.schedule == "interleaved" else 1
        ideal = (plan.mesh.pp - 1) / (v * plan.num_micro_batches)
        out.append({"what": "bubble fraction", "formula": "(pp - 1) / (V \u00d7 m), textbook, equal stages",
                    "filled": f"({plan.mesh.pp} - 1) / ({v} \u00d7 {plan.num_micro_batches})",
                    "value": fmt.percent(ideal), "note": "",
                    "plan": fmt.percent(tb["bubble_s"] / max(p.step_time_s - tb["bubble_s"], 1e-30)) + " of busy time"})
    return out


# The solver facts worth a glance, with the words to show them under.
SOLVER_HEADLINE = {"status": "status", "gap": "optimality gap", "candidates": "candidate layouts",
                   "solved": "solved", "pruned_by_bound": "pruned by bound", "oom": "out of memory",
                   "search_s": "search time", "hsdp": "HSDP", "compression": "gradient reduction dtype",
                   "ep": "expert parallelism"}


def _solver_value(key, value) -> str:
    if key == "gap" and isinstance(value, (int, float)):
        return fmt.percent(value, 2)
    if key == "search_s" and isinstance(value, (int, float)):
        return fmt.seconds(value)
    return fmt.number(value)


def link_rows(plan) -> list[dict]:
    """Bandwidth, efficiency and latency of the links the plan names, for checking comm times by hand.

    The plan records link names only, so the numbers come from the profiles
    shipped with this autopar (or the ones the cluster file defined inline,
    which the plan does carry); the page says so next to the table.
    """
    from cost_models.errors import CostModelError
    from cost_models.hardware import LinkProfile, get_link

    inline = plan.cluster.get("links") if isinstance(plan.cluster.get("links"), dict) else {}
    rows = []
    for tier, key in (("intra node", "intra_node_link"), ("inter node", "inter_node_link"), ("host", "host_link")):
        name = plan.cluster.get(key)
        if not isinstance(name, str):
            continue
        try:
            link = (LinkProfile.from_dict(name, inline[name]) if name in inline else get_link(name)).to_dict()
        except (CostModelError, TypeError, KeyError):
            continue  # an unknown name: nothing trustworthy to show
        rows.append({"tier": tier, "name": name, "bandwidth": f"{link['bandwidth_gbs']:g} GB/s",
                     "efficiency": fmt.percent(link["bus_efficiency"], 0), "latency": f"{link['latency_us']:g} \u00b5s",
                     "source": link.get("source", "")})
    return rows


def rate_unit(plan) -> str:
    """Throughput unit: tokens for token models (the captured inputs have a sequence axis);
    samples (images) otherwise, where the Plan carries samples_per_s and no tokens_per_s."""
    return "tok/s" if plan.token_model else "samples/s"


def rate_value(plan) -> float:
    """The plan's predicted throughput in rate_unit(plan)."""
    p = plan.predicted
    return p.tokens_per_s if rate_unit(plan) == "tok/s" and p.tokens_per_s is not None else p.samples_per_s


def _critical_rank(plan) -> int | None:
    v = (plan.predicted.time_breakdown or {}).get("critical_pp_rank")
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def build_context(plan, graph=None) -> dict:
    c = plan.cluster
    nodes, gpn = int(c.get("nodes", 1) or 1), int(c.get("gpus_per_node", 8) or 8)
    # cp ranks sit between dp and tp: drawn as the data axis's inner part (dp x cp ranks, cp inner)
    pp, dp, tp = plan.mesh.pp, plan.mesh.dp * (plan.mesh.cp or 1), plan.mesh.tp
    # The drawing covers the mesh's ranks; a plan using fewer GPUs than the cluster leaves the rest idle.
    mesh_nodes = min(nodes, max(1, -(-plan.mesh.world_size // gpn)))
    detail_ids = mesh.detail_nodes(pp, dp, tp, gpn, mesh_nodes)
    events, drawn = timeline.schedule_events(plan)
    p2p = [t[2] for t in timeline.stage_times(plan)]
    mem_rows = memory.memory_rows(plan.predicted.memory_breakdown, _capacity(plan))
    title = f"autopar plan: {plan.model.get('name') or 'model'} on {plan.mesh.world_size} GPUs"
    return {
        "title": title,
        "plan": plan,
        "s": summary(plan),
        "mesh_axes": mesh.axis_rows(pp, dp, tp, gpn, plan.mesh.dp_shard if plan.mesh.hsdp else None),
        # the overview adds nothing when the detail already draws every node
        "mesh_overview": mesh.overview_svg(pp, dp, tp, gpn, mesh_nodes) if len(detail_ids) < mesh_nodes else None,
        "mesh_detail": mesh.detail_svg(pp, dp, tp, gpn, detail_ids),
        "mesh_detail_nodes": detail_ids,
        "pp0_nodes": max(1, -(-(dp * tp) // gpn)),
        "mesh_nodes": mesh_nodes,
        "gpus_per_node": gpn,
        "stage_rows": tables.stage_rows(plan),
        "layer_runs": tables.layer_runs(plan, graph),
        "has_params": graph is not None,
        "gantt": gantt.gantt_svg(events, pp, p2p, plan.schedule == "interleaved") if events else None,
        "gantt_drawn": drawn,
        "memory_svg": memory.memory_svg(mem_rows) if mem_rows else None,
        "memory_rows": mem_rows,
        "time_rows": tables.time_rows(plan),
        "comm_rows": tables.comm_rows(plan),
        "alternatives": tables.alternative_rows(plan, rate_unit(plan)),
        "baselines": tables.baseline_rows(plan, rate_unit(plan)),
        "not_offered": tables.not_offered(plan),
        "assumptions": tables.flatten(plan.assumptions),
        "cluster_rows": tables.flatten(plan.cluster),
        "constraints": tables.flatten(plan.constraints),
        "solver_rows": tables.flatten(plan.solver),
        "solver_headline": [(label, _solver_value(k, plan.solver[k])) for k, label in SOLVER_HEADLINE.items()
                            if k in plan.solver],
        "critical_rank": _critical_rank(plan),
        "hand_checks": hand_checks(plan),
        "link_rows": link_rows(plan),
        "fusions": plan.fusions,
        "priced_for": priced_for(plan),
        "fmt": fmt,
    }
