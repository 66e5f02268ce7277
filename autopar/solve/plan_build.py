"""The Plan the planner returns, written from the winner's one estimate: its stages
and per-layer choices, the predicted numbers, the solver's account (`solver`) and
what the numbers assume (`assumptions`).
"""
from __future__ import annotations

from cost_models.float8 import linear_paths
from cost_models.layer_compute import tp_for

from autopar.plan import LayerChoice, Mesh, Plan, Predicted, Stage
from autopar.solve.refine import assignment_of
from autopar.solve.search import SearchResult
from autopar.solve.search_space import Candidate

TP_KINDS = ("transformer_block", "attention", "mlp", "moe_block")
GB = 1e9


def tp_style(layer, tp: int, sequence_parallel: bool) -> str:
    if tp == 1 or tp not in (layer.tp_degrees or (1,)):
        return "sequence" if tp > 1 and sequence_parallel and layer.kind == "norm" else "replicate"
    if layer.kind in ("embedding", "head"):
        return "vocab"
    if layer.kind == "norm":
        return "sequence" if sequence_parallel else "replicate"
    if layer.kind in TP_KINDS or layer.tp_allreduces:
        return "colwise_rowwise"
    return "replicate"


def build_plan(spec, cluster, pins, gbs, precision, optimizer, winner, result, selection) -> Plan:
    r, layout, est = winner
    c: Candidate = r.candidate
    choices = assignment_of(layout)
    stages = []
    start = 0
    per_stage = list(getattr(est, "per_stage", []) or [])
    for s, count in enumerate(layout.stage_layers):
        layers = []
        for i in range(start, start + count):
            layer = spec.layers[i]
            zero, ckpt, off = choices[i]
            float8 = est.layer_float8[i] if i < len(est.layer_float8) else False
            layers.append(LayerChoice(name=layer.name, kind=layer.kind,
                                      module_paths=list(layer.module_paths or [layer.name]), zero=zero,
                                      reshard_after_forward=zero == 3, checkpoint=ckpt, offload=off,
                                      tp_style=tp_style(layer, c.tp, c.sequence_parallel),
                                      float8=linear_paths(layer, c.micro_batch_size, spec.seq_len,
                                                          tp_for(layer, c.tp)) if float8 else []))
        start += count
        stages.append(Stage(index=s, pp_rank=s % c.pp, layers=layers,
                            predicted=_plain(per_stage[s]) if s < len(per_stage) else {}))
    device = cluster.device_profile
    capacity = float(device.usable_memory_bytes)
    breakdown = [dict(_plain(b), capacity=_plain(b).get("capacity", capacity))
                 for b in (est.memory_breakdown or [])]
    predicted = Predicted(step_time_s=float(est.step_time_s), tokens_per_s=float(est.tokens_per_s),
                          tflops_per_gpu=float(est.tflops_per_gpu), mfu=float(est.mfu),
                          peak_memory_bytes=[float(x) for x in est.peak_memory_bytes], memory_breakdown=breakdown,
                          time_breakdown=_plain(est.time_breakdown),
                          comm=[dict(_plain(x), exposed_s=_plain(x).get("exposed_s", _plain(x).get("time_s", 0.0)))
                                for x in (est.comm or [])])
    return Plan(
        model={"name": spec.name, "source": getattr(spec, "source", None), "total_params": int(spec.total_params),
               "num_layers": len(spec.layers), "seq_len": spec.seq_len},
        cluster=cluster.to_dict(), global_batch_size=gbs, seq_len=spec.seq_len, precision=precision,
        mesh=Mesh(pp=c.pp, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard or None, ep=c.ep or None,
                  cp=c.cp if c.cp > 1 else None), sequence_parallel=c.sequence_parallel, schedule=c.schedule,
        virtual_stages=c.virtual_stages, micro_batch_size=c.micro_batch_size, num_micro_batches=c.num_micro_batches,
        stages=stages, predicted=predicted, grad_reduce_dtype=layout.grad_reduce_dtype,
        solver=_solver_info(result, r, selection),
        assumptions=_assumptions(cluster, est, precision, optimizer),
        constraints=pins.to_dict())


def _solver_info(result: SearchResult, winner, selection: dict) -> dict:
    """`status` speaks for the Plan, whose numbers are the cost model's: "optimal" only when
    the solver proved its optimum and nothing priced faster (`selection`); otherwise
    "feasible", with `gap` None when the Plan is not the solver's answer (no bound holds
    for it). `solver_status` / `solver_gap` are the solver's own, over its step model."""
    sol = winner.solution
    proven = selection["proven_optimal"]
    return {
        "engine": "ortools CP-SAT (per candidate) + bound pruning over candidates",
        "status": "optimal" if proven else "feasible",
        "gap": round(result.max_gap, 6) if selection["selected"] == "solver optimum" else None,
        "solver_status": "optimal" if result.all_optimal else "feasible",
        "solver_gap": round(result.max_gap, 6),
        "optimal_for": "the solver's closed-form step model; the Plan's numbers are cost_models.estimate's "
                       "pipeline simulation, checked against uniform layouts and stage-boundary moves",
        **{k: (round(v, 9) if isinstance(v, float) else v) for k, v in selection.items() if k != "proven_optimal"},
        "objective_step_time_s": round(winner.step_s, 9) if winner.step_s is not None else None,
        "candidates": result.candidates,
        "solved": result.solved,
        "pruned_by_bound": result.pruned,
        "oom": len(result.oom),
        "unresolved": result.stats.get("unresolved"),
        "unexplored": result.stats.get("unexplored"),
        "winner_status": sol.status if sol is not None else winner.status,
        "workers": 1,
        "units": {"time": "1 ns", "memory": "1 KiB"},
    }


def _assumptions(cluster, est, precision, optimizer) -> dict:
    device = cluster.device_profile
    out = {
        "device": device.name,
        "peak_tflops": device.peak(precision) / 1e12 if precision in device.peak_flops else None,
        "memory_gb": device.memory_bytes / GB,
        "reserve_gb": device.reserve_bytes / GB,
        "gemm_max_efficiency": device.gemm_max_efficiency,
        "attention_fwd_efficiency": device.attention_fwd_efficiency,
        "attention_bwd_efficiency": device.attention_bwd_efficiency,
        "memory_efficiency": device.memory_efficiency,
        "intra_node_link": cluster.intra_node_link,
        "inter_node_link": cluster.inter_node_link,
        "precision": precision,
        "optimizer": optimizer,
        "step_time_model": "(m + (pp-1)/V) x slowest pp rank per micro-batch + slowest rank's exposed "
                           "data-parallel communication and optimizer step (solver); final numbers from "
                           "cost_models.estimate",
    }
    extra = getattr(est, "assumptions", None)
    if isinstance(extra, dict):
        out["cost_model"] = _plain(extra)
    return out


def _plain(x):
    """JSON-safe copy (floats, ints, strings, lists, dicts) for the Plan."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return int(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)
