"""Communication compression in the planner: the chosen layout priced again with its
gradients reduced in bf16 (`Layout.grad_reduce_dtype`, cost_models/compression.py),
kept when the user allows it and it is faster, said in `Plan.solver["compression"]`
either way.

Why after the search and not inside it: compression changes no stage, mesh or
per-layer option, only the data-parallel reductions' bytes and casts, so the layout
the search chose is priced once more; where it cannot pay (dp 1, gradients already
held in bf16, another engine's plan) nothing is priced and planning time is unchanged.

Why not chosen by default: bf16 reduction changes the gradients' rounding, so a
compressed plan no longer matches one process at fp32 tolerance; the planner says
what it would gain and keeps it only under `--grad-reduce-dtype auto` (or `bf16`, a
pin). That is the same contract as DeepSpeed's `communication_data_type` and FSDP2's
`reduce_dtype`: off until asked.
"""
from __future__ import annotations

import dataclasses

from cost_models.compression import wire_bytes
from cost_models.errors import CostModelError
from cost_models.estimate import estimate
from cost_models.memory import layer_states

from autopar.engine import engine_of
from autopar.solve.refine import fits

DTYPE = "bf16"


# DDP's own rule (DistributedDataParallel._check_comm_hook): its bf16_compress_hook needs a
# CUDA / NCCL 2.10+ or XPU / XCCL torch, which CPU ranks are not run with
CPU_DDP = ("DDP's bf16_compress_hook needs a CUDA / NCCL or XPU / XCCL torch, not CPU ranks; ZeRO 0 / 1 on a pure "
           "data-parallel mesh runs under DDP")


def nothing_to_compress(model, layout, cluster) -> str | None:
    """Why a bf16 reduction of `layout` cannot pay or cannot run (None: it might pay)."""
    if layout.dp <= 1:
        return "dp 1: no gradient is reduced"
    why = (getattr(model, "lowering_limits", None) or {}).get("compression")  # what_runs: this torch cannot
    if why:
        return why
    replicate = max(layout.layer_zero or [layout.zero]) <= 1  # lowered_zero_levels kept 0 / 1: DDP runs it
    if replicate and cluster.device_profile.vendor == "cpu":
        return CPU_DDP
    if not engine_of(model).is_autopar:
        return "another engine's plan reduces as that engine does"
    if layout.precision == "fp16":
        return "fp16 gradients are reduced in fp16 or fp32, not bf16 (autopar/compression.py)"
    held = layer_states(1.0, layout, 0, "none")[1][1]
    if wire_bytes(held, DTYPE) >= held:
        return "the gradients are reduced in bf16 already (main_grads same)"
    return None


def choose(model, cluster, winner, pin: str | None, limit_bytes: float):
    """(winner, sentence for Plan.solver["compression"] or None): `winner` (CandidateResult,
    Layout, Estimate) with its gradients reduced in bf16 when pinned, or allowed ('auto')
    and faster; otherwise unchanged, with what bf16 reduction would have given."""
    r, layout, est = winner
    why_not = nothing_to_compress(model, layout, cluster)
    if pin == "fp32":
        return winner, "gradients reduced as held (--grad-reduce-dtype fp32)"
    if why_not:  # said only when asked: an unpinned plan with nothing to compress reads as before
        return winner, f"gradients reduced as held: {why_not}" if pin else None
    squeezed = dataclasses.replace(layout, grad_reduce_dtype=DTYPE)
    try:
        est2 = estimate(model, squeezed, cluster)
    except CostModelError as exc:
        return winner, f"bf16 gradient reduction not priced: {exc}"
    gain = 1 - est2.step_time_s / est.step_time_s
    numbers = (f"{est2.step_time_s * 1e3:.3g} ms against {est.step_time_s * 1e3:.3g} ms "
               f"({abs(gain):.1%} {'faster' if gain > 0 else 'slower'})")
    if pin == DTYPE or (pin == "auto" and gain > 0 and fits(est2, limit_bytes)):
        why = "pinned (--grad-reduce-dtype bf16)" if pin == DTYPE else "faster"
        return (r, squeezed, est2), f"gradients reduced in bf16, cast back after: {why}, {numbers}"
    if pin == "auto":
        return winner, f"gradients reduced as held: bf16 reduction is not faster here ({numbers})"
    return winner, (f"gradients reduced as held; bf16 reduction would take {numbers}, not chosen: it changes the "
                    "gradients' rounding (--grad-reduce-dtype auto or bf16 to allow it)")
