"""What the user pinned: the `constraints` dict of `autopar.plan` and the CLI's
pinning flags (`--tp --pp --dp --dp-shard --ep --micro-batch --zero --checkpoint
--schedule --sequence-parallel --grad-reduce-dtype`), parsed once and checked before any search.

A pinned value removes every other value of that knob from the search space;
with everything pinned, the planner only prices the one layout (an estimator
for a hand-written plan). Contradictions (tp*pp*dp not the GPU count,
interleaving with one pipeline stage, sequence parallelism without tensor
parallelism, a batch that does not split into micro-batches) are rejected
here with a message naming the flags, before any cost is computed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from autopar.errors import AutoparError

KNOWN_KEYS = ("tp", "pp", "dp", "dp_shard", "ep", "cp", "micro_batch", "zero", "checkpoint", "schedule",
              "sequence_parallel", "offload", "memory_headroom", "grad_reduce_dtype")
# --grad-reduce-dtype: fp32 (never compress), bf16 (compress), auto (the planner keeps bf16 if faster)
GRAD_REDUCE_CHOICES = ("fp32", "bf16", "auto")
CHECKPOINTS = ("none", "selective", "full")
OFFLOADS = ("none", "optimizer", "params")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "accumulate")  # accumulate: no pipeline (pp 1)

# CLI spelling of each key, so messages name the flag a person typed.
FLAG = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "dp_shard": "--dp-shard", "ep": "--ep", "cp": "--cp",
        "micro_batch": "--micro-batch", "zero": "--zero",
        "checkpoint": "--checkpoint", "schedule": "--schedule", "sequence_parallel": "--sequence-parallel",
        "offload": "--offload", "memory_headroom": "--memory-headroom", "grad_reduce_dtype": "--grad-reduce-dtype"}


class ConstraintError(AutoparError):
    """Pinned layout values that are malformed or contradict each other or the cluster."""


@dataclass(frozen=True)
class Constraints:
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    dp_shard: int | None = None  # HSDP: ZeRO states sharded over groups of this many dp ranks
    ep: int | None = None  # expert parallelism: MoE experts split over groups of this many dp ranks
    cp: int | None = None  # context parallelism: every sequence cut over cp ranks (solve/context_parallel.py)
    micro_batch: int | None = None  # samples per micro-batch
    zero: int | None = None
    checkpoint: str | None = None
    schedule: str | None = None  # gpipe | 1f1b | interleaved
    virtual_stages: int | None = None  # from "interleaved:V"
    sequence_parallel: bool | None = None
    offload: str | None = None
    # share of usable GPU memory to leave free (planner.DEFAULT_MEMORY_HEADROOM when None);
    # a limit on the plan rather than a layout knob, accepted here so that
    # autopar.compile(constraints=...) can pass it on
    memory_headroom: float | None = None
    grad_reduce_dtype: str | None = None  # GRAD_REDUCE_CHOICES; None: priced, not chosen (solve/compression.py)

    def to_dict(self) -> dict:
        """The pinned values only (what a Plan records under `constraints`)."""
        d = {k: v for k, v in asdict(self).items() if v is not None}
        v = d.pop("virtual_stages", None)
        if v is not None and d.get("schedule") == "interleaved":  # the user's spelling: "interleaved:V"
            d["schedule"] = f"interleaved:{v}"
        return d

    @property
    def fully_pinned(self) -> bool:
        return all(v is not None for v in (self.tp, self.pp, self.dp, self.micro_batch, self.zero,
                                           self.checkpoint, self.schedule))


def _positive_int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConstraintError(f"{FLAG[key]} must be a positive integer, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ConstraintError(f"{FLAG[key]} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ConstraintError(f"{FLAG[key]} must be a positive integer, got {value!r}")
    return n


def parse_schedule(value: str) -> tuple[str, int | None]:
    """'gpipe' | '1f1b' | 'interleaved' | 'interleaved:V' -> (schedule, V or None)."""
    text = str(value).strip().lower()
    name, _, v = text.partition(":")
    if name not in SCHEDULES:
        raise ConstraintError(f"--schedule {value!r} is not a schedule",
                              hint="use gpipe, 1f1b, interleaved or interleaved:V (V virtual stages per pp rank), "
                                   "or accumulate for no pipeline")
    if not v:
        return name, None
    if name != "interleaved":
        raise ConstraintError(f"--schedule {value!r}: only interleaved takes a virtual-stage count")
    try:
        stages = int(v)
    except ValueError:
        raise ConstraintError(f"--schedule {value!r}: V must be an integer >= 2") from None
    if stages < 2:
        raise ConstraintError(f"--schedule {value!r}: interleaving needs V >= 2 virtual stages per pp rank",
                              hint="use --schedule 1f1b for one stage per pp rank")
    return name, stages


def parse_constraints(raw: dict | Constraints | None) -> Constraints:
    """Check types and spellings of a constraints dict (no cluster needed yet)."""
    if raw is None:
        return Constraints()
    if isinstance(raw, Constraints):
        return raw
    if not isinstance(raw, dict):
        raise ConstraintError(f"constraints must be a dict, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(KNOWN_KEYS))
    if unknown:
        raise ConstraintError(f"unknown constraint(s): {', '.join(unknown)}",
                              hint=f"known keys: {', '.join(KNOWN_KEYS)}")
    out: dict = {}
    for key in ("tp", "pp", "dp", "dp_shard", "ep", "cp", "micro_batch"):
        if raw.get(key) is not None:
            out[key] = _positive_int(key, raw[key])
    if raw.get("zero") is not None:
        z = raw["zero"]
        if isinstance(z, bool) or str(z) not in ("0", "1", "2", "3"):
            raise ConstraintError(f"--zero must be 0, 1, 2 or 3, got {z!r}")
        out["zero"] = int(z)
    if raw.get("checkpoint") is not None:
        c = str(raw["checkpoint"]).lower()
        if c not in CHECKPOINTS:
            raise ConstraintError(f"--checkpoint must be one of {', '.join(CHECKPOINTS)}, got {raw['checkpoint']!r}")
        out["checkpoint"] = c
    if raw.get("offload") is not None:
        o = str(raw["offload"]).lower()
        if o not in OFFLOADS:
            raise ConstraintError(f"--offload must be one of {', '.join(OFFLOADS)}, got {raw['offload']!r}")
        out["offload"] = o
    if raw.get("schedule") is not None:
        out["schedule"], v = parse_schedule(raw["schedule"])
        if v is not None:
            out["virtual_stages"] = v
    if raw.get("memory_headroom") is not None:
        h = raw["memory_headroom"]
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
            raise ConstraintError(f"--memory-headroom must be a fraction of usable memory in [0, 1), got {h!r}",
                                  hint="e.g. 0.1 leaves 10% of each GPU's usable memory free; 0 plans to the limit")
        out["memory_headroom"] = float(h)
    if raw.get("grad_reduce_dtype") is not None:
        g = str(raw["grad_reduce_dtype"]).lower()
        if g not in GRAD_REDUCE_CHOICES:
            raise ConstraintError(f"--grad-reduce-dtype must be one of {', '.join(GRAD_REDUCE_CHOICES)}, "
                                  f"got {raw['grad_reduce_dtype']!r}")
        out["grad_reduce_dtype"] = g
    if raw.get("sequence_parallel") is not None:
        sp = raw["sequence_parallel"]
        if not isinstance(sp, bool):
            raise ConstraintError(f"sequence_parallel must be true or false, got {sp!r}")
        out["sequence_parallel"] = sp
    c = Constraints(**out)
    _check_contradictions(c)
    return c


def _check_contradictions(c: Constraints) -> None:
    if c.sequence_parallel and c.tp == 1:
        raise ConstraintError("--sequence-parallel contradicts --tp 1: sequence parallelism splits the "
                              "sequence over the tensor-parallel group",
                              hint="drop --sequence-parallel or pin --tp > 1")
    if c.schedule == "interleaved" and c.pp == 1:
        raise ConstraintError("--schedule interleaved contradicts --pp 1: interleaving needs a pipeline",
                              hint="pin --pp >= 2 or drop --schedule")
    if c.schedule == "accumulate" and c.pp not in (None, 1):
        raise ConstraintError(f"--schedule accumulate contradicts --pp {c.pp}: accumulate is the schedule "
                              "without a pipeline", hint="drop --pp, or pin --schedule gpipe, 1f1b or interleaved")
    if c.dp_shard is not None and c.zero == 0:
        raise ConstraintError(f"--dp-shard {c.dp_shard} contradicts --zero 0: HSDP shards the ZeRO states over "
                              "dp-shard ranks, ZeRO 0 shards nothing", hint="pin --zero 1, 2 or 3, or drop --dp-shard")
    if c.dp_shard is not None and c.dp is not None and c.dp % c.dp_shard:
        raise ConstraintError(f"--dp-shard {c.dp_shard} does not divide --dp {c.dp}",
                              hint="dp = replicas x dp-shard: pin a divisor of --dp")
    if c.ep not in (None, 1) and c.dp is not None and c.dp % c.ep:
        raise ConstraintError(f"--ep {c.ep} does not divide --dp {c.dp}",
                              hint="expert parallelism folds into dp (dp = efsdp x ep): pin a divisor of --dp")
    if c.ep not in (None, 1) and (c.tp not in (None, 1) or c.dp_shard is not None):
        raise ConstraintError(f"--ep {c.ep} runs beside data and pipeline parallelism only: it contradicts --tp / "
                              f"--dp-shard", hint="drop --ep, or those pins")
    if c.ep not in (None, 1) and (c.cp or 1) > 1:
        raise ConstraintError(f"--ep {c.ep} does not run beside context parallelism yet: it contradicts --cp {c.cp}",
                              hint="drop --ep or --cp")
    clash = (c.cp or 1) > 1 and ((c.pp or 1) > 1 and f"--pp {c.pp}" or c.dp_shard and f"--dp-shard {c.dp_shard}")
    if clash:
        raise ConstraintError(f"--cp {c.cp} contradicts {clash}: context parallelism is lowered at pp 1 without HSDP",
                              hint="drop --pp / --dp-shard, or drop --cp")
    if c.offload == "params" and c.zero is not None and c.zero != 3:
        raise ConstraintError(f"--offload params needs --zero 3 (parameters are offloaded shard by shard), got --zero {c.zero}")
    if c.offload == "optimizer":
        raise ConstraintError(
            "--offload optimizer cannot run: autopar offloads with FSDP2's CPUOffloadPolicy, which keeps "
            "parameters, gradients and optimizer state on the host together (the cost model prices that as "
            "--offload params)", hint="use --offload params --zero 3, or drop --offload")


def check_against_cluster(c: Constraints, world_size: int, global_batch_size: int) -> None:
    """Contradictions between pinned values, the GPU count and the global batch."""
    axes = ("pp", "dp", "cp", "tp") if c.cp is not None else ("pp", "dp", "tp")
    pinned = {k: getattr(c, k) for k in axes if getattr(c, k) is not None}
    product = 1
    for v in pinned.values():
        product *= v
    desc = " x ".join(f"{FLAG[k]} {v}" for k, v in pinned.items())
    if len(pinned) == len(axes) and product != world_size:
        raise ConstraintError(f"{desc} = {product} GPUs, but the cluster has {world_size}",
                              hint="pp x dp x tp must equal the GPU count; leave one of them free")
    if pinned and world_size % product:
        what = desc if len(pinned) == 1 else f"{desc} = {product}"
        raise ConstraintError(f"{what} does not divide the {world_size} GPUs of the cluster",
                              hint="pp x dp x tp must equal the GPU count")
    if c.dp is not None and global_batch_size % c.dp:
        raise ConstraintError(f"global batch {global_batch_size} is not divisible by --dp {c.dp}",
                              hint="each data-parallel replica needs a whole number of samples")
    if c.micro_batch is not None:
        if c.micro_batch > global_batch_size:
            raise ConstraintError(f"--micro-batch {c.micro_batch} exceeds the global batch {global_batch_size}")
        if global_batch_size % c.micro_batch:
            raise ConstraintError(f"global batch {global_batch_size} is not divisible by --micro-batch {c.micro_batch}",
                                  hint="global batch = dp x micro-batch x number of micro-batches")
        if c.dp is not None and global_batch_size % (c.dp * c.micro_batch):
            raise ConstraintError(
                f"global batch {global_batch_size} is not divisible by --dp {c.dp} x --micro-batch {c.micro_batch}"
                f" = {c.dp * c.micro_batch}",
                hint="global batch = dp x micro-batch x number of micro-batches")
    _check_pipeline_schedule(c, global_batch_size)


def _check_pipeline_schedule(c: Constraints, global_batch_size: int) -> None:
    """A pinned 1F1B / interleaved schedule needs at least pp micro-batches:
    torch's Schedule1F1B raises below that (each rank's warm-up is pp - rank
    forwards) and interleaving needs a multiple of pp. The most micro-batches
    the pins allow is global batch / (dp x micro-batch), with unpinned ones at 1."""
    if c.schedule not in ("1f1b", "interleaved") or c.pp is None or c.pp == 1:
        return
    most = global_batch_size // ((c.dp or 1) * (c.micro_batch or 1))
    if most >= c.pp:
        return
    pins = " x ".join(f"{FLAG[k]} {getattr(c, k)}" for k in ("dp", "micro_batch") if getattr(c, k) is not None)
    raise ConstraintError(
        f"--schedule {c.schedule} with --pp {c.pp} needs at least {c.pp} micro-batches per step, but global batch "
        f"{global_batch_size}" + (f" / ({pins})" if pins else "") + f" allows at most {most}",
        hint="use --schedule gpipe, a larger global batch, a smaller --micro-batch or --dp, or fewer --pp stages")
