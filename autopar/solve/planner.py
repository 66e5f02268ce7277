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

from autopar.engine import AUTOPAR, Engine, engine_of, with_engine
from autopar.errors import ClusterSpecError, InfeasibleError
from autopar.plan import LayerChoice, Mesh, Plan, Predicted, Stage
from autopar.solve.constraints import ConstraintError, Constraints, check_against_cluster, parse_constraints
from autopar.solve.layout import assignment_layout, root_held_layers
from autopar.solve.cpsat import solve_cpsat
from autopar.solve.fusion_costs import charge_fusions, plan_fusions
from autopar.solve.lowering_costs import charge_tp_collectives
from autopar.solve.problem import KIB, NS, memory_floor, time_lower_bound, to_mem_units
from autopar.solve.refine import assignment_of, fits, polish, tidy, uniform_layouts
from autopar.solve.search import CandidateResult, SearchResult, search
from autopar.solve.search_space import Candidate, divisors, enumerate_candidates, whole_batch_reason
from autopar.solve.table import TableBuilder
from autopar.solve.what_fits import checking_a_fix, hint_text, tried_text, what_would_fit

TP_KINDS = ("transformer_block", "attention", "mlp", "moe_block")
GB = 1e9
# Share of usable GPU memory (device memory minus the profile's reserve) the planner
# leaves free: predicted peak <= (1 - headroom) x usable. What the cost model does not
# see lives there: the optimizer step's temporaries (torch's foreach AdamW allocates
# per-group scratch tensors), NCCL communicators and their buffers beyond the reserve,
# allocator fragmentation beyond the modelled 8 % (reserved vs allocated differ by
# 5-10 % on large runs), and the cost model's own error on activations. A plan at
# 97-100 % of memory also runs slower than predicted before it runs out: the caching
# allocator frees and retries (torch.cuda.memory_stats num_alloc_retries > 0) once it
# cannot cache. 10 % of an 80 GB GPU is 7.5 GB.
DEFAULT_MEMORY_HEADROOM = 0.10


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


def model_spec(model, example_inputs=None, *, seq_len=None, name=None, precision: str = "bf16"):
    """A ModelSpec/ModelGraph as is, or the capture of an nn.Module at the training
    precision (its activations in that dtype); seq_len overrides the traced one."""
    if hasattr(model, "layers") and not callable(getattr(model, "forward", None)):
        spec = model
    else:
        from autopar.capture import capture  # the solver needs capture only for nn.Modules
        # Without example_inputs capture infers them for the common model families (HF, token,
        # image models) and raises CaptureError saying what to pass when it cannot.
        spec = capture(model, example_inputs, dtype=precision, **({"name": name} if name else {}))
    if seq_len is not None and seq_len != spec.seq_len:
        spec = copy.copy(spec)  # expressions are symbolic in S: a new length is a new value, not a re-trace
        spec.seq_len = int(seq_len)
        if getattr(spec, "tokens_per_sample", 1) > 1:
            spec.tokens_per_sample = int(seq_len)
    return spec


def tp_degrees(model) -> tuple:
    """Tensor-parallel sizes every splittable layer accepts (blocks decide). A layer
    that splits at no size (an odd vocabulary, ALBERT's MLM head whose LayerNorm
    spans the column-split dim) runs replicated over tp and vetoes nothing."""
    allowed = None
    for layer in _splittable(model):
        allowed = (set(layer.tp_degrees) | {1}) if allowed is None else allowed & (set(layer.tp_degrees) | {1})
    return tuple(sorted(allowed)) if allowed else (1,)


def tp_refusals(model, degrees) -> dict:
    """{tp: why} for each of `degrees` some splittable layer does not accept:
    the first such layer, with the sizes tp must divide."""
    out = {}
    for tp in degrees:
        layer = next((l for l in _splittable(model) if tp not in set(l.tp_degrees)), None)
        if layer is not None:
            sizes = ", ".join(f"{k} {layer.attrs[k]}" for k in ("heads", "kv_heads", "ffn_hidden", "vocab_size")
                              if layer.attrs.get(k))
            out[tp] = f"tp does not divide layer {layer.name}'s {sizes or 'split dimension'}"
    return out


def _splittable(model) -> list:
    layers = [l for l in model.layers if l.kind in TP_KINDS] or [l for l in model.layers if l.tp_allreduces]
    return [l for l in layers if set(l.tp_degrees or (1,)) - {1}]


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
                               _choices(result.problem, result.solution), precision=precision, optimizer=optimizer,
                               root_held=root_held_layers(model), engine=engine_of(model))
    return layout, estimate(model, layout, cluster)


def _repair(spec, cluster, r, est, precision, optimizer, time_limit_s, limit, rounds: int = 2):
    """Re-solve a candidate whose priced layout overflows memory, with each
    overflowing rank's capacity lowered by its overshoot. A safety net only:
    the solver's memory rule is the estimate's (exact per-chunk activations,
    buffers rounded up), so this should never run; `Plan.solver
    ["memory_repairs"]` counts the times it did, and the tests require 0.
    Returns a priced (result, layout, estimate) that fits, or None."""
    problem = r.problem
    for _ in range(rounds):
        over = [max(0.0, peak - limit) for peak in est.peak_memory_bytes]
        if not any(over) or len(over) != problem.pp:
            return None
        problem = dataclasses.replace(problem, capacity=[c - to_mem_units(1.02 * o + 2**20) if o else c
                                                         for c, o in zip(problem.capacity, over)])
        sol = solve_cpsat(problem, time_limit_s=min(0.3, time_limit_s))
        if sol.objective is None:
            return None
        fixed = CandidateResult(r.candidate, problem, r.lower_bound_s, solution=sol, status="ok")
        layout, est = _price(spec, cluster, fixed, precision, optimizer)
        if fits(est, limit):
            return fixed, layout, est
    return None


def _gpu_overflow(est, limit_bytes: float) -> bool:
    """Some pp rank over the memory limit (host-memory limits of offload are separate)."""
    return any(peak > limit_bytes for peak in est.peak_memory_bytes)


def _with_repairs(spec, cluster, priced, precision, optimizer, time_limit_s, limit_bytes, limit: int = 2,
                  counter=None):
    """Priced layouts, the first `limit` overflowing ones replaced by their repair when it fits.
    counter (a dict) gets the number of solver-feasible layouts the estimate found overflowing."""
    out, tried = [], 0
    if counter is not None:
        counter["memory_repairs"] = counter.get("memory_repairs", 0) + sum(_gpu_overflow(x[2], limit_bytes)
                                                                           for x in priced)
    best_fit = min((x[2].step_time_s for x in priced if fits(x[2], limit_bytes)), default=float("inf"))
    for x in priced:
        # only worth it when the solver thought it faster than the best layout that already fits
        if not fits(x[2], limit_bytes) and tried < limit and x[0].step_s < best_fit:
            tried += 1
            fixed = _repair(spec, cluster, x[0], x[2], precision, optimizer, time_limit_s, limit_bytes)
            if fixed is not None:
                x = fixed
        out.append(x)
    return out


def _run_search(model, cluster, constraints, global_batch_size, precision, optimizer, keep, time_limit_s,
                progress=None, offload=False, limit_bytes=None):
    world = cluster.world_size
    cands, space = enumerate_candidates(world, global_batch_size, len(model.layers), tp_degrees(model), constraints,
                                       seq_len=getattr(model, "seq_len", None),
                                       lowering_limits=getattr(model, "lowering_limits", None),
                                       whole_batch=whole_batch_reason(model.layers),
                                       tp_why=tp_refusals(model, divisors(world)))
    if not cands:
        raise InfeasibleError(
            f"no valid mesh for {world} GPUs, global batch {global_batch_size} and {len(model.layers)} layers"
            + (f" ({space.summary()})" if space.rejected else ""),
            hint="choose a GPU count with pp x dp x tp factorisations the model and batch allow "
                 "(dp must divide the global batch, tp the attention heads), or relax the pinned flags")
    builder = TableBuilder(model, cluster, constraints=constraints, precision=precision, optimizer=optimizer,
                           offload=offload, capacity_bytes=limit_bytes)
    # First pass: 6 work units, not search's 15. Candidates it does not reach are still
    # ranked by their warm start; on GPT-3 175B / 64 GPUs (the slowest benchmark case)
    # the other 9 units changed no plan and cost 35 s.
    result = search(cands, builder, bound=builder.bound, keep=keep, time_limit_s=time_limit_s, progress=progress,
                    distinct=_mesh_key, sweep=lambda c: int(c.schedule == "interleaved"), first_pass_budget=6.0)
    result.stats["candidate_list"] = cands  # the space the uniform-layout check walks (not in the Plan)
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
    close ones), plus the best of each mesh kept exact; each with its layers at
    the fastest option that keeps the solver's answer (`refine.tidy`)."""
    out, meshes = list(result.ranked[:8]), set()
    for r in result.ranked:
        if _mesh_key(r.candidate) not in meshes and len(meshes) < keep:
            meshes.add(_mesh_key(r.candidate))
            if r not in out:
                out.append(r)
    return [dataclasses.replace(r, solution=tidy(r.problem, r.solution)) for r in out]


def _min_memory_per_gpu(result: SearchResult, reserve: float) -> float:
    """Smallest per-GPU footprint any candidate could reach (its memory lower bound)."""
    best = math.inf
    for r in result.oom:
        if r.problem is not None and r.problem.num_layers >= r.problem.num_stages:
            best = min(best, memory_floor(r.problem) * KIB + reserve)
    return best


def _smallest_world(model, cluster, constraints, global_batch_size, precision, optimizer,
                    headroom: float = 0.0) -> int | None:
    """Smallest GPU count (whole nodes, doubling) at which some layout fits."""
    free = Constraints(**{**constraints.__dict__, "dp": None, "pp": None})
    g = cluster.gpus_per_node
    nodes = cluster.nodes
    for _ in range(12):
        nodes *= 2
        bigger = scaled_cluster(cluster, nodes)
        limit = (1 - headroom) * bigger.device_profile.usable_memory_bytes
        try:
            result, _ = _run_search(model, bigger, free, global_batch_size, precision, optimizer, 3, 2.0,
                                    offload=free.offload is None, limit_bytes=limit)
        except InfeasibleError:
            continue
        if any(fits(_price(model, bigger, r, precision, optimizer)[1], limit) for r in result.ranked):
            return nodes * g
    return None


def plan(model, cluster_spec, example_inputs=None, global_batch_size: int | None = None, constraints=None,
         seq_len: int | None = None, precision: str = "bf16", top_k: int = 5, *, optimizer: str = "adam",
         time_limit_s: float = 1.0, progress=None, name: str | None = None, source: str | None = None,
         fusion: bool = True, module=None, memory_headroom: float | None = None, check_lowering=None,
         engine: Engine = AUTOPAR) -> Plan:
    """Search the best parallel layout of `model` on `cluster_spec` and return it as a Plan.

    model: an nn.Module (captured with example_inputs) or a ModelSpec/ModelGraph.
    cluster_spec: a ClusterSpec, preset name ('dgx-h100:4'), device name or file path.
    constraints: dict with any of tp, pp, dp, micro_batch, zero, checkpoint,
    schedule ('gpipe' | '1f1b' | 'interleaved[:V]'), sequence_parallel, offload.
    fusion: run the fusion pass and record its chains in `Plan.fusions`; on a
    GPU device profile the cost model then charges the fused kernels' bytes.
    module: the nn.Module behind `model` when `model` is an already captured
    ModelGraph (the fusion pass traces modules, not the graph).
    memory_headroom: share of usable GPU memory left free (0 <= h < 1; default
    DEFAULT_MEMORY_HEADROOM = 0.1): every pp rank's predicted peak stays within
    (1 - h) x usable memory. Also accepted as constraints["memory_headroom"]
    (what `autopar.compile(constraints=...)` passes on). Recorded in
    `Plan.solver["memory_headroom"]` with the limit in bytes.
    check_lowering: `f(module, graph, example_inputs) -> dict` saying which
    layouts the lowering can run (autopar.lower.what_runs.limits; the
    orchestrators pass it, the solver never imports the lowering). Layouts it
    rules out are not searched; the dict is kept in `Plan.solver["lowering_limits"]`.
    engine: who runs the plan (autopar.engine.Engine). autopar's own program by default;
    another engine (`ENGINES["megatron"]`, ...) prices a run made there, kept in
    `Plan.assumptions["engine"]`, and such a plan is refused by the lowering.
    """
    cluster = resolve_cluster(cluster_spec)
    pins = parse_constraints(constraints)
    headroom = resolve_headroom(memory_headroom, pins)
    spec = model_spec(model, example_inputs, seq_len=seq_len, name=name, precision=precision)
    is_module = callable(getattr(model, "forward", None))  # as model_spec decides
    torch_module = module if module is not None else (model if is_module else None)
    lowering_limits = getattr(spec, "lowering_limits", None)  # a graph checked before (what_fits re-plans)
    if check_lowering is not None and torch_module is not None:
        # only the tp degrees this cluster could use (each is one fake-tensor run per block kind)
        world_tp = [t for t in tp_degrees(spec) if t > 1 and cluster.world_size % t == 0
                    and (pins.tp is None or t == pins.tp)]
        lowering_limits = check_lowering(torch_module, spec, example_inputs, tp_degrees=world_tp)
    if engine.counted_tp_collectives:
        spec = charge_tp_collectives(spec, lowering_limits)  # tp priced as the lowering issues it
    spec = with_engine(spec, engine)  # another engine's attention kernel; every layout built from it
    fusions, no_fusion_why = [], "turned off (fusion=False)"
    if fusion:
        fusions, no_fusion_why = plan_fusions(torch_module, spec)
        found = len(fusions)
        fusions = [f for f in fusions if engine.runs_fused(f["pattern"])]  # another engine fuses its own
        if found and not fusions:
            no_fusion_why = f"the {engine.name} engine runs none of the {found} fusable chains found as one kernel"
    unfused_spec, spec = spec, charge_fusions(spec, fusions, cluster.device_profile)
    for s in (unfused_spec, spec):
        s.lowering_limits = lowering_limits
        s.engine = engine
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
    device = cluster.device_profile
    limit = (1 - headroom) * device.usable_memory_bytes  # what every pp rank's predicted peak must stay within
    result, builder = _run_search(spec, cluster, pins, global_batch_size, precision, optimizer, keep, time_limit_s,
                                  progress, limit_bytes=limit)
    if result.best is None and pins.offload is None:
        # Second pass: nothing fits without CPU offload; let layers offload.
        result, builder = _run_search(spec, cluster, pins, global_batch_size, precision, optimizer, keep,
                                      time_limit_s, progress, offload=True, limit_bytes=limit)
    first, first_builder = result, builder
    priced = [(r, *_price(spec, cluster, r, precision, optimizer)) for r in _to_price(result, keep)]
    first_peaks = [max(x[2].peak_memory_bytes) + device.reserve_bytes for x in priced]
    repairs: dict = {}
    priced = _with_repairs(spec, cluster, priced, precision, optimizer, time_limit_s, limit, counter=repairs)
    fitting = [x for x in priced if fits(x[2], limit)]
    if not fitting and not pins.offload and result.ranked and not any(
            o != "none" for _, _, o in builder.options):
        # The solver's memory model passed them but the full estimate did not: try with offload too.
        result, builder = _run_search(spec, cluster, pins, global_batch_size, precision, optimizer, keep,
                                      time_limit_s, progress, offload=True, limit_bytes=limit)
        priced = [(r, *_price(spec, cluster, r, precision, optimizer)) for r in _to_price(result, keep)]
        priced = _with_repairs(spec, cluster, priced, precision, optimizer, time_limit_s, limit, counter=repairs)
        fitting = [x for x in priced if fits(x[2], limit)]
    _fill_problems(result, builder)
    if not fitting:
        _fill_problems(first, first_builder)
        need = min([_min_memory_per_gpu(first, device.reserve_bytes)] + first_peaks)
        why = next((x[2].why_not_fit for x in priced if x[2].why_not_fit), "")
        smallest = (None if checking_a_fix() else  # a what_fits re-plan: "does not fit" is its whole answer
                    _smallest_world(spec, cluster, pins, global_batch_size, precision, optimizer, headroom))
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
        within = (f" ({limit / GB:.1f} GB usable after the {headroom:.0%} memory headroom)" if headroom else "")
        # What the search was allowed (pins held, not "allowed") and the changes re-planned and found to fit.
        fixes = what_would_fit(spec, cluster, pins, global_batch_size, precision, optimizer, replan=plan,
                               headroom=headroom, smallest_world=smallest, time_limit_s=time_limit_s)
        raise InfeasibleError(
            f"{spec.name} does not fit on {world} x {device.name}{pinned}: {need_txt} "
            f"({tried_text(pins)}); "
            f"{device.memory_bytes / GB:.1f} GB per GPU available{within}",
            hint=hint_text(fixes),
            min_bytes_per_gpu=need if math.isfinite(need) else None, capacity_bytes=device.memory_bytes,
            smallest_world=smallest, device=device.name, fixes=fixes)

    # The best few, priced exactly, against the best uniform layouts of the same space;
    # the fastest that fits wins, then its stage boundaries move while estimate agrees.
    solver_pick = min(fitting, key=lambda x: (x[2].step_time_s, x[0].candidate))
    uniform, uniform_priced = uniform_layouts(
        spec, cluster, result.stats.get("candidate_list", []), builder.options, bound_problem=builder.bound_problem,
        precision=precision, optimizer=optimizer, limit_bytes=limit, best_s=solver_pick[2].step_time_s)
    uniform = [(CandidateResult(c, None, None, status="uniform"), layout, est) for c, _, layout, est in uniform]
    pool = sorted(fitting + uniform[:keep], key=lambda x: (x[2].step_time_s, x[0].status == "uniform",
                                                           x[0].candidate))
    chosen = pool[0]
    layout, est, moves = polish(spec, cluster, chosen[1], chosen[2], limit_bytes=limit)
    winner = chosen if not moves else (dataclasses.replace(chosen[0], status="polished"), layout, est)
    selection = _selection(result, solver_pick, chosen, winner, uniform, uniform_priced, moves)
    plan_obj = _build_plan(spec, cluster, pins, global_batch_size, precision, optimizer, winner, result, selection)
    plan_obj.model["source"] = source or plan_obj.model.get("source")
    plan_obj.alternatives = _alternatives(winner, [x for x in priced + uniform[:keep] if x is not chosen], result,
                                          top_k, limit)
    plan_obj.set_throughput()  # samples/s everywhere, tokens/s only for a token model (seq_len set)
    plan_obj.fusions = fusions
    if not engine.is_autopar:
        plan_obj.assumptions["engine"] = engine.to_dict()
    if pins.zero in (0, 1) and any(c.zero != pins.zero for c in plan_obj.layer_choices):
        plan_obj.assumptions["zero"] = (
            f"ZeRO {pins.zero} was pinned; on this mesh the lowering runs it as ZeRO 2 (FSDP2, the only data "
            f"parallelism that composes with tensor/pipeline parallelism or other FSDP2 layers, has no "
            f"whole-gradient mode), so the plan states and prices ZeRO 2: the same bytes on the wire, "
            f"gradients sharded")
    unwrapped = [c.name for c in plan_obj.layer_choices if c.checkpoint == "none" and len(c.module_paths) > 1]
    if pins.checkpoint not in (None, "none") and unwrapped:
        plan_obj.assumptions["checkpoint"] = (
            f"checkpoint {pins.checkpoint} was pinned; {', '.join(unwrapped)} run(s) without recomputation (the "
            f"lowering recomputes a layer by wrapping its one module, and these are several), as priced")
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
    plan_obj.solver["memory_headroom"] = headroom
    if lowering_limits is not None:
        plan_obj.solver["lowering_limits"] = lowering_limits
    plan_obj.solver["memory_limit_bytes"] = limit
    return plan_obj


def resolve_headroom(memory_headroom, pins: Constraints) -> float:
    """The headroom in force: the argument, else constraints["memory_headroom"], else the default."""
    value = memory_headroom if memory_headroom is not None else pins.memory_headroom
    if value is None:
        return DEFAULT_MEMORY_HEADROOM
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConstraintError(f"memory headroom must be a fraction of usable memory in [0, 1), got {value!r}",
                              hint="e.g. 0.1 leaves 10% of each GPU's usable memory free; 0 plans to the limit")
    return float(value)


def _selection(result: SearchResult, solver_pick, chosen, winner, uniform, uniform_priced: int, moves: int) -> dict:
    """How the returned layout was chosen, and whether "optimal" may be claimed: only when
    the solver proved its optimum, the Plan is that optimum, and neither a uniform layout
    nor a stage-boundary move priced faster under the cost model (what the Plan reports)."""
    is_solver_best = chosen[0].status != "uniform" and result.best is not None and (
        chosen[0].candidate == result.best.candidate)
    if chosen[0].status == "uniform":
        how = "uniform layout"
    elif is_solver_best:
        how = "solver optimum"
    else:
        how = "solver runner-up"  # the pipeline simulation re-ranked the solver's best few
    if moves:
        how += " + stage boundaries moved"
    pick = solver_pick[2].step_time_s
    out = {"selected": how, "solver_pick_step_time_s": pick,
           "uniform_layouts_priced": uniform_priced,
           "best_uniform_step_time_s": uniform[0][2].step_time_s if uniform else None,
           "stage_moves": moves,
           "proven_optimal": bool(result.all_optimal and is_solver_best and not moves)}
    if winner[2].step_time_s < pick:
        out["note"] = (f"{how}: {1 - winner[2].step_time_s / pick:.1%} faster than the solver's pick "
                       f"({pick * 1e3:.1f} ms) under the cost model's pipeline simulation, which the solver's "
                       "closed-form step model does not follow exactly; optimality is not proven")
    return out


# -- building the Plan -------------------------------------------------------------
def _build_plan(spec, cluster, pins, gbs, precision, optimizer, winner, result, selection) -> Plan:
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


def _summary(c: Candidate, choices) -> dict:
    zeros = sorted({z for z, _, _ in choices})
    ckpts = sorted({k for _, k, _ in choices})
    return {"mesh": {"pp": c.pp, "dp": c.dp, "tp": c.tp}, "schedule": c.schedule, "virtual_stages": c.virtual_stages,
            "micro_batch_size": c.micro_batch_size, "num_micro_batches": c.num_micro_batches,
            "sequence_parallel": c.sequence_parallel,
            "zero": zeros[0] if len(zeros) == 1 else zeros, "checkpoint": ckpts[0] if len(ckpts) == 1 else ckpts}


_TIME_WORDS = {"compute_s": "compute", "recompute_s": "recomputation", "tp_comm_s": "tensor-parallel communication",
               "pp_comm_s": "pipeline communication", "dp_comm_exposed_s": "exposed data-parallel communication",
               "bubble_s": "pipeline bubble", "optimizer_s": "optimizer step"}


def _sched(a: dict) -> str:
    # pp = 1 is schedule `accumulate` (autopar.plan.ACCUMULATE), its one name everywhere
    return a["schedule"] + (f":{a['virtual_stages']}" if a["schedule"] == "interleaved" else "")


def _differences(alt: dict, best: dict) -> list[str]:
    """What the alternative changes against the plan, in the plan's words ('schedule
    interleaved:2 (plan interleaved:3)'); empty when only the stage split / per-layer mix differs."""
    out = []
    mesh = lambda a: "pp{pp} x dp{dp} x tp{tp}".format(**a["mesh"])  # noqa: E731
    for what, value in (("mesh", mesh), ("schedule", _sched),
                        ("micro-batch", lambda a: f"{a['micro_batch_size']} x {a['num_micro_batches']}"),
                        ("sequence parallel", lambda a: "on" if a["sequence_parallel"] else "off"),
                        ("zero", lambda a: str(a["zero"])), ("checkpoint", lambda a: str(a["checkpoint"]))):
        if value(alt) != value(best):
            out.append(f"{what} {value(alt)} (plan {value(best)})")
    return out


def _why_slower(est, best, diffs: list[str]) -> str:
    slower = est.step_time_s / best.step_time_s - 1 if best.step_time_s else 0.0
    deltas = {k: est.time_breakdown.get(k, 0.0) - best.time_breakdown.get(k, 0.0) for k in _TIME_WORDS}
    key = max(sorted(deltas), key=lambda k: deltas[k])
    digits = 1 if slower >= 0.001 else 3  # a near-tie still shows a difference
    text = f"{slower:.{digits}%} slower (+{(est.step_time_s - best.step_time_s) * 1e3:.{digits}f} ms per step)"
    if deltas[key] > 0:
        text += f": more {_TIME_WORDS[key]} (+{deltas[key] * 1e3:.{digits}f} ms)"
    what = ("; ".join(diffs) if diffs else
            "same mesh, schedule and micro-batching, other stage split / per-layer choices")
    return f"{text}; {what}"


def _predicted_dict(est) -> dict:
    return {"step_time_s": float(est.step_time_s), "tokens_per_s": float(est.tokens_per_s),
            "tflops_per_gpu": float(est.tflops_per_gpu), "mfu": float(est.mfu),
            "peak_memory_bytes": [float(x) for x in est.peak_memory_bytes]}


def _alternatives(winner, others, result: SearchResult, top_k: int, limit_bytes: float) -> list[dict]:
    """Runners-up, fastest first: the priced layouts (the solver's best few and the best
    uniform ones) that fit, by predicted step time, each saying how much slower it is and
    what differs from the plan; then the priced ones over the memory limit (by step time);
    then candidates whose memory bound alone rules them out (by the step time their bound
    allows). Which layouts make the list: one per mesh first (a reader compares layouts,
    not micro-batch sizes), then the rest."""
    r0, layout0, best_est = winner
    best = _summary(r0.candidate, assignment_of(layout0))

    def identity(x):  # the same layout reached twice (a uniform layout the solver also found)
        return x[0].candidate, tuple(x[1].stage_layers or ()), tuple(assignment_of(x[1]))

    unique, seen_layouts = [], {identity(winner)}
    for x in others:
        if identity(x) not in seen_layouts:
            seen_layouts.add(identity(x))
            unique.append(x)
    ranked = sorted(unique, key=lambda x: (not fits(x[2], limit_bytes), x[2].step_time_s, x[0].candidate))
    seen, picked = {_mesh_key(r0.candidate)}, []
    for x in ranked:
        if _mesh_key(x[0].candidate) not in seen:
            seen.add(_mesh_key(x[0].candidate))
            picked.append(x)
    picked += [x for x in ranked if x not in picked]
    picked = sorted(picked[:top_k], key=lambda x: (not fits(x[2], limit_bytes), x[2].step_time_s, x[0].candidate))
    out = []
    for r, layout, est in picked:
        alt = _summary(r.candidate, assignment_of(layout))
        alt["predicted"] = _predicted_dict(est)
        alt["source"] = "uniform layout" if r.status == "uniform" else "solver"
        alt["slower_by"] = est.step_time_s / best_est.step_time_s - 1 if best_est.step_time_s else 0.0
        alt["differs"] = _differences(alt, best)
        if fits(est, limit_bytes) and est.step_time_s <= best_est.step_time_s:
            what = "; ".join(alt["differs"]) or "another stage split / per-layer choices"
            alt.update(status="ok", why=f"ties the plan ({est.step_time_s * 1e3:.1f} ms per step); {what}")
        elif fits(est, limit_bytes):
            alt.update(status="slower", why=_why_slower(est, best_est, alt["differs"]))
        else:
            peak = max(est.peak_memory_bytes)
            alt.update(status="oom", why=f"out of memory: needs {peak / GB:.1f} GB on its fullest GPU (cost model), "
                                         f"over the {limit_bytes / GB:.1f} GB limit")
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
               "predicted": {}, "status": "oom", "source": "memory bound",
               "bound_step_time_s": time_lower_bound(p) * NS / p.virtual_stages,
               "why": f"out of memory: needs at least {need / GB:.1f} GB per GPU for layers alone, "
                      f"{p.capacity[0] * KIB / GB:.1f} GB available to layers"}
        out.append(alt)
    return out
