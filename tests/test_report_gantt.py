"""The pipeline Gantt stays readable and small for deep interleaved pipelines,
and draws exactly the simulated schedule (merging only changes how it is boxed)."""
from __future__ import annotations

import re

from autopar.report import gantt, render_html, timeline
from autopar.report.timeline import Event
from test_report_fixtures import make_plan, make_small_plan


def deep_interleaved_plan():
    # pp 16 x V 6 = 96 stages of one layer each, 96 micro-batches: the shape of
    # the GPT-3 175B pinned sample that used to draw ~6,000 boxes (1.6 MB).
    return make_plan(pp=16, dp=8, tp=8, schedule="interleaved", virtual_stages=6, num_micro_batches=96,
                     num_blocks=94)


def op_boxes(html: str) -> list[str]:
    return re.findall(r'<rect[^>]*class="op (?:fwd|bwd)"', html)


def test_deep_interleaved_gantt_is_small_and_says_what_it_draws():
    plan = deep_interleaved_plan()
    drawn = timeline.drawn_micro_batches(plan)
    assert drawn % plan.mesh.pp == 0 and drawn < plan.num_micro_batches  # interleaving needs multiples of pp
    events, n = timeline.schedule_events(plan)
    assert n == drawn and len(events) == 2 * drawn * plan.mesh.pp * plan.virtual_stages
    before = plan.to_json()
    html = render_html(plan)
    assert plan.to_json() == before  # drawing never touches the plan's numbers
    boxes = op_boxes(html)
    assert 0 < len(boxes) < timeline.MAX_DRAWN_BOXES
    assert len(html.encode()) < 700 * 1024
    assert f"{drawn} of {plan.num_micro_batches} micro-batches drawn" in html


def test_shallow_pipelines_still_draw_every_pass_as_its_own_box():
    plan = make_small_plan(num_micro_batches=8)
    html = render_html(plan)
    assert len(op_boxes(html)) == 2 * plan.mesh.pp * plan.num_micro_batches
    assert "passes back to back" not in html


def test_merged_boxes_cover_every_simulated_pass_exactly_once():
    plan = deep_interleaved_plan()
    events, _ = timeline.schedule_events(plan)
    end = max(e.end_s for e in events)
    scale = 932 / end
    runs = gantt.merge_slivers(events, scale)
    assert sorted(id(e) for run in runs for e in run) == sorted(id(e) for e in events)
    assert len(runs) < len(events)  # the slivers of warm-up and drain were merged
    for run in runs:
        assert len({(e.pp_rank, e.phase) for e in run}) == 1
        for a, b in zip(run, run[1:]):  # back to back, each too narrow to read
            assert (b.start_s - a.end_s) * scale < gantt.GAP_PX
            assert (a.end_s - a.start_s) * scale < gantt.MERGE_BELOW_PX


def test_merge_rules_on_hand_made_events():
    ev = [Event(0, 0, "fwd", 0.0, 1.0), Event(0, 1, "fwd", 1.0, 2.0),  # narrow, back to back: merge
          Event(0, 2, "fwd", 4.0, 5.0),  # gap: new box
          Event(0, 2, "bwd", 5.0, 6.0),  # other phase: new box
          Event(1, 0, "fwd", 0.0, 1.0)]  # other rank: new box
    runs = gantt.merge_slivers(ev, scale=1.0)  # 1 px per second: all narrow
    assert [len(r) for r in runs] == [2, 1, 1, 1]
    wide = gantt.merge_slivers(ev, scale=100.0)  # 100 px per pass: readable, never merged
    assert [len(r) for r in wide] == [1] * 5
