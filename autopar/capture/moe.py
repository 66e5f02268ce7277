"""What expert parallelism needs to know of an MoE layer, read off its forward dataflow.

The layer's routing is its last top-k (DeepSeek-V3's group-limited routing runs
top-k on group scores first); from it, over the forward records' producers:

* the **router**: the nearest parameter GEMM upstream of the top-k (its
  logits' GEMM; GPT-OSS's bias rides in the same addmm). Its input width is
  the hidden size the all-to-alls move.
* the **experts**: ops with parameters downstream of the top-k (the routed
  tokens reach them through the indices: `hidden[token_idx]`, a sort by
  expert id, a grouped GEMM's offsets), inside the module that holds the
  expert GEMMs. Weights kept as one tensor over the experts (transformers
  5.x's `gate_up_proj` (experts, 2 x ffn, hidden), DBRX's (experts x ffn,
  hidden)) are the `fused` form; one module per expert (an nn.ModuleList) is
  `module_list`, and every expert of the list counts even when capture ran
  one (a loop over the experts hit runs expert 0 for each on meta).
* **shared experts**: parameter GEMMs neither upstream nor downstream of the
  top-k (DeepSeek-V3's `shared_experts`, Qwen2-MoE's `shared_expert` and its
  gate): dense, on every token.

The tokens routed (`tokens x top_k`: the rows each all-to-all moves, each
`hidden` wide) and the experts' FLOPs scale with batch and sequence: capture
fits them in B and S (LayerSpec.ep_routed_tokens, ep_expert_fwd_flops,
ep_expert_bwd_flops); the rest are attrs.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

_INDEX = re.compile(r"\.\d+(?=\.|$)")


@dataclass(frozen=True)
class MoeFacts:
    experts: int
    top_k: int
    hidden: int
    routed_tokens: int  # tokens x top_k: rows of one all-to-all
    expert_param_bytes: int
    dense_param_bytes: int  # every other parameter of the layer (router, shared experts, attention...)
    shared_expert_param_bytes: int
    router_param_bytes: int
    experts_form: str  # "fused" | "module_list"
    expert_fwd_flops: int = 0  # the experts' ops (below the top-k, in the experts' module)
    expert_bwd_flops: int = 0

    def attrs(self) -> dict:
        return {"moe_hidden": self.hidden, "expert_param_bytes": self.expert_param_bytes,
                "dense_param_bytes": self.dense_param_bytes, "shared_experts": bool(self.shared_expert_param_bytes),
                "shared_expert_param_bytes": self.shared_expert_param_bytes,
                "router_param_bytes": self.router_param_bytes, "experts_form": self.experts_form}


def _weights(fwd: list) -> dict:
    """The parameters each op computes with: its own, and those of its inputs made
    from parameters alone (DeepSeek-V3's router casts its weight to fp32 first)."""
    made, weights = set(), {}
    for r in fwd:
        names = set(r.param_names).union(*(weights.get(i, ()) for i in r.inputs if i in made))
        if names:
            weights[r.idx] = names
        # made from parameters alone: every traced input is, every untraced one is a parameter
        if names and all(i in made for i in r.inputs) and r.in_producers.count(-1) <= len(r.param_names):
            made.add(r.idx)
    return weights


def _upstream(records: dict, start) -> set:
    seen, todo = set(), [start]
    while todo:
        r = records.get(todo.pop())
        if r is None or r.idx in seen:
            continue
        seen.add(r.idx)
        todo.extend(r.inputs)
    return seen


def _downstream(fwd: list, start: int) -> set:
    below = {start}
    for r in fwd:
        if r.idx > start and any(i in below for i in r.inputs):
            below.add(r.idx)
    return below


def _common_module(paths: list) -> str:
    """The innermost module holding all of `paths` (commonprefix compares lists item by item)."""
    return ".".join(os.path.commonprefix([p.split(".") for p in paths]))


def _relative(name: str, prefix: str) -> str:
    return name[len(prefix) + 1:] if prefix else name


def _expert_names(used: set, block_params: dict, prefix: str) -> tuple[set, str]:
    """Every parameter of the experts: those the ops used, and the same parameter of
    every other entry of a ModuleList (`experts.3.w1.weight` for `experts.0.w1.weight`);
    and the form: an index in the name inside the layer is a ModuleList entry."""
    patterns = {_INDEX.sub(".*", _relative(n, prefix)) for n in used}
    names = {n for n in block_params if _INDEX.sub(".*", _relative(n, prefix)) in patterns}
    listed = any(_INDEX.search(_relative(n, prefix)) for n in used)
    return names, "module_list" if listed else "fused"


def moe_facts(trace, layer: int, fwd: list, bwd: list, prefix: str) -> MoeFacts | None:
    """The MoE facts of one layer, or None when it routes nothing (no top-k)."""
    routing = trace.topk.get(layer)
    topks = [r for r in fwd if r.op == "aten.topk"]
    if not routing or not topks:
        return None
    experts, k, tokens = routing
    records = {r.idx: r for r in fwd}
    top = topks[-1]
    above = _upstream(records, top.idx)
    below = _downstream(fwd, top.idx)
    weights = _weights(fwd)
    router = max((records[i] for i in above if records[i].kind == "gemm" and i in weights),
                 key=lambda r: r.idx, default=None)
    if router is None:
        return None  # a top-k of something else (a sampler, a sparse attention), not a learned router
    routed = [r for r in fwd if r.idx in below and r.idx in weights]
    gemms = [r.module for r in routed if r.kind == "gemm"]
    if not gemms:
        return None
    home = _common_module(gemms)
    inside = {r.idx for r in fwd if r.idx in below and (r.module == home or r.module.startswith(home + "."))}
    used = {n for r in routed if r.module == home or r.module.startswith(home + ".") for n in weights[r.idx]}
    block_params = {n: b for n, b in trace.param_bytes.items() if not prefix or n.startswith(prefix + ".")}
    names, form = _expert_names(used, block_params, prefix)
    shared = {n for r in fwd if r.kind == "gemm" and r.idx in weights and r.idx not in above and r.idx not in below
              for n in weights[r.idx]}
    expert_bytes = sum(block_params.get(n, 0) for n in names)
    hidden = router.gemm[2] if router.gemm else 0
    return MoeFacts(experts=experts, top_k=k, hidden=hidden, routed_tokens=tokens * k,
                    expert_param_bytes=expert_bytes, dense_param_bytes=sum(block_params.values()) - expert_bytes,
                    shared_expert_param_bytes=sum(block_params.get(n, 0) for n in shared - names),
                    router_param_bytes=sum(block_params.get(n, 0) for n in weights[router.idx]),
                    experts_form=form, expert_fwd_flops=sum(records[i].flops for i in inside),
                    expert_bwd_flops=sum(r.flops for r in bwd if r.fwd_ref in inside))
