"""silu(a) * b (SwiGLU's gate), as one kernel."""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from autopar.kernels import fused_modules as fm
from autopar.kernels.fx_ops import MUL, SILU, is_fn, module_of, only_user, other_arg


def match(nodes: list, modules: dict, used: set) -> list[dict]:
    found = []
    for n in nodes:
        if n in used or not is_fn(n, MUL, "mul") or len(n.args) != 2 or n.kwargs:
            continue
        for s in n.args:
            if (isinstance(s, fx.Node) and s not in used
                    and (is_fn(s, SILU, "silu") or isinstance(module_of(s, modules), nn.SiLU))
                    and only_user(s, n) and isinstance(other_arg(n, s), fx.Node) and not s.kwargs.get("inplace")):
                src = s.args[0]
                anchor = src.target if isinstance(src, fx.Node) and src.op == "call_module" else None
                lin = module_of(src, modules) if isinstance(src, fx.Node) else None
                width = lin.out_features if isinstance(lin, nn.Linear) else None
                found.append(dict(pattern="swiglu", anchor=anchor, nodes=[s, n], ops=["silu", "mul"], width=width,
                                  params={}, modules=[]))
                used.update([s, n])
                break
    return found


def rewrite(graph: fx.Graph, modules: dict, match: dict, block=None) -> None:
    silu, mul = match["nodes"]
    with graph.inserting_before(mul):
        fused = graph.call_function(fm.swiglu_fn, (silu.args[0], other_arg(mul, silu)))
    mul.replace_all_uses_with(fused)
    graph.erase_node(mul)
    graph.erase_node(silu)
