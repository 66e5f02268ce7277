"""What context parallelism (cp) needs to know about a layer, read off its forward ops.

cp cuts the sequence over ranks. Every position-local op (GEMMs, norms,
elementwise, the loss) then runs on the rank's tokens unchanged; only the ops
that mix positions need the other ranks' data. In a decoder that is the
attention core: torch's ring attention
(torch.distributed.tensor.experimental.context_parallel) keeps each rank's
query shard and passes the key/value shards around the ring, so what one ring
step moves is K and V of one shard: `cp_kv_elems_per_token` x batch x seq / cp
elements (cost_models/context_parallel.py prices it).

The facts for an attention layer (softmax over scores, or an SDPA kernel) and, for
any layer, `arange_positions`, set in the layer's attrs (constants: they do not change with B or S):
  arange_positions   (any layer) the forward numbers positions with torch.arange of
                     the length it is given: under cp each rank would count its own
                     tokens from 0 (transformers does, and autopar/lower/
                     context_parallel.py hands its position modules the global ones)
  attention          "sdpa" (a fused SDPA kernel, which torch's CP splits) or
                     "eager" (scores by matmul + softmax: nothing splits it)
  attn_mask          the SDPA kernel was given a mask tensor (padding, documents,
                     sliding window): torch's ring attention takes is_causal only
  position_mixing    the ops that mix positions (the attention kernels; for eager
                     attention the softmax over scores)
  cp_kv_elems_per_token  K + V elements per token as the attention kernel reads
                     them (heads x head_dim each; after any repeat_kv, since the
                     ring exchanges the tensors SDPA is given), summed over the
                     layer's attention calls
`causal` (is_causal of the kernel) is already in attrs (metrics._attrs).
autopar/lower/context_parallel.py refuses from these (`graph_refusal`).
"""
from __future__ import annotations

import math


def _scores_softmax(r) -> bool:
    """A softmax over attention scores: (b, heads, s_q, s_k) or (b x heads, s_q, s_k)."""
    return r.kind == "softmax" and bool(r.in_shapes) and len(r.in_shapes[0]) in (3, 4)


def cp_facts(fwd: list, has_attention: bool) -> dict:
    """The layer's facts; the attention ones only where capture found heads
    (metrics._attrs): a loss's softmax over (b, s, vocab) is no attention."""
    facts = {"arange_positions": True} if any(r.op == "aten.arange" for r in fwd) else {}
    if not has_attention:
        return facts
    kernels = [r for r in fwd if r.kind == "attention" and r.in_shapes and len(r.in_shapes[0]) == 4]
    if kernels:
        return {**facts,
            "attention": "sdpa",
            # q, k, v and nothing else, or a mask tensor beside them
            "attn_mask": any(len(r.in_shapes) > 3 for r in kernels),
            "position_mixing": sorted({r.op for r in kernels}),
            "cp_kv_elems_per_token": sum(math.prod(r.in_shapes[1][1:2] + r.in_shapes[1][3:])
                                         + math.prod(r.in_shapes[2][1:2] + r.in_shapes[2][3:])
                                         for r in kernels),
        }
    softmaxes = [r for r in fwd if _scores_softmax(r)]
    if softmaxes:
        return {**facts, "attention": "eager", "position_mixing": sorted({r.op for r in softmaxes})}
    return facts
