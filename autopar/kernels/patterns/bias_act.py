"""Linear(bias) -> gelu / silu: the bias add and the activation in one kernel after the GEMM.

Found, not rewritten: autopar's own kernel for it lost to eager and to torch.compile and
was deleted (autopar/kernels/swiglu.py); the chain is still found because another engine
runs it fused (Megatron-LM's --bias-gelu-fusion), which `autopar plan --engine` prices."""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from autopar.kernels.fx_ops import GELU, SILU, is_fn, module_of, only_user


def _activation(n: fx.Node, modules: dict):
    """(pattern, kernel activation) of an activation node, or None."""
    act_mod = module_of(n, modules)
    if is_fn(n, GELU, "gelu") or isinstance(act_mod, nn.GELU):
        approx = act_mod.approximate if act_mod is not None else n.kwargs.get("approximate", "none")
        return "bias_gelu", ("gelu_tanh" if approx == "tanh" else "gelu")
    if (is_fn(n, SILU, "silu") or isinstance(act_mod, nn.SiLU)) and not n.kwargs.get("inplace"):
        return "bias_silu", "silu"
    return None


def match(nodes: list, modules: dict, used: set) -> list[dict]:
    found = []
    for n in nodes:
        kind = None if n in used else _activation(n, modules)
        if kind is None or len(n.args) != 1:
            continue
        pattern, act = kind
        src = n.args[0]
        lin = module_of(src, modules) if isinstance(src, fx.Node) else None
        if type(lin) is not nn.Linear or lin.bias is None:
            continue
        if not only_user(src, n) or src in used:
            continue
        found.append(dict(pattern=pattern, anchor=src.target, nodes=[src, n], ops=[src.target, act],
                          width=lin.out_features, params={"act": act}, modules=[src.target]))
        used.update([src, n])
    return found
