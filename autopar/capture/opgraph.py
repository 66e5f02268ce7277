"""The forward op graph (networkx) of one traced point.

Nodes are aten ops (plus one `input` node); an edge means "produces a tensor
that is consumed by". Blocks that were not run (same signature as an earlier
block) get copies of their representative's nodes under their own module
path, wired to the previous layer's last op, so the graph has every layer.
"""
from __future__ import annotations

import networkx as nx


def build_op_graph(trace, layer_index: list, prefixes: dict) -> nx.DiGraph:
    """layer_index: (tracer layer index, layer name) of each kept layer, in order."""
    g = nx.DiGraph()
    g.add_node("input", op="input", kind="input", module="", layer="", in_shapes=(), in_dtypes=(),
               out_shapes=(), out_dtypes=(), flops=0, bytes_read=0, bytes_written=0, bytes=0)
    by_layer = {}
    for r in trace.records:
        if r.phase == "fwd":
            by_layer.setdefault(r.layer, []).append(r)
    layer_names = dict(layer_index)
    node_of = {-1: "input"}
    last = "input"
    for index in sorted(layer_names):
        name = layer_names[index]
        rep = trace.rep_of.get(index, index)
        records = by_layer.get(rep, [])
        src_prefix, dst_prefix = prefixes.get(rep, ""), prefixes.get(index, "")
        local = {}
        for k, r in enumerate(records):
            node = f"{name}/{k}"
            module = r.module
            if rep != index and src_prefix and module.startswith(src_prefix):
                module = dst_prefix + module[len(src_prefix):]
            g.add_node(node, op=r.op, kind=r.kind, module=module, layer=name, in_shapes=r.in_shapes,
                       in_dtypes=r.in_dtypes, out_shapes=r.out_shapes, out_dtypes=r.out_dtypes, flops=r.flops,
                       bytes_read=r.bytes_read, bytes_written=r.bytes_written, bytes=r.nbytes)
            local[r.idx] = node
            for i in r.inputs:
                if i in local:
                    g.add_edge(local[i], node)
                elif rep == index and i in node_of:
                    g.add_edge(node_of[i], node)
                elif i == -1:
                    g.add_edge("input", node)
                else:  # input from the previous layer (copied block): its last op
                    g.add_edge(last, node)
        if rep == index:
            node_of.update(local)
        if records:
            last = f"{name}/{len(records) - 1}"
    return g
