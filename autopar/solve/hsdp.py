"""HSDP in the planner: the best layouts the search found, priced again with their
ZeRO states sharded over groups of `dp_shard` dp ranks and replicated across the
dp / dp_shard groups (FSDP2's hybrid sharding), kept when one is faster and fits.

Why after the search and not inside it: HSDP changes neither the stage problem's
shape nor the per-layer options, only each option's data-parallel traffic and
memory, and a search over every shard size would multiply the candidates (GPT-3
175B on 1,024 GPUs: up to 8 sizes per mesh). The best layouts of distinct meshes
(`TRIES`) are re-priced by `estimate` at the sizes `search_space.dp_shard_choices`
names (a node's worth of dp ranks and its doublings), which is where HSDP pays:
the shard group's all-gathers and reduce-scatters stay inside a node, and only
the 1/dp_shard gradient shards cross nodes, once per step. A pinned `--dp-shard`
is searched as any pin is (every candidate carries it); nothing is added here then.
"""
from __future__ import annotations

import dataclasses

from cost_models.errors import CostModelError
from cost_models.estimate import estimate

from autopar.engine import engine_of
from autopar.solve.layout import lowered_zero_levels, root_held_layers
from autopar.solve.refine import assignment_of, fits
from autopar.solve.search_space import dp_shard_choices, mesh_key

TRIES = 2  # distinct meshes of the best priced layouts re-priced under HSDP
GB = 1e9


def hsdp_variants(model, cluster, pool: list, *, limit_bytes: float, pinned: bool) -> tuple[list, list]:
    """(fitting HSDP layouts as (CandidateResult, Layout, Estimate), every size tried as
    (candidate, step seconds or None when it does not fit)) for the first `TRIES`
    meshes of `pool` (priced layouts, fastest first) that shard ZeRO states over dp > 1."""
    if pinned or not engine_of(model).is_autopar:  # another engine's plan runs its own data parallelism
        return [], []
    if (getattr(model, "lowering_limits", None) or {}).get("hsdp"):  # the lowering cannot run it (what_runs)
        return [], []
    found, tried, meshes = [], [], set()
    for r, layout, _ in pool:
        c = r.candidate
        if len(meshes) >= TRIES:
            break
        if c.dp <= 1 or c.dp_shard or c.ep or mesh_key(c) in meshes or layout.layer_zero is None:
            continue
        if not any(z >= 1 for z in layout.layer_zero):  # nothing sharded: HSDP has nothing to keep local
            continue
        meshes.add(mesh_key(c))
        for size in dp_shard_choices(c.dp, c.tp, cluster.gpus_per_node):
            x = _priced(model, cluster, r, layout, size)
            ok = x is not None and fits(x[2], limit_bytes)
            tried.append((x[0].candidate if x else dataclasses.replace(c, dp_shard=size),
                          x[2].step_time_s if ok else None))
            if ok:
                found.append(x)
    return found, tried


def _priced(model, cluster, r, layout, size: int):
    """`layout` under HSDP with shard groups of `size`, every layer an FSDP2 unit (ZeRO
    0 / 1 run as 2, as the lowering runs them on the 2-D mesh)."""
    cand = dataclasses.replace(r.candidate, dp_shard=size)
    choices = assignment_of(layout)
    zeros = lowered_zero_levels(cand, [z for z, _, _ in choices], [o for _, _, o in choices],
                                root_held_layers(model), engine=engine_of(model))
    hsdp = dataclasses.replace(layout, dp_shard=size, layer_zero=zeros, zero=max(zeros))
    try:
        return dataclasses.replace(r, candidate=cand, status="hsdp"), hsdp, estimate(model, hsdp, cluster)
    except CostModelError:
        return None


def account(winner, pool: list, tried: list) -> str | None:
    """Why the plan shards as it does, in a sentence for `Plan.solver["hsdp"]`: the HSDP
    layout chosen against the best whole-dp layout, or the sizes tried and why they lost."""
    if not tried and not winner[0].candidate.dp_shard:
        return None
    c, est = winner[0].candidate, winner[2]
    plain = next((x for x in pool if not x[0].candidate.dp_shard), None)
    if c.dp_shard:
        text = (f"HSDP: dp {c.dp} = {c.dp // c.dp_shard} replicas x {c.dp_shard} shards, the gathers and "
                f"reduce-scatters inside each group of {c.dp_shard} dp ranks and only the 1/{c.dp_shard} gradient "
                f"shards all-reduced across replicas")
        if plain is not None:
            gain = 1 - est.step_time_s / plain[2].step_time_s
            more = (max(est.peak_memory_bytes) - max(plain[2].peak_memory_bytes)) / GB
            text += (f"; {gain:.1%} faster than sharding over the whole dp ({plain[2].step_time_s * 1e3:.1f} ms, "
                     f"{plain[0].candidate.describe()}), for {more:+.1f} GB on the fullest GPU")
        return text
    per_mesh: dict = {}
    for cand, step_s in tried:
        per_mesh.setdefault(f"pp{cand.pp} x dp{cand.dp} x tp{cand.tp}", []).append((cand.dp_shard, step_s))
    shown = "; ".join(f"{mesh}: {_sizes_text(sizes)}" for mesh, sizes in per_mesh.items())
    return (f"HSDP shard groups tried on the best layouts ({shown}): none faster than sharding over the whole dp "
            f"({est.step_time_s * 1e3:.1f} ms)")


def _sizes_text(sizes: list) -> str:
    """'4 (812.0 ms), 8 (790.1 ms), 16, 32 do not fit' for [(dp_shard, step seconds or None)]."""
    priced = ", ".join(f"{s} ({t * 1e3:.1f} ms)" for s, t in sizes if t is not None)
    unfit = ", ".join(str(s) for s, t in sizes if t is None)
    return ", ".join(part for part in (priced, unfit and f"{unfit} do not fit") if part)
