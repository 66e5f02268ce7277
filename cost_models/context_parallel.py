"""Context parallelism (cp): the price of one attention layer with its sequence cut over cp ranks.

What moves. Ring attention (Liu, Zaharia, Abbeel 2023, "Ring Attention with
Blockwise Transformers for Near-Infinite Context", arXiv:2310.01889, section 3;
torch's `torch.distributed.tensor.experimental.context_parallel`, whose
`_templated_ring_attention` autopar/lower/context_parallel.py runs; torchtitan's
context parallelism, torchtitan/distributed/context_parallel, and the PyTorch
tutorial "Introduction to Context Parallel") keeps each rank's query shard and
passes the key/value shards round the ring: cp - 1 steps, each receiving K and V
of one shard,

    kv_shard_bytes = batch x seq / cp x kv_elems_per_token x bytes per element

(kv_elems_per_token: K + V heads x head_dim as the attention kernel reads them,
capture's `cp_kv_elems_per_token`). Backward moves twice that per step: K and V
again, and the dK, dV accumulators travelling with them
(`_templated_ring_attention_backward`: a kv rotater and a dkv rotater).

What hides it. Each step's transfer runs while the previous shard's attention
computes (the paper's overlap of "blockwise computation" with the ring's
send/receive), so a step exposes max(0, transfer - compute). Under torch's
head-tail load balancing (each rank holds chunks r and 2 cp - 1 - r of 2 cp)
every one of the cp steps computes the same two of the (2 cp)^2 / 2 chunk
pairs of the causal triangle, so a step computes the whole causal attention's
time / cp^2 (the first, local step included, which has nothing to hide).

What cp divides. Every other op of the layer is position-local and runs on
seq / cp tokens: compute and saved activations per rank / cp (flash attention
saves O(seq) per head, not the seq^2 scores). The ring holds two shards of K
and V at a time (the one computed on, the one arriving).

In `estimate` (Layout.cp > 1): `cp_view` is one cp rank's share of the job (every
op on seq / cp tokens; dp x cp ranks holding and reducing the ZeRO states and
gradients, as torchtitan folds cp into FSDP's dp_shard_cp group, the cp ranks
inner to dp after tp), and `sharded_layer_cost` adds to each attention layer what
the view under-prices: the causal attention over the whole sequence / cp (the
view computes only its own seq / cp square) and the ring's exposed transfers.

Not priced: torch's all-gather rotation (`set_rotate_method("allgather")`: the
same (cp - 1) shards in one collective, hidden only behind the first step;
autopar's lowering keeps the default alltoall rotation, a ring of sends) and the
ring's two K/V shard buffers (a transient the size of one layer's K and V).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from cost_models.comm import p2p_time
from cost_models.compute import op_times
from cost_models.errors import CostModelError
from cost_models.hardware import ClusterSpec
from cost_models.workload import LayerSpec

BWD_EXCHANGE_FACTOR = 2  # backward: K, V and their gradients dK, dV each step


@dataclass(frozen=True)
class AttentionLayerShape:
    """One attention layer on the whole sequence, as one GPU would run it: `batch`
    sequences of `seq` tokens; K + V elements per token the ring exchanges; the
    attention kernel's forward / backward seconds (causal, whole sequence); the
    layer's other compute seconds and its saved activation bytes."""

    batch: float
    seq: int
    kv_elems_per_token: int
    dtype_bytes: int
    attn_fwd_s: float
    attn_bwd_s: float
    other_fwd_s: float = 0.0
    other_bwd_s: float = 0.0
    activation_bytes: float = 0.0


@dataclass(frozen=True)
class ContextParallelCost:
    kv_shard_bytes: float  # K and V of one shard: what one forward ring step receives
    fwd_comm_s: float  # all cp - 1 forward steps' transfers
    bwd_comm_s: float
    fwd_exposed_s: float  # the part of them no attention compute hides
    bwd_exposed_s: float
    fwd_compute_s: float  # this rank's attention + other ops
    bwd_compute_s: float
    activation_bytes_per_rank: float
    ring_buffer_bytes: float  # K, V shards held by the ring at once (transient)

    @property
    def time_s(self) -> float:
        return self.fwd_compute_s + self.bwd_compute_s + self.fwd_exposed_s + self.bwd_exposed_s


def kv_shard_bytes(layer: AttentionLayerShape, cp: int) -> float:
    return layer.batch * layer.seq / cp * layer.kv_elems_per_token * layer.dtype_bytes


def _ring(step_bytes: float, step_compute_s: float, cp: int, same_node: bool,
          cluster: ClusterSpec) -> tuple[float, float]:
    """(transfer seconds, exposed seconds) of cp - 1 ring steps, each hidden behind one step's compute."""
    one = p2p_time(step_bytes, same_node, cluster)
    return (cp - 1) * one, (cp - 1) * max(0.0, one - step_compute_s)


def cp_layer_cost(layer: AttentionLayerShape, cp: int, cluster: ClusterSpec, *,
                  same_node: bool = True) -> ContextParallelCost:
    """One attention layer's price for one micro-batch on one cp rank (all ranks alike
    under load balancing). `same_node`: the cp ring's neighbours share NVLink."""
    if cp < 1 or layer.seq % (2 * cp if cp > 1 else 1):
        raise CostModelError(f"cp={cp} needs the sequence ({layer.seq}) in 2 x cp equal chunks "
                             f"(the causal load balancing)")
    shard = kv_shard_bytes(layer, cp)
    fwd_step, bwd_step = layer.attn_fwd_s / cp ** 2, layer.attn_bwd_s / cp ** 2
    fwd_comm, fwd_exposed = _ring(shard, fwd_step, cp, same_node, cluster)
    bwd_comm, bwd_exposed = _ring(BWD_EXCHANGE_FACTOR * shard, bwd_step, cp, same_node, cluster)
    return ContextParallelCost(
        kv_shard_bytes=shard, fwd_comm_s=fwd_comm, bwd_comm_s=bwd_comm,
        fwd_exposed_s=fwd_exposed, bwd_exposed_s=bwd_exposed,
        fwd_compute_s=(layer.attn_fwd_s + layer.other_fwd_s) / cp,
        bwd_compute_s=(layer.attn_bwd_s + layer.other_bwd_s) / cp,
        activation_bytes_per_rank=layer.activation_bytes / cp,
        ring_buffer_bytes=2 * shard if cp > 1 else 0.0)


def attention_layer_shape(layer: LayerSpec, batch: float, seq: int, cluster: ClusterSpec, *,
                          dtype: str = "bf16", dtype_bytes: int = 2, byte_scale: float = 1.0) -> AttentionLayerShape:
    """A captured layer as `cp_layer_cost` takes it: its attention ops' and other
    ops' times on the whole sequence on one GPU (compute.op_times, the model
    `layer_compute` uses), K + V elements per token from capture's
    `cp_kv_elems_per_token` (autopar/capture/cp_facts.py), saved activations at
    the training dtype (`byte_scale`: its bytes / the captured dtype's)."""
    kv = layer.attrs.get("cp_kv_elems_per_token")
    if not kv:
        raise CostModelError(f"layer '{layer.name}' has no scaled_dot_product_attention call capture could "
                             f"read: context parallelism cannot split it")
    device = cluster.device_profile
    times = {True: [0.0, 0.0], False: [0.0, 0.0]}
    for op in layer.ops:
        f, b = op_times(op, batch, seq, device, dtype=dtype, byte_scale=byte_scale)
        times[op.kind == "attention"][0] += f
        times[op.kind == "attention"][1] += b
    return AttentionLayerShape(
        batch=batch, seq=seq, kv_elems_per_token=kv, dtype_bytes=dtype_bytes,
        attn_fwd_s=times[True][0], attn_bwd_s=times[True][1], other_fwd_s=times[False][0],
        other_bwd_s=times[False][1], activation_bytes=layer.eval("activation_bytes", batch, seq) * byte_scale)


def cp_view(model, layout):
    """(model, layout) as one cp rank of `layout` runs them: sequences of seq / cp
    tokens, and dp x cp data-parallel ranks (the cp ranks inner to dp: torchtitan's
    dp_shard_cp), sharding ZeRO states and reducing gradients as dp x cp ranks do;
    under HSDP each shard group spans dp_shard x cp ranks. cp 1: unchanged."""
    cp = layout.cp
    if cp == 1:
        return model, layout
    seq = model.seq_len
    if not seq or seq % (2 * cp):
        raise CostModelError(f"cp={cp} needs the sequence ({seq}) in 2 x cp = {2 * cp} equal chunks "
                             f"(the causal load balancing)")
    share = copy.copy(model)
    share.seq_len = seq // cp
    if getattr(model, "tokens_per_sample", 1) == seq:
        share.tokens_per_sample = seq // cp
    return share, replace(layout, cp=1, dp=layout.dp * cp, dp_shard=layout.dp_shard * cp if layout.dp_shard else None)


def kv_elems_per_token(layer: LayerSpec) -> int | None:
    """K + V elements per token the ring exchanges: capture's fact, or for an analytic
    block (attrs heads / kv_heads / head_dim) 2 x kv_heads x head_dim."""
    attrs = layer.attrs or {}
    if attrs.get("cp_kv_elems_per_token"):
        return attrs["cp_kv_elems_per_token"]
    if attrs.get("head_dim") and (attrs.get("kv_heads") or attrs.get("heads")):
        return 2 * (attrs.get("kv_heads") or attrs["heads"]) * attrs["head_dim"]
    return None


def ring_extra_s(layer: LayerSpec, model, layout, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds one attention layer takes on a cp rank beyond its
    price on seq / cp tokens: the whole causal attention / cp less the local square,
    plus the ring's transfers no step's attention hides (`cp_layer_cost`). A layer
    without attention ops: (0, 0)."""
    attention = [op for op in layer.ops if op.kind == "attention"]
    if layout.cp == 1 or not attention:
        return 0.0, 0.0
    kv = kv_elems_per_token(layer)
    if not kv:
        raise CostModelError(f"layer '{layer.name}' has no scaled_dot_product_attention call capture could "
                             f"read: context parallelism cannot split it")
    cp, b, seq = layout.cp, layout.micro_batch_size, model.seq_len
    tp = layout.tp if layout.tp in tuple(layer.tp_degrees or (1,)) else 1
    dtype_bytes = 4 if layout.precision == "fp32" else 2
    byte_scale = dtype_bytes / (model.dtype_bytes or 2)

    def times(s):
        f = bw = 0.0
        for op in attention:
            t = op_times(op, b, s, cluster.device_profile, dtype=layout.precision, byte_scale=byte_scale,
                         work_divisor=tp if op.tp_sharded else 1)
            f, bw = f + t[0], bw + t[1]
        return f, bw
    (full_f, full_b), (local_f, local_b) = times(seq), times(seq // cp)
    shape = AttentionLayerShape(batch=b, seq=seq, kv_elems_per_token=kv / tp, dtype_bytes=dtype_bytes,
                                attn_fwd_s=full_f, attn_bwd_s=full_b)
    ring = cp_layer_cost(shape, cp, cluster, same_node=layout.tp * cp <= cluster.gpus_per_node)
    return (max(0.0, full_f / cp - local_f) + ring.fwd_exposed_s,
            max(0.0, full_b / cp - local_b) + ring.bwd_exposed_s)


def sharded_layer_cost(layer: LayerSpec, model, layout, cluster: ClusterSpec, price, checkpoint: str):
    """`layer`'s LayerCost on one cp rank: `price(model, layout)` (layer_cost) of its
    share (`cp_view`) plus the attention the share under-prices (`ring_extra_s`),
    redone in backward under full recomputation (the checkpointed forward runs the ring again)."""
    share, share_layout = cp_view(model, layout)
    cost = price(share, share_layout)
    fwd, bwd = ring_extra_s(layer, model, layout, cluster)
    if not fwd and not bwd:
        return cost
    return replace(cost, fwd_s=cost.fwd_s + fwd, bwd_s=cost.bwd_s + bwd,
                   recompute_s=cost.recompute_s + (fwd if checkpoint == "full" else 0.0))
