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

from cost_models.estimate import layer_cost

from autopar.solve.constraints import CHECKPOINTS, OFFLOADS, Constraints
from autopar.solve.layout import candidate_layout
from autopar.solve.problem import (OptionCost, StageProblem, in_flight_numerators, to_mem_units,
                                   to_time_units)
from autopar.solve.search_space import Candidate


def option_space(constraints: Constraints | None = None) -> list[tuple]:
    c = constraints or Constraints()
    out = []
    for zero in range(4):
        for ckpt in CHECKPOINTS:
            for off in OFFLOADS:
                if off == "optimizer" and zero == 0 or off == "params" and zero != 3:
                    continue
                if (c.zero is not None and zero != c.zero or c.checkpoint is not None and ckpt != c.checkpoint
                        or c.offload is not None and off != c.offload):
                    continue
                out.append((zero, ckpt, off))
    return out


def pareto(rows: list[tuple]) -> list[tuple]:
    """Keep (OptionCost-like key, payload) rows no other row beats or ties on every cost."""
    kept = []
    for i, (cost, payload) in enumerate(rows):
        dominated = False
        for j, (other, _) in enumerate(rows):
            if j == i:
                continue
            le = all(a <= b for a, b in zip(other, cost))
            if le and (other != cost or j < i):
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
                 optimizer: str = "adam", stage_time_overhead=None, reserve_bytes=None):
        self.model = model
        self.cluster = cluster
        self.precision = precision
        self.optimizer = optimizer
        self.options = option_space(constraints)
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
        self._stage_time_overhead = stage_time_overhead or (lambda cand: 0.0)
        self._reserve_bytes = reserve_bytes or (lambda cand: 0.0)
        self.capacity_bytes = float(cluster.device_profile.usable_memory_bytes)
        self.layer_cost_calls = 0

    def _layer_rows(self, cand: Candidate) -> list[list[tuple]]:
        key = (cand.tp, cand.dp, cand.micro_batch_size, cand.num_micro_batches, cand.pp, cand.sequence_parallel)
        rows = self._rows.get(key)
        if rows is not None:
            return rows
        layout = candidate_layout(cand if cand.schedule != "interleaved" else
                                  Candidate(cand.pp, cand.dp, cand.tp, cand.micro_batch_size,
                                            cand.num_micro_batches, "1f1b", 1, cand.sequence_parallel),
                                  precision=self.precision, optimizer=self.optimizer)
        rows = []
        for layer in self.representative:
            row = []
            for zero, ckpt, off in self.options:
                lc = layer_cost(layer, self.model, layout, self.cluster, zero=zero, checkpoint=ckpt, offload=off)
                self.layer_cost_calls += 1
                cost = (to_time_units(lc.fwd_s + lc.bwd_s + lc.recompute_s + lc.tp_comm_s),
                        to_time_units(lc.dp_comm_exposed_s + getattr(lc, "optimizer_s", 0.0)),
                        to_mem_units(lc.param_bytes + lc.grad_bytes + lc.optimizer_bytes),
                        to_mem_units(lc.activation_bytes))
                row.append((cost, (zero, ckpt, off)))
            rows.append(pareto(row))
        self._rows[key] = rows
        return rows

    def __call__(self, cand: Candidate) -> StageProblem:
        rows = self._layer_rows(cand)
        labels: list[tuple] = []
        label_index: dict = {}
        group_options = []
        for row in rows:
            opts = []
            for cost, label in row:
                if label not in label_index:
                    label_index[label] = len(labels)
                    labels.append(label)
                opts.append(OptionCost(label_index[label], *cost))
            group_options.append(opts)
        capacity = to_mem_units(max(0.0, self.capacity_bytes - self._reserve_bytes(cand)))
        return StageProblem(
            layer_group=list(self.group_of), group_options=group_options, pp=cand.pp,
            virtual_stages=cand.virtual_stages, num_micro_batches=cand.num_micro_batches,
            in_flight_num=in_flight_numerators(cand.schedule, cand.pp, cand.virtual_stages, cand.num_micro_batches),
            capacity=[capacity] * cand.pp,
            stage_time_overhead=to_time_units(self._stage_time_overhead(cand)) if cand.pp > 1 else 0,
            option_labels=labels)
