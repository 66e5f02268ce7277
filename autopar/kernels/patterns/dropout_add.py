"""Dropout(x) + y (the residual after a sub-layer), as one kernel."""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from autopar.kernels import fused_modules as fm
from autopar.kernels.fx_ops import ADD, is_fn, module_of, only_user, other_arg


def match(nodes: list, modules: dict, used: set) -> list[dict]:
    found = []
    for n in nodes:
        if n in used or not is_fn(n, ADD, "add") or len(n.args) != 2 or n.kwargs:
            continue
        for d in n.args:
            dm = module_of(d, modules) if isinstance(d, fx.Node) else None
            if (isinstance(dm, nn.Dropout) and d not in used and only_user(d, n)
                    and isinstance(other_arg(n, d), fx.Node) and not dm.inplace):
                src = module_of(d.args[0], modules) if isinstance(d.args[0], fx.Node) else None
                width = src.out_features if isinstance(src, nn.Linear) else None
                found.append(dict(pattern="dropout_add", anchor=None, nodes=[d, n], ops=[d.target, "add"],
                                  width=width, params={"p": dm.p}, modules=[d.target]))
                used.update([d, n])
                break
    return found


def rewrite(graph: fx.Graph, modules: dict, match: dict, block=None) -> None:
    drop, add = match["nodes"]
    fm.swap_class(modules[drop.target], "dropout_add")
    with graph.inserting_before(add):
        fused = graph.call_module(drop.target, (drop.args[0], other_arg(add, drop)))
    add.replace_all_uses_with(fused)
    graph.erase_node(add)
    graph.erase_node(drop)
