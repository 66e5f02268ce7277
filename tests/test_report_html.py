"""The HTML report: valid HTML5, small, escaped, deterministic, faithful to the Plan."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import html5lib
import pytest

from autopar.plan import Plan
from autopar.report import format as fmt
from autopar.report import mesh, render_html, svg, tables, write_html
from test_report_fixtures import make_plan, make_small_plan

SVG = "{http://www.w3.org/2000/svg}"
XHTML = "{http://www.w3.org/1999/xhtml}"
HOSTILE = "<script>alert(1)</script>"


def parse(text: str):
    """Strict HTML5 parse: raises html5lib.html5parser.ParseError on any parse error."""
    return html5lib.HTMLParser(strict=True).parse(text)


def svgs(tree, cls: str):
    return [e for e in tree.iter(f"{SVG}svg") if cls in e.get("class", "").split()]


def all_text(tree) -> str:
    return "".join(tree.itertext())


FIXTURES = {
    "gpt3_175b_1024": lambda: make_plan(),
    "small_8": lambda: make_small_plan(),
    "interleaved": lambda: make_plan(name="interleaved", nodes=8, pp=4, dp=2, tp=8, schedule="interleaved",
                                     virtual_stages=2, num_micro_batches=16, num_blocks=30),
    "gpipe": lambda: make_small_plan(schedule="gpipe"),
    "no_pipeline": lambda: make_small_plan(pp=1, dp=4, tp=2, num_micro_batches=2, with_alternatives=False),
    "tp_across_nodes": lambda: make_plan(name="wide_tp", nodes=4, gpus_per_node=4, pp=2, dp=1, tp=8, num_micro_batches=8, num_blocks=8),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_report_is_valid_html5_with_all_charts(name):
    plan = FIXTURES[name]()
    tree = parse(render_html(plan))
    for cls in ("mesh-detail", "memory"):
        assert len(svgs(tree, cls)) == 1, cls
    nodes = plan.cluster["nodes"]
    # the node overview appears exactly when the GPU detail cannot show every node
    assert len(svgs(tree, "mesh-overview")) == (1 if nodes > mesh.DETAIL_MAX_NODES else 0)
    assert len(svgs(tree, "gantt")) == 1
    ids = [e.get("id") for e in tree.iter() if e.get("id")]
    assert len(ids) == len(set(ids)), "duplicate element ids"
    # every in-page link points at a section that exists
    hrefs = {a.get("href")[1:] for a in tree.iter(f"{XHTML}a") if a.get("href", "").startswith("#")}
    assert hrefs <= set(ids)


def test_report_is_self_contained_and_inert():
    text = render_html(make_plan())
    tree = parse(text)
    assert not list(tree.iter(f"{XHTML}script"))
    assert not list(tree.iter(f"{XHTML}link")), "no external stylesheets"
    # nothing to fetch: no src attributes, no url() in CSS, and a CSP that forbids fetching anyway
    assert not [e for e in tree.iter() if e.get("src")]
    assert "url(" not in text
    csp = [m.get("content") for m in tree.iter(f"{XHTML}meta") if m.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in csp[0]


def test_175b_report_is_under_2mb_and_collapses_identical_layers():
    plan = make_plan()
    text = render_html(plan)
    assert len(text.encode()) < 2 * 1024 * 1024
    runs = tables.layer_runs(plan)
    # 98 layers on 16 stages: embedding + head are their own runs, blocks collapse to one run per stage
    assert len(runs) == 16 + 2
    assert sum(r.n for r in runs) == len(plan.layer_choices)
    assert runs[1].first == "blocks.0" and runs[1].last == "blocks.5" and runs[1].n == 6


def test_runs_split_where_choices_or_indices_change():
    plan = make_small_plan(pp=1, dp=8, tp=1, num_micro_batches=1, num_blocks=6)
    layers = plan.stages[0].layers
    layers[3].checkpoint = "full"  # blocks.2 differs from its neighbours
    runs = tables.layer_runs(plan)
    names = [(r.first, r.last, r.n) for r in runs]
    assert names == [("embedding", "embedding", 1), ("blocks.0", "blocks.1", 2), ("blocks.2", "blocks.2", 1),
                     ("blocks.3", "blocks.5", 3), ("lm_head", "lm_head", 1)]


def test_hostile_names_render_as_text():
    plan = make_small_plan(layer_name=HOSTILE + "{i}", module_name=HOSTILE, name=HOSTILE)
    plan.model["source"] = "models/" + HOSTILE + ".py:build"
    plan.cluster["device"] = HOSTILE
    plan.alternatives[0]["why"] = HOSTILE
    plan.assumptions[HOSTILE] = HOSTILE
    text = render_html(plan)
    assert HOSTILE not in text
    tree = parse(text)
    assert not list(tree.iter(f"{XHTML}script"))
    assert not list(tree.iter(f"{SVG}script"))
    body_text = all_text(tree)
    assert body_text.count(HOSTILE) >= 6  # title, model, layers, modules, device, why, assumptions
    assert (HOSTILE + "0") in body_text  # layer names as text in the tables


def test_svg_text_and_attributes_are_escaped():
    doc = svg.document(10, 10, [svg.text(1, 2, HOSTILE, class_='x" onload="alert(1)'),
                                svg.with_title(svg.rect(0, 0, 1, 1), HOSTILE)],
                       label=HOSTILE, class_="chart")
    root = ET.fromstring(str(doc))  # well-formed XML: nothing broke out of its element
    texts = [e.text for e in root.iter(f"{SVG}text")]
    assert texts == [HOSTILE]
    assert root.find(f"{SVG}text").get("class") == 'x" onload="alert(1)'
    assert root.find(f"{SVG}text").get("onload") is None
    assert [e.text for e in root.iter(f"{SVG}title")] == [HOSTILE, HOSTILE]


def test_render_is_deterministic_and_survives_json_round_trip(tmp_path):
    plan = make_plan()
    first = render_html(plan)
    assert render_html(plan) == first
    assert render_html(Plan.from_json(plan.to_json())) == first
    out = write_html(plan, str(tmp_path / "plan.html"))
    assert open(out, encoding="utf-8").read() == first


def test_summary_shows_the_plans_own_numbers():
    plan = make_plan()
    text = all_text(parse(render_html(plan)))
    p = plan.predicted
    for shown in (fmt.seconds(p.step_time_s), fmt.si(p.tokens_per_s, "tok/s"), fmt.percent(p.mfu),
                  f"{p.tflops_per_gpu:.1f} TFLOP/s", fmt.bytes_(max(p.peak_memory_bytes))):
        assert shown in text
    for alt in plan.alternatives:
        assert alt["why"] in text


def test_mesh_drawing_places_every_rank_where_the_mesh_formula_says():
    pp, dp, tp, gpn = 4, 2, 8, 8
    for rank in range(pp * dp * tp):
        p, d, t = mesh.rank_coords(rank, pp, dp, tp)
        assert (p * dp + d) * tp + t == rank
    doc = ET.fromstring(str(mesh.detail_svg(pp, dp, tp, gpn, [0, 1])))
    tips = [e.text for e in doc.iter(f"{SVG}title")][1:]  # first title labels the chart
    assert len(tips) == 2 * gpn
    for tip in tips:
        rank, p, d, t = map(int, re.match(r"rank (\d+): pp (\d+), dp (\d+), tp (\d+)", tip).groups())
        assert mesh.rank_coords(rank, pp, dp, tp) == (p, d, t)
    overview = ET.fromstring(str(mesh.overview_svg(pp, dp, tp, gpn, nodes=8)))
    assert len([g for g in overview.iter(f"{SVG}g") if g.get("class") == "node"]) == 8


def test_axis_rows_name_the_link_tier_each_group_uses():
    rows = {r["axis"]: r for r in mesh.axis_rows(pp=16, dp=8, tp=8, gpus_per_node=8)}
    assert rows["tp"]["tier"] == "intra_node" and rows["tp"]["nodes_spanned"] == 1
    assert rows["dp"]["tier"] == "inter_node" and rows["dp"]["example"] == [0, 8, 16, 24, 32, 40, 48, 56]
    assert rows["pp"]["stride"] == 64 and rows["pp"]["nodes_spanned"] == 16
    wide = {r["axis"]: r for r in mesh.axis_rows(pp=1, dp=1, tp=16, gpus_per_node=8)}
    assert wide["tp"]["tier"] == "inter_node" and wide["tp"]["nodes_spanned"] == 2


def test_gantt_draws_every_drawn_micro_batch_on_every_rank():
    plan = make_small_plan(num_micro_batches=4)
    tree = parse(render_html(plan))
    g = svgs(tree, "gantt")[0]
    ops = [r for r in g.iter(f"{SVG}rect") if "op" in r.get("class", "").split()]
    assert len(ops) == 2 * plan.mesh.pp * plan.num_micro_batches
    # lanes show through between boxes: the bubble is drawn, not hidden
    assert len([r for r in g.iter(f"{SVG}rect") if r.get("class") == "lane"]) == plan.mesh.pp


def test_memory_bars_stack_the_plans_breakdown():
    plan = make_plan()
    tree = parse(render_html(plan))
    chart = svgs(tree, "memory")[0]
    bars = [r for r in chart.iter(f"{SVG}rect") if "mem" in r.get("class", "").split()]
    assert len(bars) == 5 * plan.mesh.pp
    # bar widths are proportional to bytes: params/optimizer ratio survives the drawing
    rank0 = bars[:5]
    ratio = float(rank0[0].get("width")) / float(rank0[2].get("width"))
    b = plan.predicted.memory_breakdown[0]
    assert ratio == pytest.approx(b["params"] / b["optimizer"], rel=0.02)
    caps = [l for l in chart.iter(f"{SVG}line") if l.get("class") == "capacity"]
    assert len(caps) == plan.mesh.pp + 1  # one per bar + the legend


def test_comm_rows_group_by_axis_and_tier():
    plan = make_plan()
    rows = tables.comm_rows(plan)
    assert [(r["axis"], r["tier"]) for r in rows] == [("tp", "intra node"), ("dp", "inter node"), ("pp", "inter node")]
    dp = rows[1]
    assert dp["collectives"] == "reduce-scatter, all-gather"
    assert dp["bytes"] == fmt.bytes_(sum(c["bytes"] for c in plan.predicted.comm if c["axis"] == "dp"))


def test_hand_checks_reproduce_the_plans_headline_numbers():
    from autopar.report.context import hand_checks

    plan = make_plan()
    checks = {h["what"]: h for h in hand_checks(plan)}
    assert checks["tokens/s"]["value"] == checks["tokens/s"]["plan"]
    assert checks["MFU"]["value"] == checks["MFU"]["plan"]
    assert checks["step time"]["value"] == checks["step time"]["plan"]


def test_plan_with_empty_predictions_still_renders():
    plan = Plan(model={"name": "empty"}, cluster={"nodes": 1, "gpus_per_node": 8, "device": "h100-sxm"})
    tree = parse(render_html(plan))
    assert "no time breakdown" in all_text(tree)


def test_tp_groups_are_bracketed_per_node_and_marked_when_they_span_nodes():
    def labels(*args):
        doc = ET.fromstring(str(mesh.detail_svg(*args)))
        return [t.text for t in doc.iter(f"{SVG}text") if "tp group" in (t.text or "")]

    assert labels(2, 2, 2, 8, [0]) == ["tp group (2 GPUs)"] * 4
    assert labels(1, 1, 16, 8, [0, 1]) == ["part of a 16-GPU tp group"] * 2
    assert labels(1, 8, 1, 8, [0]) == []  # no tensor parallelism: nothing to bracket


def test_models_without_a_sequence_report_samples_per_second():
    from autopar.report.context import hand_checks

    plan = make_small_plan(name="vit", seq_len=None)
    text = all_text(parse(render_html(plan)))
    assert plan.predicted.tokens_per_s is None and fmt.si(plan.predicted.samples_per_s, "samples/s") in text
    assert "tok/s" not in text
    check = {h["what"]: h for h in hand_checks(plan)}["samples/s"]
    assert check["value"] == check["plan"]


def test_links_table_shows_the_named_link_profiles_and_skips_unknown_names():
    from autopar.report.context import link_rows
    from cost_models.hardware import get_link

    plan = make_small_plan()
    plan.cluster.update(intra_node_link="nvlink4", inter_node_link="no-such-link")
    rows = link_rows(plan)
    assert [r["name"] for r in rows] == ["nvlink4"]
    assert rows[0]["bandwidth"] == f"{get_link('nvlink4').to_dict()['bandwidth_gbs']:g} GB/s"
    assert "nvlink4" in all_text(parse(render_html(plan)))


def test_timeline_uses_the_simulated_stage_times_and_draws_a_few_rounds():
    from autopar.report import timeline

    plan = make_plan()  # pp 16, 192 micro-batches
    for st in plan.stages:  # what cost_models.estimate fed its simulator
        st.predicted["sim_fwd_s"] = 2 * st.predicted["fwd_s"]
        st.predicted["sim_bwd_s"] = 3 * st.predicted["bwd_s"]
    events, drawn = timeline.schedule_events(plan)
    assert drawn == 2 * plan.mesh.pp < plan.num_micro_batches
    assert len(events) == 2 * plan.mesh.pp * drawn
    first = plan.stages[0].predicted
    e = next(e for e in events if e.stage == 0 and e.phase == "fwd")
    assert e.end_s - e.start_s == pytest.approx(first["sim_fwd_s"])
    e = next(e for e in events if e.stage == 0 and e.phase == "bwd")
    assert e.end_s - e.start_s == pytest.approx(first["sim_bwd_s"])
    # every micro-batch's backward on a stage starts after its forward there
    done = {(e.stage, e.micro_batch, e.phase): e for e in events}
    assert all(done[(s, m, "bwd")].start_s >= done[(s, m, "fwd")].end_s for (s, m, ph) in done if ph == "fwd")


def test_interleaved_timeline_draws_a_multiple_of_pp():
    from autopar.report import timeline

    plan = make_plan(name="interleaved", nodes=8, pp=4, dp=2, tp=8, schedule="interleaved", virtual_stages=2,
                     num_micro_batches=64, num_blocks=30)
    events, drawn = timeline.schedule_events(plan)
    assert drawn % plan.mesh.pp == 0 and drawn < 64
    assert {e.stage for e in events} == set(range(8))
    assert len(events) == 2 * 8 * drawn
