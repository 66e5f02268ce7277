"""Pipeline schedules: Megatron's step-time formula, bubbles, the timeline for the report."""
import pytest

from cost_models.pipeline import closed_form_bubble_fraction, simulate, timeline


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(1, 4), (4, 4), (4, 16), (8, 3)])
def test_uniform_stages_follow_megatron_eq1(schedule, p, m):
    tf, tb = 1.0, 2.0
    res = simulate(schedule, p, m, [tf] * p, [tb] * p)
    assert res.step_time_s == pytest.approx((m + p - 1) * (tf + tb))


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_bubble(v):
    p, m, tf, tb = 4, 8, 1.0, 2.0
    res = simulate("interleaved", p, m, [tf / v] * (p * v), [tb / v] * (p * v), virtual_stages=v)
    ideal = m * (tf + tb)
    assert (res.step_time_s - ideal) / ideal == pytest.approx(closed_form_bubble_fraction("interleaved", p, m, v))


def test_bubbles_shrink_with_micro_batches_and_interleaving():
    p = 8
    frac = []
    for m in (8, 16, 64):
        r = simulate("1f1b", p, m, [1.0] * p, [2.0] * p)
        frac.append(r.bubble_s[0] / r.step_time_s)
    assert frac[0] > frac[1] > frac[2]
    plain = simulate("1f1b", p, 16, [1.0] * p, [2.0] * p).step_time_s
    inter = simulate("interleaved", p, 16, [0.5] * 2 * p, [1.0] * 2 * p, virtual_stages=2).step_time_s
    assert inter < plain


def test_p2p_and_unequal_stages_lengthen_the_step():
    base = simulate("1f1b", 4, 8, [1.0] * 4, [2.0] * 4).step_time_s
    assert simulate("1f1b", 4, 8, [1.0] * 4, [2.0] * 4, [0.1] * 4).step_time_s > base
    slow_last = simulate("1f1b", 4, 8, [1.0, 1.0, 1.0, 1.5], [2.0, 2.0, 2.0, 3.0]).step_time_s
    assert slow_last == pytest.approx(base + 8 * 1.5, rel=0.1)  # the slow stage paces every micro-batch


def test_timeline_is_a_valid_schedule():
    p, m, v = 4, 8, 2
    ev = timeline("interleaved", p, m, v, fwd_s=[0.5] * 8, bwd_s=[1.0] * 8, p2p_s=[0.01] * 8)
    assert len(ev) == 2 * m * p * v
    assert {"pp_rank", "stage", "micro_batch", "phase", "start_s", "end_s"} <= set(ev[0])
    for r in range(p):
        mine = [e for e in ev if e["pp_rank"] == r]
        assert all(a["end_s"] <= b["start_s"] + 1e-12 for a, b in zip(mine, mine[1:]))  # one op at a time
        assert all(e["stage"] % p == r for e in mine)
    done = {(e["stage"], e["micro_batch"], e["phase"]): e for e in ev}
    for e in ev:  # every forward follows the previous stage's forward plus the transfer
        if e["phase"] == "fwd" and e["stage"] > 0:
            assert e["start_s"] >= done[(e["stage"] - 1, e["micro_batch"], "fwd")]["end_s"] + 0.01 - 1e-12


def test_bad_schedule_inputs():
    from cost_models.errors import CostModelError
    with pytest.raises(CostModelError, match="unknown pipeline schedule"):
        simulate("zigzag", 2, 2, [1, 1], [1, 1])
    with pytest.raises(CostModelError, match="divisible by pp"):
        simulate("interleaved", 4, 6, [1] * 8, [1] * 8, virtual_stages=2)


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_blocking_p2p_never_beats_async(schedule, v):
    p, m = 4, 8
    args = (schedule, p, m, [1.0 / v] * (p * v), [3.0 / v] * (p * v), [0.1] * (p * v))
    fast = simulate(*args, virtual_stages=v).step_time_s
    slow = simulate(*args, virtual_stages=v, blocking_p2p=True).step_time_s
    assert slow > fast
    # and with free transfers the rendezvous changes nothing
    free = (schedule, p, m, [1.0 / v] * (p * v), [3.0 / v] * (p * v), [0.0] * (p * v))
    assert simulate(*free, virtual_stages=v, blocking_p2p=True).step_time_s == pytest.approx(
        simulate(*free, virtual_stages=v).step_time_s)


# -- in-flight micro-batches: simulation, closed form and torch's own schedule agree ----------

PVM = [(2, 1, 2), (4, 1, 4), (4, 1, 16), (8, 1, 8), (2, 2, 4), (4, 2, 8), (4, 3, 12), (4, 2, 4), (8, 2, 16),
       (8, 4, 32), (16, 4, 32)]


def _torch_order(pp, v, m, rank):
    """(phase, micro-batch, local chunk) as torch.distributed.pipelining runs them on `rank`
    (what autopar lowers onto), built without a process group."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    if v == 1:  # Schedule1F1B: pp - rank warm-up forwards, then one backward and one forward
        warm = min(m, pp - rank)
        order = [("fwd", i, 0) for i in range(warm)]
        for i in range(m - warm):
            order += [("bwd", i, 0), ("fwd", warm + i, 0)]
        return order + [("bwd", i, 0) for i in range(m - warm, m)]
    s = sched.ScheduleInterleaved1F1B.__new__(sched.ScheduleInterleaved1F1B)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = pp, v, m
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    out = []
    for a in s._calculate_single_rank_operations(rank):
        if a is not None:
            phase = "fwd" if a.computation_type == sched._ComputationType.FORWARD else "bwd"
            out.append((phase, a.microbatch_index, a.stage_index // pp))
    return out


def _peak_chunks(order):
    live = peak = 0
    for phase, _, _ in order:
        live += 1 if phase == "fwd" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p, v, m", PVM)
def test_peak_in_flight_is_closed_form_and_torchs_count(p, v, m):
    from cost_models.memory import in_flight_micro_batches
    schedule = "interleaved" if v > 1 else "1f1b"
    res = simulate(schedule, p, m, [1.0] * (p * v), [2.0] * (p * v), [0.05] * (p * v), virtual_stages=v)
    for r in range(p):
        torch_peak = _peak_chunks(_torch_order(p, v, m, r)) / v
        assert res.peak_in_flight[r] == pytest.approx(torch_peak)
        assert in_flight_micro_batches(schedule, p, m, r, v) == pytest.approx(torch_peak)
    if v > 1 and (v + 1) * p - 1 <= m * v:  # Korthikanti's factor on rank 0 once m allows the full warm-up
        assert res.peak_in_flight[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("p, v, m", [pv for pv in PVM if pv[1] > 1])
def test_simulated_order_is_torchs_interleaved_order(p, v, m):
    from cost_models.pipeline import rank_order
    for r in range(p):
        assert rank_order("interleaved", r, p, m, v) == _torch_order(p, v, m, r)


def test_gpipe_keeps_every_micro_batch():
    res = simulate("gpipe", 4, 6, [1.0] * 4, [2.0] * 4)
    assert res.peak_in_flight == [6.0] * 4


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (8, 4, 32), (16, 4, 32)])
def test_peak_bytes_with_unequal_chunks(p, v, m):
    """Chunks with different activation sizes: the simulation's byte peak is the exact
    per-chunk count (`peak_chunk_bytes`), not count x average, which the first chunk
    (held by the whole warm-up) can exceed by a wide margin."""
    from cost_models.memory import in_flight_micro_batches, peak_chunk_bytes
    import random
    rng = random.Random(p * 100 + v * 10 + m)
    act = [rng.choice([1.0, 3.0, 10.0]) for _ in range(p * v)]
    res = simulate("interleaved", p, m, [1.0] * (p * v), [2.0] * (p * v), virtual_stages=v, activation_bytes=act)
    for r in range(p):
        chunk_bytes = [act[k * p + r] for k in range(v)]
        assert res.peak_activation_bytes[r] == pytest.approx(peak_chunk_bytes("interleaved", p, m, chunk_bytes, r))
    heavy_first = [10.0] + [1.0] * (v - 1)  # e.g. no checkpointing in chunk 0, full in the others
    exact = peak_chunk_bytes("interleaved", p, m, heavy_first, 1)
    averaged = in_flight_micro_batches("interleaved", p, m, 1, v) * sum(heavy_first)
    assert exact > averaged


@pytest.mark.parametrize("schedule, p, v, m", [("gpipe", 4, 1, 6), ("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8),
                                               ("interleaved", 16, 4, 32)])
def test_planner_table_in_flight_matches_simulated_bytes_for_equal_chunks(schedule, p, v, m):
    """The stage solver charges in_flight_num[r] / V x (rank's activation bytes per
    micro-batch); with equal chunks that is exactly the simulation's byte peak."""
    from autopar.solve.problem import in_flight_numerators
    per_chunk = 3.0
    res = simulate(schedule, p, m, [1.0] * (p * v), [2.0] * (p * v), virtual_stages=v,
                   activation_bytes=[per_chunk] * (p * v))
    nums = in_flight_numerators(schedule, p, v, m)
    for r in range(p):
        assert res.peak_activation_bytes[r] == pytest.approx(nums[r] / v * per_chunk * v)


def test_the_list_based_simulation_gives_the_event_by_event_ones_exact_floats():
    """Without events or rendezvous the simulation runs on lists (_until_done_async): the
    same finish, busy and peak values, to the bit, as the event-keeping path."""
    import random

    from cost_models.pipeline import simulate
    rng = random.Random(0)
    for _ in range(150):
        schedule = rng.choice(["gpipe", "1f1b", "interleaved"])
        pp = rng.choice([1, 2, 3, 4, 8])
        v = rng.choice([1, 2, 3]) if schedule == "interleaved" else 1
        m, n = pp * rng.randint(1, 5), pp * v
        f, b = [rng.random() for _ in range(n)], [2 * rng.random() for _ in range(n)]
        x, a = [0.1 * rng.random() for _ in range(n)], [10 * rng.random() for _ in range(n)]
        fast = simulate(schedule, pp, m, f, b, x, virtual_stages=v, activation_bytes=a)
        slow = simulate(schedule, pp, m, f, b, x, virtual_stages=v, activation_bytes=a, keep_events=True)
        assert (fast.finish_s, fast.busy_s, fast.peak_in_flight, fast.peak_activation_bytes) == \
               (slow.finish_s, slow.busy_s, slow.peak_in_flight, slow.peak_activation_bytes)
