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
from autopar.plan import Plan
from autopar.solve import compression, expert_parallel, float8_choice, hsdp
from autopar.solve import context_parallel as cp_search
from autopar.solve.alternatives import how_chosen, list_alternatives
from autopar.solve.baselines import price_baselines
from autopar.solve.constraints import ConstraintError, Constraints, check_against_cluster, parse_constraints
from autopar.solve.layout import assignment_layout, root_held_layers
from autopar.solve.cpsat import solve_cpsat
from autopar.solve.fusion_costs import charge_compiled_blocks, charge_fusions, plan_fusions
from autopar.solve.lowering_costs import charge_tp_collectives, keep_whole
from autopar.solve.plan_build import TP_KINDS, build_plan, tp_style  # noqa: F401  (tp_style: planner.tp_style)
from autopar.solve.problem import KIB, memory_floor, to_mem_units
from autopar.solve.refine import UNIFORM_ESTIMATES, fits, polish, tidy, uniform_layouts, uniform_pricings
from autopar.solve.search import CandidateResult, SearchResult, search
from autopar.solve.search_space import divisors, enumerate_candidates, mesh_key, moe_experts, whole_batch_reason
from autopar.solve.table import TableBuilder
from autopar.solve.capacity import check_capacity
from autopar.two_processes import Beside
from autopar.solve.what_fits import checking_a_fix, doubled_clusters, hint_text, tried_text, what_would_fit

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
                progress=None, offload=False, limit_bytes=None, uniform_ahead=False):
    """Search the candidates of this space. `uniform_ahead`: the uniform-layout check's
    first estimates are priced meanwhile by a second process (two_processes.Beside),
    left in result.stats["uniform_ahead"] for `_choose` (who must stop it)."""
    world = cluster.world_size
    cands, space = enumerate_candidates(world, global_batch_size, len(model.layers), tp_degrees(model), constraints,
                                       seq_len=getattr(model, "seq_len", None),
                                       lowering_limits=getattr(model, "lowering_limits", None),
                                       whole_batch=whole_batch_reason(model.layers),
                                       tp_why=tp_refusals(model, divisors(world)),
                                       experts=moe_experts(model.layers) if engine_of(model).is_autopar else 0)
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
    ahead = Beside(lambda: uniform_pricings(model, cluster, cands, builder.options, bound_problem=builder.bound_problem,
                                            precision=precision, optimizer=optimizer,
                                            limit=3 * UNIFORM_ESTIMATES)) if uniform_ahead else None
    try:
        result = search(cands, builder, bound=builder.bound, keep=keep, time_limit_s=time_limit_s,
                        progress=progress, distinct=mesh_key, sweep=lambda c: int(c.schedule == "interleaved"),
                        first_pass_budget=6.0)
    except BaseException:
        if ahead is not None:
            ahead.stop()
        raise
    # neither is in the Plan: the space the uniform-layout check walks, and its estimates priced ahead
    result.stats["candidate_list"] = cands
    result.stats["uniform_ahead"] = ahead
    return result, builder


def _fill_problems(result: SearchResult, builder) -> None:
    """Candidates ruled out by the cheap bound have no table; give them the bound table."""
    for r in result.oom:
        if r.problem is None:
            r.problem = builder.bound_problem(r.candidate)


def _to_price(result: SearchResult, keep: int) -> list:
    """The solver's best eight (the cost model's pipeline simulation can reorder
    close ones), plus the best of each mesh kept exact; each with its layers at
    the fastest option that keeps the solver's answer (`refine.tidy`)."""
    out, meshes = list(result.ranked[:8]), set()
    for r in result.ranked:
        if mesh_key(r.candidate) not in meshes and len(meshes) < keep:
            meshes.add(mesh_key(r.candidate))
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
    for bigger in doubled_clusters(cluster, scaled_cluster):
        limit = (1 - headroom) * bigger.device_profile.usable_memory_bytes
        try:
            result, _ = _run_search(model, bigger, free, global_batch_size, precision, optimizer, 3, 2.0,
                                    offload=free.offload is None, limit_bytes=limit)
        except InfeasibleError:
            continue
        if any(fits(_price(model, bigger, r, precision, optimizer)[1], limit) for r in result.ranked):
            return bigger.world_size
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
    float8_choice.check_device(engine, cluster)
    pins = parse_constraints(constraints)
    headroom = resolve_headroom(memory_headroom, pins)
    captured = model_spec(model, example_inputs, seq_len=seq_len, name=name, precision=precision)
    # states that fit nowhere on this cluster: said now, before the lowering's checks and the search
    check_capacity(captured, cluster, offload_pin=pins.offload, precision=precision, optimizer=optimizer,
                   headroom=headroom, scaled_cluster=scaled_cluster)
    torch_module = module if module is not None else (model if callable(getattr(model, "forward", None)) else None)
    spec, unfused_spec, lowering_limits, fusions, no_fusion_why = _priced_graph(
        captured, cluster, pins, torch_module=torch_module, check_lowering=check_lowering, engine=engine, fusion=fusion,
        example_inputs=example_inputs)
    global_batch_size, batch_assumed = _global_batch(global_batch_size, cluster.world_size, pins)
    req = _Request(spec=spec, cluster=cluster, pins=pins, global_batch_size=global_batch_size, precision=precision,
                   optimizer=optimizer, time_limit_s=time_limit_s, headroom=headroom,
                   # what every pp rank's predicted peak must stay within
                   limit=(1 - headroom) * cluster.device_profile.usable_memory_bytes,
                   # Distinct meshes kept exact by the search (the winner and two runners-up): more
                   # would loosen the pruning cutoff and multiply the solves for little insight.
                   keep=3 if top_k > 0 else 1, progress=progress)
    try:
        found = _search_and_price(req) if (pins.cp or 1) == 1 else None  # a pinned cp searches only its share
        base = _choose(req, found) if found is not None and found.fitting else None
        cut = cp_search.search(req, base, _search_and_price, _choose)  # solve/context_parallel.py
        if cut is None or cut[0] == "tried":
            if base is None:
                _refuse(req, found)
            chosen, winner, selection, others = base
            if cut:
                selection["cp"] = cut[1]
        else:
            found, chosen, winner, selection, others = cut
    finally:  # every search's uniform layouts priced ahead (_search_and_price): their processes end
        for ahead in req.aheads:
            _stop(ahead)
    plan_obj = build_plan(spec, cluster, pins, global_batch_size, precision, optimizer, winner, found.result,
                          selection)
    plan_obj.model["source"] = source or plan_obj.model.get("source")
    plan_obj.alternatives = list_alternatives(winner, [x for x in found.priced + others if x is not chosen],
                                              found.result, top_k, req.limit)
    if not checking_a_fix():  # a what_fits re-plan answers "fits or not"; the comparison is the user's plan's
        plan_obj.baselines = price_baselines(
            spec, cluster, global_batch_size, precision=precision, optimizer=optimizer, limit_bytes=req.limit,
            plan_step_s=plan_obj.predicted.step_time_s,
            cluster_of=lambda nodes, per_node: scaled_cluster(cluster, nodes, per_node))
    plan_obj.set_throughput()  # samples/s everywhere, tokens/s only for a token model (seq_len set)
    plan_obj.fusions = fusions
    _note_assumptions(plan_obj, spec, pins, engine, fusion=fusion, fusions=fusions, no_fusion_why=no_fusion_why,
                      charged=spec is not unfused_spec, assumed_batch=cluster.world_size if batch_assumed else None)
    # No wall-clock times in the Plan: the same inputs must give the same JSON.
    plan_obj.solver["layer_cost_calls"] = found.builder.layer_cost_calls
    plan_obj.solver["time_limit_work_units"] = time_limit_s
    # priced layouts the solver called feasible and the estimate did not (0 when the
    # two memory models agree, which the tests require)
    plan_obj.solver["memory_repairs"] = found.repairs.get("memory_repairs", 0)
    plan_obj.solver["memory_headroom"] = headroom
    if lowering_limits is not None:
        plan_obj.solver["lowering_limits"] = lowering_limits
    plan_obj.solver["memory_limit_bytes"] = req.limit
    return plan_obj


# -- the steps of `plan` ---------------------------------------------------------
def _priced_graph(spec, cluster, pins, *, torch_module, check_lowering, engine, fusion, example_inputs):
    """The graph the search prices: the captured `spec` with the tp collectives and
    attention kernel of the engine that runs it, the fused chains charged.
    `torch_module`: the nn.Module behind it (None for an analytic spec).
    -> (spec, the same before fusion, lowering_limits, fusions, why none were fused)."""
    lowering_limits = getattr(spec, "lowering_limits", None)  # a graph checked before (what_fits re-plans)
    captured = spec  # the fusion pass reads its layers' names and modules, which the lowered graph keeps
    # the fusion pass traces the blocks while the lowering's checks run (no input of one is the other's)
    fusing = Beside(lambda: [("fusions", plan_fusions(torch_module, captured))]) \
        if fusion and check_lowering is not None and torch_module is not None else None
    if check_lowering is not None and torch_module is not None:
        # only the tp degrees this cluster could use (each is one fake-tensor run per block kind)
        world_tp = [t for t in tp_degrees(spec) if t > 1 and cluster.world_size % t == 0
                    and (pins.tp is None or t == pins.tp)]
        try:
            lowering_limits = check_lowering(torch_module, spec, example_inputs, tp_degrees=world_tp)
        except BaseException:
            _stop(fusing)
            raise
    spec = lowered_graph(spec, lowering_limits, engine)
    fusions, no_fusion_why = [], "turned off (fusion=False)"
    if fusion:
        ready = fusing.finish(timeout_s=30.0) if fusing is not None else {}
        fusions, no_fusion_why = ready["fusions"] if "fusions" in ready else plan_fusions(torch_module, captured)
        found = len(fusions)
        fusions = [f for f in fusions if engine.runs_fused(f["pattern"])]  # another engine fuses its own
        if found and not fusions:
            no_fusion_why = f"the {engine.name} engine runs none of the {found} fusable chains found as one kernel"
    spec, unfused_spec = fused_graph(spec, cluster, lowering_limits, fusions, engine)
    return spec, unfused_spec, lowering_limits, fusions, no_fusion_why


# A saved Plan records its lowering limits and fused chains, so the graph it was priced on is
# charged again from them by these two (autopar/solve/reprice.py).
def lowered_graph(spec, lowering_limits, engine: Engine):
    """The captured `spec` as the engine runs it: what the lowering runs whole and the tp
    collectives it issues (`lowering_limits`), the engine's attention kernel."""
    spec = keep_whole(spec, lowering_limits)  # a head read by weight runs whole, so it is priced whole
    if engine.counted_tp_collectives:
        spec = charge_tp_collectives(spec, lowering_limits)  # tp priced as the lowering issues it
    return with_engine(spec, engine)  # another engine's attention kernel; every layout built from it


def fused_graph(spec, cluster, lowering_limits, fusions: list, engine: Engine):
    """`lowered_graph`'s spec with the fused chains charged and the blocks compiled where the
    engine compiles them: the graph every layout is priced on. -> (it, the same unfused)."""
    unfused_spec, spec = spec, charge_fusions(spec, fusions, cluster.device_profile)
    if engine.compiled_blocks:
        spec = charge_compiled_blocks(spec)
    for s in (unfused_spec, spec):
        s.lowering_limits = lowering_limits
        s.engine = engine
    return spec, unfused_spec


def _global_batch(global_batch_size, world: int, pins: Constraints) -> tuple[int, bool]:
    """The global batch (one sample per GPU when none was given) and whether it was assumed."""
    batch_assumed = global_batch_size is None
    if batch_assumed:
        global_batch_size = world  # one sample per GPU; recorded in the plan's assumptions
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise InfeasibleError(f"global batch size must be a positive integer, got {global_batch_size!r}")
    check_against_cluster(pins, world, global_batch_size)
    return global_batch_size, batch_assumed


@dataclasses.dataclass
class _Request:
    """One planning request, as the steps of `plan` share it."""
    spec: object  # the graph the search prices (`_priced_graph`)
    cluster: ClusterSpec
    pins: Constraints
    global_batch_size: int
    precision: str
    optimizer: str
    time_limit_s: float
    headroom: float
    limit: float  # bytes every pp rank's predicted peak must stay within
    keep: int  # distinct meshes the search keeps exact
    progress: object = None
    aheads: list = dataclasses.field(default_factory=list)  # the searches' uniform layouts priced ahead

    def search(self, offload: bool = False, uniform_ahead: bool = False):
        return _run_search(self.spec, self.cluster, self.pins, self.global_batch_size, self.precision, self.optimizer,
                           self.keep, self.time_limit_s, self.progress, offload=offload, limit_bytes=self.limit,
                           uniform_ahead=uniform_ahead)

    def price(self, result: SearchResult) -> list:
        return [(r, *_price(self.spec, self.cluster, r, self.precision, self.optimizer))
                for r in _to_price(result, self.keep)]

    def repair(self, priced: list, counter: dict) -> list:
        return _with_repairs(self.spec, self.cluster, priced, self.precision, self.optimizer, self.time_limit_s,
                             self.limit, counter=counter)


@dataclasses.dataclass
class _Found:
    """What the search and the pricing found."""
    result: SearchResult  # the search whose layouts were priced last
    builder: TableBuilder
    priced: list  # (CandidateResult, Layout, Estimate) of its best few, repaired where they overflowed
    fitting: list  # those of `priced` within the memory limit
    first: SearchResult  # the first search (what a refusal reports)
    first_builder: TableBuilder
    first_peaks: list  # the first search's priced peaks, reserve included
    repairs: dict  # {"memory_repairs": layouts the solver passed and the estimate did not}


def _search_and_price(req: _Request) -> _Found:
    """Search, then price the best few with the full estimate; with CPU offload allowed
    when nothing fits without it."""
    result, builder = req.search(uniform_ahead=True)
    ahead = result.stats["uniform_ahead"]
    req.aheads.append(ahead)  # plan() ends it on every path, a failure here included
    found = _price_found(req, result, builder)
    if found.result.stats.get("uniform_ahead") is not ahead:
        _stop(ahead)  # a second search replaced the first: the estimates priced ahead serve no check
    return found


def _stop(ahead) -> dict | None:
    """The uniform layouts priced ahead (`_run_search`), their process ended."""
    return ahead.stop() if ahead is not None else None


def _price_found(req: _Request, result, builder) -> _Found:
    if result.best is None and req.pins.offload is None:
        # Second pass: nothing fits without CPU offload; let layers offload.
        result, builder = req.search(offload=True)
    first, first_builder = result, builder
    priced = req.price(result)
    first_peaks = [max(x[2].peak_memory_bytes) + req.cluster.device_profile.reserve_bytes for x in priced]
    repairs: dict = {}
    priced = req.repair(priced, repairs)
    fitting = [x for x in priced if fits(x[2], req.limit)]
    if not fitting and not req.pins.offload and result.ranked and not any(
            o != "none" for _, _, o in builder.options):
        # The solver's memory model passed them but the full estimate did not: try with offload too.
        result, builder = req.search(offload=True)
        priced = req.repair(req.price(result), repairs)
        fitting = [x for x in priced if fits(x[2], req.limit)]
    _fill_problems(result, builder)
    return _Found(result=result, builder=builder, priced=priced, fitting=fitting, first=first,
                  first_builder=first_builder, first_peaks=first_peaks, repairs=repairs)


def _refuse(req: _Request, found: _Found):
    """Nothing fits: raise InfeasibleError saying how much memory the model needs, what
    the search was allowed (pins held, not "allowed"), and the changes re-planned and
    found to fit (`what_fits.py`)."""
    spec, cluster, pins, headroom, limit = req.spec, req.cluster, req.pins, req.headroom, req.limit
    device = cluster.device_profile
    _fill_problems(found.first, found.first_builder)
    need = min([_min_memory_per_gpu(found.first, device.reserve_bytes)] + found.first_peaks)
    why = next((x[2].why_not_fit for x in found.priced if x[2].why_not_fit), "")
    smallest = (None if checking_a_fix() else  # a what_fits re-plan: "does not fit" is its whole answer
                _smallest_world(spec, cluster, pins, req.global_batch_size, req.precision, req.optimizer, headroom))
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
    fixes = what_would_fit(spec, cluster, pins, req.global_batch_size, req.precision, req.optimizer, replan=plan,
                           headroom=headroom, smallest_world=smallest, time_limit_s=req.time_limit_s)
    raise InfeasibleError(
        f"{spec.name} does not fit on {cluster.world_size} x {device.name}{pinned}: {need_txt} "
        f"({tried_text(pins)}); "
        f"{device.memory_bytes / GB:.1f} GB per GPU available{within}",
        hint=hint_text(fixes),
        min_bytes_per_gpu=need if math.isfinite(need) else None, capacity_bytes=device.memory_bytes,
        smallest_world=smallest, device=device.name, fixes=fixes)


def _choose(req: _Request, found: _Found):
    """The best few, priced exactly, against the best uniform layouts of the same space and
    the HSDP variants of the best of them; the fastest that fits wins, then its stage
    boundaries move while estimate agrees.
    -> (chosen, winner after the moves, how it was chosen, the other layouts priced)."""
    solver_pick = min(found.fitting, key=lambda x: (x[2].step_time_s, x[0].candidate))
    uniform, uniform_priced = uniform_layouts(
        req.spec, req.cluster, found.result.stats.get("candidate_list", []), found.builder.options,
        bound_problem=found.builder.bound_problem, precision=req.precision, optimizer=req.optimizer,
        limit_bytes=req.limit, best_s=solver_pick[2].step_time_s, known=_stop(found.result.stats.get("uniform_ahead")))
    uniform = [(CandidateResult(c, None, None, status="uniform"), layout, est) for c, _, layout, est in uniform]
    order = lambda x: (x[2].step_time_s, x[0].status == "uniform", x[0].candidate)  # noqa: E731
    pool = sorted(found.fitting + uniform[:req.keep], key=order)
    # HSDP re-priced on the best layouts of the space searched (solve/hsdp.py)
    variants, tried = hsdp.hsdp_variants(req.spec, req.cluster, pool, limit_bytes=req.limit,
                                         pinned=req.pins.dp_shard is not None)
    chosen = sorted(pool + variants, key=order)[0]
    layout, est, moves = polish(req.spec, req.cluster, chosen[1], chosen[2], limit_bytes=req.limit)
    winner = chosen if not moves else (dataclasses.replace(chosen[0], status="polished"), layout, est)
    selection = how_chosen(found.result, solver_pick, chosen, winner, uniform, uniform_priced, moves)
    why = hsdp.account(winner, pool, tried)
    if why:
        selection["hsdp"] = why
    why = expert_parallel.account(winner, pool, moe_experts(req.spec.layers))
    if why:
        selection["ep"] = why
    winner, why = compression.choose(req.spec, req.cluster, winner, req.pins.grad_reduce_dtype, req.limit)
    if why:
        selection["compression"] = why
        if winner[1].grad_reduce_dtype:  # the solver's optimum was over uncompressed prices
            selection["proven_optimal"] = False
    return chosen, winner, selection, uniform[:req.keep] + variants


def _note_assumptions(plan_obj: Plan, spec, pins: Constraints, engine: Engine, *, fusion: bool, fusions: list,
                      no_fusion_why: str, charged: bool, assumed_batch: int | None) -> None:
    """What the Plan runs differently from what was asked, said in its assumptions:
    another engine, a pinned ZeRO 0/1 run as ZeRO 2, a pinned checkpoint a layer cannot
    take, the fusions, an assumed global batch."""
    if engine != AUTOPAR:  # another engine, or autopar's program priced with compiled blocks
        plan_obj.assumptions["engine"] = engine.to_dict()
    if engine.float8:
        plan_obj.assumptions["float8"] = float8_choice.account(spec, plan_obj)
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
        "charged": charged,  # False on a cpu profile (torch fallback) or with nothing fused
        **({"why_none": no_fusion_why} if not fusions and no_fusion_why else {})}
    if assumed_batch is not None:
        plan_obj.assumptions["global_batch_size"] = f"{assumed_batch} (one sample per GPU; none was given)"


def resolve_headroom(memory_headroom, pins: Constraints) -> float:
    """The headroom in force: the argument, else constraints["memory_headroom"], else the default."""
    value = memory_headroom if memory_headroom is not None else pins.memory_headroom
    if value is None:
        return DEFAULT_MEMORY_HEADROOM
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConstraintError(f"memory headroom must be a fraction of usable memory in [0, 1), got {value!r}",
                              hint="e.g. 0.1 leaves 10% of each GPU's usable memory free; 0 plans to the limit")
    return float(value)


