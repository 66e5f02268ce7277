"""Layout: one fully specified way to run a model on a cluster.

Mesh axes are tp (innermost: consecutive ranks, inside a node first), dp,
then pp (outermost), ranks numbered node-major; `comm.py` derives which tier
each group's collectives pay from that order. Under HSDP (`dp_shard` < dp)
the dp axis splits into dp_replicate x dp_shard, the shard group inner
(neighbours: inside a node when dp_shard x tp fits one). A Layout is what the planner
searches over and what `estimate()` prices; it holds no model or hardware.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cost_models import compression
from cost_models.errors import CostModelError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
CHECKPOINTS = ("none", "selective", "full")
OFFLOADS = ("none", "optimizer", "params")  # "params" offloads optimizer state too
PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adam", "sgd")
MAIN_GRADS = ("same", "fp32", "fp32-unfused")


@dataclass
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    checkpoint: str = "none"
    offload: str = "none"
    precision: str = "bf16"
    optimizer: str = "adam"
    stage_layers: list | None = None  # layer counts per stage, len pp * virtual_stages
    layer_zero: list | None = None  # per-layer overrides aligned with model.layers
    layer_checkpoint: list | None = None
    layer_offload: list | None = None
    # Float8 GEMMs for the nn.Linears (torchao, cost_models/float8.py): with `float8`, each
    # layer runs in float8 where that is faster on this device at its shapes, unless
    # `layer_float8` (per layer, True/False) says which layers do
    float8: bool = False
    layer_float8: list | None = None
    # Pipeline sends: False = asynchronous isend/irecv (torch.distributed.pipelining,
    # what autopar lowers to); True = blocking rendezvous (Megatron, DeepSpeed).
    p2p_blocking: bool = False
    # Where gradients live between backward and the optimizer, when training in 16 bits:
    # "same" = the training dtype (PyTorch autograd's .grad); "fp32" = fp32 main gradients,
    # reduced in fp32, accumulated inside the weight-gradient GEMM (Megatron-LM's
    # gradient-accumulation fusion, FSDP2 reduce_dtype=float32, Llama 3); "fp32-unfused" =
    # the same plus a memory-bound lp -> fp32 pass after every micro-batch's backward
    # (DeepSpeed's BF16 optimizer: clear_lp_grads / update_hp_grads).
    main_grads: str = "same"
    # FSDP2 mixed precision on a one-rank mesh: how autopar lowers a 16-bit plan with
    # dp = 1 (fp32 parameters cast per forward, gradients cast back, FSDP2's hooks)
    fsdp_one_rank: bool = False
    # How the optimizer runs: "fused" (one pass over the state: apex / Megatron /
    # DeepSpeed FusedAdam, torch fused=True) or "foreach" (torch's default on GPUs and
    # torchtitan's: one multi-tensor kernel per arithmetic step, ~20 passes for AdamW)
    optimizer_impl: str = "fused"
    # Tensor-parallel collectives split into chunks and run under the neighbouring GEMMs
    # (Transformer Engine's userbuffers overlap in Megatron-core / NeMo; torch's async TP
    # is the same idea): the exposed part is one chunk plus whatever the GEMM cannot
    # cover, and the GEMM loses the SMs the overlap takes (cost_models/overlap.py: tp_overlapped).
    # autopar lowers plain DTensor collectives, so its own plans leave this False.
    tp_comm_overlap: bool = False
    # Under gradient accumulation, FSDP2 units (ZeRO >= 2) reduce-scatter each micro-batch's
    # gradients under that micro-batch's backward (torchtitan, DeepSpeed ZeRO-2/3, and
    # autopar's lowering, pipelines included): the gradients stay sharded, as memory.py books
    # them, and the reduce-scatter runs m times; FSDP2 also reshards after every backward, so
    # a ZeRO-2 unit gathers in every forward (m all-gathers). False: once, after the last
    # micro-batch (Megatron's distributed optimizer, which holds whole gradient buffers until then).
    grads_reduced_per_micro_batch: bool = False
    # HSDP (hybrid sharded data parallelism, FSDP2's fully_shard on a 2-D (replicate, shard)
    # mesh): ZeRO >= 1 states are sharded over groups of `dp_shard` dp ranks and the
    # gradient shards all-reduced across the dp / dp_shard replicas. None: one shard group
    # of the whole dp (plain FSDP / ZeRO), which is what every layout before it meant.
    dp_shard: int | None = None
    # Communication compression (cost_models/compression.py): gradients reduced in this
    # narrower dtype ("bf16"), cast back after; None: reduced as held
    grad_reduce_dtype: str | None = None
    # Expert parallelism (cost_models/expert_parallel.py): an MoE layer's experts split over
    # groups of `ep` neighbouring dp ranks, their states sharded over the other
    # ep_fold_ranks / ep ("efsdp", torchtitan's dp_shard x cp = efsdp x ep); dense layers,
    # routers and shared experts as without it. 1: every rank holds every expert.
    ep: int = 1
    # Context parallelism (cost_models/context_parallel.py): every sequence cut over cp ranks,
    # placed between dp and tp (tp, cp, dp, pp from the innermost, as torchtitan orders them);
    # every op but attention runs on seq / cp tokens, the ZeRO states are sharded and the
    # gradients reduced over dp x cp (torchtitan's dp_shard_cp). 1: no cut.
    cp: int = 1
    extra: dict = field(default_factory=dict)  # free-form notes (e.g. where a published layout came from)

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.micro_batch_size * self.num_micro_batches

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """The dp ranks ZeRO >= 1 states are sharded over (the whole dp unless HSDP)."""
        return self.dp_shard or self.dp

    @property
    def replicas(self) -> int:
        """How many copies of the sharded states HSDP keeps (dp / dp_shard; 1 without HSDP)."""
        return self.dp // self.shard_ranks

    @property
    def hsdp(self) -> bool:
        return self.shard_ranks < self.dp

    @property
    def ep_fold_ranks(self) -> int:
        """The ranks ep divides: dp (x cp once the layout has a cp axis). The one place that says so."""
        return self.dp

    @property
    def efsdp(self) -> int:
        """The ranks an expert's states are sharded over: ep_fold_ranks / ep."""
        return self.ep_fold_ranks // self.ep

    @property
    def num_stages(self) -> int:
        return self.pp * (self.virtual_stages if self.schedule == "interleaved" else 1)

    def validate(self, num_layers: int | None = None) -> None:
        """Raise CostModelError naming the first field that cannot be priced."""
        for key in ("tp", "pp", "dp", "cp", "micro_batch_size", "num_micro_batches", "virtual_stages"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostModelError(f"layout.{key} must be a positive integer, got {value!r}")
        if self.dp_shard is not None and (isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int)
                                          or self.dp_shard < 1 or self.dp % self.dp_shard):
            raise CostModelError(f"layout.dp_shard must be a positive divisor of dp {self.dp}, got {self.dp_shard!r}")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1 or self.ep_fold_ranks % self.ep:
            raise CostModelError(f"layout.ep must be a positive divisor of dp {self.dp}, got {self.ep!r}")
        if self.ep > 1 and self.hsdp:
            raise CostModelError("layout.ep with dp_shard (HSDP) is not priced: experts shard over efsdp = dp / ep")
        checks = (("schedule", SCHEDULES), ("checkpoint", CHECKPOINTS), ("offload", OFFLOADS),
                  ("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("main_grads", MAIN_GRADS))
        for key, allowed in checks:
            if getattr(self, key) not in allowed:
                raise CostModelError(f"layout.{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        compression.check(self.grad_reduce_dtype)
        if self.zero not in (0, 1, 2, 3):
            raise CostModelError(f"layout.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            raise CostModelError("layout.virtual_stages > 1 needs schedule 'interleaved'")
        if self.schedule == "interleaved" and self.pp > 1 and self.num_micro_batches % self.pp:
            # Megatron's interleaved order runs micro-batches in groups of pp.
            raise CostModelError(
                f"interleaved schedule needs num_micro_batches ({self.num_micro_batches}) "
                f"to be a multiple of pp ({self.pp})")
        if self.stage_layers is not None:
            if len(self.stage_layers) != self.num_stages:
                raise CostModelError(
                    f"layout.stage_layers has {len(self.stage_layers)} entries, needs pp x virtual_stages = {self.num_stages}")
            if any((not isinstance(n, int)) or n < 0 for n in self.stage_layers):
                raise CostModelError("layout.stage_layers entries must be non-negative integers")
            if num_layers is not None and sum(self.stage_layers) != num_layers:
                raise CostModelError(
                    f"layout.stage_layers sums to {sum(self.stage_layers)}, the model has {num_layers} layers")
        elif num_layers is not None and num_layers < self.num_stages:
            raise CostModelError(f"{self.num_stages} pipeline stages but only {num_layers} layers")
        for key in ("layer_zero", "layer_checkpoint", "layer_offload", "layer_float8"):
            values = getattr(self, key)
            if values is not None and num_layers is not None and len(values) != num_layers:
                raise CostModelError(f"layout.{key} has {len(values)} entries, the model has {num_layers} layers")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise CostModelError(f"unknown layout field(s): {', '.join(sorted(unknown))}")
        return cls(**d)
