"""The Plan: a plain, serializable decision handed from solve to lower/report/cli.

Everything downstream reads only this (plus the ModelGraph): lowering builds
the parallel module from it, the report draws it, the CLI prints it. It is
JSON with a schema version; loading never unpickles anything.

Vocabulary: `mesh` axes are pp / dp / tp; a pipeline `stage` is a contiguous
run of layers on one pp rank (with interleaving, a pp rank holds several
stages: stage i runs on pp rank i % pp); `zero` is the ZeRO level 0-3;
`checkpoint` is activation recomputation (none / selective / full).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autopar.errors import PlanMismatchError
from autopar.plan_schema import (ACCUMULATE, CHECKPOINTS, OFFLOADS, PRECISIONS,  # noqa: F401 - the plan's words
                                 SCHEDULES, SCHEMA_VERSION, TP_STYLES, type_problem)


def check_precision(precision) -> str:
    """`precision` if it is one autopar plans for; a named AutoparError otherwise."""
    if precision not in PRECISIONS:
        raise PlanMismatchError(f"precision must be bf16, fp16 or fp32, got {precision!r}",
                                hint="the training compute dtype: bf16 (default), fp16 or fp32 (e.g. on CPU ranks)")
    return precision


def schedule_name(pp, schedule):
    """The schedule's one name: `accumulate` for every pp = 1 spelling
    (older plans' "1f1b" / "gpipe"), the schedule itself otherwise."""
    if pp == 1 and schedule in ("gpipe", "1f1b"):
        return ACCUMULATE
    return schedule


@dataclass
class Mesh:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    # HSDP: ZeRO states sharded over groups of dp_shard dp ranks (neighbours), the
    # gradient shards all-reduced across the dp / dp_shard replicas. None (and absent
    # from the JSON): one shard group of the whole dp, as every plan before the field.
    dp_shard: int | None = None
    # Expert parallelism: each MoE layer's experts split over groups of `ep` data-parallel
    # ranks (neighbours), sharded by FSDP2 over the other fold_ranks / ep ("efsdp"), as
    # torchtitan folds it (dp_shard x cp = efsdp x ep). World size is unchanged. None
    # (and absent from the JSON): every rank holds every expert, as every plan before it.
    ep: int | None = None
    # Context parallelism: every sequence cut over cp ranks (ring attention), between dp
    # and tp in rank order as torchtitan orders it (pp, dp, cp, tp); parameters sharded and
    # gradients reduced over dp x cp. None (and absent from the JSON): no cut, cp 1.
    cp: int | None = None

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * (self.cp or 1) * self.tp

    @property
    def ep_fold_ranks(self) -> int:
        """The ranks ep divides: dp (x cp once a cp axis exists). The one place that says so."""
        return self.dp

    @property
    def efsdp(self) -> int:
        """The ranks an expert's weights are FSDP-sharded over: fold_ranks / ep."""
        return self.ep_fold_ranks // (self.ep or 1) if self.ep_fold_ranks % (self.ep or 1) == 0 else 1

    @property
    def shard_ranks(self) -> int:
        """The dp ranks the ZeRO states are sharded over (the whole dp unless HSDP)."""
        return self.dp_shard or self.dp

    @property
    def replicas(self) -> int:
        return self.dp // self.shard_ranks if self.dp % self.shard_ranks == 0 else 1

    @property
    def hsdp(self) -> bool:
        return self.dp_shard is not None and self.dp_shard < self.dp

    def dp_text(self) -> str:
        """'dp 8', 'dp 8 (ep 4)' or, under HSDP, 'dp 8 = 2 replicas x 4 shards' (terminal, report); then
        ' x cp 16' under context parallelism."""
        ep = f" (ep {self.ep})" if (self.ep or 1) > 1 else ""
        cp = f" x cp {self.cp}" if (self.cp or 1) > 1 else ""
        if not self.hsdp:
            return f"dp {self.dp}{ep}{cp}"
        return f"dp {self.dp} = {self.replicas} replicas x {self.dp_shard} shards{cp}"


@dataclass
class LayerChoice:
    """Per-layer decisions. `name` is the layer's name in the ModelGraph."""

    name: str
    kind: str = "other"
    module_paths: list[str] = field(default_factory=list)  # modules of the user's model this layer covers
    zero: int = 0
    reshard_after_forward: bool = False  # FSDP2: True for ZeRO-3
    checkpoint: str = "none"
    offload: str = "none"
    tp_style: str = "replicate"
    # the layer's nn.Linear modules (paths in the user's model) that run their GEMMs in
    # float8 (torchao's Float8Linear, tensorwise scaling); empty: none
    float8: list[str] = field(default_factory=list)


@dataclass
class Stage:
    index: int  # stage id in execution order (0 .. pp*virtual_stages-1)
    pp_rank: int  # which pp rank runs it
    layers: list[LayerChoice] = field(default_factory=list)
    predicted: dict = field(default_factory=dict)  # per-stage timing / memory breakdown

    @property
    def layer_names(self) -> list[str]:
        return [c.name for c in self.layers]


@dataclass
class Predicted:
    step_time_s: float = 0.0
    # Throughput in the model's own unit: samples/s for every model; tokens/s only for
    # token models (the captured inputs have a sequence axis, Plan.seq_len is set),
    # None for the rest (images): Plan.set_throughput fills both.
    tokens_per_s: float | None = 0.0
    samples_per_s: float = 0.0
    tflops_per_gpu: float = 0.0  # model FLOPs (no recomputation counted)
    mfu: float = 0.0
    peak_memory_bytes: list[float] = field(default_factory=list)  # per pp rank
    memory_breakdown: list[dict] = field(default_factory=list)  # per pp rank: params, grads, optimizer, activations, buffers
    time_breakdown: dict = field(default_factory=dict)  # compute, tp_comm, dp_comm_exposed, pp_comm, bubble, optimizer...
    comm: list[dict] = field(default_factory=list)  # per mesh axis: axis, collective, bytes, time_s, tier


@dataclass
class Plan:
    model: dict = field(default_factory=dict)  # name, source, total_params, num_layers, seq_len
    cluster: dict = field(default_factory=dict)  # the ClusterSpec as plain data
    global_batch_size: int = 1
    seq_len: int | None = None
    precision: str = "bf16"
    mesh: Mesh = field(default_factory=Mesh)
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    # Communication compression: gradients reduced in this dtype, narrower than they are
    # held ("bf16"; autopar/compression.py says what it means per precision). None (and
    # absent from the JSON): reduced as held, as every plan before the field.
    grad_reduce_dtype: str | None = None
    stages: list[Stage] = field(default_factory=list)
    predicted: Predicted = field(default_factory=Predicted)
    alternatives: list[dict] = field(default_factory=list)  # ranked: layout summary, predicted, why it lost
    # what a user of one stack alone would run (DeepSpeed ZeRO, FSDP2; solve/baselines.py):
    # its layout, predicted numbers, whether it fits and why, step time as a multiple of the plan's
    baselines: list[dict] = field(default_factory=list)
    fusions: list[dict] = field(default_factory=list)  # fused-op chains chosen (kernels)
    solver: dict = field(default_factory=dict)  # status, time_s, gap, candidates...
    assumptions: dict = field(default_factory=dict)  # hardware profile, efficiencies, formulas
    constraints: dict = field(default_factory=dict)  # what the user pinned
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        self.schedule = schedule_name(getattr(self.mesh, "pp", None), self.schedule)
        self.set_throughput()

    @property
    def token_model(self) -> bool:
        """The captured inputs have a sequence axis (token ids, embedded sequences): throughput
        is also counted in tokens. Decided by capture (seq_len), not by the model's name."""
        return self.seq_len is not None

    def set_throughput(self) -> None:
        """samples_per_s = global batch / step time for the plan, every alternative and baseline, and
        tokens_per_s only for a token model (None otherwise; the cost model counts an
        image model's samples as its 'tokens'). Plans saved before samples/s get it on load."""
        others = [x for xs in (self.alternatives, self.baselines) if isinstance(xs, list)  # plan_problem names it
                  for x in xs if isinstance(x, dict)]
        predictions = [self.predicted] + [x.get("predicted") for x in others]
        for p in predictions:
            if isinstance(p, Predicted):
                p = p.__dict__
            if not isinstance(p, dict):
                continue
            step, batch = p.get("step_time_s"), self.global_batch_size
            if _positive(step) and _positive(batch):
                p["samples_per_s"] = batch / step
            if not self.token_model and "tokens_per_s" in p:
                p["tokens_per_s"] = None

    # -- derived views ---------------------------------------------------
    @property
    def layer_choices(self) -> list[LayerChoice]:
        return [c for st in self.stages for c in st.layers]

    def choice(self, layer_name: str) -> LayerChoice:
        for c in self.layer_choices:
            if c.name == layer_name:
                return c
        raise KeyError(layer_name)

    # -- JSON ------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("dp_shard", "ep"):  # unset (no HSDP, no ep): the JSON of every plan before the field
            if d["mesh"].get(key) is None:
                d["mesh"].pop(key, None)
        if (d["mesh"].get("cp") or 1) == 1:  # no context parallelism: the JSON of every plan before the field
            d["mesh"].pop("cp", None)
        if d.get("grad_reduce_dtype") is None:  # uncompressed: the JSON of every plan before the field
            d.pop("grad_reduce_dtype", None)
        return d

    def to_json(self, indent: int | None = 2) -> str:
        # sort_keys keeps the text identical for identical plans (determinism).
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanMismatchError(
                f"plan schema version {version!r} is not supported (this autopar reads version {SCHEMA_VERSION})",
                hint="re-run `autopar plan ... --json` with this version of autopar to regenerate the plan",
            )
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise PlanMismatchError(f"plan has unknown fields: {', '.join(sorted(unknown))}")
        problem = type_problem(d)  # field by field, before a value of the wrong type is used
        if problem:
            raise PlanMismatchError(f"not a valid autopar plan: {problem}",
                                    hint="was it edited by hand? regenerate it with `autopar plan ... --json`")
        d = dict(d)
        d["alternatives"] = [_renamed_schedule(a) for a in d.get("alternatives", [])]
        d["mesh"] = Mesh(**d.get("mesh", {}))
        d["predicted"] = Predicted(**d.get("predicted", {}))
        d["stages"] = [
            Stage(index=s["index"], pp_rank=s["pp_rank"],
                  layers=[LayerChoice(**c) for c in s.get("layers", [])],
                  predicted=s.get("predicted", {}))
            for s in d.get("stages", [])
        ]
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanMismatchError(f"plan is not valid JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise PlanMismatchError("plan JSON must be an object")
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            return cls.from_json(f.read())


def _renamed_schedule(alternative: dict) -> dict:
    """An alternative of an older plan file with its pp = 1 schedule under its one name."""
    pp = (alternative.get("mesh") or {}).get("pp")
    name = schedule_name(pp, alternative.get("schedule"))
    return alternative if name == alternative.get("schedule") else {**alternative, "schedule": name}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
