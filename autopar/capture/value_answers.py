"""Answers for the few ops whose output size or result is a tensor's value,
in forwards that run on fake tensors to read shapes (the lowering's block,
pipeline and output probes).

An eager MoE loop (DBRX's `for e in mask.sum(...).nonzero(): idx = torch.where(
mask[e])`) sizes its token lists by routing values, which fake tensors do not
have: FakeTensorMode raises on `nonzero` and on reading an integer back
(`.item()`, a 0-dim index). Such a loop still returns a tensor of a fixed
shape (`index_add_` into the layer's output), so the probe only needs *some*
consistent answer: `nonzero` of n elements returns `share` x n zero indices
(index 0 is valid on every dimension; a boolean mask indexing a tensor selects
as many), and an integer read back is 0 (expert 0 is shaped like every other).

Whether an answer leaked into a shape the probe records is not assumed: a
caller that saw answers (`answered`) probes again with another share and
compares (`what_runs.record_blocks`). A layer whose outputs are sized by
values (a boolean mask keeping some tokens) then differs and is refused.
Floating-point and boolean reads are not answered: a branch on them would
take one side silently.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class ValueAnswers(TorchDispatchMode):
    """Enter inside FakeTensorMode (after it): answers `nonzero` and integer `.item()`."""

    def __init__(self, share: float = 0.5):
        super().__init__()
        self.share = share
        self.answered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _ANSWERED:
            return func(*args, **kwargs)
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
        try:
            return func(*args, **kwargs)  # a value fake tensors know (a constant) is its own answer
        except (DynamicOutputShapeException, DataDependentOutputException):
            if func is aten._local_scalar_dense.default and not _is_integer(args[0]):
                raise
        self.answered += 1
        if func is aten._local_scalar_dense.default:
            return 0
        if func is aten.index.Tensor:
            # boolean-mask indexing: FakeTensorMode runs its nonzero inside, unseen here
            x, indices = args
            return func(x, [i for m in indices for i in self._positions(m)])
        return self._nonzero(args[0])

    def _nonzero(self, x):
        rows = max(1, int(x.numel() * self.share)) if x.numel() else 0
        return torch.zeros((rows, x.dim()), dtype=torch.long, device=x.device)

    def _positions(self, index):
        """A boolean mask as the long indices it selects (one per dimension it spans)."""
        if index is None or index.dtype is not torch.bool:
            return [index]
        return list(self._nonzero(index).unbind(1))


_ANSWERED = (aten.nonzero.default, aten._local_scalar_dense.default, aten.index.Tensor)


def _is_integer(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.numel() == 1 and not t.dtype.is_floating_point
            and not t.dtype.is_complex and t.dtype is not torch.bool)
