"""The device mesh drawn over the cluster's nodes.

Rank order is the DeviceMesh's row-major order over axes (pp, dp, tp), the
order lowering builds its mesh in (docs/INTERFACES.md section 5):

    rank = (pp_index * dp + dp_index) * tp + tp_index,   node = rank // gpus_per_node

so tp is innermost (a tp group is `tp` consecutive ranks, inside one node
when tp <= gpus_per_node: NVLink), dp groups stride by tp, and pp neighbours
are dp*tp ranks apart (usually other nodes). The drawing has two parts: an
overview with one square per node coloured by the pp rank(s) it hosts (the
whole pattern, legible at 1,024 or 16,384 GPUs), and a detail of the first
nodes of pp rank 0 with one cell per GPU labelled with its dp and tp index.
"""
from __future__ import annotations

from markupsafe import Markup

from autopar.report import svg
from autopar.report.palette import stage_color

OVERVIEW_COLUMNS = 32
DETAIL_MAX_NODES = 4


def rank_coords(rank: int, pp: int, dp: int, tp: int) -> tuple[int, int, int]:
    """(pp_index, dp_index, tp_index) of a global rank."""
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def axis_rows(pp: int, dp: int, tp: int, gpus_per_node: int, dp_shard: int | None = None) -> list[dict]:
    """One row per mesh axis: size, rank stride, nodes one group spans, link tier;
    under HSDP (`dp_shard`) also the dp axis's two groups: dp_shard (neighbouring
    tp slabs, where the states are sharded) and dp_replicate (striding over them).

    Pure topology (which ranks talk to which), not a prediction: it lets the
    reader check the comm table's tiers against the drawing.
    """
    rows = []
    axes = [("tp", tp, 1), ("dp", dp, tp)]
    if dp_shard:
        axes += [("dp_shard", dp_shard, tp), ("dp_replicate", dp // dp_shard, tp * dp_shard)]
    for axis, size, stride in axes + [("pp", pp, dp * tp)]:
        members = [k * stride for k in range(size)]  # group of rank 0
        nodes = sorted({r // gpus_per_node for r in members})
        rows.append({
            "axis": axis,
            "size": size,
            "stride": stride,
            "example": members,
            "nodes_spanned": len(nodes),
            "tier": "intra_node" if len(nodes) == 1 else "inter_node",
        })
    return rows


def _node_pp_ranks(node: int, gpus_per_node: int, pp: int, dp: int, tp: int) -> list[int]:
    per_pp = dp * tp
    first, last = node * gpus_per_node, (node + 1) * gpus_per_node - 1
    return list(range(first // per_pp, min(last // per_pp, pp - 1) + 1))


def overview_svg(pp: int, dp: int, tp: int, gpus_per_node: int, nodes: int) -> Markup:
    """One square per node, filled by the pp rank(s) of its GPUs."""
    cols = min(OVERVIEW_COLUMNS, nodes)
    rows = -(-nodes // cols)
    cell, gap, left, top = 22, 3, 44, 8
    legend_cols = min(pp, 16)
    width = max(left + cols * (cell + gap) + 8, left + legend_cols * 52 + 8)
    legend_top = top + rows * (cell + gap) + 14
    legend_rows = -(-pp // legend_cols)
    height = legend_top + legend_rows * 18 + 6
    parts = []
    for r in range(rows):
        parts.append(svg.text(left - 6, top + r * (cell + gap) + cell * 0.7, f"{r * cols}", class_="axis-label", text_anchor="end"))
    for n in range(nodes):
        x = left + (n % cols) * (cell + gap)
        y = top + (n // cols) * (cell + gap)
        ranks = _node_pp_ranks(n, gpus_per_node, pp, dp, tp)
        slice_w = cell / len(ranks)
        tip = (f"node {n}: GPUs {n * gpus_per_node}-{(n + 1) * gpus_per_node - 1}, "
               f"pp rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
        body = [svg.title(tip)]
        for k, p in enumerate(ranks):
            body.append(svg.rect(x + k * slice_w, y, slice_w, cell, fill=stage_color(p, pp)))
        body.append(svg.rect(x, y, cell, cell, class_="node-outline"))
        parts.append(svg.group(body, class_="node"))
    for p in range(pp):
        x = left + (p % legend_cols) * 52
        y = legend_top + (p // legend_cols) * 18
        parts.append(svg.rect(x, y - 10, 12, 12, fill=stage_color(p, pp), class_="swatch"))
        parts.append(svg.text(x + 16, y, f"pp {p}", class_="legend"))
    return svg.document(width, height, parts, class_="chart mesh-overview",
                        label=f"{nodes} nodes x {gpus_per_node} GPUs, coloured by pipeline rank")


def detail_nodes(pp: int, dp: int, tp: int, gpus_per_node: int, nodes: int) -> list[int]:
    """The nodes drawn GPU by GPU: all of a small cluster, else the first of pp rank 0."""
    if nodes <= DETAIL_MAX_NODES:
        return list(range(nodes))
    per_pp_nodes = max(1, -(-(dp * tp) // gpus_per_node))
    return list(range(min(per_pp_nodes, DETAIL_MAX_NODES, nodes)))


def detail_svg(pp: int, dp: int, tp: int, gpus_per_node: int, node_ids: list[int]) -> Markup:
    """One row per node, one cell per GPU: rank, dp index, tp index; tp groups bracketed."""
    cell_w, cell_h, gap, left, top = 88, 46, 4, 70, 10
    row_h = cell_h + 26
    width = left + gpus_per_node * (cell_w + gap) + 10
    height = top + len(node_ids) * row_h + 4
    parts = []
    for row, n in enumerate(node_ids):
        y = top + row * row_h
        parts.append(svg.text(left - 8, y + cell_h * 0.6, f"node {n}", class_="axis-label", text_anchor="end"))
        for g in range(gpus_per_node):
            rank = n * gpus_per_node + g
            if rank >= pp * dp * tp:
                break
            p, d, t = rank_coords(rank, pp, dp, tp)
            x = left + g * (cell_w + gap)
            cell = [
                svg.title(f"rank {rank}: pp {p}, dp {d}, tp {t}"),
                svg.rect(x, y, cell_w, cell_h, rx=4, fill=stage_color(p, pp), class_="gpu"),
                svg.text(x + cell_w / 2, y + 17, f"rank {rank}", class_="gpu-rank", text_anchor="middle"),
                svg.text(x + cell_w / 2, y + 34, f"pp{p} dp{d} tp{t}", class_="gpu-coord", text_anchor="middle"),
            ]
            parts.append(svg.group(cell, class_="gpu-cell"))
        # Bracket each tp group's GPUs on this node (tp is innermost, so a group is a
        # run of consecutive ranks; with tp > gpus_per_node it continues on the next node).
        if tp > 1:
            g = 0
            while g < gpus_per_node and n * gpus_per_node + g < pp * dp * tp:
                group = (n * gpus_per_node + g) // tp
                end = g
                while end < gpus_per_node and (n * gpus_per_node + end) // tp == group:
                    end += 1
                x0 = left + g * (cell_w + gap)
                x1 = left + end * (cell_w + gap) - gap
                yb = y + cell_h + 6
                label = f"tp group ({tp} GPUs)" if end - g == tp else f"part of a {tp}-GPU tp group"
                parts.append(svg.line(x0, yb, x1, yb, class_="tp-bracket"))
                parts.append(svg.text((x0 + x1) / 2, yb + 13, label, class_="bracket-label", text_anchor="middle"))
                g = end
    return svg.document(width, height, parts, class_="chart mesh-detail",
                        label="GPUs of the first nodes with their mesh coordinates")
