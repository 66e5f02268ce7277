"""autopar.capture: model + example inputs -> ModelGraph of costed layers.

The model is copied to the meta device (no weights, no activations) and run
forward + backward under instrumentation (tracer.py) at a few (batch, seq)
points; every per-layer number is fitted to an exact polynomial in B and S
(fit.py) and checked at one more point. See docs/capture.md.
"""
from __future__ import annotations

import hashlib
import time
from collections import Counter
from fractions import Fraction

import torch
import torch.nn as nn

from autopar.capture.auto_inputs import infer_example_inputs
from autopar.capture.fit import PointGrid, fit
from autopar.capture.graph import EXPR_FIELDS, ModelGraph
from autopar.capture.inputs import template_from
from autopar.capture.metrics import layer_metrics, tp_degrees
from autopar.capture.module_tree import find_blocks, meta_copy, static_signature
from autopar.capture.opgraph import build_op_graph
from autopar.capture.tracer import Tracer
from autopar.errors import CaptureError
from autopar.precision import DTYPES as PRECISION_DTYPES
from cost_models.workload import LayerSpec, OpSpec


def capture(model: nn.Module, example_inputs=None, *, dtype: torch.dtype | str = torch.bfloat16,
            name: str | None = None, seq_dim="auto", loss_fn=None) -> ModelGraph:
    """Capture `model` into a ModelGraph.

    example_inputs: a tuple of tensors (any device; only shapes and dtypes are
        used; a trailing dict is passed as keyword arguments) or a callable
        `batch_size -> tuple`; None infers them for Hugging Face models and
        token/image models (auto_inputs.py; said in graph.notes).
    dtype: the training compute dtype, or its precision name ("bf16", "fp16",
        "fp32"); floating parameters and activations are measured in it. The
        planner scales bytes to another precision, which is exact only for the
        tensors kept in the compute dtype (an fp32 upcast in a bf16 capture, e.g.
        an RMSNorm's, would be priced at 8 bytes): capture at the precision the
        model trains in.
    seq_dim: "auto" (dim 1 of 2-D integer / 3-D float inputs), an int, or None
        (costs are fitted in batch only, at the given sequence length).
    loss_fn: optional `loss_fn(output, targets)` (the model file's); its cost
        (e.g. the saved log-softmax of the logits) becomes part of the head
        layer. Targets are class indices shaped like the output minus its last dim.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture expects an nn.Module, got {type(model).__name__}")
    if isinstance(dtype, str):
        if dtype not in PRECISION_DTYPES:
            raise CaptureError(f"unknown precision {dtype!r}", hint=f"one of {', '.join(PRECISION_DTYPES)}")
        dtype = PRECISION_DTYPES[dtype]
    start = time.perf_counter()
    notes = []
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        # torch.compile(model): layer names and module_paths are the user's module's, not `_orig_mod.*`.
        model = model._orig_mod
        notes.append("captured the module torch.compile wraps (eager costs: the plan prices its own kernels)")
    if example_inputs is None:
        inferred = infer_example_inputs(model)
        if inferred is None:
            raise CaptureError(f"no example_inputs given and none can be inferred for {type(model).__name__}",
                               hint="pass a tuple of input tensors or a callable batch_size -> tuple")
        example_inputs = inferred
        notes.append(f"example inputs inferred: {inferred.description}")
    template = template_from(example_inputs, seq_dim)
    meta = meta_copy(model, dtype)
    blocks = find_blocks(meta)
    tracer = Tracer(meta, blocks, [static_signature(m) for _, m in blocks], loss_fn)

    grids = PointGrid.fallbacks(template.seq)
    for attempt, grid in enumerate(grids):
        traces = {}
        try:
            for point in grid.all_points:
                args, kwargs = template.make(point[0], point[1] or template.seq, dtype)
                traces[point] = tracer.run(point[0], point[1] or template.seq, args, kwargs)
            layers, indices, base = _build_layers(meta, blocks, traces, grid, template.seq, loss_fn)
            break
        except CaptureError as exc:
            # The base point is the model's own input: a failure there is the model's.
            if attempt == len(grids) - 1 or (not traces and attempt == 0):
                raise
            nxt = grids[attempt + 1]
            how = (f"fitted in s near {template.seq} only (lengths {', '.join(map(str, nxt.seqs))}), valid "
                   "for lengths on the same side of any threshold") if nxt.seqs else \
                f"sequence length fixed at {template.seq}: costs fitted in batch only"
            notes.append(f"{how}; the wider fit failed: {exc.message}")

    if base.own_checkpointing:
        notes.append("the model checkpoints its own activations (torch.utils.checkpoint); capture measured it "
                     "without, because the plan chooses checkpointing per layer")
    seq_len = template.seq
    seq_fit = "none" if grid.seqs is None else "local" if grid.local else "wide"
    graph = ModelGraph(
        name=name or type(model).__name__, layers=layers, seq_len=seq_len,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        tokens_per_sample=seq_len or 1, batch_size=base.batch, dtype=str(dtype).removeprefix("torch."),
        notes=notes, seq_fit=seq_fit if seq_len is not None else "none",
    )
    graph.graph = build_op_graph(base, list(zip(indices, (l.name for l in layers))),
                                  {i + 1: path for i, (path, _) in enumerate(blocks)})
    graph.capture_seconds = time.perf_counter() - start
    _check_params(model, graph)
    graph.notes += _one_big_layer(layers)
    return graph


def _one_big_layer(layers) -> list[str]:
    """A note when no stack of repeated blocks cuts the model and one layer holds most
    of its parameters (x-transformers' decoder walks its own ModuleList of attention and
    feed-forward entries, which nothing else calls): the plan can place, pipeline-cut or
    checkpoint that layer only whole, and says so instead of pricing it as if it could."""
    total = sum(l.params for l in layers)
    repeated = Counter(l.signature for l in layers if l.signature)
    if not total or (repeated and max(repeated.values()) >= 2):
        return []
    big = max(layers, key=lambda l: l.params)
    if big.params < total / 2:
        return []
    return [f"no stack of repeated blocks was found: layer {big.name} holds {big.params / total:.0%} of the "
            f"parameters as one layer, so pipeline stages and per-layer checkpointing cannot split it (blocks are "
            f"the modules of an nn.ModuleList / nn.Sequential that the model calls one by one)"]


def _check_params(model: nn.Module, graph: ModelGraph):
    expected = sum(p.numel() for p in model.parameters())
    if graph.total_params != expected:  # an internal bug, not a user error: say so plainly
        raise CaptureError(f"internal error: captured {graph.total_params} parameters but the model has {expected}",
                           hint="please report this model to the autopar maintainers")


def _split_records(trace):
    fwd, bwd = {}, {}
    for r in trace.records:
        (fwd if r.phase == "fwd" else bwd).setdefault(r.layer, []).append(r)
    return fwd, bwd


def _build_layers(meta, blocks, traces, grid, seq, loss_fn):
    n = len(blocks) + 2
    prefix = {i + 1: path for i, (path, _) in enumerate(blocks)}
    base_point = grid.points[0]
    base = traces[base_point]

    # Metrics of each measured layer at each point (shortcut layers reuse their representative's).
    metrics = {}
    for point, trace in traces.items():
        fwd, bwd = _split_records(trace)
        for layer in set(trace.rep_of.values()):
            metrics[(point, layer)] = layer_metrics(trace, layer, fwd.get(layer, []), bwd.get(layer, []),
                                                    prefix=prefix.get(layer, ""), is_head=layer == n - 1)

    owners, shared = _param_owners(meta, blocks, traces, n)
    sizes = {name: (p.numel(), p.element_size()) for name, p in meta.named_parameters()}
    block_kinds = {_block_kind(metrics[(base_point, base.rep_of.get(i, i))]) for i in range(1, n - 1)}
    exprs_cache = {}
    norms = _batch_norms(meta)
    layers, indices = [], []
    for layer in range(n):
        reps = tuple(traces[p].rep_of.get(layer, layer) for p in grid.all_points)
        per_point = {p: metrics[(p, r)] for p, r in zip(grid.all_points, reps)}
        m0 = per_point[base_point]
        owned = [k for k, v in owners.items() if v == layer]
        params = sum(sizes[k][0] for k in owned)
        called = _top_level(base.called.get(layer, []))
        if layer in (0, n - 1) and not (params or m0.fwd_flops or m0.activation_bytes or called):
            continue  # nothing runs before the first / after the last block
        kind, lname, paths = _name_and_kind(layer, n, prefix, m0, called, block_kinds)
        paths = paths + _loose_params(owned, paths)
        what = f"layer {lname}"
        if reps not in exprs_cache:
            exprs_cache[reps] = _fit_layer(per_point, grid, what)
        fields, ops = exprs_cache[reps]
        fields = dict(fields)
        attrs = dict(m0.attrs)
        attrs["param_tensors"] = len(owned)  # the optimizer's per-tensor work (for-loop / foreach)
        # modules holding its parameters (the lowering shards a layer of several as one FSDP unit)
        attrs["param_modules"] = sum(1 for p in paths if any(k == p or k.startswith(p + ".") for k in owned))
        if shared.get(layer):
            # the tied weights it uses but another layer owns: their gradient is made here
            # first, and a pipeline rank without the owner keeps a copy (the memory model)
            attrs["tied_param_count"] = sum(sizes[k][0] for k in shared[layer])
        if layer == n - 1 and loss_fn is not None:
            attrs["loss"] = True
        if seq is not None:
            attrs["seq_len"] = seq
        bn = _batch_norm_channels(norms, paths)
        if bn:
            attrs["batch_norm_channels"] = bn
        sig_src = (static_signature(blocks[layer - 1][1]), base.input_shapes.get(layer)) if 0 < layer < n - 1 \
            else (lname, layer, [(k, sizes[k]) for k in owned], sorted(shared.get(layer, ())), str(fields))
        indices.append(layer)
        layers.append(LayerSpec(
            name=lname, kind=kind, params=params, param_bytes=sum(sizes[k][0] * sizes[k][1] for k in owned),
            **fields, tp_allreduces=m0.tp_allreduces if kind != "head" else 0,
            # no module, no weight to split: a head the root computes from another layer's weight
            tp_degrees=tp_degrees(attrs, kind) if paths else (1,), ops=ops, attrs=attrs,
            signature=hashlib.sha1(repr(sig_src).encode()).hexdigest()[:12],
            module_paths=paths, shared_params=sorted(shared.get(layer, ())), op_prefix=prefix.get(layer, ""),
        ))
    return layers, indices, base


def _batch_norms(meta: nn.Module) -> list:
    """(path, channels) of the model's BatchNorms, in module order: read once, not once per layer."""
    return [(name, m.num_features) for name, m in meta.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _batch_norm_channels(norms: list, paths: list) -> list:
    """Channels of each BatchNorm in the layer's modules (`norms`: _batch_norms): it
    normalises by batch statistics, which data parallelism must synchronise (priced by
    the cost model) and micro-batching cannot keep (the planner does not offer it)."""
    return [channels for name, channels in norms
            if any(p == "" or name == p or name.startswith(p + ".") for p in paths)]


def _loose_params(owned: list, paths: list) -> list:
    """Owned parameters outside every module of the layer: held directly by the
    root or by a container (ViT's `class_token`, `pos_embedding`). They are
    listed by their parameter path so every parameter belongs to some layer's
    `module_paths`."""
    return sorted(k for k in owned if not any(p == "" or k.startswith(p + ".") for p in paths))


def _top_level(paths: list) -> list:
    unique = list(dict.fromkeys(paths))
    return [p for p in unique if not any(p != q and p.startswith(q + ".") for q in unique)]


def _block_kind(m) -> str:
    if m.attrs.get("experts"):
        return "moe_block"
    if m.has_attention:
        return "transformer_block"
    if m.has_conv:
        return "conv_stage"
    return "mlp" if m.has_weight_gemm else "other"


def _name_and_kind(layer, n, prefix, m, called, block_kinds):
    if 0 < layer < n - 1:
        path = prefix[layer]
        return _block_kind(m), path or "model", [path]
    if layer == 0:
        sequence_model = bool(block_kinds & {"transformer_block", "moe_block"})
        if m.has_embedding or ((m.has_conv or m.has_weight_gemm) and sequence_model):
            kind = "embedding"  # token embedding, or a ViT patch embedding
        elif m.has_conv:
            kind = "conv_stage"
        else:
            kind = "embedding" if m.has_weight_gemm else "other"
        default = {"embedding": "embedding", "conv_stage": "stem"}.get(kind, "input")
    else:
        kind = "head" if (m.has_weight_gemm or m.has_conv) else "norm" if m.has_norm else "other"
        default = kind if kind != "other" else "output"
    name = called[0] if len(called) == 1 else default
    return kind, name, called


def _param_owners(meta, blocks, traces, n):
    """Each parameter belongs to the first layer (in execution order) that uses
    it; other users list it in shared_params (tied weights counted once)."""
    canonical = {}
    for name, p in meta.named_parameters():
        canonical.setdefault(id(p), name)
    users = {}
    for trace in traces.values():
        for layer, names in trace.params_used.items():
            for name in names:
                users.setdefault(name, set()).add(layer)
    for i, (path, block) in enumerate(blocks):
        for _, p in block.named_parameters(remove_duplicate=False):
            users.setdefault(canonical[id(p)], set()).add(i + 1)
    owners, shared = {}, {}
    for name in canonical.values():
        layers = sorted(users.get(name, {0}))
        owners[name] = layers[0]
        for other in layers[1:]:
            shared.setdefault(other, set()).add(name)
    return owners, shared


def _s2_keys(dicts: list, seqs) -> set:
    """Keys whose value has an s^2 term across three sequence lengths (same batch)."""
    (s1, s2, s3) = seqs
    keys = set()
    for key in set(dicts[0]) & set(dicts[1]) & set(dicts[2]):
        y1, y2, y3 = (d[key] for d in dicts)
        d1 = Fraction(y2 - y1, s2 - s1)
        if (Fraction(y3 - y2, s3 - s2) - d1) / (s3 - s1) != 0:
            keys.add(key)
    return keys


def _fit_layer(per_point: dict, grid: PointGrid, what: str):
    values = {f: {p: getattr(m, f) for p, m in per_point.items()}
              for f in ("fwd_flops", "bwd_flops", "activation_bytes", "activation_bytes_tp_sharded",
                        "input_bytes", "output_bytes", "tp_gather_bytes", "activation_bytes_tp_gathered",
                        "ep_routed_tokens", "ep_expert_fwd_flops", "ep_expert_bwd_flops")}
    # What one kernel per chain of memory-bound ops saves: the chains seen at every point
    # that save at every point, so the sum stays a polynomial in (batch, seq)
    fusion_savings = {}
    for what_fuses, prefix in (("module_fusion_chains", "module"), ("layer_fusion_chains", "compiled")):
        chains = set.intersection(*(set(getattr(m, what_fuses)) for m in per_point.values()))
        for i, name in enumerate((f"{prefix}_fusion_saved_fwd", f"{prefix}_fusion_saved_bwd")):
            keep = [k for k in chains if all(getattr(m, what_fuses)[k][i] > 0 for m in per_point.values())]
            fusion_savings[name] = {p: sum(getattr(m, what_fuses)[k][i] for k in keep) for p, m in per_point.items()}
    # Selective recomputation drops the saved tensors that grow with s^2 (the
    # attention scores, softmax, dropout mask) and redoes the ops whose FLOPs
    # grow with s^2 (QK^T, scores x V).
    sel_bytes = {p: 0 for p in per_point}
    sel_sharded = {p: 0 for p in per_point}  # the part of sel_bytes tp divides (not GPT's gathered core)
    sel_gathered = {p: 0 for p in per_point}  # the part downstream of a tp gather (GPT's core)
    sel_flops = {p: 0 for p in per_point}
    if grid.seqs is not None:
        series = [per_point[(grid.batches[0], s)] for s in grid.seqs]
        saved_keys = _s2_keys([{k: e[0] for k, e in m.saved_entries.items()} for m in series], grid.seqs)
        op_keys = _s2_keys([m.fwd_op_flops for m in series], grid.seqs)
        for p, m in per_point.items():
            for key, (nbytes, shape) in m.saved_entries.items():
                # A tensor not seen in the series: fall back to its shape (two dims of length s).
                if key in saved_keys or (key not in series[0].saved_entries and list(shape).count(p[1]) >= 2):
                    sel_bytes[p] += nbytes
                    sel_sharded[p] += nbytes if key in m.saved_tp_sharded else 0
                    sel_gathered[p] += nbytes if key in m.saved_tp_gathered else 0
            if sel_bytes[p]:
                sel_flops[p] = sum(f for k, f in m.fwd_op_flops.items() if k in op_keys)
    if not any(sel_bytes.values()):
        # No attention core with s^2 tensors (FlashAttention keeps only its
        # logsumexp): selective then means the op-level policy lowering runs
        # (autopar/checkpoint_policy.py), so measure what that policy drops.
        sel_bytes = {p: m.policy_dropped_bytes for p, m in per_point.items()}
        sel_sharded = {p: m.policy_dropped_tp_sharded for p, m in per_point.items()}
        sel_gathered = {p: m.policy_dropped_tp_gathered for p, m in per_point.items()}
        sel_flops = {p: m.policy_recompute_flops for p, m in per_point.items()}
    values["activation_bytes_selective"] = sel_bytes
    values["selective_recompute_flops"] = sel_flops
    values["activation_bytes_selective_tp_sharded"] = sel_sharded
    values["activation_bytes_selective_tp_gathered"] = sel_gathered
    fields = {f: fit(v, grid, f"{f} of {what}") for f, v in values.items()}
    for name, v in fusion_savings.items():
        try:
            fields[name] = fit(v, grid, f"{name} of {what}")
        except CaptureError:  # only another engine's estimate reads it: never a reason to refuse a model
            fields[name] = 0

    ops = []
    base = per_point[grid.points[0]]
    for key, op in base.ops.items():
        if not all(key in m.ops for m in per_point.values()):
            continue  # an op that exists at some sizes only: kept in the layer totals
        get = lambda field: {p: m.ops[key][field] for p, m in per_point.items()}
        gemm = None
        if op["gemm"] and all(m.ops[key]["gemm"] for m in per_point.values()):
            gemm = tuple(fit({p: m.ops[key]["gemm"][i] for p, m in per_point.items()}, grid,
                             f"gemm dim {i} of {key} in {what}") for i in range(3))
        ops.append(OpSpec(name=key, kind=op["kind"], fwd_flops=fit(get("fwd_flops"), grid, f"{key} in {what}"),
                          bwd_flops=fit(get("bwd_flops"), grid, f"{key} in {what}"),
                          fwd_bytes=fit(get("fwd_bytes"), grid, f"{key} in {what}"),
                          bwd_bytes=fit(get("bwd_bytes"), grid, f"{key} in {what}"),
                          gemm=gemm, tp_sharded=op["tp_sharded"], tp_replicated=op["tp_replicated"],
                          count=op["count"], linear=op["linear"] and gemm is not None, tp_pieces=op["tp_pieces"],
                          tp_split=op["tp_split"] if op["tp_sharded"] else "",
                          **({"causal": op["causal"]} if op["kind"] == "attention" else {})))
    assert set(fields) >= set(EXPR_FIELDS)
    return fields, ops
