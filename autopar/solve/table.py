"""Per-candidate cost tables: the cost model's `layer_cost`, one row per
layer signature, one column per per-layer option, scaled to integers.

Options are (zero, checkpoint, offload) triples. Offloading the optimizer
state needs ZeRO >= 1 (it is offloaded shard by shard) and offloading the
parameters needs ZeRO-3. Pinned knobs keep only their value. Options that
another option beats or ties on all four costs (time, step tail, static
memory, activation memory) are dropped per signature before solving: no
optimum needs them, and ties go to the simpler option (lower ZeRO, less
checkpointing, no offload), which keeps plans deterministic and plain.

Layer costs are computed once per (signature, tp, dp, micro-batch size,
micro-batch count, pp, sequence parallel) and reused across schedules: the
schedule only changes how many micro-batches are in flight and the bubble,
which the stage problem accounts for itself.
"""
from __future__ import annotations

import dataclasses

from cost_models import comm as C
from cost_models.estimate import DTYPE_BYTES, layer_cost
from cost_models.memory import FRAGMENTATION, model_state_bytes, state_bytes_per_param
from cost_models.workload import fast

from autopar.engine import engine_of
from autopar.solve.constraints import CHECKPOINTS, OFFLOADS, Constraints
from autopar.solve.layout import candidate_layout, checkpoint_that_runs, lowered_zero_levels, root_held_layers
from autopar.solve.problem import (KIB, NS, OptionCost, lower_bound, StageProblem, in_flight_numerators, to_mem_units,
                                   to_time_units)
from autopar.solve.search_space import Candidate


def option_space(constraints: Constraints | None = None, *, offload: bool = False) -> list[tuple]:
    """Per-layer (zero, checkpoint, offload) options the solver may choose.

    ZeRO-1 is searched only when pinned: ZeRO-2 moves the same bytes per step
    (reduce-scatter + all-gather, ZeRO paper section 7) and holds fewer
    gradients, so it is never worse. Offload is searched only when asked
    (`offload=True`: the planner's second pass when nothing fits without it)
    or pinned, since moving state over PCIe is a last resort.
    """
    c = constraints or Constraints()
    out = []
    for zero in range(4):
        if zero == 1 and c.zero != 1:
            continue
        for ckpt in CHECKPOINTS:
            for off in OFFLOADS:
                # No optimizer-only offload: the lowering's offload is FSDP2's
                # CPUOffloadPolicy, which moves parameters, gradients and
                # optimizer state together ("params", with ZeRO 3).
                if off == "optimizer" or off == "params" and zero != 3:
                    continue
                if off != "none" and not offload and c.offload is None:
                    continue
                if (c.zero is not None and zero != c.zero or c.checkpoint is not None and ckpt != c.checkpoint
                        or c.offload is not None and off != c.offload):
                    continue
                out.append((zero, ckpt, off))
    return out


def pareto(rows: list[tuple]) -> list[tuple]:
    """Keep (OptionCost-like key, payload) rows no other row beats or ties on every cost."""
    def flat(cost):
        return tuple(x for c in cost for x in (c if isinstance(c, tuple) else (c,)))

    kept = []
    for i, (cost, payload) in enumerate(rows):
        dominated = False
        cost_f = flat(cost)
        for j, (other, _) in enumerate(rows):
            if j == i:
                continue
            other_f = flat(other)
            le = all(a <= b for a, b in zip(other_f, cost_f))
            if le and (other_f != cost_f or j < i):
                dominated = True
                break
        if not dominated:
            kept.append((cost, payload))
    return kept


def layer_signature(layer) -> str:
    return layer.signature or f"{layer.kind}:{layer.name}"


class TableBuilder:
    """Builds the StageProblem of each candidate from the cost model."""

    def __init__(self, model, cluster, *, constraints: Constraints | None = None, precision: str = "bf16",
                 optimizer: str = "adam", stage_time_overhead=None, reserve_bytes=None, offload: bool = False,
                 capacity_bytes: float | None = None):
        self.model = model
        self.cluster = cluster
        self.precision = precision
        self.optimizer = optimizer
        self.engine = engine_of(model)  # autopar's own program, or another engine being priced
        self.options = option_space(constraints, offload=offload)
        # Group layers by signature, numbered in order of first appearance.
        self.group_of: list[int] = []
        self.representative: list = []
        index: dict = {}
        for layer in model.layers:
            sig = layer_signature(layer)
            if sig not in index:
                index[sig] = len(self.representative)
                self.representative.append(layer)
            self.group_of.append(index[sig])
        self._rows: dict = {}
        self._canonical: dict = {}
        self._bound_problems: dict = {}
        self._bound_options: dict = {}
        self._overheads: dict = {}
        self._outputs: dict = {}
        self._stage_time_overhead = stage_time_overhead or self.p2p_overhead
        self._reserve_bytes = reserve_bytes or (lambda cand: 0.0)
        # what layers may use per GPU: usable memory, less the planner's headroom when it gives one
        self.capacity_bytes = float(cluster.device_profile.usable_memory_bytes if capacity_bytes is None
                                    else capacity_bytes)
        self.layer_cost_calls = 0

    def _layer_rows(self, cand: Candidate) -> list[list[tuple]]:
        key = (cand.tp, cand.dp, cand.micro_batch_size, cand.num_micro_batches, cand.pp, cand.sequence_parallel,
               cand.dp_shard, cand.ep, cand.cp)
        rows = self._rows.get(key)
        if rows is not None:
            return rows
        layout = candidate_layout(cand if cand.schedule != "interleaved" else
                                  dataclasses.replace(cand, schedule="1f1b", virtual_stages=1),
                                  precision=self.precision, optimizer=self.optimizer, engine=self.engine)
        rows = []
        held = root_held_layers(self.model)
        held_group = {g: held[i] for i, g in enumerate(self.group_of)}
        for g, layer in enumerate(self.representative):
            row = []
            for zero, ckpt, off in self.options:
                ckpt = checkpoint_that_runs(layer, ckpt)  # a layer of several modules: no recomputation
                # ZeRO 0/1 priced as the level the lowering runs on this mesh
                # (ZeRO 2 under tp/pp); a mix of whole-gradient and FSDP2
                # layers on a pure dp mesh is relabelled when the whole
                # assignment is priced (assignment_layout).
                zero = lowered_zero_levels(cand, [zero], [off], [held_group[g]], engine=self.engine)[0]
                lc = layer_cost(layer, self.model, layout, self.cluster, zero=zero, checkpoint=ckpt, offload=off)
                self.layer_cost_calls += 1
                row.append((self._option_cost(layer, lc, cand, zero), (zero, ckpt, off)))
            rows.append(pareto(row))
        self._rows[key] = rows
        return rows

    def p2p_overhead(self, cand: Candidate) -> float:
        """Per stage per micro-batch: the activation sent forward and its gradient sent back."""
        if cand.pp == 1:
            return 0.0
        last = self.group_of[-1]
        groups = {g for g in self.group_of[:-1]} or {last}
        out = max(self._output_bytes(self.representative[g], cand) for g in sorted(groups))
        if cand.sequence_parallel and cand.tp > 1:
            out /= cand.tp
        same_node = C.pp_neighbours_same_node(cand.tp, cand.dp, self.cluster)
        return 2 * C.p2p_time(out, same_node, self.cluster)

    def _option_cost(self, layer, lc, cand: Candidate, zero: int) -> tuple:
        """The four costs + peak terms, composed the way cost_models.estimate composes them:
        the pipeline runs fwd + bwd + recompute + TP comm + per-micro-batch exposed FSDP
        gathers; the rank's step ends with the gradient reduction and the optimizer;
        fragmentation is charged on grads and activations."""
        time = (lc.fwd_s + lc.bwd_s + lc.recompute_s + lc.tp_comm_s + lc.dp_fwd_exposed_s + lc.dp_bwd_exposed_s)
        step = lc.dp_step_exposed_s + lc.optimizer_s
        frag = 1.0 + FRAGMENTATION
        static = (lc.param_bytes + frag * lc.grad_bytes + lc.optimizer_bytes + lc.bucket_bytes
                  + self._tied_copy(layer, cand, zero))
        p_b, g_b, _ = state_bytes_per_param(self.precision, self.optimizer)
        fsdp = lc.params_local * (2 * p_b + g_b) if zero >= 3 and cand.dp > 1 else 0.0
        if zero == 2 and cand.dp > 1 and cand.pp > 1 and cand.num_micro_batches > 1:
            # a pipeline stage keeps its ZeRO-2 units gathered from the first forward to the
            # last backward (pipeline_parallel.ReducingStage), as the estimate books them
            # (peak_memory._FsdpBackward): the 16-bit parameters are alive all step
            static += lc.params_local * p_b
        tp_out = self._output_bytes(layer, cand) if cand.tp > 1 else 0.0
        return (to_time_units(time), to_time_units(step), to_mem_units(static), to_mem_units(frag * lc.activation_bytes),
                (to_mem_units(frag * lc.working_bytes), to_mem_units(fsdp), to_mem_units(tp_out)),
                to_mem_units(lc.optimizer_temp_bytes))

    def _output_bytes(self, layer, cand: Candidate) -> float:
        key = (layer_signature(layer), cand.micro_batch_size)
        hit = self._outputs.get(key)
        if hit is None:
            scale = DTYPE_BYTES.get(self.precision, 2) / (self.model.dtype_bytes or 2)
            hit = fast(layer.output_bytes)(cand.micro_batch_size, self.model.seq_len or 1) * scale
            self._outputs[key] = hit
        return hit

    def _tied_copy(self, layer, cand: Candidate, zero: int) -> float:
        """With a pipeline, a tied output layer keeps its own copy of the embedding
        weight (Megatron; it sits on the last rank, the embedding on the first)."""
        tied = layer.attrs.get("tied_param_count", 0) if layer.shared_params else 0
        if not tied or cand.pp == 1:
            return 0.0
        tp = cand.tp if cand.tp in tuple(layer.tp_degrees or (1,)) else 1
        st = model_state_bytes(tied / tp, precision=self.precision, optimizer=self.optimizer, zero=zero,
                               dp=cand.dp_shard or cand.dp, offload="none")
        return st.params + (1.0 + FRAGMENTATION) * st.grads + st.optimizer

    # -- the cheap bound table ------------------------------------------------------
    def _canonical_costs(self, cand: Candidate) -> list[dict]:
        """Per group, per checkpoint mode: layer_cost under dp = pp = 1, one micro-batch.

        Compute, recomputation and tensor-parallel communication of a layer
        depend only on (tp, sequence parallel, micro-batch size): the tp group
        is the same consecutive ranks whatever dp and pp are. So these few
        calls price every candidate sharing (tp, sp, micro-batch); data-parallel
        exposure is left at zero and model states come from the ZeRO formulas,
        which makes the table a valid under-estimate (tested)."""
        key = (cand.tp, cand.sequence_parallel, cand.micro_batch_size)
        hit = self._canonical.get(key)
        if hit is not None:
            return hit
        layout = candidate_layout(Candidate(1, 1, cand.tp, cand.micro_batch_size, 1, "1f1b", 1, cand.sequence_parallel),
                                  precision=self.precision, optimizer=self.optimizer, engine=self.engine)
        ckpts = sorted({c for _, c, _ in self.options}, key=("none", "selective", "full").index)
        out = []
        for layer in self.representative:
            out.append({c: layer_cost(layer, self.model, layout, self.cluster, zero=0, checkpoint=c, offload="none")
                        for c in ckpts})
            self.layer_cost_calls += len(ckpts)
        self._canonical[key] = out
        return out

    def bound_problem(self, cand: Candidate) -> StageProblem:
        """A StageProblem whose optimum is at most the real one (for bounds only).
        Built once per candidate (the search bounds it, the uniform-layout check reads it)."""
        hit = self._bound_problems.get(cand)
        if hit is not None:
            return hit
        self._bound_problems[cand] = problem = self._bound_problem(cand)
        return problem

    def _bound_problem(self, cand: Candidate) -> StageProblem:
        # the options depend on (tp, sp, micro-batch) and dp alone: built once for the
        # candidates that differ only in pp, schedule or micro-batch count
        key = (cand.tp, cand.sequence_parallel, cand.micro_batch_size, cand.dp)
        options = self._bound_options.get(key)
        if options is None:
            options = self._bound_options[key] = self._bound_group_options(cand)
        return self._problem(cand, [list(opts) for opts in options], list(self.options))

    def _bound_group_options(self, cand: Candidate) -> list:
        canon = self._canonical_costs(cand)
        group_options = []
        states: dict = {}  # (parameters, zero, offload) -> model states: checkpointing does not change them
        for per_ckpt in canon:
            opts = []
            for i, (zero, ckpt, off) in enumerate(self.options):
                lc = per_ckpt[ckpt]
                key = (lc.params_local, zero, off)
                st = states.get(key)
                if st is None:
                    st = states[key] = model_state_bytes(lc.params_local, precision=self.precision,
                                                         optimizer=self.optimizer, zero=zero, dp=cand.dp, offload=off)
                opts.append(OptionCost(i, to_time_units(lc.fwd_s + lc.bwd_s + lc.recompute_s + lc.tp_comm_s), 0,
                                       int(st.params + st.grads + st.optimizer) // KIB,
                                       int(lc.activation_bytes) // KIB))
            group_options.append(opts)
        return group_options

    def bound(self, cand: Candidate) -> float | None:
        """Lower bound on the candidate's step time in seconds, None if it cannot fit."""
        lb = lower_bound(self.bound_problem(cand))
        return None if lb is None else lb * NS / cand.virtual_stages

    def _problem(self, cand: Candidate, group_options, labels) -> StageProblem:
        capacity = to_mem_units(max(0.0, self.capacity_bytes - self._reserve_bytes(cand)))
        return StageProblem(
            layer_group=list(self.group_of), group_options=group_options, pp=cand.pp,
            virtual_stages=cand.virtual_stages, num_micro_batches=cand.num_micro_batches,
            in_flight_num=in_flight_numerators(cand.schedule, cand.pp, cand.virtual_stages, cand.num_micro_batches),
            capacity=[capacity] * cand.pp,
            stage_time_overhead=self._overhead(cand), option_labels=labels)

    def _overhead(self, cand: Candidate) -> int:
        key = (cand.tp, cand.dp, cand.pp, cand.micro_batch_size, cand.sequence_parallel)
        if key not in self._overheads:
            self._overheads[key] = to_time_units(self._stage_time_overhead(cand)) if cand.pp > 1 else 0
        return self._overheads[key]

    def __call__(self, cand: Candidate) -> StageProblem:
        rows = self._layer_rows(cand)
        labels: list[tuple] = []
        label_index: dict = {}
        group_options = []
        for row in rows:
            opts = []
            for (time, step, static, act, peaks, step_mem), label in row:
                if label not in label_index:
                    label_index[label] = len(labels)
                    labels.append(label)
                opts.append(OptionCost(label_index[label], time, step, static, act, peaks, step_mem))
            group_options.append(opts)
        return self._problem(cand, group_options, labels)
