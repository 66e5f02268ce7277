"""The planner's fast paths give, to the bit, what the code they replaced gave:
the same plan for the same model and cluster is a hard rule, so each one is
checked here against that code (kept below as the reference) on random inputs."""
import math
import random

import numpy as np

from autopar.solve.problem import OptionCost, StageProblem, in_flight_numerators, lagrangian_bound, water_fill
from autopar.solve.problem import _layer_classes


def _water_fill_bisect(base, count, unit):
    top = max(base)
    if count <= 0 or unit <= 0:
        return top
    lo = max(top, -(-(sum(base) + count * unit) // len(base)))
    hi = max(top, lo + unit)
    loads = {}
    for b in base:
        loads[b] = loads.get(b, 0) + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(n * ((mid - b) // unit) for b, n in loads.items() if mid > b) >= count:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _lagrangian_per_class(p):
    """lagrangian_bound as it was: numpy arrays and five ops per layer class."""
    pp = p.pp
    cost_rows, mem_rows, weights = [], [], []
    for g, w, c in _layer_classes(p):
        opts = p.group_options[g]
        cost_rows.append(np.array([(p.time_weight * o.time + p.step_weight * o.step) / pp for o in opts], float))
        mem_rows.append(np.array([o.static_mem + w * o.act_mem for o in opts], float))
        weights.append(c)
    capacity = float(sum(p.capacity))
    overhead = p.time_weight * (p.virtual_stages * p.stage_time_overhead if pp > 1 else 0)

    def g_of(lams):
        total = np.full(lams.shape, -capacity) * lams
        for cost, mem, w in zip(cost_rows, mem_rows, weights):
            total += w * np.min(cost[:, None] + mem[:, None] * lams[None, :], axis=0)
        return total

    scale = max(max(float(c.max()) for c in cost_rows), 1.0) / max(max(float(m.max()) for m in mem_rows), 1.0)
    lams = np.concatenate([[0.0], scale * np.logspace(-6, 6, 97)])
    vals = g_of(lams)
    i = int(np.argmax(vals))
    fine = np.linspace(lams[max(i - 1, 0)], lams[min(i + 1, len(lams) - 1)], 65)
    best = max(float(vals.max()), float(g_of(fine).max()))
    return max(0, int(math.floor(best + overhead)) - 1)


def test_water_fill_walks_to_what_the_bisection_found():
    rng = random.Random(1)
    for _ in range(3000):
        unit = rng.choice([1, 2, 7, rng.randint(1, 10**9)])
        spread = rng.choice([0, 3, unit, 5 * unit, 10**10])
        base = [rng.randint(0, spread) for _ in range(rng.choice([1, 2, 4, 33, 128]))]
        if rng.random() < 0.5:  # mostly equal bins, as beside pinned first and last layers
            base = [base[0]] * (len(base) - 2) + base[-2:] if len(base) > 2 else base
        count = rng.choice([0, 1, rng.randint(0, 300)])
        assert water_fill(base, count, unit) == _water_fill_bisect(base, count, unit), (base, count, unit)
    assert water_fill([3], 5, 0) == 3


def _random_problem(rng):
    n = rng.randint(4, 100)
    ngroups = rng.randint(1, 4)
    groups = [rng.randrange(ngroups) for _ in range(n)]
    scale_t, scale_m = 10 ** rng.randint(2, 9), 10 ** rng.randint(1, 7)
    opts = [[OptionCost(k, rng.randint(1, scale_t), rng.randint(0, scale_t // 10), rng.randint(0, scale_m),
                        rng.randint(0, scale_m)) for k in range(rng.randint(1, 9))] for _ in range(ngroups)]
    pp = rng.choice([1, 2, 4, 8, 16])
    v = rng.choice([1, 2, 3, 4]) if pp > 1 else 1
    if n < pp * v:
        pp, v = 1, 1
    schedule = "interleaved" if v > 1 else rng.choice(["gpipe", "1f1b"])
    m = pp * rng.randint(1, 6)
    cap = rng.randint(1, 4 * scale_m * n // pp + 1)
    return StageProblem(groups, opts, pp, v, m, in_flight_numerators(schedule, pp, v, m), [cap] * pp,
                        rng.randint(0, scale_t // 100))


def test_lagrangian_bound_gives_the_per_class_floats():
    rng = random.Random(2)
    for _ in range(400):
        p = _random_problem(rng)
        assert lagrangian_bound(p) == _lagrangian_per_class(p)


def _undominated_pairwise(vectors):
    peaks = []
    for c in sorted(set(vectors), reverse=True):
        if not any(all(a >= b for a, b in zip(o, c)) for o in peaks):
            peaks.append(c)
    return peaks


def test_chunk_count_filter_keeps_what_the_pairwise_one_kept():
    from cost_models.memory import _undominated, in_flight_chunk_counts
    from cost_models.pipeline import rank_order
    rng = random.Random(3)
    for _ in range(300):
        vectors = [tuple(rng.randint(0, rng.choice([1, 3, 200])) for _ in range(rng.randint(1, 8)))] * 1
        vectors += [tuple(rng.randint(0, 5) for _ in vectors[0]) for _ in range(rng.randint(0, 60))]
        assert sorted(_undominated(vectors)) == sorted(_undominated_pairwise(vectors))
    for pp, v, m in [(4, 2, 8), (8, 3, 32), (16, 4, 64), (3, 5, 9)]:
        for r in range(pp):
            counts, seen = [0] * v, []
            for phase, _, chunk in rank_order("interleaved", r, pp, m, v):
                counts[chunk] += 1 if phase == "fwd" else -1
                if phase == "fwd":
                    seen.append(tuple(counts))
            assert in_flight_chunk_counts("interleaved", pp, m, r, v) == sorted(_undominated_pairwise(seen))


def test_rank_memory_after_reads_what_applying_and_undoing_gave():
    """RankMemory.after reads the peak terms off their tallies; the old way applied the
    switch to them, summed their maxima and undid it."""
    from autopar.solve.warm_start import RankMemory
    rng = random.Random(4)
    for _ in range(300):
        opts = [OptionCost(k, rng.randint(1, 50), rng.randint(0, 5), rng.randint(0, 100), rng.randint(0, 30),
                           tuple(rng.choice([0, 7, 20, rng.randint(0, 60)]) for _ in range(rng.randint(0, 3))),
                           rng.randint(0, 20)) for k in range(rng.randint(2, 5))]
        pp, v = rng.choice([(1, 1), (2, 1), (2, 2), (4, 3)])
        n = pp * v + rng.randint(0, 12)
        p = StageProblem([0] * n, [opts], pp, v, 4 * pp, in_flight_numerators(
            "interleaved" if v > 1 else "1f1b", pp, v, 4 * pp), [10**6] * pp)
        stage_of = sorted(list(range(pp * v)) + [rng.randrange(pp * v) for _ in range(n - pp * v)])
        option_of = [rng.randrange(len(opts)) for _ in range(n)]
        layers = [i for i in range(n) if stage_of[i] % pp == 0]
        mem = RankMemory(p, 0, layers, stage_of, option_of)
        for _ in range(10):
            i = rng.choice(layers)
            old, new, chunk = opts[option_of[i]], rng.choice(opts), stage_of[i] // pp
            held = sum(1 for j in layers if option_of[j] == option_of[i] and stage_of[j] // pp == chunk)
            count = rng.randint(1, held + 2)  # beyond `held`: not a switch of existing layers
            mem._apply_peaks(old, -count)
            mem._apply_peaks(new, count)
            peaks = sum(max(c, default=0) for c in mem.peaks)
            mem._apply_peaks(new, -count)
            mem._apply_peaks(old, count)
            delta = count * (new.act_mem - old.act_mem)
            act = max(d + vec[chunk] * delta for d, vec in zip(mem._act_dots(), mem.vecs))
            static = mem.static + count * (new.static_mem - old.static_mem)
            want = max(static + peaks + act, static + mem.step + count * (new.step_mem - old.step_mem))
            assert mem.after(old, new, chunk, count) == want


def _tidy_by_evaluate(p, stage_of, option_of, objective):
    """refine.tidy as it was: every trial evaluated whole."""
    from autopar.solve.problem import evaluate
    from autopar.solve.refine import faster_options
    for i in range(p.num_layers):
        for k in faster_options(p.group_options[p.layer_group[i]], option_of[i]):
            before, option_of[i] = option_of[i], k
            value = evaluate(p, stage_of, option_of)
            if value is not None and value <= objective:
                objective = value
                break
            option_of[i] = before
    return objective, option_of


def test_tidy_from_tallies_keeps_what_evaluating_each_trial_kept():
    from autopar.solve.problem import StageSolution, evaluate, rank_memory
    from autopar.solve.refine import tidy
    rng = random.Random(5)
    changed = 0
    for _ in range(300):
        p = _random_problem(rng)
        for o in [o for opts in p.group_options for o in opts]:
            object.__setattr__(o, "peaks", tuple(rng.choice([0, rng.randint(0, 9)]) for _ in range(rng.randint(0, 2))))
        # a random valid assignment, the capacity a little above what it needs: some trials do not fit
        cuts = sorted(rng.sample(range(1, p.num_layers), p.num_stages - 1))
        stage_of = [sum(1 for c in cuts if c <= i) for i in range(p.num_layers)]
        option_of = [rng.randrange(len(p.group_options[g])) for g in p.layer_group]
        need = rank_memory(p, stage_of, option_of)
        p.capacity = [max(need) + rng.choice([0, 1, max(need) // 10])] * p.pp
        objective = evaluate(p, stage_of, option_of)
        got = tidy(p, StageSolution(objective, list(stage_of), list(option_of)))
        want_obj, want_opts = _tidy_by_evaluate(p, list(stage_of), list(option_of), objective)
        assert (got.objective, got.option_of_layer) == (want_obj, want_opts)
        changed += want_opts != option_of
    assert changed > 100


def _balance_stages_every_round(weights, num_stages):
    """cost_models.stages.balance_stages as it was: 60 rounds, every layer visited."""
    n = len(weights)
    if num_stages == 1:
        return [n]

    def split(limit):
        counts, loads, load, count = [], [], 0.0, 0
        for i, w in enumerate(weights):
            must_cut = count > 0 and n - i < num_stages - len(counts)
            if count > 0 and (load + w > limit or must_cut) and len(counts) < num_stages - 1:
                counts.append(count)
                loads.append(load)
                load, count = 0.0, 0
            load += w
            count += 1
        counts.append(count)
        loads.append(load)
        return counts, loads

    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        counts, loads = split(mid)
        if len(counts) <= num_stages and max(loads) <= mid * (1 + 1e-12):
            hi = mid
        else:
            lo = mid
    counts, _ = split(hi)
    while len(counts) < num_stages:
        j = max((k for k in range(len(counts)) if counts[k] > 1), key=lambda k: counts[k])
        counts[j:j + 1] = [counts[j] // 2, counts[j] - counts[j] // 2]
    return counts


def test_balance_stages_splits_as_sixty_full_rounds_did():
    from cost_models.stages import balance_stages
    rng = random.Random(6)
    for _ in range(2000):
        n = rng.randint(1, 100)
        kind = rng.random()
        if kind < 0.3:  # identical blocks between a light first and a heavy last layer
            weights = [0.1] + [1.0] * (n - 2) + [3.7] if n > 2 else [1.0] * n
        elif kind < 0.6:
            weights = [rng.choice([0.0, 1.0, 2.5, rng.random(), 1e-3 * rng.random(), 1e9 * rng.random()])
                       for _ in range(n)]
        else:
            weights = [rng.random() for _ in range(n)]
        s = min(n, rng.choice([1, 2, rng.randint(1, n), n, max(1, n // 3)]))
        assert balance_stages(weights, s) == _balance_stages_every_round(weights, s), (weights, s)
