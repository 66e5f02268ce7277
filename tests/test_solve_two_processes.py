"""The planner's work beside the search (autopar/two_processes.py): the
uniform-layout check reads what was priced ahead instead of pricing it again,
and a plan made with a forked helper equals the plan made without one, field
for field (the lowering's checks split over two processes included)."""
from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar.solve import planner, refine
from cost_models.analytic import gpt
from cost_models.hardware import ClusterSpec

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not os.sys.platform.startswith("linux"),
                                reason="fork is Linux's way here")


def _space():
    spec = gpt("gpt-1.3b", hidden=2048, heads=16, layers=24, seq_len=2048, vocab_size=50304)
    cluster = planner.scaled_cluster(ClusterSpec.resolve("a100-80g"), 4)
    result, builder = planner._run_search(spec, cluster, planner.parse_constraints(None), 256, "bf16", "adam",
                                          3, 1.0, limit_bytes=0.9 * cluster.device_profile.usable_memory_bytes)
    return spec, cluster, result, builder


def _check(spec, cluster, result, builder, known=None, best_s=float("inf")):
    return refine.uniform_layouts(spec, cluster, result.stats["candidate_list"], builder.options,
                                  bound_problem=builder.bound_problem, precision="bf16", optimizer="adam",
                                  limit_bytes=0.9 * cluster.device_profile.usable_memory_bytes, best_s=best_s,
                                  max_estimates=40, known=known)


def test_uniform_check_reads_what_was_priced_ahead(monkeypatch):
    spec, cluster, result, builder = _space()
    ahead = dict(refine.uniform_pricings(spec, cluster, result.stats["candidate_list"], builder.options,
                                         bound_problem=builder.bound_problem, precision="bf16", optimizer="adam",
                                         limit=150))
    alone, priced = _check(spec, cluster, result, builder)
    calls = []
    real = refine.price_uniform
    monkeypatch.setattr(refine, "price_uniform", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    again, priced_again = _check(spec, cluster, result, builder, known=ahead)
    assert priced_again == priced and len(alone) == len(again) > 0
    assert [(c, o, e.step_time_s) for c, o, _, e in again] == [(c, o, e.step_time_s) for c, o, _, e in alone]
    assert calls == []  # everything it needed was priced ahead, in its own order
    # what is known is what is read: an entry known as refused (no estimate) is not priced
    first = next(iter(ahead))
    skipped, _ = _check(spec, cluster, result, builder, known={**ahead, first: (ahead[first][0], None)})
    assert (first[0], first[1]) not in [(c, o) for c, o, _, _ in skipped]
    assert (first[0], first[1]) in [(c, o) for c, o, _, _ in alone]


def _plan_json(monkeypatch, fork: str):
    from autopar.lower.what_runs import limits
    from autopar.zoo.gpt import GPT, GPTConfig

    monkeypatch.setenv("AUTOPAR_FORK", fork)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=64, hidden=128, heads=8, layers=4))
    inputs = lambda b: (torch.zeros(b, 64, dtype=torch.long),)  # noqa: E731
    p = autopar.plan(model, planner.scaled_cluster(ClusterSpec.resolve("a100-80g"), 4), example_inputs=inputs,
                     global_batch_size=64, check_lowering=limits)
    d = p.to_dict()
    for k in ("search_s", "cpsat_s"):  # wall-clock seconds: the only fields that may differ
        d["solver"].pop(k, None)
    return d


def test_a_plan_made_with_a_forked_helper_is_the_plan_made_without(monkeypatch):
    with_fork = _plan_json(monkeypatch, "1")
    alone = _plan_json(monkeypatch, "0")
    assert with_fork["solver"]["lowering_limits"]["tp_checked"] == [2, 4, 8]  # six runs split over two processes
    assert with_fork == alone
