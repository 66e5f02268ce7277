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
