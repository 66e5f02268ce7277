"""The global part of the search space: every (mesh, micro-batching, schedule,
sequence-parallel) combination the planner may price.

A `Candidate` fixes everything that is the same on every GPU; the per-layer
part (stage partition, ZeRO level, checkpointing, offload of each layer) is
left to the stage solver (`cpsat.py`). Enumeration rules, and why:

- pp x dp x tp = GPU count. tp must divide every tensor-parallel layer
  (`LayerSpec.tp_degrees` of blocks: heads, kv heads, ffn); layers that cannot
  split at that tp (an odd vocabulary, a norm) run replicated over tp.
  tp larger than a node is kept (it crosses the slower inter-node link and the
  cost model charges it) so the search can take it when it pays.
- pp <= number of layers (every stage holds at least one layer).
- dp divides the global batch; the micro-batch size divides the per-replica
  batch; the number of micro-batches follows.
- pp = 1: one schedule, `accumulate` (gradient accumulation over the micro-batches).
  pp > 1: GPipe always; 1F1B only with at least pp micro-batches (torch's
  Schedule1F1B raises "Number of microbatches must be greater than or equal
  to the number of stages" otherwise); interleaved 1F1B with V virtual stages
  per rank when pp*V <= layers and the micro-batch count is a multiple of pp
  (Megatron's rule; torch's ScheduleInterleaved1F1B accepts any multiple of
  max(1, m // pp) rounds, but only m % pp == 0 gives its order the shape the
  cost model simulates, and it implies m >= pp).
- sequence parallelism only with tp > 1.
- HSDP (`dp_shard`, the ZeRO states sharded over groups of dp_shard dp ranks,
  replicated across dp / dp_shard of them): only when pinned (`--dp-shard`,
  which must divide dp) does every candidate carry it; unpinned, the search runs
  over whole-dp sharding and the planner prices the shard group sizes of
  `dp_shard_choices` on its best few layouts afterwards (solve/hsdp.py): the
  per-layer problem is the same, and a search over every shard size would
  multiply the candidates.
- a model with BatchNorm (`LayerSpec.attrs["batch_norm_channels"]`): one
  micro-batch per dp rank and no pipeline. Its training forward normalises
  by the statistics of the batch it sees; the lowering synchronises them over
  dp (autopar/lower/batch_norm.py) but a micro-batch only ever sees its own
  samples, which is another function than one process training the batch.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from autopar.plan import ACCUMULATE
from autopar.solve.constraints import Constraints

INTERLEAVE_CHOICES = (2, 3, 4, 6, 8)  # virtual stages per pp rank tried when unpinned


@dataclass(frozen=True, order=True)
class Candidate:
    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    num_micro_batches: int
    schedule: str  # gpipe | 1f1b | interleaved
    virtual_stages: int = 1
    sequence_parallel: bool = False
    dp_shard: int = 0  # HSDP's shard group (dp ranks); 0: the whole dp (an int, so candidates still sort)
    ep: int = 0  # expert parallelism: MoE experts split over groups of ep dp ranks; 0: not split
    cp: int = 1  # context parallelism: every sequence cut over cp ranks (solve/context_parallel.py)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        sched = self.schedule if self.schedule != "interleaved" else f"interleaved:{self.virtual_stages}"
        if self.pp == 1:
            sched = "no pipeline"
        sp = " +SP" if self.sequence_parallel else ""
        dp = f"dp{self.dp}" + (f" ({self.dp // self.dp_shard} replicas x {self.dp_shard} shards)"
                               if self.dp_shard else "") + (f" (ep {self.ep})" if self.ep else "")
        dp += f" x cp{self.cp}" if self.cp > 1 else ""
        return (f"pp{self.pp} x {dp} x tp{self.tp}{sp}, micro-batch {self.micro_batch_size} x "
                f"{self.num_micro_batches}, {sched}")


def mesh_key(c: Candidate) -> tuple:
    """The mesh a candidate runs on: the search keeps and the Plan lists distinct meshes."""
    return (c.pp, c.dp, c.tp, c.dp_shard, c.ep, c.cp)


def dp_shard_choices(dp: int, tp: int, gpus_per_node: int) -> list[int]:
    """HSDP shard group sizes worth pricing for a dp of `dp`: the group that fills one
    node (gpus_per_node / tp dp ranks, whose gathers then never leave it) and its
    doublings (2, 4, ... nodes) below dp; dp itself is plain sharding. Few on purpose:
    each is one more priced layout per layout tried."""
    start = max(2, gpus_per_node // tp if tp <= gpus_per_node else 2)
    out, s = [], start
    while s < dp:
        if dp % s == 0:
            out.append(s)
        s *= 2
    return out


def _dp_shard_of(dp: int, c: Constraints, report: SpaceReport, mesh: str, cannot_run: str | None) -> int | None:
    """The candidate's dp_shard under a `--dp-shard` pin (0: none, or the whole dp), None
    when the pin does not divide this dp or the lowering cannot run HSDP (said in the report)."""
    if c.dp_shard is None or c.dp_shard >= dp and dp % c.dp_shard == 0:
        return 0
    if dp % c.dp_shard:
        report.add(f"--dp-shard {c.dp_shard} does not divide dp", mesh)
        return None
    if cannot_run:
        report.add(f"lowering cannot run HSDP ({cannot_run})", mesh)
        return None
    return c.dp_shard


def ep_choices(pp: int, dp: int, tp: int, experts: int, c: Constraints, report: SpaceReport, mesh: str,
               cannot_run: str | None) -> list[int]:
    """The ep degrees (0: none) a mesh is searched with: for a model with MoE layers, on a
    mesh without tp or HSDP (what the lowering runs: dp, and pp), every divisor of dp
    above 1 that divides the experts; a pinned --ep only. Empty: the pin cannot run on
    this mesh (said in the report)."""
    pinned = c.ep if c.ep not in (None, 1) else None
    runs = experts and tp == 1 and not c.dp_shard and not cannot_run
    if not runs or (pinned and (dp % pinned or experts % pinned)):
        if pinned:
            why = (f"lowering cannot run ep ({cannot_run})" if cannot_run else
                   "the model has no MoE layer" if not experts else
                   "--ep runs beside dp and pp only (tp 1)" if tp > 1 else
                   f"--ep {pinned} does not divide dp or the {experts} experts")
            report.add(why, mesh)
            return []
        return [0]
    if pinned:
        return [pinned]
    return [0] + [e for e in divisors(dp) if e > 1 and experts % e == 0] if c.ep is None else [0]


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class SpaceReport:
    """Why meshes were dropped (turned into a message when nothing is left)."""

    rejected: dict  # reason -> list of short mesh descriptions

    def add(self, reason: str, what: str) -> None:
        self.rejected.setdefault(reason, []).append(what)

    def summary(self, limit: int = 4) -> str:
        parts = []
        for reason, items in self.rejected.items():
            shown = ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")
            parts.append(f"{reason}: {shown}")
        return "; ".join(parts)


def enumerate_candidates(world_size: int, global_batch_size: int, num_layers: int, tp_degrees,
                         constraints: Constraints | None = None, *, max_micro_batch: int | None = None,
                         interleave_choices=INTERLEAVE_CHOICES, seq_len: int | None = None,
                         lowering_limits: dict | None = None, whole_batch: str | None = None,
                         tp_why: dict | None = None, experts: int = 0) -> tuple[list[Candidate], SpaceReport]:
    """All candidates allowed by the cluster, the model and the pins, in a fixed order.

    `seq_len` (the training sequence length) rules out sequence parallelism
    where tp does not divide it: every tp rank must hold an equal shard of
    the sequence (torch's collectives need equal pieces). `lowering_limits`
    (autopar.lower.what_runs) rules out what the lowering cannot run for
    this model: pipelines, tp degrees, sequence parallelism, with reasons.
    `whole_batch` (see `whole_batch_reason`): why each replica's batch must
    run as one forward; micro-batching and pipelines are then not offered.
    `tp_why`: {tp: why} for tp degrees outside `tp_degrees` (which layer refuses).
    `experts`: the expert count every MoE layer's divides (0: no MoE layer), for ep."""
    c = constraints or Constraints()
    report = SpaceReport({})
    limits = lowering_limits if (lowering_limits or {}).get("checked") else {}
    if lowering_limits is not None and not lowering_limits.get("checked"):
        # The lowering was asked and could not say what runs: offer only what needs no
        # split of the model (data parallelism, ZeRO), never a layout that may not run.
        why = f"its check could not run: {lowering_limits.get('why', 'unknown')}"
        limits = {"pipeline": why, "tp": {str(t): why for t in tp_degrees if t > 1}}
    no_tp = limits.get("tp") or {}
    no_sp = limits.get("sequence_parallel") or {}
    tp_ok = set(tp_degrees)
    out: list[Candidate] = []
    for tp in divisors(world_size):
        if c.tp is not None and tp != c.tp:
            continue
        if tp not in tp_ok:
            # no tp_why: no layer has a split dimension at all (ResNet's convolutions, a plain MLP stack)
            report.add((tp_why or {}).get(tp, "no layer tp can split at this degree (none has attention heads, an "
                                              "ffn or a vocabulary tp divides)"), f"tp{tp}")
            continue
        if no_tp.get(str(tp)):
            report.add(f"lowering cannot run it ({no_tp[str(tp)]})", f"tp{tp}")
            continue
        for pp in divisors(world_size // tp):
            if c.pp is not None and pp != c.pp:
                continue
            dp = world_size // (tp * pp)
            if c.dp is not None and dp != c.dp:
                continue
            mesh = f"pp{pp}xdp{dp}xtp{tp}"
            if pp > num_layers:
                report.add(f"more pipeline stages than the {num_layers} layers", mesh)
                continue
            if pp > 1 and limits.get("pipeline"):
                report.add(f"lowering cannot run it ({limits['pipeline']})", mesh)
                continue
            if pp > 1 and whole_batch:
                report.add(f"a pipeline runs micro-batches and {whole_batch}", mesh)
                continue
            if (c.cp or 1) > 1 and dp % c.cp:  # the search of one cp rank's share: dp here is dp x cp
                report.add(f"dp x cp is not a multiple of cp {c.cp}", mesh)
                continue
            if global_batch_size % dp:
                report.add(f"dp does not divide the global batch {global_batch_size}", mesh)
                continue
            dp_shard = _dp_shard_of(dp, c, report, mesh, limits.get("hsdp"))
            if dp_shard is None:
                continue
            eps = ep_choices(pp, dp, tp, experts, c, report, mesh, limits.get("ep"))
            if not eps:
                continue
            per_replica = global_batch_size // dp
            for mbs, ep in ((mbs, ep) for mbs in divisors(per_replica) for ep in eps):
                if c.micro_batch is not None and mbs != c.micro_batch:
                    continue
                if max_micro_batch is not None and c.micro_batch is None and mbs > max_micro_batch:
                    continue
                m = per_replica // mbs
                if m > 1 and whole_batch:
                    report.add(f"{m} micro-batches per step, and {whole_batch}", f"{mesh} micro-batch {mbs}")
                    continue
                for schedule, v in _schedules(pp, m, num_layers, c, interleave_choices, report,
                                              f"{mesh} with {m} micro-batches"):
                    for sp in _sequence_parallel(tp, c, seq_len, report, mesh, no_sp.get(str(tp))):
                        out.append(Candidate(pp=pp, dp=dp, tp=tp, micro_batch_size=mbs, num_micro_batches=m,
                                             schedule=schedule, virtual_stages=v, sequence_parallel=sp,
                                             dp_shard=dp_shard, ep=ep))
    return out, report


def moe_experts(layers) -> int:
    """The expert count every MoE layer's divides (their gcd; capture's `experts`), 0 when
    the model has no MoE layer: ep is searched only then."""
    counts = [(l.attrs or {}).get("experts", 0) for l in layers if l.ep_routed_tokens]
    return math.gcd(*counts) if counts else 0


def whole_batch_reason(layers) -> str | None:
    """Why every forward must see a replica's whole batch, or None: BatchNorm
    (capture's `batch_norm_channels`) normalises by the batch it is given."""
    bn = [l.name for l in layers if (l.attrs or {}).get("batch_norm_channels")]
    if not bn:
        return None
    return (f"BatchNorm (in {', '.join(bn[:3])}{' ...' if len(bn) > 3 else ''}) would normalise each micro-batch "
            f"by its own statistics, not the batch one process trains on")


def _schedules(pp: int, m: int, num_layers: int, c: Constraints, interleave_choices, report=None, what=""):
    if pp == 1:
        # No pipeline: micro-batches are plain gradient accumulation, the schedule
        # named `accumulate`. A pinned gpipe/1f1b is accepted (without a pipeline they
        # are the same schedule); interleaving needs pp > 1.
        if c.schedule != "interleaved":
            yield ACCUMULATE, 1
        return
    for schedule in ("gpipe", "1f1b", "interleaved"):
        if c.schedule is not None and schedule != c.schedule:
            continue
        if schedule == "gpipe":
            yield schedule, 1
            continue
        if m < pp or (schedule == "interleaved" and m % pp):
            # torch.distributed.pipelining would refuse (1F1B) or reorder (interleaved) these;
            # only a pinned schedule is worth a reason, an unpinned one still has GPipe.
            if c.schedule is not None and report is not None:
                report.add(f"{schedule} needs the micro-batch count to be "
                           + ("a multiple of pp" if schedule == "interleaved" else "at least pp"), what)
            continue
        if schedule == "1f1b":
            yield schedule, 1
            continue
        choices = (c.virtual_stages,) if c.virtual_stages else interleave_choices
        for v in choices:
            if pp * v <= num_layers:
                yield schedule, v


def _sequence_parallel(tp: int, c: Constraints, seq_len: int | None = None, report=None, what: str = "",
                       cannot_run: str | None = None):
    if tp == 1:
        if not c.sequence_parallel:
            yield False
        return
    for sp in (False, True):
        if sp and seq_len and seq_len % tp:
            if c.sequence_parallel and report is not None:
                report.add(f"sequence parallelism needs tp to divide the sequence length {seq_len}", what)
            continue
        if sp and cannot_run:
            if report is not None:
                report.add(f"lowering cannot run sequence parallelism ({cannot_run})", what)
            continue
        if c.sequence_parallel is None or c.sequence_parallel == sp:
            yield sp
