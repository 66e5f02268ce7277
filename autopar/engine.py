"""Which training engine runs the plan: autopar's own, or another one being priced.

By default every number autopar prints is for the program `autopar compile`
emits: DTensor tensor parallelism whose collectives are counted on the
lowering itself, FSDP2 for any data parallelism beside tp / pp (so ZeRO 0/1
run as ZeRO 2 there), torch's foreach AdamW, gradients in the training dtype.

A user who wants to compare a hand layout with a run they made on another
engine (Megatron-LM / Megatron-core / NeMo, plain PyTorch FSDP or DDP) needs
that engine's behaviour priced instead; otherwise the comparison measures the
engines, not the layouts. `Engine` names those differences. Each field maps to
a `cost_models.layout.Layout` field that states a documented behaviour of the
engine (docs/cost_model.md says where each comes from); none is a fitted
constant. A plan priced for another engine is an estimate only: the lowering
refuses it (`check_runs_on_autopar`).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, fields, replace

from autopar.errors import AutoparError, PlanMismatchError

# The kernels cost_models.compute.ATTENTION_IMPL_SPEED prices (a test keeps the two equal;
# not imported from there: the CLI builds its parser without the cost models' sympy)
ATTENTION_KERNELS = ("flash-triton", "flash1", "flash2")
MAIN_GRADS = ("same", "fp32")
OPTIMIZER_IMPLS = ("foreach", "fused")


# The chains autopar's program swaps its own kernel in for (autopar.kernels.RUNS, which
# says what was measured; stated here too because the CLI builds its parser without
# importing the kernels: a test keeps the two equal). Eager blocks: where the kernel beats
# eager; compiled blocks: where it beats inductor's own fusion of the chain.
AUTOPAR_FUSED = ("swiglu", "add_rmsnorm", "scaled_softmax", "dropout_add", "linear_cross_entropy")
AUTOPAR_FUSED_COMPILED = ("swiglu", "add_layernorm", "linear_cross_entropy")


@dataclass(frozen=True)
class Engine:
    name: str = "autopar"
    # TP collectives chunked under the neighbouring GEMMs (Megatron-core --tp-comm-overlap,
    # Transformer Engine userbuffers): Layout.tp_comm_overlap
    tp_comm_overlap: bool = False
    # "fp32": gradients reduced and accumulated in fp32 (Megatron's gradient-accumulation
    # fusion, FSDP reduce_dtype=float32): Layout.main_grads
    main_grads: str = "same"
    # "fused": one pass over the optimizer state (apex / Megatron FusedAdam, torch fused=True);
    # "foreach": torch's default multi-tensor AdamW (what autopar's program runs)
    optimizer_impl: str = "foreach"
    # the fused attention kernel the engine runs (None: FlashAttention-2, SDPA's kernel)
    attention_kernel: str | None = None
    # ZeRO levels priced as pinned (Megatron's distributed optimizer is a true ZeRO 1); False:
    # as autopar's lowering runs them (FSDP2 has no whole-gradient mode beside tp / pp)
    zero_as_pinned: bool = False
    # TP collectives: counted on autopar's DTensor lowering (True), or the dataflow's
    # Megatron pattern (two all-reduces per block each way, or AG + RS with SP)
    counted_tp_collectives: bool = True
    # Attention split by heads whatever the model code does: where autopar's DTensor lowering
    # must all-gather q/k/v (a fused qkv split by the full hidden size) and run the attention
    # whole on every tp rank, Megatron's column-parallel qkv is head-parallel. So the gather
    # is not issued, the ops downstream of it run 1/tp, and what they save is 1/tp
    # (Korthikanti et al. 2022, section 4: s b h (10 + 24/t + 5 a s / (h t)) without SP,
    # (s b h / t)(34 + 5 a s / h) with it)
    head_parallel_attention: bool = False
    # The fusion pass's chains (autopar.kernels.fusion.PATTERNS) the engine runs as one
    # kernel; None: autopar's own, the chains its Triton kernels win for where its blocks
    # run (AUTOPAR_FUSED eager, AUTOPAR_FUSED_COMPILED compiled). Any other engine is
    # priced with only the chains it fuses itself: the rest run eager.
    fused_patterns: tuple[str, ...] | None = None
    # The engine runs its own kernels, not the model's code: each chain of memory-bound ops
    # in a module (a norm, an activation, RoPE) as one kernel (LayerSpec.module_fusion_saved_*)
    fuses_modules: bool = False
    # autopar's own program with every block torch.compile'd (autopar/lower/compile_blocks.py;
    # on by default on CUDA): a block's memory-bound ops run as the fused kernels inductor
    # makes of them (LayerSpec.compiled_fusion_saved_*), launched as that many kernels.
    # Priced so only when asked (`autopar plan --compile`, plan(engine=COMPILED)) until
    # measured on a GPU: the eager pricing is the one the validation set checks.
    compiled_blocks: bool = False
    # autopar's compiled program with float8 GEMMs (torchao's Float8Linear, tensorwise
    # scaling) for each layer whose nn.Linears run faster so on this device
    # (cost_models/float8.py; `autopar plan --compile --float8`). Only with compiled
    # blocks: eager, each cast is several unfused passes (torchao's own advice).
    float8: bool = False

    @property
    def is_autopar(self) -> bool:
        """autopar's own program, its blocks compiled or not: the one the lowering runs."""
        return replace(self, compiled_blocks=False, float8=False) == AUTOPAR

    def runs_fused(self, pattern: str) -> bool:
        """Whether this engine runs the fusion pass's chain `pattern` as one kernel."""
        if self.fused_patterns is None:
            return pattern in (AUTOPAR_FUSED_COMPILED if self.compiled_blocks else AUTOPAR_FUSED)
        return pattern in self.fused_patterns

    def layout_fields(self) -> dict:
        """The Layout fields this engine sets (the rest of a Layout is the plan's)."""
        return {"tp_comm_overlap": self.tp_comm_overlap, "main_grads": self.main_grads,
                "optimizer_impl": self.optimizer_impl, "float8": self.float8}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Engine":
        if not d:
            return AUTOPAR
        known = {f.name for f in fields(cls)}
        # JSON has no tuples: a saved plan's list must compare equal to the preset's tuple
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known})


AUTOPAR = Engine()
COMPILED = Engine(compiled_blocks=True)  # autopar's program, blocks compiled (what CUDA runs by default)
COMPILED_FLOAT8 = Engine(compiled_blocks=True, float8=True)  # and float8 Linears where they win
# Presets a user names with --engine; the flags below it override single fields.
ENGINES = {
    "autopar": AUTOPAR,
    # Megatron-LM / Megatron-core / NeMo: fused Adam, fp32 main gradients accumulated in the
    # weight-gradient GEMM (--accumulate-allreduce-grads-in-fp32, gradient-accumulation
    # fusion), the distributed optimizer as ZeRO 1, Megatron's TP collective pattern.
    # TP overlap is a separate switch (--tp-comm-overlap), off by default as in Megatron.
    # Fused as Megatron-LM's arguments default (--bias-gelu-fusion, --bias-swiglu-fusion,
    # --masked-softmax-fusion, --bias-dropout-fusion): bias + GeLU, SwiGLU, the scaled masked
    # softmax, dropout + residual add. Its residual add and the next LayerNorm stay two
    # kernels (Transformer Engine fuses the norm into the following GEMM's module, not into
    # the add). It runs Megatron's implementation of the architecture, not the model file:
    # every norm is Transformer Engine's one kernel, so is its fused RoPE, and activations
    # are compiled (`@jit_fuser`): fuses_modules.
    "megatron": Engine(name="megatron", main_grads="fp32", optimizer_impl="fused", zero_as_pinned=True,
                       counted_tp_collectives=False, head_parallel_attention=True,
                       fused_patterns=("bias_gelu", "swiglu", "scaled_softmax", "dropout_add"),
                       fuses_modules=True),
    # Plain PyTorch outside autopar (FSDP1/FSDP2 or DDP as written by hand, torchtitan,
    # Composer): torch's foreach AdamW, ZeRO levels as pinned; its tensor parallelism is
    # DTensor's, whose collectives the lowering check counts as for autopar's own. Eager:
    # every op of a chain is its own kernel (no fused chains; torch.compile is not priced).
    "pytorch": Engine(name="pytorch", zero_as_pinned=True, fused_patterns=()),
}


def engine_from_options(name: str | None = None, *, tp_comm_overlap: bool | None = None,
                        main_grads: str | None = None, optimizer_impl: str | None = None,
                        attention_kernel: str | None = None, compiled_blocks: bool | None = None,
                        float8: bool | None = None) -> Engine:
    """The engine a user named (`--engine`) with single fields overridden. Any override
    without `--engine` prices another engine too: it starts from "pytorch".
    `compiled_blocks` (`--compile`): autopar's own program with compiled blocks;
    `float8` (`--float8`): and float8 GEMMs where they are faster."""
    if float8 and not compiled_blocks:
        raise AutoparError("--float8 needs --compile: torchao's float8 casts are fast only fused by torch.compile "
                           "(eager, each cast is several passes over the tensor and costs more than the float8 "
                           "GEMM saves)", hint="add --compile (what autopar compile runs on a GPU by default)")
    if compiled_blocks:
        if name not in (None, "autopar") or any(v is not None for v in (tp_comm_overlap, main_grads,
                                                                           optimizer_impl, attention_kernel)):
            raise AutoparError("--compile prices autopar's own program with compiled blocks; it does not "
                               "describe another engine", hint="drop --compile, or the other engine's flags")
        return COMPILED_FLOAT8 if float8 else COMPILED
    overrides = {k: v for k, v in (("tp_comm_overlap", tp_comm_overlap), ("main_grads", main_grads),
                                   ("optimizer_impl", optimizer_impl), ("attention_kernel", attention_kernel))
                 if v is not None}
    if name is None:
        name = "pytorch" if overrides else "autopar"
    if name not in ENGINES:
        raise AutoparError(f"--engine {name}: unknown engine", hint=f"one of {', '.join(ENGINES)}")
    if name == "autopar" and overrides:
        flags = ", ".join("--" + k.replace("_", "-") for k in overrides)
        raise AutoparError(f"{flags} describe(s) another engine than autopar's own program, which runs as it is",
                           hint="name the engine you are pricing, e.g. --engine megatron or --engine pytorch")
    checks = (("main_grads", MAIN_GRADS), ("optimizer_impl", OPTIMIZER_IMPLS), ("attention_kernel", ATTENTION_KERNELS))
    for key, allowed in checks:
        if key in overrides and overrides[key] not in allowed:
            raise AutoparError(f"--{key.replace('_', '-')} {overrides[key]}: must be one of {', '.join(allowed)}")
    return replace(ENGINES[name], **overrides)


def with_engine(spec, engine: Engine):
    """`spec` as `engine` runs it (copies; the input is untouched): attention ops carry the
    engine's kernel, attention is split by heads where the engine does so, memory-bound
    modules run as one kernel each where the engine has its own, and the spec remembers
    the engine for every layout built from it."""
    if engine == AUTOPAR:
        return spec
    spec = copy.copy(spec)
    spec.layers = [_layer_as_run(layer, engine) for layer in spec.layers]
    spec.engine = engine
    return spec


def _layer_as_run(layer, engine: Engine):
    changed = copy.copy(layer)
    if engine.fuses_modules:
        changed.fused_bytes_saved_fwd = layer.fused_bytes_saved_fwd + layer.module_fusion_saved_fwd
        changed.fused_bytes_saved_bwd = layer.fused_bytes_saved_bwd + layer.module_fusion_saved_bwd
    if engine.attention_kernel is not None and any(op.kind == "attention" for op in layer.ops):
        changed.ops = [replace(op, impl=engine.attention_kernel) if op.kind == "attention" else op
                       for op in layer.ops]
    if engine.head_parallel_attention:
        changed.ops = [replace(op, tp_sharded=True, tp_replicated=False) if op.tp_replicated else op
                       for op in changed.ops]
        changed.tp_gather_bytes = 0
        # cost_models.memory divides the sharded share by tp and keeps the gathered one whole
        changed.activation_bytes_tp_sharded = layer.activation_bytes_tp_sharded + layer.activation_bytes_tp_gathered
        changed.activation_bytes_tp_gathered = 0
        if layer.activation_bytes_selective_tp_sharded is not None:
            changed.activation_bytes_selective_tp_sharded = (layer.activation_bytes_selective_tp_sharded
                                                             + layer.activation_bytes_selective_tp_gathered)
        changed.activation_bytes_selective_tp_gathered = 0
    return changed


def engine_of(spec) -> Engine:
    """The engine a spec was prepared for (`with_engine`); autopar's own by default."""
    return getattr(spec, "engine", None) or AUTOPAR


def plan_engine(plan) -> Engine:
    """The engine a Plan was priced for (kept in `Plan.assumptions["engine"]`)."""
    assumptions = plan.assumptions if isinstance(plan.assumptions, dict) else {}
    return Engine.from_dict(assumptions.get("engine"))


def check_runs_on_autopar(plan) -> None:
    """Refuse to lower a plan that was priced for another engine: its numbers describe
    a run autopar's program does not make (correct or refused)."""
    engine = plan_engine(plan)
    if not engine.is_autopar:
        raise PlanMismatchError(
            f"this plan was priced for the {engine.name} engine ({describe(engine)}); autopar's program runs "
            f"differently, so it cannot lower it as priced",
            hint="re-plan without --engine / --tp-comm-overlap / --main-grads / --optimizer-impl / "
                 "--attention-kernel to get a plan autopar runs")


def priced_for(plan) -> str:
    """Which program a plan's numbers are for, in words (the terminal plan and the report)."""
    engine = plan_engine(plan)
    if engine.is_autopar:
        blocks = "blocks torch.compile'd" if engine.compiled_blocks else "blocks eager"
        if engine.float8:
            blocks += ", float8 Linears where faster"
        return (f"autopar's own program (what autopar compile emits; priced with its {blocks}); to compare "
                "with a run made on Megatron-LM / NeMo or plain PyTorch, price it as that engine ran it "
                "(--engine, docs/cli.md)")
    return f"the {engine.name} engine ({describe(engine)}): an estimate autopar does not lower"


def describe(engine: Engine) -> str:
    d = {k: v for k, v in engine.to_dict().items() if k != "name" and v != getattr(AUTOPAR, k)}
    if "fused_patterns" in d:  # a list of chains reads better than a tuple's repr
        d["fused_patterns"] = "+".join(d["fused_patterns"]) or "none"
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "as autopar"
