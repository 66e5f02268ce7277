"""Memory by phase: the peak bytes one pp rank's GPU holds during a step, and
what it holds then.

A step has several moments, each with its own set of live tensors; the peak is
the largest, and the breakdown (params, grads, optimizer, activations,
buffers, fragmentation) describes that moment:

- forward / backward: model states, the activations the schedule keeps in
  flight (cost_models/pipeline.py), one layer's recomputed working set, FSDP's
  unsharded unit and its prefetched neighbour, DDP's buckets, TP's output;
- the loss's first backward op: every activation plus two logits-sized gradients;
- the optimizer step: no activations, every gradient, foreach Adam's temporary;
- FSDP's backward with one micro-batch, unit by unit: each unit's unsharded
  parameters and gradient beside its reduce-scatter buffers (`_FsdpBackward`).

One layer's own bytes (states, activations, transients) are LayerCost's
(cost_models/layer.py, from cost_models/memory.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.compute import fast
from cost_models.layer_compute import tp_for
from cost_models.memory import FRAGMENTATION, backward_peak, model_state_bytes, state_bytes_per_param


@dataclass
class RankLayers:
    """The layers one pp rank holds (`idx`: indices into the model's layers) and what
    was decided for each, with the micro-batch's shape."""

    idx: list
    costs: list  # LayerCost of every layer of the model
    layers: list  # LayerSpec of every layer of the model
    zeros: list
    offloads: list
    layout: object
    b: int
    s1: int
    byte_scale: float

    def total(self, attr: str) -> float:
        return sum(getattr(self.costs[j], attr) for j in self.idx)


def _model_states(rk: RankLayers) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of the rank's layers; a tied output layer on
    another rank than its embedding keeps its own copy (Megatron)."""
    layout, layers, idx = rk.layout, rk.layers, rk.idx
    params, grads, optim = rk.total("param_bytes"), rk.total("grad_bytes"), rk.total("optimizer_bytes")
    for j in idx:
        tied = layers[j].attrs.get("tied_param_count", 0) if layers[j].shared_params else 0
        if tied and not any(layers[k].kind == "embedding" for k in idx):
            extra = model_state_bytes(tied / tp_for(layers[j], layout.tp), precision=layout.precision,
                                      optimizer=layout.optimizer, zero=rk.zeros[j], dp=layout.shard_ranks,
                                      offload=rk.offloads[j])
            params, grads, optim = params + extra.params, grads + extra.grads, optim + extra.optimizer
    return params, grads, optim


def _fsdp_buffers(rk: RankLayers, p_b: float, g_b: float, forward_only: bool) -> float:
    """FSDP2 holds the unsharded parameters of the unit it runs and of the one it
    prefetches (its neighbour in execution order), and in backward the running
    unit's unsharded gradients: the largest such neighbouring pair of the rank
    (a 128k-vocabulary head beside a block, not the head twice). `forward_only`:
    the moment is the forward's (one micro-batch), no unit gradient then.
    ZeRO-2 units reduced every micro-batch (Layout.grads_reduced_per_micro_batch)
    reshard after each backward and are gathered again by the next micro-batch's
    forward: the all-gather buffer of the forward's last unit (where the activations
    peak) is alive beside its unsharded parameters (FSDPMemTracker, ALL_GATHER on the
    pp 2 rank 0 of benchmarks/memory_lowered.py)."""
    z3 = [j for j in rk.idx if rk.zeros[j] >= 3]
    if not z3 and rk.layout.dp > 1 and rk.layout.grads_reduced_per_micro_batch and rk.layout.num_micro_batches > 1 \
            and rk.layout.pp == 1:  # a pipeline stage keeps them gathered (ReducingStage)
        last = max(rk.idx, default=None)
        return rk.costs[last].params_local * p_b if last is not None and rk.zeros[last] == 2 else 0.0
    if not (z3 and rk.layout.dp > 1):
        return 0.0
    units = [rk.costs[j].params_local if rk.zeros[j] >= 3 else 0.0 for j in sorted(rk.idx)]
    pairs = list(zip(units, units[1:])) or [(units[0], 0.0)]
    if forward_only:
        return max((a + c) * p_b for a, c in pairs)
    return max((a + c) * p_b + max(a, c) * g_b for a, c in pairs)


def _stage_output_bytes(rk: RankLayers) -> float:
    """The output of the rank's last layer for one micro-batch, which torch's pipeline stage
    keeps through that micro-batch's backward (stage_backward's argument). On the last stage
    the captured head ends in the loss: the stage outputs its logits, the output of the
    head's largest GEMM in the compute dtype (vocab-split under tp)."""
    j = max(rk.idx)
    layer = rk.layers[j]
    if not rk.costs[j].loss_grad_bytes:
        return fast(layer.output_bytes)(rk.b, rk.s1) * rk.byte_scale
    lp = 4 if rk.layout.precision == "fp32" else 2
    return max((fast(op.gemm[0])(rk.b, rk.s1) * fast(op.gemm[1])(rk.b, rk.s1) * lp
                / (tp_for(layer, rk.layout.tp) if op.tp_sharded else 1) for op in layer.ops if op.gemm), default=0.0)


class _FsdpBackward:
    """FSDP's backward, one micro-batch (m = 1), unit by unit from the last: while unit u
    computes, its unsharded parameters and gradient are alive beside the parameters
    FSDP2 prefetched for the next unit; then it reshards its parameters and copies its
    gradient into a reduce-scatter input in the reduce dtype, with the output shard
    beside it. The units before u still hold their activations, the units after it
    already hold their gradient shards, and ZeRO-2 units not yet reached keep their
    unsharded parameters. FSDPMemTracker puts the peak of short-sequence LLM steps at
    the LM head's reduce-scatter: 2 + 4 + 4/dp bytes per head parameter on top of
    every block's activations."""

    def __init__(self, rk: RankLayers, units: list, root_held: list, p_b: float, tp_buf: float, ddp_buf: float,
                 others_act: float = 0.0):
        layout, layers = rk.layout, rk.layers
        self.rk, self.units, self.p_b, self.tp_buf, self.ddp_buf = rk, units, p_b, tp_buf, ddp_buf
        # Several micro-batches a step, each reduced in its own backward
        # (Layout.grads_reduced_per_micro_batch): every unit holds a gradient shard from
        # the earlier ones, and what else stays alive meanwhile is `others_act` (the other
        # micro-batches in flight, and the stage output a pipeline stage keeps)
        self.accumulated, self.others_act = layout.num_micro_batches > 1, others_act
        # ... and a pipeline stage keeps its ZeRO-2 units gathered until its last backward
        # (pipeline_parallel.ReducingStage)
        self.kept_gathered = self.accumulated and layout.pp > 1
        self.order = sorted(rk.idx)
        self.lp = 4 if layout.precision == "fp32" else 2
        self.red = 4 if (layout.main_grads != "same" or layout.precision == "fp32") else self.lp
        # Layers holding an end of a tied weight run in FSDP2's root unit (the lowering
        # keeps one parameter in one unit): never resharded, and their gradients stay
        # unsharded from the first of them the backward reaches (the head, which makes
        # the tied embedding's gradient) to the root's reduce-scatter after the last
        self.root = set(j for j in units if root_held[j])
        self.tied_grad = {j: layers[j].attrs.get("tied_param_count", 0) / tp_for(layers[j], layout.tp) * self.lp
                          for j in self.root if layers[j].shared_params}
        self.own = [j for j in units if j not in self.root]

    def rs_buffers(self, n: float) -> float:  # a reduce-scatter's input and output shard
        return n * self.red * (1 + 1 / self.rk.layout.shard_ranks)

    def unit_moment(self, u: int, optim: float) -> tuple[float, tuple]:
        """(bytes, (params, grads, activations, buffers, fragmentation)) while unit u's backward runs."""
        rk, costs, zeros, layers, order, root, lp, p_b = (self.rk, self.rk.costs, self.rk.zeros, self.rk.layers,
                                                          self.order, self.root, self.lp, self.p_b)
        pu = costs[u].params_local
        before = [j for j in order if j < u]
        # ZeRO-2 units from u on: resharded, unless kept gathered
        params_u = sum(costs[j].param_bytes for j in order
                       if self.kept_gathered or not (zeros[j] == 2 and j >= u and j not in root))
        grads_u = sum(costs[j].grad_bytes for j in order if (j > u or self.accumulated) and j not in root)
        held_u = sum(costs[j].params_local * lp for j in root if j > u) \
            + (sum(g for h, g in self.tied_grad.items() if h > u) if u not in root else 0.0)
        act_u = sum(costs[j].activation_bytes for j in before) + self.others_act
        nxt = max((j for j in self.units if j < u), default=None)
        prefetch = costs[nxt].params_local * p_b if nxt is not None and zeros[nxt] >= 3 \
            and u != self.units[-1] else 0.0
        # the reduce-scatter of the unit before it in backward is still in flight: FSDP2
        # keeps one reduce-scatter's input alive until it issues the next
        prev = min((j for j in self.own if j > u), default=None)
        in_flight = self.rs_buffers(costs[prev].params_local) if prev is not None else 0.0
        # its gradients appear as its activations are consumed: the larger of the two,
        # beside the gradient of its output it reads throughout (logits-sized at a head:
        # its weight gradient is made while that is alive)
        out_grad = costs[u].loss_grad_bytes / 2 if costs[u].loss_grad_bytes \
            else fast(layers[u].output_bytes)(rk.b, rk.s1) * rk.byte_scale
        # A unit grouping several modules (a head's norm and output Linear, as the
        # lowering shards them) keeps its all-gather buffer through its backward
        # beside the unsharded parameters: FSDPMemTracker, torch 2.13 (a one-module
        # unit frees it once the parameters are copied out). A layer left to the root
        # unit (tied weights) is not sharded as a group of its own.
        grouped = pu * p_b if u not in root and layers[u].attrs.get("param_modules", 1) > 1 else 0.0
        computing = (pu * p_b if zeros[u] >= 3 else 0.0) + grouped + in_flight + out_grad \
            + backward_peak(layers[u], costs[u].activation_bytes + costs[u].working_bytes, pu * lp)
        reducing = 0.0 if u in root else pu * lp + self.rs_buffers(pu) + grouped
        unit_bufs = prefetch + max(computing, reducing) + held_u
        frag_u = FRAGMENTATION * (act_u + grads_u)
        tp_buf, ddp_buf = self.tp_buf, self.ddp_buf
        return (params_u + optim + grads_u + act_u + unit_bufs + tp_buf + ddp_buf + frag_u,
                (params_u, grads_u, act_u, unit_bufs + tp_buf + ddp_buf + frag_u, frag_u))

    def root_moment(self, params: float, optim: float) -> tuple[float, tuple]:
        """The root's reduce-scatter, after the whole backward: every other unit's
        gradient is a shard, the root's are unsharded beside their reduce buffers, and the
        ZeRO-2 units have resharded their 16-bit parameters (as in unit_moment)."""
        costs = self.rk.costs
        if not self.kept_gathered:
            params -= sum(costs[j].param_bytes for j in self.order if self.rk.zeros[j] == 2 and j not in self.root)
        grads_r = sum(costs[j].grad_bytes for j in self.order if j not in self.root)
        last = min(self.own, default=None)
        in_flight = self.rs_buffers(costs[last].params_local) if last is not None else 0.0
        held = sum(costs[j].params_local for j in self.root)
        bufs = held * self.lp + self.rs_buffers(held) + in_flight
        frag_r = FRAGMENTATION * grads_r
        tp_buf, ddp_buf = self.tp_buf, self.ddp_buf
        act = self.others_act
        return (params + optim + grads_r + act + bufs + tp_buf + ddp_buf + frag_r,
                (params, grads_r, act, bufs + tp_buf + ddp_buf + frag_r, frag_r))

    def peak(self, params: float, optim: float) -> tuple[float, tuple | None]:
        """The largest moment of the backward (0.0, None when none is above nothing)."""
        at_rs, rs_parts = 0.0, None
        moments = [self.unit_moment(u, optim) for u in self.units]
        if self.root:
            moments.append(self.root_moment(params, optim))
        for t, parts in moments:
            if t > at_rs:
                at_rs, rs_parts = t, parts
        return at_rs, rs_parts


def rank_memory(rk: RankLayers, peak_activation_bytes: float, root_held: list, device) -> tuple[float, dict]:
    """(peak bytes, breakdown at that moment) of one pp rank; `peak_activation_bytes`: the
    activations its schedule keeps in flight at once (the pipeline simulation's)."""
    layout, costs, idx = rk.layout, rk.costs, rk.idx
    m = layout.num_micro_batches
    params, grads, optim = _model_states(rk)
    activations = peak_activation_bytes + max((costs[j].working_bytes for j in idx), default=0.0)
    # Buffers: FSDP holds the unsharded params of the layer it runs and the one it
    # prefetches plus one layer's unsharded grads; DDP its buckets; TP its output.
    p_b, g_b, _ = state_bytes_per_param(layout.precision, layout.optimizer)
    # One micro-batch: the activations peak at the end of the forward, before any
    # gradient exists, and shrink as the backward produces the gradients: the two
    # never peak together, the larger counts. FSDP holds the running and the
    # prefetched unit's unsharded parameters in forward; its unit gradients and
    # reduce-scatter buffers belong to the backward's moments (below).
    # A pipeline stage reducing every micro-batch has its backward's moments below too.
    per_mb_stage = layout.grads_reduced_per_micro_batch and layout.pp > 1
    fsdp_buf = _fsdp_buffers(rk, p_b, g_b, forward_only=m == 1 or per_mb_stage)
    ddp_buf = rk.total("bucket_bytes")
    tp_buf = (max((fast(rk.layers[j].output_bytes)(rk.b, rk.s1) for j in idx), default=0.0) * rk.byte_scale
              if layout.tp > 1 else 0.0)
    if m == 1:
        grads_fb, act_fb = (0.0, activations) if activations >= grads else (grads, 0.0)
    else:
        grads_fb, act_fb = grads, activations
    frag = FRAGMENTATION * (act_fb + grads_fb)
    buffers = fsdp_buf + ddp_buf + tp_buf + frag
    total = params + grads_fb + optim + act_fb + buffers
    # The optimizer step is a second peak: activations are gone, the gradients are
    # all alive, and foreach Adam holds a temporary of every state element at once.
    opt_temp = rk.total("optimizer_temp_bytes")
    # The first backward op of the loss is a third: every saved activation is alive,
    # plus two logits-sized gradients (the loss's gradient output and its log-softmax
    # gradient input, in the dtype the loss computes in), and with one micro-batch no
    # gradient exists yet. No recompute working set, no gradient buffers then.
    loss_grads = rk.total("loss_grad_bytes")
    grads_then = grads if m > 1 else 0.0
    act_then = peak_activation_bytes + loss_grads
    # ZeRO-3 units were resharded after their forward and are gathered again only
    # by their own backward hooks, after the loss's: no FSDP buffer at that moment
    at_loss = (params + grads_then + optim + act_then + tp_buf + ddp_buf
               + FRAGMENTATION * (act_then + grads_then)) if loss_grads else 0.0
    at_step = params + grads + optim + ddp_buf + opt_temp
    at_rs, rs_parts = 0.0, None
    units = [j for j in sorted(idx) if rk.zeros[j] >= 2 and costs[j].params_local > 0 and rk.offloads[j] == "none"]
    # FSDP2 reduce-scatters in the backward with one micro-batch at pp = 1, and in every
    # micro-batch's backward of a pipeline stage that keeps gradient sync on (autopar:
    # dp > 1, autopar/lower/pipeline_parallel.py:ReducingStage; benchmarks/memory_lowered.py
    # pp 2 rows: the last stage peaks at its head's reduce-scatter). At pp = 1 with several
    # micro-batches the forward/backward moment above is what measured within 5% (the
    # `_2mb` row, -1.3%; these moments, calibrated on one micro-batch, book it +5.7%).
    if layout.dp > 1 and units and (m == 1 and layout.pp == 1 or per_mb_stage):
        # alive through the backward beside its own activations: the other micro-batches in
        # flight, and the stage output torch's pipeline stage keeps (stage_backward's argument)
        others = max(0.0, peak_activation_bytes - rk.total("activation_bytes"))
        others += _stage_output_bytes(rk) if layout.pp > 1 else 0.0
        at_rs, rs_parts = _FsdpBackward(rk, units, root_held, p_b, tp_buf, ddp_buf, others).peak(params, optim)
    if at_rs > max(total, at_loss, at_step):
        params, grads, activations, buffers, frag = rs_parts
        total = at_rs
    elif total >= max(at_loss, at_step):
        grads, activations = grads_fb, act_fb  # the breakdown describes the forward/backward moment
    elif at_loss > total and at_loss >= at_step:
        # the breakdown describes that moment (the loss's gradients under activations)
        grads, activations = grads_then, act_then
        frag = FRAGMENTATION * (act_then + grads_then)
        buffers = tp_buf + ddp_buf + frag
        total = at_loss
    elif at_step > total:
        # the breakdown describes the step's peak: no activations then
        activations, buffers, frag = 0.0, ddp_buf + opt_temp, 0.0
        total = at_step
    # fragmentation: allocator blocks reserved but not allocated (in buffers; what
    # torch.cuda.max_memory_allocated does not count)
    return total, {"params": params, "grads": grads, "optimizer": optim, "activations": activations,
                   "buffers": buffers, "fragmentation": frag, "capacity": device.usable_memory_bytes,
                   "reserve": device.reserve_bytes, "host": rk.total("host_bytes")}
