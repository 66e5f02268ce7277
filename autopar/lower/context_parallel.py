"""Context parallelism (cp): every sequence cut over the ranks of a 1-D "cp" mesh.

The style is torch's own (`torch.distributed.tensor.experimental.context_parallel`,
as torchtitan's torchtitan/distributed/context_parallel uses it): the batch's
sequence-indexed tensors (input ids, labels, position tables or ids) are split
on their sequence dim, load-balanced for a causal mask by torch's head-tail
balancer (rank r of cp holds chunks r and 2 cp - 1 - r of 2 cp equal chunks, so
every rank sees the same share of the causal triangle), and every
`F.scaled_dot_product_attention` inside the context runs as torch's ring
attention: each rank keeps its query shard while the key/value shards travel
the ring (cp - 1 steps), partial outputs merged by their log-sum-exp. Every
other op (embeddings, norms, MLPs, the head, the loss) is position-local and
runs unchanged on the rank's tokens.

What this file adds to torch:
  * the CPU kernel. torch's CP dispatcher knows the CUDA kernels only (flash,
    memory-efficient, cuDNN); on CPU SDPA lowers to
    `_scaled_dot_product_flash_attention_for_cpu`, which returns the same
    (output, logsumexp (b, h, s)) pair. `register_cpu_ring_attention` adds it and
    its backward to torch's CP op table, each run by torch's own
    `_templated_ring_attention(_backward)`: same ring, same rotation, same merge.
  * the loss over cp: each rank scores its own tokens, and model_io's global token
    mean counts cp's shares (`ParallelModel._weigh_by_tokens`), so after the gradient
    averaging over dp x cp the step is the mean over every token, as one process computes it.
  * the refusals (`refusal`): what torch's ring cannot split.

From a Plan (`Mesh.cp` > 1): `lower` builds the (pp, dp, cp, tp) mesh
(lower/mesh.py), shards the parameters over dp x cp (`mesh.data_mesh`), refuses
what cannot run before any group exists (`check_plan`), and every train / eval
step runs inside `step_shard`; the loss's global token mean is model_io's
(`ParallelModel._weigh_by_tokens` counts cp's shares).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import PlanMismatchError

_SEQ_DIM = 2  # (batch, heads, seq, head_dim): the dim torch's ring attention splits
_REGISTERED = False


def register_cpu_ring_attention() -> None:
    """Add the CPU flash kernel (and its backward) to torch's CP op table, so
    `context_parallel` runs ring attention on CPU tensors (gloo) too. The
    handlers unwrap the Shard(2) DTensors CP made of q, k, v, run torch's ring
    on the local shards and hand back Shard(2) DTensors, as torch's
    `_sdpa_handler` does for the CUDA kernels."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    aten = torch.ops.aten

    def _wrap(tensors, mesh):
        return tuple(DTensor.from_local(t, mesh, [Shard(_SEQ_DIM)], run_check=False) for t in tensors)

    def _forward(op_call, args, kwargs):
        query, key, value = args[:3]
        dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
        is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        if kwargs.get("attn_mask") is not None:
            raise NotImplementedError("context parallel ring attention takes no attn_mask (is_causal only)")
        mesh = query.device_mesh
        out, lse = cp_attention._templated_ring_attention(
            mesh.get_group(), _SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
            query.to_local(), key.to_local(), value.to_local(), is_causal=is_causal,
            dropout_p=dropout_p, scale=kwargs.get("scale"))[:2]
        return _wrap((out, lse), mesh)

    def _backward(op_call, args, kwargs):
        grad_out, query, key, value, out, lse, dropout_p, is_causal = args[:8]
        mesh = query.device_mesh
        grads = cp_attention._templated_ring_attention_backward(
            mesh.get_group(), _SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out.to_local(), grad_out_name="grad_out", query=query.to_local(),
            key=key.to_local(), value=value.to_local(), out=out.to_local(), logsumexp=lse.to_local(),
            is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"))
        return _wrap(grads[:3], mesh)

    # `custom_ops` is the table torch's `_enable_cp_dtensor_dispatcher` installs into
    # DTensor's dispatcher on entering `context_parallel` and removes on leaving it:
    # outside the context the CPU kernel keeps its ordinary (tp) sharding rules.
    cp_attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _forward
    cp_attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _backward
    _REGISTERED = True


def _hf_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config if hasattr(config, "_attn_implementation") else None


def refusal(model: nn.Module, seq_len: int, cp: int, *, n_inputs: int = 1, graph=None) -> str | None:
    """Why `model` cannot run with its sequence of `seq_len` cut over `cp` ranks,
    or None. Checked before anything is built (every rank alike): the load
    balancing, the attention implementation, masks the ring cannot split; and,
    given the captured `graph`, what its attention ops were called with."""
    if cp <= 1:
        return None
    if seq_len % (2 * cp):
        return (f"context parallel {cp} needs the sequence ({seq_len}) in 2 x cp = {2 * cp} equal chunks "
                f"(the causal load balancing); pad the sequence to a multiple of {2 * cp}")
    if n_inputs > 1:
        return ("context parallel takes token ids only: an explicit attention mask (padding, packed "
                "documents) is not split by torch's ring attention; drop the mask or use cp 1")
    config = _hf_config(model)
    if config is not None:
        impl = config._attn_implementation
        if impl != "sdpa":
            return (f"attention implementation '{impl}' does not call scaled_dot_product_attention, which "
                    f"context parallel splits; load the model with attn_implementation='sdpa'")
        window = getattr(config, "sliding_window", None)
        # transformers decides from the local length (s / cp) whether the window masks anything
        if window and getattr(config, "use_sliding_window", True) and seq_len > window:
            return (f"sliding-window attention (window {window} < {seq_len} tokens) is a mask torch's ring "
                    f"attention does not split; use cp 1")
        if position_modules(model) == ([], []):
            return ("this model's positions enter neither through a rotary embedding nor a learned position "
                    "table autopar can hand the global positions (ALiBi biases, offset tables such as OPT's): "
                    "each rank would number its tokens from 0; use cp 1")
    for path, buf in model.named_buffers():
        if buf.dim() >= 2 and buf.shape[-1] == buf.shape[-2] and buf.shape[-1] >= seq_len:
            return (f"buffer '{path}' {tuple(buf.shape)} looks like a precomputed attention mask (square over "
                    f"positions); context parallel needs is_causal SDPA without one")
    if graph is None:
        return None
    return graph_refusal(graph, positions_handled=config is not None)


def graph_refusal(graph, *, positions_handled: bool = False) -> str | None:
    """The captured graph's facts (capture/cp_facts.py, in each layer's attrs):
    every attention layer must run SDPA, causal, without a mask tensor; no layer
    may number positions with torch.arange of its local length, unless
    `positions_handled` (a transformers model: `sequence_shard` hands its
    position modules the global positions)."""
    for layer in graph.layers:
        attrs = getattr(layer, "attrs", None) or {}
        if attrs.get("arange_positions") and not positions_handled:
            return (f"layer '{layer.name}' numbers positions with torch.arange in its forward: under context "
                    f"parallel each rank would count its own tokens from 0; keep the positions in a buffer "
                    f"(as autopar.zoo's models do), which the sequence cut splits")
        if "heads" not in attrs:
            continue
        if attrs.get("attention") == "eager":
            return (f"layer '{layer.name}' computes attention by hand (matmul + softmax), not through "
                    f"scaled_dot_product_attention: context parallel cannot split it")
        if attrs.get("attn_mask"):
            return (f"layer '{layer.name}' passes an attention mask tensor to SDPA: torch's ring attention "
                    f"takes is_causal only")
        if attrs.get("causal") is False:
            return (f"layer '{layer.name}' runs non-causal attention: the load-balanced ring needs "
                    f"is_causal=True")
    return None


def _global_positions(positions: torch.Tensor):
    def pre_hook(module, args, kwargs):
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": positions}
        return (*args[:1], positions, *args[2:]), kwargs
    return pre_hook


def _global_ids(positions: torch.Tensor):
    def pre_hook(module, args):
        return (positions, *args[1:])
    return pre_hook


def position_tables(model: nn.Module, seq_len: int) -> list[tuple[nn.Module, str]]:
    """Buffers indexed by position on dim 0: 2-D tables (RoPE cos / sin, learned
    position tables kept as buffers; at least `seq_len` rows, not a square mask)
    and 1-D integer position ids.
    The model slices them by its local length, so each rank must hold the rows
    of its own positions, in the load-balanced order."""
    found = []
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is None or buf.shape[0:1] < (seq_len,):
                continue
            table = buf.dim() == 2 and buf.shape[0] != buf.shape[1]
            ids = buf.dim() == 1 and not buf.is_floating_point()  # position ids (the zoo GPT's `pos`)
            if table or ids:
                found.append((module, name))
    return found


def position_modules(model: nn.Module) -> tuple[list[nn.Module], list[nn.Embedding]]:
    """Where a Hugging Face model turns positions into numbers: rotary embeddings
    (a module with a float `inv_freq` buffer) and learned position tables (an
    nn.Embedding as long as the config's maximum positions, not the vocabulary's).
    transformers numbers the tokens it is given 0..s/cp - 1; `sequence_shard`
    hands these modules the global positions instead."""
    rotaries = [m for m in model.modules()
                if isinstance(getattr(m, "inv_freq", None), torch.Tensor) and m.inv_freq.is_floating_point()]
    config = _hf_config(model)
    longest = {getattr(config, k, None) for k in ("max_position_embeddings", "n_positions")} - {None}
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tables = [m for m in model.modules()
              if isinstance(m, nn.Embedding) and m is not tokens and m.num_embeddings in longest]
    return rotaries, tables


@contextlib.contextmanager
def sequence_shard(model: nn.Module, cp_mesh, inputs: torch.Tensor, labels: torch.Tensor, *,
                   shift_labels: bool = False):
    """Inside: ring attention on, and this rank's share of the batch, as
    (inputs, labels); the model's position tables (`position_tables`) and rotary
    embeddings (a module with an `inv_freq` buffer, as transformers' are) see the
    global positions of the rank's tokens.
    `inputs` and `labels` are (batch, seq); labels are aligned with inputs, or
    `shift_labels=True` (Hugging Face's convention: the model shifts them) shifts
    them over the whole sequence first, as transformers' own loss would, with
    -100 after the last token. The user's tensors and buffers are left as they
    were on exit."""
    from torch.distributed.tensor.experimental import context_parallel
    register_cpu_ring_attention()
    b, s = inputs.shape
    inputs, labels = inputs.clone(), labels.clone()
    if shift_labels:
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    buffers, dims, hooks = [inputs, labels], [1, 1], []
    rotaries, embeddings = position_modules(model) if _hf_config(model) is not None else ([], [])
    if rotaries or embeddings:
        # transformers numbers the tokens it is given 0..s/cp - 1. Its position modules
        # must see their global positions, but its mask builder must not: positions that
        # jump (the balanced order) read as packed documents and build a mask, where
        # plain local positions let SDPA run is_causal, which the ring splits.
        positions = torch.arange(s, device=inputs.device).expand(b, s).contiguous()
        buffers.append(positions)
        dims.append(1)
        hooks = [m.register_forward_pre_hook(_global_positions(positions), with_kwargs=True) for m in rotaries]
        hooks += [m.register_forward_pre_hook(_global_ids(positions)) for m in embeddings]
    tables = position_tables(model, s)
    originals = [module._buffers[name] for module, name in tables]
    for module, name in tables:
        module._buffers[name] = module._buffers[name][:s].clone()  # the model slices [:local s]: rows of this rank
        buffers.append(module._buffers[name])
        dims.append(0)
    try:
        with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=set(buffers)):
            yield inputs, labels
    finally:
        for hook in hooks:
            hook.remove()
        for (module, name), original in zip(tables, originals):
            module._buffers[name] = original


def model_refusal(model: nn.Module, seq_len, *, n_inputs: int = 1, graph=None) -> str | None:
    """Why no cp can run on `model` (what_runs' "cp"), or None: `refusal` at cp 2 on its
    sequence rounded up to 4 tokens (each plan's own 2 x cp chunks are checked with it)."""
    if not seq_len:
        return "the model's inputs have no sequence axis to cut"
    return refusal(model, seq_len + (-seq_len) % 4, 2, n_inputs=n_inputs, graph=graph)


def plan_refusal(model: nn.Module, plan, example_inputs) -> str | None:
    """Why `plan`'s mesh.cp cannot run on `model` as autopar lowers it, or None:
    `refusal` on the example inputs' sequence, and what the lowering does not compose
    cp with yet (a pipeline, whose stages are built for the whole sequence; HSDP)."""
    cp = plan.mesh.cp or 1
    if cp == 1:
        return None
    if plan.mesh.pp > 1:
        return f"context parallel {cp} under a pipeline (pp {plan.mesh.pp}) is not lowered; use pp 1 with cp"
    if plan.mesh.hsdp:
        return f"context parallel {cp} with HSDP (mesh.dp_shard) is not lowered; drop dp_shard with cp"
    if callable(example_inputs):  # batch size -> one micro-batch's inputs
        example_inputs = example_inputs(plan.micro_batch_size)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    first = inputs[0] if inputs else None
    if not isinstance(first, torch.Tensor) or first.dim() != 2 or first.is_floating_point():
        return "context parallel cuts token ids of shape (batch, seq); these example inputs are not"
    return (refusal(model, plan.seq_len or first.shape[1], cp, n_inputs=len(inputs))
            or attention_refusal(model, inputs))


def attention_refusal(model: nn.Module, inputs: tuple) -> str | None:
    """How the model calls SDPA, seen in one forward on fake tensors (model_io.probe_forward,
    no real weight read, no collective): torch's load-balanced ring takes is_causal without a
    mask only. None also when the probe cannot run the model (the step then says why)."""
    from autopar.lower.model_io import forward_kwargs, probe_forward
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        calls.append((mask is not None, bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))))
        return sdpa(*args, **kwargs)
    F.scaled_dot_product_attention = spy
    try:
        with probe_forward(model):
            model(*inputs, **forward_kwargs(model))
    except Exception:  # noqa: BLE001 - undecided here
        return None
    finally:
        F.scaled_dot_product_attention = sdpa
    if not calls:
        return "the model calls no scaled_dot_product_attention, which is what context parallel splits"
    if any(mask for mask, _ in calls):
        return "the model passes an attention mask tensor to SDPA: torch's ring attention takes is_causal only"
    if not all(causal for _, causal in calls):
        return "the model runs non-causal attention: the load-balanced ring needs is_causal=True"
    return None


def check_plan(model: nn.Module, plan, example_inputs) -> None:
    """`plan_refusal` as an error, on every rank before any process group."""
    reason = plan_refusal(model, plan, example_inputs)
    if reason:
        raise PlanMismatchError(f"mesh.cp {plan.mesh.cp} cannot run: {reason}")


@contextlib.contextmanager
def step_shard(model: nn.Module, cp_mesh, inputs: tuple, targets: torch.Tensor, loss_fn):
    """One step's batch cut over cp (`sequence_shard`), as ((inputs,), targets). A
    loss that shifts its labels itself (transformers' causal LM loss) gets them
    shifted over the whole sequence first and told so (`labels_shifted`)."""
    seq = targets.shape[1] if targets.dim() >= 2 else 0
    cp = cp_mesh.size()
    if seq % (2 * cp):
        raise PlanMismatchError(f"context parallel {cp} needs the sequence ({seq}) in 2 x cp = {2 * cp} equal "
                                f"chunks; pad the batch's sequences to a multiple of {2 * cp}")
    shift = bool(getattr(loss_fn, "shift", False))
    # the ring of K/V sends, each overlapped with a step's attention, as cost_models/context_parallel.py
    # prices it (torch's default rotation all-gathers every shard after the first step instead)
    from torch.distributed.tensor.experimental import _attention as cp_api
    cp_api.set_rotate_method("alltoall")
    with sequence_shard(model, cp_mesh, inputs[0], targets, shift_labels=shift) as (x, y):
        ring_sdpa = F.scaled_dot_product_attention  # torch's CP wrapper, installed by the context
        F.scaled_dot_product_attention = _heads_local(ring_sdpa)
        loss_fn.labels_shifted = shift
        try:
            yield (x,), y
        finally:
            loss_fn.labels_shifted = False
            F.scaled_dot_product_attention = ring_sdpa  # before the context restores its own


def _heads_local(ring_sdpa):
    """SDPA whose tensor-parallel DTensor inputs (q, k, v on the tp mesh, heads split)
    enter torch's ring as this rank's heads: the ring takes plain tensors or its own
    Shard(seq) DTensors only. The output goes back to the tp placements it came in."""
    from torch.distributed.tensor import DTensor

    def sdpa(query, key, value, *args, **kwargs):
        if not isinstance(query, DTensor):
            return ring_sdpa(query, key, value, *args, **kwargs)
        out = ring_sdpa(query.to_local(), key.to_local(), value.to_local(), *args, **kwargs)
        return DTensor.from_local(out, query.device_mesh, query.placements, run_check=False)
    return sdpa


def check(model: nn.Module, seq_len: int, cp: int, *, n_inputs: int = 1, graph=None) -> None:
    """`refusal` as an error (every rank raises alike, before any collective)."""
    reason = refusal(model, seq_len, cp, n_inputs=n_inputs, graph=graph)
    if reason:
        raise PlanMismatchError(reason)


def unshard(cp_mesh, tensor: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence back in order (torch's `context_parallel_unshard`;
    for checks and evaluation, not the training step)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import context_parallel_unshard
    return context_parallel_unshard(cp_mesh, [tensor], [seq_dim])[0]


__all__ = ["check", "check_plan", "model_refusal", "plan_refusal", "step_shard", "graph_refusal", "position_tables", "refusal",
           "register_cpu_ring_attention", "sequence_shard", "unshard"]
