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

Not priced here: the parameters' gradient averaging over cp (it joins the data-
parallel reduction, as torchtitan folds cp into FSDP's dp_shard_cp group) and
torch's default all-gather rotation (`set_rotate_method("allgather")`: the same
(cp - 1) shards arrive in one collective, hidden only behind the first step).
`attention_layer_shape` reads a captured layer (its ops' times by compute.op_times,
capture's `cp_kv_elems_per_token`). Not yet called by `estimate` nor searched by the
planner: Layout and solve/ have no cp axis yet (docs/cost_model.md "Context parallelism").
"""
from __future__ import annotations

from dataclasses import dataclass

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
