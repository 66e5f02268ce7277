"""scale (* c or / c) -> optional causal mask (masked_fill -inf) -> softmax(-1),
as one kernel; a mask the graph proves causal needs no per-call check."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.kernels import fused_modules as fm
from autopar.kernels.fx_ops import MUL, SOFTMAX, is_fn, only_user

_DIV = {operator.truediv, torch.div}


def _masked(n: fx.Node):
    """(mask, chain, scaled input) for softmax node n: through a masked_fill(-inf) if there is one."""
    src, mask, chain = n.args[0], None, [n]
    if isinstance(src, fx.Node) and is_fn(src, {torch.masked_fill}, "masked_fill") and only_user(src, n):
        fill = src.args[2] if len(src.args) > 2 else src.kwargs.get("value")
        if fill != float("-inf"):
            return None
        mask, chain, src = src.args[1], [src] + chain, src.args[0]
    return mask, chain, src


def match(nodes: list, modules: dict, used: set) -> list[dict]:
    found = []
    for n in nodes:
        if n in used or not is_fn(n, SOFTMAX, "softmax"):
            continue
        if n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None) != -1 or (masked := _masked(n)) is None:
            continue
        mask, chain, src = masked
        if not (isinstance(src, fx.Node) and only_user(src, chain[0]) and len(src.args) == 2
                and (is_fn(src, MUL, "mul") or is_fn(src, _DIV, "div"))):
            continue
        x, c = src.args
        if not (isinstance(x, fx.Node) and isinstance(c, (int, float))):
            continue
        scale = float(c) if not is_fn(src, _DIV, "div") else 1.0 / float(c)
        found.append(dict(pattern="scaled_softmax", anchor=None, nodes=[src] + chain,
                          ops=[s.name for s in [src] + chain], width=None,
                          params={"scale": scale, "masked": mask is not None}, modules=[], mask=mask))
        used.update([src] + chain)
    return found


def rewrite(graph: fx.Graph, modules: dict, match: dict, block=None) -> None:
    nodes = match["nodes"]
    scale_node, last = nodes[0], nodes[-1]
    x = scale_node.args[0]
    with graph.inserting_before(last):
        if match["params"]["masked"] and block is not None and _static_causal(match["mask"], block):
            fused = graph.call_function(fm.fused_causal_softmax, (x, match["params"]["scale"]))
        elif match["params"]["masked"]:
            fused = graph.call_function(fm.fused_masked_softmax, (x, match["mask"], match["params"]["scale"]))
        else:
            fused = graph.call_function(fm.fused_scaled_softmax, (x, match["params"]["scale"]))
    last.replace_all_uses_with(fused)
    for old in reversed(nodes):
        graph.erase_node(old)
    _erase_if_unused(match.get("mask"), graph)  # the mask computation, when proven and now unused


def _static_causal(mask: Any, block: nn.Module) -> bool:
    """True if `mask` is provably the causal mask from the graph alone: a
    buffer (optionally compared `== 0` / `logical_not`-ed), sliced to its
    top-left corner, whose square tail dims are upper-triangular above the
    diagonal. Then the fused softmax needs no per-call check of the mask."""
    if not isinstance(mask, fx.Node):
        return False
    negate = False
    node = mask
    if is_fn(node, {operator.eq, torch.eq}, "eq") and len(node.args) == 2 and node.args[1] == 0:
        negate, node = True, node.args[0]
    elif is_fn(node, {torch.logical_not, operator.invert}, "logical_not"):
        negate, node = True, node.args[0]
    if is_fn(node, {operator.getitem}) and isinstance(node.args[1], tuple):
        idx = node.args[1]
        if not all(isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) for i in idx):
            return False
        node = node.args[0]
    if node.op != "get_attr":
        return False
    try:
        buf = block.get_buffer(node.target)
    except AttributeError:
        return False
    if buf.is_meta or buf.dim() < 2 or buf.shape[-1] != buf.shape[-2] or any(d != 1 for d in buf.shape[:-2]):
        return False
    m = buf.reshape(buf.shape[-2:])
    m = (m == 0) if negate else m
    if m.dtype != torch.bool:
        return False
    n = m.shape[-1]
    return bool(torch.equal(m.cpu(), torch.ones(n, n, dtype=torch.bool).triu(1)))


def _erase_if_unused(node: Any, graph: fx.Graph) -> None:
    # Only the chain that built the mask, and only nodes nobody else reads:
    # a general dead-code pass could drop in-place ops of the user's code.
    while isinstance(node, fx.Node) and not node.users and node.op in ("call_function", "call_method", "get_attr"):
        parent = node.args[0] if node.args else None
        graph.erase_node(node)
        node = parent
