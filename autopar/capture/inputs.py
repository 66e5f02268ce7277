"""Example inputs -> meta inputs at any (batch, seq).

Only shapes and dtypes of the example inputs are used. The batch axis is
found by calling `example_inputs(1)` and `example_inputs(2)` and seeing which
dims change (or, for a fixed tuple, dim 0 of every tensor whose dim 0 is the
given batch). The sequence axis is dim 1 of 2-D integer tensors (token ids,
masks, labels) and of 3-D float tensors (embedded sequences); a model with
neither (images) has no sequence axis.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.errors import CaptureError


@dataclass
class InputTemplate:
    spec: object  # pytree spec of (args, kwargs)
    leaves: list  # per leaf: ("tensor", shape, dtype, batch_dim, seq_dims) or ("value", v)
    seq: int | None

    def make(self, batch: int, seq: int | None, dtype: torch.dtype | None = None):
        """Meta inputs at (batch, seq); floating inputs in the capture dtype (as
        a bf16 training loop casts its inputs)."""
        flat = []
        for leaf in self.leaves:
            if leaf[0] == "value":
                flat.append(leaf[1])
                continue
            _, shape, leaf_dtype, batch_dim, seq_dims = leaf
            shape = list(shape)
            if batch_dim is not None:
                shape[batch_dim] = batch
            for d in seq_dims if seq is not None else ():
                shape[d] = seq
            if dtype is not None and leaf_dtype.is_floating_point:
                leaf_dtype = dtype
            flat.append(torch.empty(shape, dtype=leaf_dtype, device="meta"))
        args, kwargs = tree_unflatten(flat, self.spec)
        return args, kwargs


def _split(value) -> tuple[tuple, dict]:
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if not isinstance(value, (tuple, list)):
        raise CaptureError(f"example inputs must be a tuple of tensors (or a callable returning one), "
                           f"got {type(value).__name__}",
                           hint="example_inputs(batch_size) should return e.g. (torch.randint(0, vocab, (batch_size, seq)),)")
    value = tuple(value)
    if value and isinstance(value[-1], dict):  # (args..., {kwargs})
        return value[:-1], dict(value[-1])
    return value, {}


def template_from(example_inputs, seq_dim="auto") -> InputTemplate:
    if callable(example_inputs):
        try:
            one, two = _split(example_inputs(1)), _split(example_inputs(2))
        except CaptureError:
            raise
        except Exception as exc:
            raise CaptureError(f"example_inputs(batch_size) raised {type(exc).__name__}: {exc}") from exc
        flat, spec = tree_flatten(one)
        flat2, spec2 = tree_flatten(two)
        if spec != spec2:
            raise CaptureError("example_inputs(1) and example_inputs(2) return different structures",
                               hint="return the same tuple of tensors for every batch size")
        batch_dims = []
        for a, b in zip(flat, flat2):
            if isinstance(a, torch.Tensor):
                changed = [d for d in range(a.dim()) if a.shape[d] != b.shape[d]]
                batch_dims.append(changed[0] if changed else None)
            else:
                batch_dims.append(None)
    else:
        flat, spec = tree_flatten(_split(example_inputs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0]
        given = tensors[0].shape[0] if tensors else None
        batch_dims = [0 if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == given else None
                      for x in flat]
    # Sequence axis: dim 1 of batched token-like / embedded-sequence inputs.
    seq_dims, seqs = {}, set()
    for i, (x, bd) in enumerate(zip(flat, batch_dims)):
        if not isinstance(x, torch.Tensor):
            continue
        if seq_dim == "auto":
            token_like = x.dim() == 2 and not x.is_floating_point()
            embedded = x.dim() == 3 and x.is_floating_point()
            if bd == 0 and (token_like or embedded):
                seq_dims[i] = (1,)
        elif isinstance(seq_dim, int) and bd is not None and x.dim() > seq_dim:
            seq_dims[i] = (seq_dim,)
        seqs.update(x.shape[d] for d in seq_dims.get(i, ()))
    if len(seqs) > 1:  # inputs of different lengths (encoder/decoder): keep the length fixed
        seq_dims, seqs = {}, set()
    seq = seqs.pop() if seqs else None
    leaves = []
    for i, (x, bd) in enumerate(zip(flat, batch_dims)):
        if not isinstance(x, torch.Tensor):
            leaves.append(("value", x))
            continue
        dims = seq_dims.get(i, ())
        if seq is not None and bd is None and not dims:
            # An unbatched mask or bias over positions, e.g. an (s, s) attention mask.
            dims = tuple(d for d in range(x.dim()) if x.shape[d] == seq)
        leaves.append(("tensor", tuple(x.shape), x.dtype, bd, dims))
    if not any(leaf[0] == "tensor" for leaf in leaves):
        raise CaptureError("example inputs contain no tensor", hint="return at least one input tensor")
    return InputTemplate(spec, leaves, seq)
