"""Memory per GPU: model states (ZeRO, offload), activations, buffers.

Model states, per parameter (ZeRO paper, Rajbhandari et al. 2020):
mixed precision (bf16/fp16) keeps a 2-byte parameter, a 2-byte gradient and
K bytes of optimizer state: Adam K = 12 (fp32 master copy, momentum,
variance), SGD with momentum K = 8 (master copy, momentum). Pure fp32 keeps
4 + 4 + (8 Adam | 4 SGD). ZeRO-1 shards the optimizer state over dp,
ZeRO-2 the gradients too, ZeRO-3 the parameters too.

Activations per layer (Korthikanti et al. 2022): the workload's
`activation_bytes` is what one micro-batch saves for backward with no
parallelism. Tensor parallelism divides the `activation_bytes_tp_sharded`
part by tp; sequence parallelism divides the rest by tp as well, except
`activation_bytes_tp_gathered` (downstream of a tp all-gather: whole on every
rank); selective checkpointing drops `activation_bytes_selective` (the
attention core: tp-sharded in Megatron's head-parallel layout, gathered where
the model splits a fused qkv, see `activation_bytes_selective_tp_sharded` and
`_tp_gathered`) and full checkpointing keeps only `input_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.compute import fast
from cost_models.errors import CostModelError
from cost_models.workload import LayerSpec

# (param, grad, optimizer) bytes per parameter
STATE_BYTES = {
    ("bf16", "adam"): (2, 2, 12),
    ("fp16", "adam"): (2, 2, 12),
    ("fp32", "adam"): (4, 4, 8),
    ("bf16", "sgd"): (2, 2, 8),
    ("fp16", "sgd"): (2, 2, 8),
    ("fp32", "sgd"): (4, 4, 4),
}

# Allocator fragmentation: PyTorch's caching allocator rounds blocks and
# cannot always reuse freed segments across differently sized activations;
# 5-10% of the peak is lost in practice (torch.cuda.memory_stats
# reserved/allocated on large training runs). We charge 8% of activations
# and gradients, the parts that churn every micro-batch.
FRAGMENTATION = 0.08


def state_bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int]:
    try:
        return STATE_BYTES[(precision, optimizer)]
    except KeyError:
        raise CostModelError(f"no model-state sizes for precision={precision!r}, optimizer={optimizer!r}") from None


@dataclass
class ModelStates:
    params: float
    grads: float
    optimizer: float
    host: float = 0.0  # bytes held in CPU memory by offload, per GPU


def model_state_bytes(params: float, *, precision: str = "bf16", optimizer: str = "adam", zero: int = 0,
                      dp: int = 1, offload: str = "none") -> ModelStates:
    """Bytes per GPU of `params` parameters (already divided by tp/pp)."""
    p, g, k = state_bytes_per_param(precision, optimizer)
    param_b = p * params / (dp if zero >= 3 else 1)
    grad_b = g * params / (dp if zero >= 2 else 1)
    opt_b = k * params / (dp if zero >= 1 else 1)
    host = 0.0
    if offload in ("optimizer", "params"):
        host += opt_b
        opt_b = 0.0
    if offload == "params":
        # ZeRO-Infinity / FSDP CPU offload: sharded params and grads live on the host.
        host += param_b + grad_b
        param_b, grad_b = 0.0, 0.0
    return ModelStates(param_b, grad_b, opt_b, host)


def activation_bytes(layer: LayerSpec, batch: int, seq: int | None, *, tp: int = 1, sequence_parallel: bool = False,
                     checkpoint: str = "none", byte_scale: float = 1.0) -> float:
    """Bytes one micro-batch of this layer keeps alive until its backward."""
    s = seq if seq is not None else 1
    if checkpoint == "full":
        kept = fast(layer.input_bytes)(batch, s)
        return byte_scale * kept / (tp if sequence_parallel else 1)
    total = fast(layer.activation_bytes)(batch, s)
    sharded = fast(layer.activation_bytes_tp_sharded)(batch, s)
    gathered = fast(layer.activation_bytes_tp_gathered)(batch, s)
    replicated = total - sharded - gathered
    if checkpoint == "selective":
        dropped = fast(layer.activation_bytes_selective)(batch, s)
        dropped_sharded = dropped if layer.activation_bytes_selective_tp_sharded is None \
            else fast(layer.activation_bytes_selective_tp_sharded)(batch, s)
        dropped_gathered = fast(layer.activation_bytes_selective_tp_gathered)(batch, s)
        sharded -= dropped_sharded
        gathered -= dropped_gathered
        replicated -= dropped - dropped_sharded - dropped_gathered
    elif checkpoint != "none":
        raise CostModelError(f"unknown checkpoint mode '{checkpoint}' (none, selective, full)")
    return byte_scale * (sharded / tp + gathered + replicated / (tp if sequence_parallel else 1))


def recompute_working_bytes(layer: LayerSpec, batch: int, seq: int | None, *, tp: int = 1,
                            sequence_parallel: bool = False, checkpoint: str = "none", byte_scale: float = 1.0) -> float:
    """Extra bytes alive while a checkpointed layer is recomputed in backward:
    the activations it drops come back for that one layer."""
    if checkpoint == "none":
        return 0.0
    full = activation_bytes(layer, batch, seq, tp=tp, sequence_parallel=sequence_parallel, byte_scale=byte_scale)
    kept = activation_bytes(layer, batch, seq, tp=tp, sequence_parallel=sequence_parallel,
                            checkpoint=checkpoint, byte_scale=byte_scale)
    return max(0.0, full - kept)


# -- one layer under a layout ----------------------------------------------------------
def fp32_main_grads(layout) -> bool:
    """Gradients held (and reduced) in fp32 beside 16-bit training (Layout.main_grads)."""
    return layout.main_grads != "same" and layout.precision != "fp32"


def layer_states(params_local: float, layout, zero: int, offload: str) -> tuple[ModelStates, tuple]:
    """Model states per GPU of one layer's `params_local` parameters (already divided
    by tp), and the (param, gradient, optimizer) bytes per parameter as held."""
    states = model_state_bytes(params_local, precision=layout.precision, optimizer=layout.optimizer, zero=zero,
                               dp=layout.shard_ranks, offload=offload)
    # HSDP shards the states over the dp_shard group only, each replica a full copy (FSDP
    # paper, Zhao et al. 2023, 3.2.2 "Hybrid Sharding": memory of a sharding factor F)
    p_bytes, g_bytes, k_bytes = state_bytes_per_param(layout.precision, layout.optimizer)
    if fp32_main_grads(layout):  # fp32 main gradients: 4 bytes each where the gradients are held, and reduced in fp32
        states.grads *= 4 / g_bytes
        g_bytes = 4
    if zero >= 3 and layout.dp > 1 and layout.precision in ("bf16", "fp16") and offload == "none":
        # FSDP (what autopar lowers to, and torchtitan / MPT run) shards the fp32 parameter
        # itself: no 16-bit shard exists (the 16-bit copies are unsharded and transient, in
        # the FSDP buffer), and a gradient shard takes its parameter's dtype. 4 + 4 + 8
        # bytes per parameter / dp (FSDPMemTracker: sharded param, sharded grad, optimizer
        # state). DeepSpeed's stage 3 also keeps a 16-bit shard: not modelled.
        states.params = 4 * params_local / layout.shard_ranks
        states.grads = 4 * params_local / layout.shard_ranks
        states.optimizer = (k_bytes - 4) * params_local / layout.shard_ranks
    elif zero == 2 and layout.dp > 1 and layout.precision in ("bf16", "fp16") and offload == "none":
        # ZeRO-2 as FSDP2 runs it (fully_shard, reshard_after_forward=False) shards the fp32
        # parameter too: its gradient shard is fp32 whatever the reduce dtype
        # (FSDPMemTracker: SHARDED_GRAD 4 bytes per parameter / dp on the pp 2 ranks of
        # benchmarks/memory_lowered.py). The plan's other ZeRO-2 states are unchanged.
        states.grads = 4 * params_local / layout.shard_ranks
    return states, (p_bytes, g_bytes, k_bytes)


# The temporary foreach Adam allocates for sqrt(exp_avg_sq), all tensors at once: a
# second memory peak during the optimizer step (4 bytes per fp32 state element)
FOREACH_TEMP_BYTES = {"adam": 4.0, "sgd": 0.0}


def optimizer_temp_bytes(layout, device, opt_params: float, offload: str) -> float:
    """Bytes foreach Adam allocates at once during the step for this layer's state
    elements. torch runs foreach by default only on GPUs; a CPU's default loops over
    the tensors, each temporary freed before the next (nothing to speak of)."""
    if layout.optimizer_impl != "foreach" or offload != "none" or device.vendor == "cpu":
        return 0.0
    return FOREACH_TEMP_BYTES[layout.optimizer] * opt_params


def loss_grad_bytes(layer: LayerSpec, b: int, s1: int, byte_scale: float, tp: int) -> float:
    """Two logits-sized gradients at the loss's first backward op, in the dtype the loss
    computes its log-softmax in (fp32 where it upcasts the logits, as Hugging Face's
    causal-LM loss does): the log-softmax op reads and writes the logits once each, so
    one logits tensor is half its bytes. Measured with FSDPMemTracker on Qwen2 0.5B:
    18.55 GiB of temporaries at the peak, 2 x its 9.28 GiB fp32 logits. A vocab-split
    head computes the loss on its shard (loss_parallel): each rank holds 1/tp of them."""
    if not layer.attrs.get("loss"):
        return 0.0
    sm = [op for op in layer.ops if op.kind == "softmax" and op.name.startswith("loss:")]
    return sum(fast(op.fwd_bytes)(b, s1) / (tp if op.tp_sharded else 1)
               for op in sm) * byte_scale  # 2 x (bytes / 2)


def backward_peak(layer: LayerSpec, activations: float, grads: float) -> float:
    """The most a layer's own backward holds at once of its saved activations (all of
    them, recomputed ones included, when it starts) and its weight gradients (all of
    them when it ends): capture's walk through its autograd nodes (LayerSpec.attrs
    "bwd_walk", [[alive share, gradient share], ...]); without one, the larger end."""
    walk = layer.attrs.get("bwd_walk") or ((1.0, 0.0), (0.0, 1.0))
    return max(max(a * activations + g * grads for a, g in walk), activations, grads)


def in_flight_micro_batches(schedule: str, pp: int, num_micro_batches: int, pp_rank: int = 0,
                            virtual_stages: int = 1) -> float:
    """Closed forms (the pipeline simulation agrees with these, tested against
    torch.distributed.pipelining's own action lists in tests/test_cost_pipeline.py):
    GPipe keeps all m; 1F1B keeps min(m, pp - rank) (Schedule1F1B's warm-up is
    pp - rank forwards); interleaved 1F1B keeps min(m V, (pp - rank - 1) * 2 +
    (V - 1) * pp + 1) chunks of 1/V of the stage (ScheduleInterleaved1F1B's
    warm-up plus the forward that opens each 1F1B step), i.e.
    pp (1 + (pp-1)/(pp V)) micro-batches on the first rank (Korthikanti).

    The count is exact; turning it into bytes as count x (the rank's bytes per
    micro-batch) is exact only when a rank's V chunks hold equal activations.
    They do not when chunks differ in layers or checkpointing: chunk 0 is held
    by the warm-up's extra 2 (pp - rank - 1) + 1 forwards, the others pp times
    each. `peak_chunk_bytes` gives the exact peak for unequal chunks."""
    m = num_micro_batches
    if pp == 1:  # plain gradient accumulation: one micro-batch at a time
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - pp_rank))
    chunks = min(m * virtual_stages, (pp - pp_rank - 1) * 2 + (virtual_stages - 1) * pp + 1)
    return chunks / virtual_stages


def in_flight_chunk_counts(schedule: str, pp: int, num_micro_batches: int, pp_rank: int = 0,
                           virtual_stages: int = 1) -> list[tuple[int, ...]]:
    """How many micro-batches of each local chunk (chunk k = stage k * pp + rank)
    a pp rank holds, at every moment that could be its activation peak: the
    vectors after each forward, with dominated ones dropped (another vector
    holds at least as many of every chunk). Follows the rank's op order, which
    for m % pp == 0 is ScheduleInterleaved1F1B's (and Schedule1F1B's, GPipe's)."""
    from cost_models.pipeline import rank_order  # the schedule's order lives with the simulation

    v = virtual_stages if schedule == "interleaved" and pp > 1 else 1
    if pp == 1:
        return [tuple([1] * v)]
    counts = [0] * v
    seen: list[tuple[int, ...]] = []
    for phase, _, chunk in rank_order(schedule, pp_rank, pp, num_micro_batches, v):
        counts[chunk] += 1 if phase == "fwd" else -1
        if phase == "fwd":
            seen.append(tuple(counts))
    return sorted(_undominated(seen))


def _undominated(vectors: list) -> list:
    """The vectors no other one matches or beats in every entry. A dominating vector
    sorts before what it dominates, so one pass against those kept suffices. Entries
    (counts, >= 0) are packed into one integer, a guard bit above each field: adding
    the guards to o and taking c away leaves every guard set iff o >= c entry by entry
    (no field borrows from the next), one integer test per pair instead of a loop."""
    uniq = sorted(set(vectors), reverse=True)
    width = max(max(c, default=0) for c in uniq).bit_length() + 1
    guard = sum(1 << (i * width + width - 1) for i in range(len(uniq[0])))
    peaks, packed = [], []
    for c in uniq:
        pc = sum(x << (i * width) for i, x in enumerate(c))
        if not any(((po | guard) - pc) & guard == guard for po in packed):
            peaks.append(c)
            packed.append(pc)
    return peaks


def peak_chunk_bytes(schedule: str, pp: int, num_micro_batches: int, chunk_bytes: list, pp_rank: int = 0) -> float:
    """Exact peak activation bytes of a pp rank whose chunk k keeps chunk_bytes[k]
    per micro-batch (len V; V = 1 for GPipe / 1F1B)."""
    v = len(chunk_bytes)
    vectors = in_flight_chunk_counts(schedule, pp, num_micro_batches, pp_rank, v)
    return max(sum(c * b for c, b in zip(vec, chunk_bytes)) for vec in vectors)


def activation_expr(layer: LayerSpec, *, tp: int = 1, sequence_parallel: bool = False, checkpoint: str = "none"):
    """The same rule as `activation_bytes`, kept symbolic in B (micro-batch) and S
    (sequence) so a report can print the formula it priced, e.g. 34*b*s*h/t."""
    import sympy

    total = sympy.sympify(layer.activation_bytes)
    sharded = sympy.sympify(layer.activation_bytes_tp_sharded)
    if checkpoint == "full":
        return sympy.simplify(sympy.sympify(layer.input_bytes) / (tp if sequence_parallel else 1))
    gathered = sympy.sympify(layer.activation_bytes_tp_gathered)
    if checkpoint == "selective":
        dropped = sympy.sympify(layer.activation_bytes_selective)
        dropped_sharded = dropped if layer.activation_bytes_selective_tp_sharded is None \
            else sympy.sympify(layer.activation_bytes_selective_tp_sharded)
        sharded = sharded - dropped_sharded
        gathered = gathered - sympy.sympify(layer.activation_bytes_selective_tp_gathered)
        total = total - dropped
    elif checkpoint != "none":
        raise CostModelError(f"unknown checkpoint mode '{checkpoint}' (none, selective, full)")
    replicated = total - sharded - gathered
    return sympy.factor(sharded / tp + gathered + replicated / (tp if sequence_parallel else 1))
