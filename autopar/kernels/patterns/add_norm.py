"""Residual add -> LayerNorm / RMSNorm, as one kernel returning (normed, sum)."""
from __future__ import annotations

import operator

import torch.fx as fx
import torch.nn as nn

from autopar.kernels import fused_modules as fm
from autopar.kernels.fx_ops import ADD, is_fn, is_norm, module_of, rmsnorm_probe


def match(nodes: list, modules: dict, used: set) -> list[dict]:
    found = []
    for n in nodes:
        m = module_of(n, modules)
        if m is None or not is_norm(m) or len(n.args) != 1 or n.kwargs:
            continue
        a = n.args[0]
        if not (isinstance(a, fx.Node) and is_fn(a, ADD, "add") and len(a.args) == 2 and not a.kwargs
                and all(isinstance(v, fx.Node) for v in a.args)):
            continue
        if isinstance(m, nn.LayerNorm):
            if len(m.normalized_shape) != 1:
                continue
            pattern, width, params = "add_layernorm", m.normalized_shape[0], {"eps": m.eps}
        else:
            if not rmsnorm_probe(m):
                continue
            pattern, width, params = "add_rmsnorm", m.weight.shape[0], {"eps": fm.norm_eps(m)}
        found.append(dict(pattern=pattern, anchor=n.target, nodes=[a, n], ops=["add", n.target], width=width,
                          params=params, modules=[n.target]))
        used.update([a, n])
    return found


def rewrite(graph: fx.Graph, modules: dict, match: dict, block=None) -> None:
    add, norm = match["nodes"]
    fm.swap_class(modules[norm.target], match["pattern"])
    with graph.inserting_after(norm):
        # residual as a keyword: hooks that prepare a module's inputs (TP's
        # SequenceParallel) rewrite the positional ones and drop the rest
        fused = graph.call_module(norm.target, (add.args[0],), {"residual": add.args[1]})
    with graph.inserting_after(fused):
        out = graph.call_function(operator.getitem, (fused, 0))
    with graph.inserting_after(out):
        h = graph.call_function(operator.getitem, (fused, 1))
    norm.replace_all_uses_with(out)
    add.replace_all_uses_with(h)
    graph.erase_node(norm)
    graph.erase_node(add)
