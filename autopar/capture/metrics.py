"""Numbers for one layer at one (batch, seq) point, read off a PointTrace.

Tensor-parallel facts (which ops tp divides, the row GEMMs' all-reduces, the
activations gathered where a model cuts a sharded dim) come from the forward
dataflow: see tp_dataflow.py.
"""
from __future__ import annotations

import bisect
import itertools
import math
import re
from dataclasses import dataclass, field

import torch

from autopar.capture.cp_facts import cp_facts
from autopar.capture.moe import moe_facts
from autopar.capture.tp_dataflow import tp_flow
from autopar.capture.tracer import PointTrace
from autopar.checkpoint_policy import SAVED_OP_NAMES



@dataclass
class LayerMetrics:
    fwd_flops: int = 0
    bwd_flops: int = 0
    activation_bytes: int = 0
    activation_bytes_tp_sharded: int = 0
    # Keyed by (module, op, occurrence) so the same tensor/op lines up across points.
    saved_entries: dict = field(default_factory=dict)  # key -> (nbytes, shape) per deduped storage
    fwd_op_flops: dict = field(default_factory=dict)  # key -> forward FLOPs
    # Under the selective-checkpoint policy (autopar/checkpoint_policy.py): saved
    # bytes whose storage another op of this layer wrote (they are recomputed),
    # and the forward FLOPs of those recomputed ops.
    policy_dropped_bytes: int = 0
    policy_dropped_tp_sharded: int = 0  # the part of policy_dropped_bytes tp divides
    saved_tp_sharded: set = field(default_factory=set)  # saved_entries keys tp divides
    # Saved bytes downstream of a tp gather: whole on every tp rank, even with sequence parallelism.
    activation_bytes_tp_gathered: int = 0
    policy_dropped_tp_gathered: int = 0
    saved_tp_gathered: set = field(default_factory=set)
    policy_recompute_flops: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    ops: dict = field(default_factory=dict)  # key -> dict of op numbers
    tp_allreduces: int = 0
    tp_gather_bytes: int = 0  # activations all-gathered because a sharded dim is cut (tp_dataflow.py)
    ep_routed_tokens: int = 0  # MoE: tokens x top_k, the rows each ep all-to-all moves (moe.py)
    ep_expert_fwd_flops: int = 0  # MoE: the experts' share of fwd_flops / bwd_flops
    ep_expert_bwd_flops: int = 0
    attrs: dict = field(default_factory=dict)
    has_attention: bool = False
    has_conv: bool = False
    has_embedding: bool = False
    has_weight_gemm: bool = False
    has_norm: bool = False
    col_widths: list = field(default_factory=list)
    # HBM bytes (forward, backward) an engine that runs each chain of memory-bound ops in a
    # module as one kernel saves, by the chain's first op key (module_fusion_savings)
    module_fusion_chains: dict = field(default_factory=dict)
    # The same with a chain spanning the whole layer, as inductor fuses a compiled block
    # (`torch.compile` of the block: one graph, its memory-bound ops fused between GEMMs)
    layer_fusion_chains: dict = field(default_factory=dict)


def _normalise(path: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


def _relative(path: str, prefix: str) -> str:
    if prefix and (path == prefix or path.startswith(prefix + ".")):
        return path[len(prefix) + 1:] or "."
    return path or "."


def tp_states(fwd: list, is_head: bool):
    """Per forward record: sharded (bool); and the row GEMMs and column GEMMs (see tp_dataflow.py)."""
    flow = tp_flow(fwd, is_head)
    return flow.sharded, flow.cols, flow.rows, flow.valid, flow.state


# Ops a kernel-fusing engine merges into one kernel per module: the memory-bound kinds
_FUSABLE_KINDS = frozenset({"elementwise", "norm", "softmax", "reduction"})


def _tensor_bytes(shape: tuple, dtype: str) -> int:
    return math.prod(shape) * getattr(torch, dtype).itemsize


def _chains(recs: list) -> list:
    """The connected groups of memory-bound ops among one module's own ops (an op joins
    the group of an op whose output it reads): each is what a fusing engine runs as one
    kernel. Other ops (GEMMs, attention) split them."""
    fusable = {r.idx: r for r in recs if r.kind in _FUSABLE_KINDS}
    parent = {i: i for i in fusable}

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for r in fusable.values():
        for prod in r.in_producers:
            if prod in fusable:
                parent[root(prod)] = root(r.idx)
    groups: dict = {}
    for i, r in fusable.items():
        groups.setdefault(root(i), []).append(r)
    return list(groups.values())


def module_fusion_savings(fwd: list, bwd: list, key_of=lambda r: r.idx, region=lambda r: r.module) -> dict:
    """HBM bytes (forward, backward) saved when each chain of memory-bound ops inside one
    module runs as one kernel, as an engine with its own kernels runs the architecture
    whatever the model code writes: Megatron-core's Transformer Engine norm is one kernel
    where Hugging Face's RMSNorm is eight eager ops with fp32 upcasts, its squared ReLU
    is compiled into one (`@jit_fuser`) where the model writes relu then pow, its RoPE
    is Transformer Engine's fused kernel where the model slices, negates and concatenates.

    A chain (_chains) of at least two ops that move data: fused, it reads its outside
    inputs once (parameters included) and writes the tensors used outside it once; its
    backward reads those inputs and the outputs' gradients and writes the inputs'
    gradients. Returns {key_of(the chain's first op): (forward, backward) saved}, the
    eager ops' bytes less that; negative where one kernel would move more (it reads
    whole a tensor the eager ops only slice): capture keeps the chains that save at
    every measured size (a sum of polynomials is one). `region`: what one kernel may
    span (default a module; `lambda r: "layer"`, the whole layer, as a compiled
    block's graph does)."""
    by_module: dict = {}
    for r in fwd:
        if r.module:  # ops of no module: the model's own forward, outside any block
            by_module.setdefault(region(r), []).append(r)
    # every forward input by producer, once: (consumer, bytes) of each tensor an op reads
    readers: dict = {}
    for r in fwd:
        for shape, dtype, prod in zip(r.in_shapes, r.in_dtypes, r.in_producers):
            readers.setdefault(prod, []).append((r.idx, _tensor_bytes(shape, dtype)))
    saved = {}
    for recs in by_module.values():
        for chain in _chains(recs):
            if sum(1 for r in chain if r.nbytes) < 2:
                continue  # one kernel already
            inside = {r.idx for r in chain}
            outside_in = {(prod, shape, dtype): _tensor_bytes(shape, dtype) for r in chain
                          for shape, dtype, prod in zip(r.in_shapes, r.in_dtypes, r.in_producers)
                          if prod not in inside}
            used_outside = {r.idx: nbytes for r in chain for reader, nbytes in readers.get(r.idx, ())
                            if reader not in inside}
            ins = sum(outside_in.values())
            outs = sum(used_outside.values()) or chain[-1].bytes_written  # used by the next layer only
            eager_bwd = sum(r.nbytes for r in bwd if r.fwd_ref in inside)
            first = min(chain, key=lambda r: r.idx)
            saved[key_of(first)] = (sum(r.nbytes for r in chain) - (ins + outs), eager_bwd - (2 * ins + outs))
    return saved


def layer_metrics(trace: PointTrace, layer: int, fwd: list, bwd: list, *, prefix: str, is_head: bool) -> LayerMetrics:
    """One layer's numbers at one point: FLOPs, saved activations (whole, tp-sharded,
    tp-gathered, what the selective policy drops), the per-op table, and the facts
    the cost model and the lowering read (tp all-reduces, attrs, kinds of ops)."""
    m = LayerMetrics()
    flow = tp_flow(fwd, is_head)
    m.tp_gather_bytes = flow.gather_bytes
    m.fwd_flops = sum(r.flops for r in fwd)
    m.bwd_flops = sum(r.flops for r in bwd)
    occurrences = {}

    def key_of(r):
        base = (_relative(r.module, prefix), r.op)
        occurrences[base] = occurrences.get(base, -1) + 1
        return base + (occurrences[base],)

    # (module relative to the layer, op, occurrence): the same op lines up across points
    op_key = {r.idx: key_of(r) for r in fwd}
    m.fwd_op_flops = {op_key[r.idx]: r.flops for r in fwd}
    m.policy_recompute_flops = sum(r.flops for r in fwd if r.op not in SAVED_OP_NAMES)
    m.input_bytes = trace.input_bytes.get(layer, 0)
    m.output_bytes = trace.output_bytes.get(layer, 0)
    _saved_activations(m, trace, layer, fwd, flow, op_key)
    _op_table(m, fwd, bwd, flow, prefix)
    _layer_facts(m, trace, layer, fwd, bwd, flow, is_head)
    moe = moe_facts(trace, layer, fwd, bwd, prefix)
    if moe is not None:  # what expert parallelism divides and moves (cost_models/expert_parallel.py)
        m.ep_routed_tokens = moe.routed_tokens
        m.ep_expert_fwd_flops, m.ep_expert_bwd_flops = moe.expert_fwd_flops, moe.expert_bwd_flops
        m.attrs.update(moe.attrs())
    m.module_fusion_chains = module_fusion_savings(fwd, bwd, key_of=lambda r: op_key[r.idx])
    m.layer_fusion_chains = module_fusion_savings(fwd, bwd, key_of=lambda r: op_key[r.idx], region=lambda r: "layer")
    # Kernels a compiled block launches: one per chain of memory-bound ops, one per other op
    # that computes or moves data (GEMMs, attention; views launch nothing)
    chains = _chains([r for r in fwd if r.module])
    m.attrs["compiled_kernels_fwd"] = len(chains) + sum(1 for r in fwd if r.kind not in _FUSABLE_KINDS and r.nbytes)
    return m


def _saved_activations(m: LayerMetrics, trace: PointTrace, layer: int, fwd: list, flow, op_key: dict) -> None:
    """The layer's saved tensors, each storage once: what tp shards or gathers of them,
    and what the selective-checkpoint policy drops (saved tensors another op of the
    layer wrote, recomputed in backward)."""
    sharded = flow.sharded
    seen, saved_origins = set(), set()
    for s in trace.saved:
        if s.layer != layer or s.storage in seen:
            continue
        seen.add(s.storage)
        m.activation_bytes += s.nbytes
        key = op_key.get(s.producer, ("<input>", "", len(m.saved_entries)))
        m.saved_entries[key] = (s.nbytes, s.shape)
        # A gathered tensor a row GEMM slices locally is saved as that 1/tp slice.
        is_sharded = s.producer is not None and (sharded.get(s.producer, False) or s.producer in flow.sliced)
        if is_sharded:
            m.activation_bytes_tp_sharded += s.nbytes
            m.saved_tp_sharded.add(key)
        is_gathered = s.producer is not None and s.producer in flow.replicated and not is_sharded
        if is_gathered:
            m.activation_bytes_tp_gathered += s.nbytes
            m.saved_tp_gathered.add(key)
        origin = trace.records[s.origin] if s.origin is not None and s.origin >= 0 else None
        if origin is not None and origin.layer == layer and origin.op not in SAVED_OP_NAMES:
            m.policy_dropped_bytes += s.nbytes
            m.policy_dropped_tp_sharded += s.nbytes if is_sharded else 0
            m.policy_dropped_tp_gathered += s.nbytes if is_gathered else 0
        if s.origin is not None:
            saved_origins.add(s.origin)
    # torch's selective checkpointing stores the output of every op the policy must save,
    # whether or not autograd needs it (o_proj's and down_proj's outputs feed only a residual
    # add): what it keeps beyond autograd's own saved tensors is taken off what it drops.
    # Measured with FSDPMemTracker: 805 MiB per Llama 3 8B block at s = 8192, not 513.
    for r in fwd:
        if r.op in SAVED_OP_NAMES and r.idx not in saved_origins and not r.out_is_int:
            extra = r.bytes_written
            m.policy_dropped_bytes -= extra
            if sharded.get(r.idx, False):
                m.policy_dropped_tp_sharded -= extra
    m.policy_dropped_bytes = max(0, m.policy_dropped_bytes)
    m.policy_dropped_tp_sharded = max(0, min(m.policy_dropped_tp_sharded, m.policy_dropped_bytes))


def _op_table(m: LayerMetrics, fwd: list, bwd: list, flow, prefix: str) -> None:
    """m.ops: FLOPs, bytes and counts by (module relative to the layer, op), stable
    across points; backward ops are charged to the forward op they differentiate."""
    sharded, row_ids = flow.sharded, {r.idx for r in flow.rows}
    by_idx = {}
    for r in fwd:
        key = f"{_relative(r.module, prefix)}:{r.op.removeprefix('aten.')}" + (f"_{r.variant}" if r.variant else "")
        op = m.ops.get(key)
        if op is None:
            op = m.ops[key] = dict(kind=r.kind, fwd_flops=0, bwd_flops=0, fwd_bytes=0, bwd_bytes=0,
                                   gemm=r.gemm if r.uses_param or r.kind == "gemm" else None,
                                   tp_sharded=False, tp_replicated=False, count=0, causal=r.causal,
                                   linear=r.linear, tp_pieces=1, tp_split="")
        op["tp_pieces"] = max(op["tp_pieces"], flow.pieces.get(r.idx, 1))
        if r.kind == "gemm":  # which dim tp splits: a row GEMM's k, a column GEMM's n
            op["tp_split"] = "row" if r.idx in row_ids else "column" if r.idx in flow.cols else op.get("tp_split", "")
        op["linear"] = op["linear"] and r.linear  # every call of it ran in the Linear's forward
        op["fwd_flops"] += r.flops
        op["fwd_bytes"] += r.nbytes
        op["count"] += 1
        op["tp_sharded"] |= sharded.get(r.idx, False) or r.idx in row_ids or (r.kind == "embedding" and r.uses_param)
        op["tp_replicated"] |= r.idx in flow.replicated
        by_idx[r.idx] = key
    unattributed = dict(kind="other", fwd_flops=0, bwd_flops=0, fwd_bytes=0, bwd_bytes=0, gemm=None,
                        tp_sharded=False, tp_replicated=False, count=0, causal=None, linear=False,
                        tp_pieces=1, tp_split="")
    for r in bwd:
        op = m.ops.get(by_idx.get(r.fwd_ref), unattributed)
        op["bwd_flops"] += r.flops
        op["bwd_bytes"] += r.nbytes
    if unattributed["bwd_flops"] or unattributed["bwd_bytes"]:
        m.ops["(backward):other"] = unattributed
    m.ops = {k: v for k, v in m.ops.items()
             if v["fwd_flops"] or v["bwd_flops"] or v["fwd_bytes"] or v["bwd_bytes"]}


def _layer_facts(m: LayerMetrics, trace: PointTrace, layer: int, fwd: list, bwd: list, flow, is_head: bool) -> None:
    """What kind of layer it is and what the cost model and the lowering read off it:
    tp all-reduces, the op kinds it holds, its attrs (heads, ffn, vocabulary, host ops,
    the backward walk)."""
    cols, rows = flow.cols, flow.rows
    m.tp_allreduces = len({_normalise(r.module) for r in rows})
    m.has_embedding = any(r.kind == "embedding" and r.uses_param for r in fwd)
    if m.has_embedding and not is_head:
        m.tp_allreduces += 1  # vocab-parallel embedding all-reduces its output
    m.has_conv = any(r.op in ("aten.convolution", "aten._convolution") for r in fwd)
    m.has_weight_gemm = bool(cols) or bool(rows)
    m.has_norm = any(r.kind == "norm" for r in fwd)
    m.attrs = _attrs(trace, layer, fwd, cols, flow.valid, flow.regions)
    if flow.expert_ffn:  # tp splits each expert's ffn (autopar/lower/tp_experts.py): tp must divide it
        m.attrs["expert_ffn_hidden"] = flow.expert_ffn
    # Every op the layer dispatches, views included: each costs host time (the
    # framework's dispatch, DTensor's sharding propagation under tp) whatever its size.
    m.attrs["host_ops_fwd"], m.attrs["host_ops_bwd"] = len(fwd), len(bwd)
    walk = backward_walk(trace, layer, fwd, bwd)
    if walk:
        m.attrs["bwd_walk"] = walk
    if is_head and cols:  # the head's column GEMM is the vocabulary projection
        widest = max((c for c in cols.values() if c.gemm), key=lambda c: c.gemm[1], default=None)
        m.attrs.pop("ffn_hidden", None)
        if widest is not None:
            m.attrs["vocab_size"], m.attrs["hidden"] = widest.gemm[1], widest.gemm[2]
    m.has_attention = "heads" in m.attrs
    m.attrs.update(cp_facts(fwd, m.has_attention))  # what context parallelism splits and moves (cp_facts.py)


def backward_walk(trace: PointTrace, layer: int, fwd: list, bwd: list) -> list:
    """How the layer's backward trades saved activations for weight gradients, as
    [[alive, grads], ...]: at each of its autograd nodes, the share of the layer's
    saved bytes still alive and the share of its parameters' gradients already made,
    the moments no other one dominates. The ends are [1, 0] and [0, 1]; a layer whose
    last ops hold most of its parameters (an MLP after the attention) makes their
    gradients while the attention's activations still wait: FSDPMemTracker puts
    Llama 3 70B's full-checkpoint peak there, above both the layer's activations and
    its gradients. Autograd frees a saved tensor once the last node that saved it
    has run, and runs a layer's nodes from the highest sequence number down."""
    last_saver = {}  # storage -> (bytes, sequence number of its last saver to run)
    for s in trace.saved:
        if s.layer == layer:
            nbytes, seq = last_saver.get(s.storage, (s.nbytes, s.saver_seq))
            last_saver[s.storage] = (nbytes, min(seq, s.saver_seq))
    first_user = {}  # parameter -> sequence number of its first user to run in backward
    for r in fwd:
        for name in r.param_names:
            first_user[name] = max(first_user.get(name, -1), r.seq_nr)
    total_act = sum(n for n, _ in last_saver.values())
    total_grad = sum(trace.param_bytes.get(name, 0) for name in first_user)
    if not total_act or not total_grad:
        return []
    # running sums over sequence numbers (a layer without blocks may have thousands of ops)
    saved_seqs = sorted((seq, n) for n, seq in last_saver.values())
    saved_cum = list(itertools.accumulate(n for _, n in saved_seqs))
    user_seqs = sorted((seq, trace.param_bytes.get(name, 0)) for name, seq in first_user.items())
    user_cum = list(itertools.accumulate(n for _, n in user_seqs))
    points = []
    for node in sorted({r.seq_nr for r in bwd if r.seq_nr >= 0}, reverse=True):
        i = bisect.bisect_right(saved_seqs, (node, math.inf))  # saved by nodes <= node: not yet freed
        alive = saved_cum[i - 1] if i else 0
        j = bisect.bisect_left(user_seqs, (node, -math.inf))  # used by nodes >= node: gradient made
        made = total_grad - (user_cum[j - 1] if j else 0)
        points.append((round(alive / total_act, 3), round(made / total_grad, 3)))
    frontier = []
    for a, g in sorted(set(points), reverse=True):
        if not any(a2 >= a and g2 >= g for a2, g2 in frontier):
            frontier.append((a, g))
    return [list(p) for p in sorted(frontier)]


def _attrs(trace: PointTrace, layer: int, fwd: list, cols: dict, valid: set, regions: dict) -> dict:
    attrs = {}
    float_inputs = [x for x in trace.input_shapes.get(layer, ()) if isinstance(x, tuple) and "float" in x[1]]
    if float_inputs:
        shape = float_inputs[0][0]
        if len(shape) == 4:
            attrs["channels"] = shape[1]
        elif shape:
            attrs["hidden"] = shape[-1]
    attention_regions = set()
    for r in fwd:
        if r.kind == "attention" and r.in_shapes and len(r.in_shapes[0]) == 4:
            q, k = r.in_shapes[0], r.in_shapes[1]
            attrs.setdefault("causal", r.causal)
            attrs.setdefault("heads", q[1])
            attrs.setdefault("head_dim", q[3])
            if k[1] != q[1]:
                attrs.setdefault("kv_heads", k[1])
        elif r.kind == "softmax" and r.in_shapes and len(r.in_shapes[0]) >= 3:
            shape = r.in_shapes[0]
            heads = shape[1] if len(shape) == 4 else shape[0] // trace.batch
            attrs.setdefault("heads", heads)
            if attrs.get("hidden") and heads and attrs["hidden"] % heads == 0:
                attrs.setdefault("head_dim", attrs["hidden"] // heads)
        else:
            continue
        # sharded or gathered: GPT's attention core runs on q, k, v gathered from its qkv GEMM
        attention_regions |= regions.get(r.idx, frozenset())
    if "heads" in attrs and "kv_heads" not in attrs:
        hd = attrs.get("head_dim")
        widths = [c.gemm[1] for cid, c in cols.items() if cid in attention_regions and c.gemm]
        smaller = [w for w in widths if hd and w % hd == 0 and w < attrs["heads"] * hd]
        attrs["kv_heads"] = min(smaller) // hd if smaller else attrs["heads"]
    ffn = [c.gemm[1] for cid, c in cols.items() if cid in valid and cid not in attention_regions and c.gemm]
    if ffn:
        attrs["ffn_hidden"] = max(ffn)
    for r in fwd:
        # An embedding inside an attention block is a position-bias table (T5's
        # relative_attention_bias), not a vocabulary.
        if r.kind == "embedding" and r.uses_param and "heads" not in attrs:
            attrs.setdefault("vocab_size", r.in_shapes[0][0])
            attrs.setdefault("hidden", r.in_shapes[0][1])
    if trace.topk.get(layer):
        experts, k, _ = trace.topk[layer]
        attrs["experts"], attrs["top_k"] = experts, k
    return attrs


def divisors_up_to(n: int, limit: int = 1024) -> tuple:
    return tuple(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def tp_degrees(attrs: dict, kind: str) -> tuple:
    if kind in ("transformer_block", "moe_block") and attrs.get("heads"):
        g = attrs["heads"]
        for key in ("kv_heads", "ffn_hidden", "expert_ffn_hidden"):
            if attrs.get(key):
                g = math.gcd(g, attrs[key])
        return divisors_up_to(g)
    if kind in ("embedding", "head"):
        # Vocab-parallel: the vocabulary (or class count) must divide evenly;
        # an odd vocabulary (GPT-2's 50257) stays replicated.
        return divisors_up_to(attrs["vocab_size"]) if attrs.get("vocab_size") else (1,)
    if attrs.get("ffn_hidden"):
        return divisors_up_to(math.gcd(attrs["ffn_hidden"], attrs.get("hidden", attrs["ffn_hidden"])))
    return (1,)
