"""Exact per-chunk activation memory for interleaved pipelines.

torch's ScheduleInterleaved1F1B holds a rank's chunk 0 longer than its later
chunks, so a rank's peak is max over count vectors c of sum_k c[k] x act(chunk
k), not (micro-batches in flight) x average chunk. The stage solver, its
brute-force reference and the cost model's pipeline simulation must agree.
"""
import random

import pytest

from cost_models.memory import in_flight_chunk_counts, peak_chunk_bytes

from autopar.solve.brute_force import solve_brute_force
from autopar.solve.cpsat import solve_cpsat
from autopar.solve.problem import (OptionCost, StageProblem, evaluate, in_flight_numerators, lower_bound,
                                   memory_floor, rank_memory)


def interleaved_problem(rng: random.Random, capacity=None) -> StageProblem:
    pp = rng.choice([2, 3])
    v = rng.choice([2, 3]) if pp == 2 else 2
    n = pp * v + rng.randint(0, 2)
    m = pp * rng.choice([1, 2, 3])
    ngroups = rng.randint(1, 2)
    groups = [rng.randrange(ngroups) for _ in range(n)]
    # option 0: fast, heavy activations; option 1: slower, light (checkpointing)
    opts = []
    for _ in range(ngroups):
        t, act = rng.randint(20, 100), rng.randint(10, 60)
        row = [OptionCost(0, t, rng.randint(0, 5), rng.randint(5, 40), act, (0, rng.randint(0, 10)))]
        if rng.random() < 0.8:
            row.append(OptionCost(1, int(t * rng.uniform(1.1, 1.5)), row[0].step, row[0].static_mem,
                                  max(1, act // rng.randint(3, 10)), (rng.randint(1, 20), row[0].peaks[1])))
        opts.append(row)
    return StageProblem(groups, opts, pp, v, m, in_flight_numerators("interleaved", pp, v, m),
                        [capacity or 10**9] * pp, rng.randint(0, 5))


def binding_problem(seed: int) -> tuple[StageProblem, int]:
    """A random interleaved problem with a capacity between the smallest footprint any
    assignment reaches and what the unconstrained optimum needs: memory binds."""
    rng = random.Random(seed)
    free = interleaved_problem(rng)
    best = solve_brute_force(free)
    need = max(rank_memory(free, best.stage_of_layer, best.option_of_layer))
    low = memory_floor(free)
    cap = rng.randint(low, max(low, need - 1))
    free.capacity = [cap] * free.pp
    return free, best.objective


@pytest.mark.parametrize("seed", range(30))
def test_cpsat_equals_brute_force_with_exact_chunk_memory(seed):
    p, _ = binding_problem(seed)
    exact = solve_brute_force(p)
    got = solve_cpsat(p)
    assert got.objective == exact.objective
    if got.objective is not None:
        assert got.status == "optimal"
        assert evaluate(p, got.stage_of_layer, got.option_of_layer) == got.objective
        assert max(rank_memory(p, got.stage_of_layer, got.option_of_layer)) <= p.capacity[0]
    bound = lower_bound(p)
    if exact.objective is None:
        return
    assert bound is not None and bound <= exact.objective  # bounds stay valid under the exact rule


def test_memory_binds_on_most_random_problems():
    """The comparison above is only worth something if memory changes the answer."""
    changed = infeasible = 0
    for seed in range(30):
        p, free_objective = binding_problem(seed)
        sol = solve_brute_force(p)
        infeasible += sol.objective is None
        changed += sol.objective is not None and sol.objective > free_objective
    assert changed >= 12
    assert infeasible <= 10


def test_count_vectors_are_the_cost_models():
    p = StageProblem([0] * 12, [[OptionCost(0, 1, 0, 1, 1)]], 4, 2, 8, in_flight_numerators("interleaved", 4, 2, 8),
                     [10**6] * 4)
    for r in range(4):
        assert p.chunk_counts[r] == in_flight_chunk_counts("interleaved", 4, 8, r, 2)
        # the closed form's count is the same number of chunk-micro-batches
        assert {sum(c) for c in p.chunk_counts[r]} == {p.in_flight_num[r]}


def test_rank_memory_is_the_cost_models_peak_bytes():
    rng = random.Random(5)
    for _ in range(20):
        p = interleaved_problem(rng)
        cuts = sorted(rng.sample(range(1, p.num_layers), p.num_stages - 1))
        bounds = [0] + cuts + [p.num_layers]
        stage_of = [s for s in range(p.num_stages) for _ in range(bounds[s], bounds[s + 1])]
        options = [rng.randrange(len(p.group_options[g])) for g in p.layer_group]
        got = rank_memory(p, stage_of, options)
        for r in range(p.pp):
            chunk = [sum(p.group_options[p.layer_group[i]][options[i]].act_mem for i in range(p.num_layers)
                         if stage_of[i] == k * p.pp + r) for k in range(p.virtual_stages)]
            static = sum(p.group_options[p.layer_group[i]][options[i]].static_mem for i in range(p.num_layers)
                         if stage_of[i] % p.pp == r)
            peaks = sum(max([p.group_options[p.layer_group[i]][options[i]].peaks[t] for i in range(p.num_layers)
                             if stage_of[i] % p.pp == r] or [0]) for t in range(2))
            exact = peak_chunk_bytes("interleaved", p.pp, p.num_micro_batches, chunk, r)
            assert got[r] == static + peaks + exact


def test_solver_checkpoints_the_chunk_held_longest():
    """pp 2, V 2, m 4: rank 0 holds (4 of chunk 0, 2 of chunk 1) at its peak, not 3 + 3.
    With room to checkpoint one of its two layers, the solver must pick chunk 0's,
    and the averaged rule would have judged the other choice as good."""
    heavy = [OptionCost(0, 100, 0, 0, 60), OptionCost(1, 130, 0, 0, 6)]
    p = StageProblem([0] * 4, [heavy], 2, 2, 4, in_flight_numerators("interleaved", 2, 2, 4), [10**6, 10**6])
    vec = max(p.chunk_counts[0], key=lambda c: c[0])
    assert vec[0] > vec[1]
    # checkpoint chunk 0 on rank 0: need c0*6 + c1*60; checkpoint chunk 1: c0*60 + c1*6
    need_ckpt0 = max(c[0] * 6 + c[1] * 60 for c in p.chunk_counts[0])
    need_ckpt1 = max(c[0] * 60 + c[1] * 6 for c in p.chunk_counts[0])
    assert need_ckpt0 < need_ckpt1
    p.capacity = [need_ckpt0, 10**6]
    sol = solve_cpsat(p)
    assert sol.objective == solve_brute_force(p).objective
    assert sol.stage_of_layer == [0, 1, 2, 3]
    assert sol.option_of_layer[0] == 1 and sol.option_of_layer[2] == 0  # chunk 0 of rank 0 checkpointed


def test_count_vectors_for_many_micro_batches_are_the_short_walks():
    """The solver walks at most STABLE_ROUNDS x pp micro-batches of the schedule;
    the exact walk over every micro-batch gives the same vectors."""
    from autopar.solve.problem import chunk_count_vectors
    for pp in (2, 3, 4, 8):
        for v in (2, 3, 4, 8):
            for m in (pp, 2 * pp, 5 * pp, 12 * pp):
                full = [in_flight_chunk_counts("interleaved", pp, m, r, v) for r in range(pp)]
                assert chunk_count_vectors(pp, v, m) == full, (pp, v, m)



def with_step_memory(seed: int) -> StageProblem:
    """interleaved_problem's options, each with an optimizer-step temporary of up to
    8x its static memory (foreach Adam's is a quarter of fp32 Adam's 16 B/param state;
    here larger, so that the step's moment binds often enough to be tested)."""
    import dataclasses

    rng = random.Random(1000 + seed)
    p = interleaved_problem(rng)
    p.group_options = [[dataclasses.replace(o, step_mem=rng.randint(0, 8 * o.static_mem)) for o in opts]
                       for opts in p.group_options]
    return p


@pytest.mark.parametrize("seed", range(20))
def test_optimizer_step_memory_is_a_second_constraint(seed):
    """The solver keeps static + step temporaries under capacity as well as the
    activation peak, and agrees with brute force."""
    free = with_step_memory(seed)
    best = solve_brute_force(free)
    need = max(rank_memory(free, best.stage_of_layer, best.option_of_layer))
    low = memory_floor(free)
    free.capacity = [random.Random(seed).randint(low, max(low, need))] * free.pp
    exact, got = solve_brute_force(free), solve_cpsat(free)
    assert got.objective == exact.objective
    if got.objective is not None:
        mem = rank_memory(free, got.stage_of_layer, got.option_of_layer)
        assert max(mem) <= free.capacity[0]
        for r in range(free.pp):  # rank_memory holds the step's moment too
            mine = [(free.group_options[free.layer_group[i]][k]) for i, (s, k)
                    in enumerate(zip(got.stage_of_layer, got.option_of_layer)) if s % free.pp == r]
            assert mem[r] >= sum(o.static_mem + o.step_mem for o in mine)


def test_the_optimizer_step_binds_on_some_problems():
    """The test above is only worth something if the step's moment is ever the peak."""
    import dataclasses

    binds = 0
    for seed in range(20):
        p = with_step_memory(seed)
        best = solve_brute_force(p)
        without = dataclasses.replace(p, group_options=[[dataclasses.replace(o, step_mem=0) for o in opts]
                                                        for opts in p.group_options])
        binds += (max(rank_memory(p, best.stage_of_layer, best.option_of_layer))
                  > max(rank_memory(without, best.stage_of_layer, best.option_of_layer)))
    assert binds >= 3, binds
