"""What hides behind what: the part of each collective that compute covers,
and what the covered part still costs.

A collective runs beside the compute of a window (a backward, a forward):
at most the device's hideable share of it (`collective_overlap`) hides, and
no more than the window; hidden collectives hold a few SMs, which slows the
compute they hide under (cost_models/comm.contention_s). Which window each
collective gets is decided here:

- DDP's gradient all-reduce: the last backward (GRAD_REDUCE_OVERLAP of it);
- ZeRO-1/2: the gradients' reduce-scatter under the last backward, the
  updated parameters' all-gather under the next forward;
- ZeRO-3 (FSDP): every micro-batch's prefetched all-gather under the forward
  and again the backward (FSDP_PREFETCH_OVERLAP of each), the step's
  reduce-scatter beside the last backward's all-gather;
- HSDP (Layout.dp_shard): the gathers and reduce-scatters as above inside the
  shard group, and the gradient shards' all-reduce across replicas under the
  last backward as DDP's (`all_reduce_exposed`): it crosses nodes while the
  reduce-scatter runs inside one, on other links;
- a pipeline whose sends block (Megatron, DeepSpeed) reduces after the
  flush: no window;
- tensor-parallel collectives hide only when they run chunk by chunk under
  the GEMMs (Transformer Engine's overlap: `tp_overlapped`).

The collectives themselves (which, how many bytes, how long) are
cost_models/layer_comm.py's.
"""
from __future__ import annotations

from cost_models import comm as C

# SMs Transformer Engine's TP overlap takes from the GEMMs it runs under, as a share of an
# H100's 132: NeMo's userbuffers config for GPT-3 175B (tp4, bf16, H100; NVIDIA/NeMo
# nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py) gives the forward's four
# collectives 1, 24, 1, 1 SMs (ring exchange 1, the pipelined reduce-scatter 24): 6.75 on
# average; the backward's 2-4 (bulk overlaps) and 1 (ring exchange): about 3.
TP_OVERLAP_SM_SHARE = {"fwd": 6.75 / 132, "bwd": 3 / 132}


def tp_overlapped(comm_s: float, gemm_s: float, tp: int, phase: str) -> float:
    """Exposed time of a layer's tp collectives run chunk by chunk under its GEMMs: the
    first of tp chunks cannot overlap, the rest hide behind the GEMMs up to their length,
    and the GEMMs run on fewer SMs while they carry the overlap."""
    first = comm_s / tp
    rest = comm_s - first
    hidden = min(rest, gemm_s)
    return first + (rest - hidden) + hidden * TP_OVERLAP_SM_SHARE[phase]


def exposed(comm_s: float, window_s: float, device) -> float:
    """What a collective of comm_s adds to the step when compute of window_s could
    hide it: at most the device's hideable share of it (collective_overlap) hides,
    and no more than the window."""
    return comm_s - min(device.collective_overlap * comm_s, max(0.0, window_s))


def gradient_window_share(layout) -> float:
    """The share of the last backward (and next forward) ZeRO-0/1/2 collectives hide under.
    Megatron's and DeepSpeed's pipeline engines reduce gradients (and ZeRO-1/2 gather the
    updated parameters) only after the pipeline flush: nothing left to hide behind."""
    return 0.0 if (layout.pp > 1 and layout.p2p_blocking) else C.GRAD_REDUCE_OVERLAP


def all_reduce_exposed(ar_s: float, bwd_window_s: float, share: float, device, place, cluster):
    """DDP: (exposed seconds, contention seconds) of the gradients' all-reduce under the last backward."""
    ar_exp = exposed(ar_s, share * bwd_window_s, device)
    return ar_exp, C.contention_s(ar_s - ar_exp, place, cluster)


def sharded_optimizer_exposed(rs_s: float, ag_s: float, fwd_s: float, bwd_window_s: float, share: float, device,
                              place, cluster):
    """ZeRO-1/2: (exposed seconds per step, contention seconds) when the gradients reduce
    under the last backward and the updated parameters gather under the next forward."""
    rs_exp, ag_exp = exposed(rs_s, share * bwd_window_s, device), exposed(ag_s, share * fwd_s, device)
    contention = C.contention_s(rs_s - rs_exp + ag_s - ag_exp, place, cluster)
    return rs_exp + ag_exp + contention, contention


def sharded_optimizer_per_micro_batch_exposed(rs_s: float, ag_s: float, fwd_s: float, bwd_window_s: float,
                                              share: float, m: int, device, place, cluster, gathers: int):
    """ZeRO-2 under FSDP2 with the gradients reduced every micro-batch
    (Layout.grads_reduced_per_micro_batch): (exposed seconds per forward, per backward,
    contention seconds per step). Each reduce-scatter hides under its own backward;
    FSDP2 reshards the unit after every backward (its default, which autopar's lowering
    keeps: pp = 1 and pipeline_parallel.ReducingStage), so every micro-batch's forward
    gathers the parameters again, under that forward (`gathers` = m; a pipeline stage keeps
    them gathered until its last backward: one, under the first forward)."""
    rs_exp, ag_exp = exposed(rs_s, share * bwd_window_s, device), exposed(ag_s, share * fwd_s, device)
    rs_cont, ag_cont = C.contention_s(rs_s - rs_exp, place, cluster), C.contention_s(ag_s - ag_exp, place, cluster)
    return ag_exp + ag_cont, rs_exp + rs_cont, m * rs_cont + gathers * ag_cont


def fsdp_exposed(ag_s: float, rs_s: float, copy_out_s: float, fwd_s: float, bwd_window_s: float, m: int, device,
                 place, cluster, rs_per_micro_batch: bool = False):
    """ZeRO-3 (FSDP): (forward, backward per micro-batch, step) exposed seconds and the
    step's contention seconds. Each micro-batch's prefetched all-gathers hide under its
    forward and again its backward, and slow what they hide under; the step's one
    reduce-scatter shares the last backward's window with that backward's all-gather.
    The copy out of the all-gather buffer runs on the compute stream: exposed."""
    fwd_exp = exposed(ag_s, C.FSDP_PREFETCH_OVERLAP * fwd_s, device)
    if rs_per_micro_batch:
        # every backward holds its all-gathers and its own reduce-scatter (Layout.grads_reduced_per_micro_batch)
        bwd_exp = exposed(ag_s + rs_s, C.FSDP_PREFETCH_OVERLAP * bwd_window_s, device)
        fwd_cont = C.contention_s(ag_s - fwd_exp, place, cluster)
        bwd_cont = C.contention_s(ag_s + rs_s - bwd_exp, place, cluster)
        return (max(0.0, fwd_exp + fwd_cont + copy_out_s), max(0.0, bwd_exp + bwd_cont + copy_out_s), 0.0,
                m * (fwd_cont + bwd_cont))
    bwd_exp = exposed(ag_s, C.FSDP_PREFETCH_OVERLAP * bwd_window_s, device)
    # the reduce-scatter shares the last backward's window with the all-gather
    step_exp = max(0.0, exposed(ag_s + rs_s, C.FSDP_PREFETCH_OVERLAP * bwd_window_s, device) - bwd_exp)
    # every micro-batch's prefetched gathers slow the forward / backward they hide under;
    # the step's one reduce-scatter slows the last backward
    fwd_cont = C.contention_s(ag_s - fwd_exp, place, cluster)
    bwd_cont = C.contention_s(ag_s - bwd_exp, place, cluster)
    rs_cont = C.contention_s(rs_s - step_exp, place, cluster)
    fwd_exp, bwd_exp, step_exp = (max(0.0, fwd_exp + fwd_cont + copy_out_s),
                                  max(0.0, bwd_exp + bwd_cont + copy_out_s), step_exp + rs_cont)
    return fwd_exp, bwd_exp, step_exp, m * (fwd_cont + bwd_cont) + rs_cont


def prefetch_exposed(comm_s: float, fwd_s: float, bwd_window_s: float, device) -> tuple[float, float]:
    """(forward, backward) exposed seconds of a transfer prefetched before each forward
    and each backward (offloaded parameters coming up from the host)."""
    return (exposed(comm_s, C.FSDP_PREFETCH_OVERLAP * fwd_s, device),
            exposed(comm_s, C.FSDP_PREFETCH_OVERLAP * bwd_window_s, device))
