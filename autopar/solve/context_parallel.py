"""Context parallelism (cp) in the planner: when to cut sequences, and the search for it.

Where cp is tried. Pinned (`--cp N`): only cp N. Unpinned, cp > 1 only where it
can pay: a cp rank holds 1/cp of every sequence's activations for the same tokens
per GPU and step (cost_models/context_parallel.py), and cp ranks are GPUs a batch
of few long sequences could not otherwise fill without a deep pipeline. So:
for sequences of LONG_SEQUENCE tokens or more (shorter ones plan as before cp existed):
  * cp 2, 4, 8, ... (2 x cp dividing the sequence) when no layout fits at cp 1,
    keeping the smallest that fits: one sequence's activations are what does not fit;
  * when the best cp-1 layout
    recomputes every layer in full, offloads, or idles in its pipeline bubble
    (`pays_to_try`): two cuts from the one at which the batch fills the cluster
    with tp a node and no pipeline; the faster of them and the cp-1 plan by the
    estimate is kept (Llama 3 405B at 131,072 tokens on 16,384 H100: pp 16 with one
    micro-batch idles 15/16 of its pipeline; cp 16 runs it without one).
Never where the lowering cannot run it (`lowering_limits["cp"]`), for another
engine's plan, or for a model without a sequence.

How. The search runs on one cp rank's share (`share_request`): the model at
seq / cp tokens, the global batch x cp (dp x cp ranks each holding seq / cp of a
sequence), dp a multiple of cp, pp 1 and no HSDP (what the lowering runs:
lower/context_parallel.plan_refusal). Every per-layer choice, bound, table and
memory figure of the share is the cp rank's own (cost_models.context_parallel.
cp_view prices the same share); what the share under-prices is the attention
over the whole sequence and its ring, so the layouts it finds are priced again
by `estimate` as cp layouts (`as_cp`) before anything is chosen or shown.
"""
from __future__ import annotations

import copy
import dataclasses

from cost_models.errors import CostModelError
from cost_models.estimate import estimate

from autopar.errors import InfeasibleError
from autopar.solve.refine import fits

MAX_CP = 64  # the largest cut tried unpinned (Llama 3 405B's long-context stage used 16)
# Search-cost guards, not prices (the estimate decides between the layouts found): cp is
# searched unpinned only for sequences this long (Llama 3 cut its 131,072-token stage over
# 16; below 16k tokens a sequence's activations rarely bind), and beside a cp-1 plan that
# fits only where that plan idles in its pipeline more than this share of the step.
LONG_SEQUENCE = 16384
BUBBLE_SHARE = 0.10


def why_not(spec) -> str | None:
    """Why no cp can be planned for `spec`, or None."""
    engine = getattr(spec, "engine", None)
    if engine is not None and not engine.is_autopar:
        return f"the {engine.name} engine's plan runs its own parallelism"
    if not getattr(spec, "seq_len", None):
        return "the model has no sequence axis"
    cannot = (getattr(spec, "lowering_limits", None) or {}).get("cp")
    return f"the lowering cannot run it ({cannot})" if cannot else None


def pays_to_try(best) -> bool:
    """Whether the best cp-1 layout leaves room cp can take: it recomputes every layer in
    full or offloads (memory binds, and cp divides activations), or its pipeline idles
    more than BUBBLE_SHARE of the step (the batch fills the GPUs only through a deep
    pipeline with few micro-batches; cp fills them by cutting sequences instead)."""
    layout, est = best[1], best[2]
    ckpts = layout.layer_checkpoint or [layout.checkpoint]
    offs = layout.layer_offload or [layout.offload]
    idle = est.time_breakdown.get("bubble_s", 0.0) / est.step_time_s
    return all(c == "full" for c in ckpts) or any(o != "none" for o in offs) or idle > BUBBLE_SHARE


def sizes_to_try(spec, cluster, pins, global_batch_size: int, best) -> list[int]:
    """The cp sizes to search, in order (see the module docstring). `best`: the cp-1 winner, or None."""
    if pins.cp is not None:
        return [pins.cp] if pins.cp > 1 else []
    if (pins.ep or 1) > 1:  # expert parallelism does not run beside cp yet (plan_file.ep_problem)
        return []
    seq = spec.seq_len
    if seq < LONG_SEQUENCE or best is not None and not pays_to_try(best):
        return []
    start = 2
    if best is not None:  # the cut at which the batch fills the cluster without a pipeline, tp a node
        while start * global_batch_size * cluster.gpus_per_node < cluster.world_size:
            start *= 2
    out, cp = [], start
    while cp <= min(MAX_CP, cluster.world_size) and seq % (2 * cp) == 0 and (best is None or len(out) < 2):
        out.append(cp)
        cp *= 2
    return out


def share_request(req, cp: int):
    """`req` (planner._Request) for one cp rank's share: seq / cp tokens, the batch x cp,
    dp a multiple of cp, no pipeline nor HSDP (the lowering runs cp without them)."""
    spec = copy.copy(req.spec)
    spec.seq_len = req.spec.seq_len // cp
    if getattr(req.spec, "tokens_per_sample", 1) == req.spec.seq_len:
        spec.tokens_per_sample = spec.seq_len
    why = "context parallelism is lowered at pp 1 without HSDP (lower/context_parallel.plan_refusal)"
    spec.lowering_limits = {"checked": True, **(getattr(req.spec, "lowering_limits", None) or {}),
                            "pipeline": why, "hsdp": why}
    # ep 1: expert parallelism does not run beside cp yet (plan_file.ep_problem)
    pins = dataclasses.replace(req.pins, cp=cp, ep=1, dp=req.pins.dp * cp if req.pins.dp else None)
    return dataclasses.replace(req, spec=spec, pins=pins, global_batch_size=req.global_batch_size * cp)


def as_cp(x, cp: int, spec, cluster):
    """A priced layout of the share as the cp layout it is, priced by `estimate` on the whole model."""
    r, layout, _ = x
    c = dataclasses.replace(r.candidate, dp=r.candidate.dp // cp, cp=cp)
    layout = dataclasses.replace(layout, dp=layout.dp // cp, cp=cp)
    return dataclasses.replace(r, candidate=c), layout, estimate(spec, layout, cluster)


def search(req, base, search_and_price, choose):
    """The cp plan, ("tried", why not) or None. The plan: (found of the share, chosen,
    winner, selection, other layouts priced) in cp terms, selection["cp"] saying why.
    `base`: the cp-1 choice (chosen, winner, selection, others), None when nothing fit or
    cp is pinned. Raises InfeasibleError when a pinned cp fits nowhere."""
    best = base[1] if base is not None else None
    why = why_not(req.spec)
    sizes = [] if why else sizes_to_try(req.spec, req.cluster, req.pins, req.global_batch_size, best)
    if not sizes:
        if why and req.pins.cp is not None and req.pins.cp > 1:
            raise InfeasibleError(f"--cp {req.pins.cp}: context parallelism cannot be planned: {why}")
        return None
    tried, picked = [], []
    for cp in sizes:
        share = share_request(req, cp)
        try:
            found_cp = search_and_price(share)
        except InfeasibleError as exc:
            tried.append(f"cp {cp}: {exc.message.split(';')[0]}")
            continue
        got = _in_cp_terms(req, found_cp, choose(share, found_cp), cp) if found_cp.fitting else None
        if got is None:
            tried.append(f"cp {cp}: does not fit")
            continue
        picked.append((got, cp))
        if best is None:
            break  # the smallest cut that fits
    if not picked:
        if req.pins.cp is not None:
            raise InfeasibleError(f"{req.spec.name} does not fit on {req.cluster.world_size} GPUs with --cp "
                                  f"{req.pins.cp} ({'; '.join(tried)})", hint="try a larger --cp, or more GPUs")
        return ("tried", f"cp tried: {'; '.join(tried)}") if tried else None
    got, cp = min(picked, key=lambda x: x[0][2][2].step_time_s)
    return _explained(got, cp, best, tried + [f"cp {c}: {g[2][2].step_time_s:.3f} s" for g, c in picked])


def _in_cp_terms(req, found_cp, choice, cp: int):
    """(found, chosen, winner, selection, others) of the share, every layout as its cp layout."""
    chosen, winner, selection, others = choice
    convert = lambda x: as_cp(x, cp, req.spec, req.cluster)  # noqa: E731
    try:
        priced = [convert(x) for x in found_cp.priced]
        others = [convert(x) for x in others]
        kept = [convert(winner)] + priced + others
    except CostModelError:
        return None
    # the share under-prices the ring; among what it found, the fastest by the cp estimate wins
    fitting = [x for x in kept if fits(x[2], req.limit)]
    if not fitting:
        return None
    best = min(fitting, key=lambda x: (x[2].step_time_s, x[0].candidate))
    found_cp = dataclasses.replace(found_cp, priced=priced, fitting=[x for x in priced if fits(x[2], req.limit)])
    return found_cp, best, best, dict(selection), [x for x in others if x is not best]


def _explained(picked, cp: int, best, tried: list):
    """`picked` with selection["cp"] saying why cp was chosen, or ("tried", why not)
    when the cp-1 winner `best` is as fast."""
    found_cp, chosen, winner, selection, others = picked
    est = winner[2]
    if best is not None:
        if best[2].step_time_s <= est.step_time_s:
            return ("tried", f"cp tried ({'; '.join(tried)}): none faster than cp 1 ({best[2].step_time_s:.3f} s)")
        t = best[2].time_breakdown
        why = (f"cp {cp}: every sequence cut over {cp} ranks (ring attention), {_mesh_text(winner[0].candidate)}, "
               f"each rank holding 1/{cp} of every sequence's activations; "
               f"{1 - est.step_time_s / best[2].step_time_s:.1%} faster than the best layout without cp "
               f"({best[2].step_time_s:.2f} s, {best[0].candidate.describe()}: pipeline bubble "
               f"{t.get('bubble_s', 0.0) / best[2].step_time_s:.0%}, recomputation "
               f"{t.get('recompute_s', 0.0) / best[2].step_time_s:.0%} of it); tried {'; '.join(tried)}")
        others = others + [best]
    else:
        why = (f"cp {cp}: no layout fits one sequence's activations at cp 1"
               + (f" ({'; '.join(tried)})" if tried else "")
               + f"; cut over {cp} ranks (ring attention), each holds 1/{cp} of every sequence, the smallest cut "
                 f"that fits ({max(est.peak_memory_bytes) / 1e9:.1f} GB on the fullest GPU)")
    selection["cp"] = why
    return found_cp, chosen, winner, selection, others


def _mesh_text(c) -> str:
    return f"pp {c.pp} x dp {c.dp} x cp {c.cp} x tp {c.tp}"
