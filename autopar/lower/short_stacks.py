"""Ask the lowering's questions of a model whose block stacks are cut to two blocks.

`what_runs.limits` runs the model's forward three times on fake tensors (the
blocks' recorded inputs and dataflow, the weights the root reads, two chained
pipeline stages), each through every block: 96 blocks of GPT-3 175B cost about
3 s of a 20 s `autopar plan`, to learn what one block already says. When every
block of a stack is the same computation (capture's `static_signature`: same
classes, parameter shapes and plain config attributes, the block's own index
aside), two of them answer every question the checks ask of a stack:
a block's split, its inputs and outputs, and a pipeline cut between blocks.

Only a clean answer is kept. A stack the model walks by count (`for i in
range(config.n_layer): self.h[i]`) fails on the short stack, and anything
refused there is asked again of the whole model (`what_runs.limits`): a
shortened model never refuses a layout the whole one runs, and never offers
one whose blocks differ from the two it ran.
"""
from __future__ import annotations

import contextlib
import copy

import torch.nn as nn

from autopar.capture.module_tree import static_signature

KEEP = 2  # blocks kept per stack: two pipeline stages need two blocks
_MIN_BLOCKS = 4  # shorter stacks gain too little to be worth a second answer


def _cuttable(model: nn.Module, stack: str) -> bool:
    container = model.get_submodule(stack)
    blocks = list(container._modules.values())
    return (isinstance(container, (nn.ModuleList, nn.Sequential)) and len(blocks) >= _MIN_BLOCKS
            and len({static_signature(b) for b in blocks}) == 1)


@contextlib.contextmanager
def short_stacks(model: nn.Module, graph, stacks: list[str]):
    """Within: the stacks of identical blocks among `stacks` hold their first KEEP
    blocks, and the graph handed out (a shallow copy) names only the layers left.
    Yields None (nothing cut) when no stack qualifies. The model is restored on exit."""
    cut = {s: model.get_submodule(s) for s in stacks if _cuttable(model, s)}
    if not cut:
        yield None
        return
    saved = {s: c._modules for s, c in cut.items()}
    dropped = {f"{s}.{k}" for s, mods in saved.items() for k in list(mods)[KEEP:]}
    short = copy.copy(graph)
    short.layers = [l for l in graph.layers
                    if not any(p == d or p.startswith(d + ".") for p in (l.module_paths or [l.name]) for d in dropped)]
    try:
        for s, c in cut.items():
            c._modules = dict(list(saved[s].items())[:KEEP])
        yield short
    finally:
        for s, c in cut.items():
            c._modules = saved[s]


def clean(answer: dict) -> bool:
    """An answer the short model may give for the whole one: checked, nothing refused or undecided."""
    return bool(answer.get("checked")) and answer.get("pipeline") is None and not answer.get("unverified") \
        and not any(answer.get("tp", {}).values()) and not any(answer.get("sequence_parallel", {}).values())
