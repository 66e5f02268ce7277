"""Shape-only runs of ops whose meta kernel refuses fp32.

Some meta kernels accept only the dtypes their fast device kernel has:
`aten._grouped_mm` (transformers' MoE experts) is bf16-only on meta and
under FakeTensorMode, while its CPU kernel runs fp32 and one process trains
fine. Capture and lowering's probes read shapes, not values, so such an op
is run on bf16 copies of its fp32 inputs and its outputs are handed back in
fp32.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


def shapes_in_bf16(func, args, kwargs):
    """func's outputs computed on bf16 copies of its fp32 inputs, cast back; None when that fails too."""
    flat = tree_flatten((args, kwargs))[0]
    if not any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in flat):
        return None

    def low(t):
        return t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t
    try:
        out = func(*tree_map(low, args), **tree_map(low, kwargs))
    except Exception:  # noqa: BLE001 - the caller reports the original error
        return None
    return tree_map(lambda t: t.to(torch.float32) if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
                    else t, out)


class Bf16ShapeFallback(TorchDispatchMode):
    """Enter inside FakeTensorMode: an op that fails in fp32 is retried in bf16 (see above)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception:
            out = shapes_in_bf16(func, args, kwargs)
            if out is None:
                raise
            return out
