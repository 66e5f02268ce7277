"""The fusion patterns, one module each: `match(nodes, modules, used)` finds the
chains in a traced graph (nodes already in a chain, `used`, are skipped and
the new ones added), `rewrite(graph, modules, match, block)` swaps one chain
for its fused kernel. `IN_ORDER` is the matching order: add + norm before
dropout + add, so a node belongs to at most one chain."""
from __future__ import annotations

from autopar.kernels.patterns import add_norm, bias_act, dropout_add, scaled_softmax, swiglu

IN_ORDER = (add_norm, swiglu, bias_act, scaled_softmax, dropout_add)
BY_PATTERN = {"add_layernorm": add_norm, "add_rmsnorm": add_norm, "swiglu": swiglu, "bias_gelu": bias_act,
              "bias_silu": bias_act, "scaled_softmax": scaled_softmax, "dropout_add": dropout_add}
