"""`autopar.plan`: ModelGraph x ClusterSpec -> Plan.

1. resolve the cluster, capture the model (or take a ModelSpec as is);
2. parse and check the pinned constraints;
3. enumerate candidates (`search_space.py`), build each one's integer cost
   table from `cost_models.estimate.layer_cost` (`table.py`);
4. branch and bound over candidates with CP-SAT per candidate (`search.py`,
   `cpsat.py`);
5. price the best few with `cost_models.estimate.estimate` on their exact
   stage partition and per-layer choices, keep the fastest that fits, and
   write every number of the Plan from that one estimate.
"""
from __future__ import annotations

import copy
import dataclasses
import math

from cost_models.errors import CostModelError
from cost_models.estimate import estimate
from cost_models.hardware import ClusterSpec

from autopar.errors import ClusterSpecError, InfeasibleError
from autopar.plan import LayerChoice, Mesh, Plan, Predicted, Stage
from autopar.solve.constraints import Constraints, check_against_cluster, parse_constraints
from autopar.solve.layout import assignment_layout
from autopar.solve.cpsat import solve_cpsat
from autopar.solve.fusion_costs import charge_fusions, plan_fusions
from autopar.solve.problem import KIB, NS, memory_floor, time_lower_bound, to_mem_units
from autopar.solve.search import CandidateResult, SearchResult, search
from autopar.solve.search_space import Candidate, enumerate_candidates
from autopar.solve.table import TableBuilder

TP_KINDS = ("transformer_block", "attention", "mlp", "moe_block")
GB = 1e9


# -- inputs ------------------------------------------------------------------
def resolve_cluster(cluster_spec) -> ClusterSpec:
    try:
        return ClusterSpec.resolve(cluster_spec)
    except CostModelError as exc:
        raise ClusterSpecError(str(exc)) from exc


def scaled_cluster(cluster: ClusterSpec, nodes: int, gpus_per_node: int | None = None) -> ClusterSpec:
    """The same hardware with another node count (and optionally GPUs per node)."""
    d = cluster.to_dict()
    d.pop("world_size", None)  # derived; from_dict checks it against nodes x gpus_per_node
    d["nodes"] = nodes
    if gpus_per_node is not None:
        d["gpus_per_node"] = gpus_per_node
    try:
        return ClusterSpec.from_dict(d, file=cluster.source)
    except CostModelError as exc:
        raise ClusterSpecError(str(exc)) from exc


def model_spec(model, example_inputs=None, *, seq_len=None, name=None):
    """A ModelSpec/ModelGraph as is, or the capture of an nn.Module; seq_len overrides the traced one."""
    if hasattr(model, "layers") and not callable(getattr(model, "forward", None)):
        spec = model
    else:
        from autopar.capture import capture  # the solver needs capture only for nn.Modules
        # Without example_inputs capture infers them for the common model families (HF, token,
        # image models) and raises CaptureError saying what to pass when it cannot.
        spec = capture(model, example_inputs, **({"name": name} if name else {}))
    if seq_len is not None and seq_len != spec.seq_len:
        spec = copy.copy(spec)  # expressions are symbolic in S: a new length is a new value, not a re-trace
        spec.seq_len = int(seq_len)
        if getattr(spec, "tokens_per_sample", 1) > 1:
            spec.tokens_per_sample = int(seq_len)
    return spec


def tp_degrees(model) -> tuple:
    """Tensor-parallel sizes every splittable layer accepts (blocks decide; odd vocabularies run replicated)."""
    layers = [l for l in model.layers if l.kind in TP_KINDS] or [l for l in model.layers if l.tp_allreduces]
    if not layers:
        return (1,)
    allowed = set(layers[0].tp_degrees) | {1}
    for layer in layers[1:]:
        allowed &= set(layer.tp_degrees) | {1}
    return tuple(sorted(allowed))


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


# -- the search ----------------------------------------------------------------
def _stage_layers(problem, solution) -> list[int]:
    counts = [0] * problem.num_stages
    for s in solution.stage_of_layer:
        counts[s] += 1
    return counts


def _choices(problem, solution) -> list[tuple]:
    return [problem.option_labels[problem.group_options[g][k].option]
            for g, k in zip(problem.layer_group, solution.option_of_layer)]


def _price(model, cluster, result, precision, optimizer):
    layout = assignment_layout(result.candidate, _stage_layers(result.problem, result.solution),
                               _choices(result.problem, result.solution), precision=precision, optimizer=optimizer)
    return layout, estimate(model, layout, cluster)


def _repair(spec, cluster, r, est, precision, optimizer, time_limit_s, rounds: int = 2):
    """Re-solve a candidate whose priced layout overflows memory, with each
    overflowing rank's capacity lowered by its overshoot. A safety net only:
    the solver's memory rule is the estimate's (exact per-chunk activations,
    buffers rounded up), so this should never run; `Plan.solver
    ["memory_repairs"]` counts the times it did, and the tests require 0.
    Returns a priced (result, layout, estimate) that fits, or None."""
    problem = r.problem
    for _ in range(rounds):
        cap = est.memory_breakdown[0].get("capacity", cluster.device_profile.usable_memory_bytes)
        over = [max(0.0, peak - cap) for peak in est.peak_memory_bytes]
        if not any(over) or len(over) != problem.pp:
            return None
        problem = dataclasses.replace(problem, capacity=[c - to_mem_units(1.02 * o + 2**20) if o else c
                                                         for c, o in zip(problem.capacity, over)])
        sol = solve_cpsat(problem, time_limit_s=min(0.3, time_limit_s))
        if sol.objective is None:
            return None
        fixed = CandidateResult(r.candidate, problem, r.lower_bound_s, solution=sol, status="ok")
        layout, est = _price(spec, cluster, fixed, precision, optimizer)
        if est.fits:
            return fixed, layout, est
    return None


def _gpu_overflow(est) -> bool:
    """Some pp rank over its GPU's usable memory (host-memory limits of offload are separate)."""
    return any(peak > b.get("capacity", math.inf) for peak, b in zip(est.peak_memory_bytes, est.memory_breakdown))


def _with_repairs(spec, cluster, priced, precision, optimizer, time_limit_s, limit: int = 2, counter=None):
    """Priced layouts, the first `limit` overflowing ones replaced by their repair when it fits.
    counter (a dict) gets the number of solver-feasible layouts the estimate found overflowing."""
    out, tried = [], 0
    if counter is not None:
        counter["memory_repairs"] = counter.get("memory_repairs", 0) + sum(_gpu_overflow(x[2]) for x in priced)
    best_fit = min((x[2].step_time_s for x in priced if x[2].fits), default=float("inf"))
    for x in priced:
        # only worth it when the solver thought it faster than the best layout that already fits
        if not x[2].fits and tried < limit and x[0].step_s < best_fit:
            tried += 1
            fixed = _repair(spec, cluster, x[0], x[2], precision, optimizer, time_limit_s)
            if fixed is not None:
                x = fixed
        out.append(x)
    return out


def _run_search(model, cluster, constraints, global_batch_size, precision, optimizer, keep, time_limit_s,
                progress=None, offload=False):
    world = cluster.world_size
    cands, space = enumerate_candidates(world, global_batch_size, len(model.layers), tp_degrees(model), constraints)
    if not cands:
        raise InfeasibleError(
            f"no valid mesh for {world} GPUs, global batch {global_batch_size} and {len(model.layers)} layers"
            + (f" ({space.summary()})" if space.rejected else ""),
            hint="choose a GPU count with pp x dp x tp factorisations the model and batch allow "
                 "(dp must divide the global batch, tp the attention heads), or relax the pinned flags")
    builder = TableBuilder(model, cluster, constraints=constraints, precision=precision, optimizer=optimizer,
                           offload=offload)
    # First pass: 6 work units, not search's 15. Candidates it does not reach are still
    # ranked by their warm start; on GPT-3 175B / 64 GPUs (the slowest benchmark case)
    # the other 9 units changed no plan and cost 35 s.
    result = search(cands, builder, bound=builder.bound, keep=keep, time_limit_s=time_limit_s, progress=progress,
                    distinct=_mesh_key, sweep=lambda c: int(c.schedule == "interleaved"), first_pass_budget=6.0)
    return result, builder


def _fill_problems(result: SearchResult, builder) -> None:
    """Candidates ruled out by the cheap bound have no table; give them the bound table."""
    for r in result.oom:
        if r.problem is None:
            r.problem = builder.bound_problem(r.candidate)


def _mesh_key(c: Candidate) -> tuple:
    return (c.pp, c.dp, c.tp)


def _to_price(result: SearchResult, keep: int) -> list:
    """The solver's best eight (the cost model's pipeline simulation can reorder
    close ones), plus the best of each mesh kept exact."""
    out, meshes = list(result.ranked[:8]), set()
    for r in result.ranked:
        if _mesh_key(r.candidate) not in meshes and len(meshes) < keep:
            meshes.add(_mesh_key(r.candidate))
            if r not in out:
                out.append(r)
    return out


def _min_memory_per_gpu(result: SearchResult, reserve: float) -> float:
    """Smallest per-GPU footprint any candidate could reach (its memory lower bound)."""
    best = math.inf
    for r in result.oom:
        if r.problem is not None and r.problem.num_layers >= r.problem.num_stages:
            best = min(best, memory_floor(r.problem) * KIB + reserve)
    return best


def _smallest_world(model, cluster, constraints, global_batch_size, precision, optimizer) -> int | None:
    """Smallest GPU count (whole nodes, doubling) at which some layout fits."""
    free = Constraints(**{**constraints.__dict__, "dp": None, "pp": None})
    g = cluster.gpus_per_node
    nodes = cluster.nodes
    for _ in range(12):
        nodes *= 2
        bigger = scaled_cluster(cluster, nodes)
        try:
            result, _ = _run_search(model, bigger, free, global_batch_size, precision, optimizer, 3, 2.0,
                                    offload=free.offload is None)
        except InfeasibleError:
            continue
        if any(_price(model, bigger, r, precision, optimizer)[1].fits for r in result.ranked):
            return nodes * g
    return None


def plan(model, cluster_spec, example_inputs=None, global_batch_size: int | None = None, constraints=None,
         seq_len: int | None = None, precision: str = "bf16", top_k: int = 5, *, optimizer: str = "adam",
         time_limit_s: float = 1.0, progress=None, name: str | None = None, source: str | None = None,
         fusion: bool = True, module=None) -> Plan:
    """Search the best parallel layout of `model` on `cluster_spec` and return it as a Plan.

    model: an nn.Module (captured with example_inputs) or a ModelSpec/ModelGraph.
    cluster_spec: a ClusterSpec, preset name ('dgx-h100:4'), device name or file path.
    constraints: dict with any of tp, pp, dp, micro_batch, zero, checkpoint,
    schedule ('gpipe' | '1f1b' | 'interleaved[:V]'), sequence_parallel, offload.
    fusion: run the fusion pass and record its chains in `Plan.fusions`; on a
    GPU device profile the cost model then charges the fused kernels' bytes.
    module: the nn.Module behind `model` when `model` is an already captured
    ModelGraph (the fusion pass traces modules, not the graph).
    """
    cluster = resolve_cluster(cluster_spec)
    pins = parse_constraints(constraints)
    spec = model_spec(model, example_inputs, seq_len=seq_len, name=name)
    fusions, no_fusion_why = [], "turned off (fusion=False)"
    if fusion:
        is_module = callable(getattr(model, "forward", None))  # as model_spec decides
        torch_module = module if module is not None else (model if is_module else None)
        fusions, no_fusion_why = plan_fusions(torch_module, spec)
    unfused_spec, spec = spec, charge_fusions(spec, fusions, cluster.device_profile)
    world = cluster.world_size
    batch_assumed = global_batch_size is None
    if batch_assumed:
        global_batch_size = world  # one sample per GPU; recorded in the plan's assumptions
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise InfeasibleError(f"global batch size must be a positive integer, got {global_batch_size!r}")
    check_against_cluster(pins, world, global_batch_size)
    # Distinct meshes kept exact by the search (the winner and two runners-up): more
    # would loosen the pruning cutoff and multiply the solves for little insight.
    keep = 3 if top_k > 0 else 1
    result, builder = _run_search(spec, cluster, pins, global_batch_size, precision, optimizer, keep, time_limit_s,
                                  progress)
    if result.best is None and pins.offload is None:
        # Second pass: nothing fits without CPU offload; let layers offload.
        result, builder = _run_search(spec, cluster, pins, global_batch_size, precision, optimizer, keep,
                                      time_limit_s, progress, offload=True)
    device = cluster.device_profile
    first, first_builder = result, builder
    priced = [(r, *_price(spec, cluster, r, precision, optimizer)) for r in _to_price(result, keep)]
    first_peaks = [max(x[2].peak_memory_bytes) + device.reserve_bytes for x in priced]
    repairs: dict = {}
    priced = _with_repairs(spec, cluster, priced, precision, optimizer, time_limit_s, counter=repairs)
    fitting = [x for x in priced if x[2].fits]
    if not fitting and not pins.offload and result.ranked and not any(
            o != "none" for _, _, o in builder.options):
        # The solver's memory model passed them but the full estimate did not: try with offload too.
        result, builder = _run_search(spec, cluster, pins, global_batch_size, precision, optimizer, keep,
                                      time_limit_s, progress, offload=True)
        priced = [(r, *_price(spec, cluster, r, precision, optimizer)) for r in _to_price(result, keep)]
        priced = _with_repairs(spec, cluster, priced, precision, optimizer, time_limit_s, counter=repairs)
        fitting = [x for x in priced if x[2].fits]
    _fill_problems(result, builder)
    if not fitting:
        _fill_problems(first, first_builder)
        need = min([_min_memory_per_gpu(first, device.reserve_bytes)] + first_peaks)
        why = next((x[2].why_not_fit for x in priced if x[2].why_not_fit), "")
        smallest = _smallest_world(spec, cluster, pins, global_batch_size, precision, optimizer)
        pinned = f" with {', '.join(f'{k}={v}' for k, v in pins.to_dict().items())}" if pins.to_dict() else ""
        if math.isfinite(need) and need > device.memory_bytes:
            need_txt = f"it needs at least {need / GB:.1f} GB per GPU without CPU offload"
        elif math.isfinite(need):
            need_txt = (f"no layout fits in GPU memory without CPU offload (its memory lower bound is {need / GB:.1f} "
                        "GB per GPU; whole layers per stage and buffers push every layout over)")
        else:
            need_txt = "no layout fits in GPU memory without CPU offload"
        if why:
            need_txt += f", and with offload the best layout does not fit either ({why})"
        raise InfeasibleError(
            f"{spec.name} does not fit on {world} x {device.name}{pinned}: {need_txt} "
            f"(even with ZeRO-3, full checkpointing and CPU offload allowed); "
            f"{device.memory_bytes / GB:.1f} GB per GPU available",
            hint=(f"the smallest GPU count that fits is {smallest}" if smallest else
                  "no GPU count up to 4096x this one fits; use a larger-memory device") +
                 ("; or relax the pinned flags" if pinned else ""),
            min_bytes_per_gpu=need if math.isfinite(need) else None, capacity_bytes=device.memory_bytes,
            smallest_world=smallest, device=device.name)

    # The best few, priced exactly: the fastest that fits wins.
    pool = sorted(fitting, key=lambda x: (x[2].step_time_s, x[0].candidate))
    winner = pool[0]
    plan_obj = _build_plan(spec, cluster, pins, global_batch_size, precision, optimizer, winner, result)
    plan_obj.model["source"] = source or plan_obj.model.get("source")
    plan_obj.alternatives = _alternatives(winner, [x for x in priced if x is not winner], result, top_k)
    plan_obj.fusions = fusions
    plan_obj.assumptions["fusion"] = {
        "enabled": bool(fusion), "chains": len(fusions),
        "charged": spec is not unfused_spec,  # False on a cpu profile (torch fallback) or with nothing fused
        **({"why_none": no_fusion_why} if not fusions and no_fusion_why else {})}
    if batch_assumed:
        plan_obj.assumptions["global_batch_size"] = f"{world} (one sample per GPU; none was given)"
    # No wall-clock times in the Plan: the same inputs must give the same JSON.
    plan_obj.solver["layer_cost_calls"] = builder.layer_cost_calls
    plan_obj.solver["time_limit_work_units"] = time_limit_s
    # priced layouts the solver called feasible and the estimate did not (0 when the
    # two memory models agree, which the tests require)
    plan_obj.solver["memory_repairs"] = repairs.get("memory_repairs", 0)
    return plan_obj


# -- building the Plan -------------------------------------------------------------
def _build_plan(spec, cluster, pins, gbs, precision, optimizer, winner, result) -> Plan:
    r, layout, est = winner
    c: Candidate = r.candidate
    choices = _choices(r.problem, r.solution)
    stages = []
    start = 0
    per_stage = list(getattr(est, "per_stage", []) or [])
    for s, count in enumerate(layout.stage_layers):
        layers = []
        for i in range(start, start + count):
            layer = spec.layers[i]
            zero, ckpt, off = choices[i]
            layers.append(LayerChoice(name=layer.name, kind=layer.kind,
                                      module_paths=list(layer.module_paths or [layer.name]), zero=zero,
                                      reshard_after_forward=zero == 3, checkpoint=ckpt, offload=off,
                                      tp_style=tp_style(layer, c.tp, c.sequence_parallel)))
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
        mesh=Mesh(pp=c.pp, dp=c.dp, tp=c.tp), sequence_parallel=c.sequence_parallel, schedule=c.schedule,
        virtual_stages=c.virtual_stages, micro_batch_size=c.micro_batch_size, num_micro_batches=c.num_micro_batches,
        stages=stages, predicted=predicted,
        solver=_solver_info(result, r),
        assumptions=_assumptions(cluster, est, precision, optimizer),
        constraints=pins.to_dict())


def _solver_info(result: SearchResult, winner) -> dict:
    sol = winner.solution
    return {
        "engine": "ortools CP-SAT (per candidate) + bound pruning over candidates",
        "status": "optimal" if result.all_optimal else "feasible",
        "gap": round(result.max_gap, 6),
        "objective_step_time_s": round(winner.step_s, 9),
        "candidates": result.candidates,
        "solved": result.solved,
        "pruned_by_bound": result.pruned,
        "oom": len(result.oom),
        "unresolved": result.stats.get("unresolved"),
        "unexplored": result.stats.get("unexplored"),
        "winner_status": sol.status,
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


def _summary(c: Candidate, choices) -> dict:
    zeros = sorted({z for z, _, _ in choices})
    ckpts = sorted({k for _, k, _ in choices})
    return {"mesh": {"pp": c.pp, "dp": c.dp, "tp": c.tp}, "schedule": c.schedule, "virtual_stages": c.virtual_stages,
            "micro_batch_size": c.micro_batch_size, "num_micro_batches": c.num_micro_batches,
            "sequence_parallel": c.sequence_parallel,
            "zero": zeros[0] if len(zeros) == 1 else zeros, "checkpoint": ckpts[0] if len(ckpts) == 1 else ckpts}


def _why_slower(est, best) -> str:
    slower = est.step_time_s / best.step_time_s - 1 if best.step_time_s else 0.0
    diffs = {k: est.time_breakdown.get(k, 0.0) - best.time_breakdown.get(k, 0.0)
             for k in ("compute_s", "recompute_s", "tp_comm_s", "pp_comm_s", "dp_comm_exposed_s", "bubble_s",
                       "optimizer_s")}
    key = max(sorted(diffs), key=lambda k: diffs[k])
    words = {"compute_s": "compute", "recompute_s": "recomputation", "tp_comm_s": "tensor-parallel communication",
             "pp_comm_s": "pipeline communication", "dp_comm_exposed_s": "exposed data-parallel communication",
             "bubble_s": "pipeline bubble", "optimizer_s": "optimizer step"}
    if diffs[key] <= 0:
        return f"{slower:.1%} slower"
    return f"{slower:.1%} slower: more {words[key]} (+{diffs[key]:.3g} s per step)"


def _predicted_dict(est) -> dict:
    return {"step_time_s": float(est.step_time_s), "tokens_per_s": float(est.tokens_per_s),
            "tflops_per_gpu": float(est.tflops_per_gpu), "mfu": float(est.mfu),
            "peak_memory_bytes": [float(x) for x in est.peak_memory_bytes]}


def _alternatives(winner, others, result: SearchResult, top_k: int) -> list[dict]:
    best_est = winner[2]
    out = []
    others = sorted(others, key=lambda x: (not x[2].fits, x[2].step_time_s, x[0].candidate))
    # One runner-up per mesh (other meshes first): a reader compares layouts, not micro-batch sizes.
    seen = {_mesh_key(winner[0].candidate)}
    picked = []
    for x in others:
        if _mesh_key(x[0].candidate) not in seen:
            seen.add(_mesh_key(x[0].candidate))
            picked.append(x)
    picked += [x for x in others if x not in picked]
    for r, layout, est in picked[:top_k]:
        alt = _summary(r.candidate, _choices(r.problem, r.solution))
        alt["predicted"] = _predicted_dict(est)
        if est.fits:
            alt.update(status="slower", why=_why_slower(est, best_est))
        else:
            peak = max(est.peak_memory_bytes)
            alt.update(status="oom", why=f"needs {peak / GB:.1f} GB on its fullest GPU (cost model), more than fits")
        out.append(alt)
    # The most promising layouts that cannot fit (by bound), so a reader sees why they are absent.
    # Ordered by the step time they could reach if memory allowed.
    oom = sorted((r for r in result.oom if r.problem is not None and r.problem.num_layers >= r.problem.num_stages),
                 key=lambda r: (time_lower_bound(r.problem) * NS / r.problem.virtual_stages, r.candidate))
    for r in oom[:max(0, top_k - len(out)) or 2]:
        p = r.problem
        need = memory_floor(p) * KIB
        alt = {"mesh": {"pp": r.candidate.pp, "dp": r.candidate.dp, "tp": r.candidate.tp},
               "schedule": r.candidate.schedule, "virtual_stages": r.candidate.virtual_stages,
               "micro_batch_size": r.candidate.micro_batch_size, "num_micro_batches": r.candidate.num_micro_batches,
               "sequence_parallel": r.candidate.sequence_parallel, "zero": None, "checkpoint": None,
               "predicted": {}, "status": "oom",
               "why": f"out of memory: needs at least {need / GB:.1f} GB per GPU for layers alone, "
                      f"{p.capacity[0] * KIB / GB:.1f} GB usable"}
        out.append(alt)
    return out
