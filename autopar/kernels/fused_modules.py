"""Drop-in fused versions of nn modules, made by swapping an instance's class.

The fusion pass never builds new modules: it changes the class of the
matched instance to a subclass of its own class that adds the fused path.
Parameters, buffers, hooks and names stay exactly what they were (so a
state dict, FSDP wrapping or a TP plan keyed by module path is unaffected),
`isinstance(m, nn.LayerNorm)` still holds, and a call with the original
arguments still runs the original forward. Only the rewritten block graph
calls the extra argument (`residual`) that selects the fused kernel.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.kernels.add_norm import add_layernorm, add_rmsnorm
from autopar.kernels.dropout_add import dropout_add, new_seed


def norm_eps(m: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    if isinstance(m, nn.RMSNorm) and m.eps is None:
        return float(torch.finfo(m.weight.dtype if m.weight is not None else torch.float32).eps)
    raise AttributeError(f"{type(m).__name__} has no eps attribute")


class _Pair(tuple):
    """(normed output, residual stream). Under sequence parallelism the norm
    runs on DTensors and TP's output hook calls `.to_local()` on what the
    module returns; a pair answers that for both tensors."""

    def to_local(self):
        return _Pair(t.to_local() if hasattr(t, "to_local") else t for t in self)


def _residual_like(x, residual):
    # SequenceParallel turned x (a local sequence shard) into a DTensor; the
    # residual, passed by keyword, is the same kind of local shard.
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor) and not isinstance(residual, DTensor):
        return DTensor.from_local(residual, x.device_mesh, x.placements, run_check=False)
    return residual


class _FusedAddLayerNormMixin:
    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        residual = _residual_like(x, residual)
        if residual.shape != x.shape:  # a broadcasting add: eager semantics
            h = x + residual
            return _Pair((super().forward(h), h))
        return _Pair(add_layernorm(x, residual, self.weight, self.bias, self.eps))


class _FusedAddRMSNormMixin:
    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        residual = _residual_like(x, residual)
        if residual.shape != x.shape:
            h = x + residual
            return _Pair((super().forward(h), h))
        return _Pair(add_rmsnorm(x, residual, self.weight, norm_eps(self)))


class _FusedDropoutAddMixin:
    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        if residual.shape != x.shape or not self.training or self.p == 0.0:
            return super().forward(x) + residual
        return dropout_add(x, residual, p=self.p, seed=new_seed(), training=True)


_MIXINS = {
    "add_layernorm": _FusedAddLayerNormMixin,
    "add_rmsnorm": _FusedAddRMSNormMixin,
    "dropout_add": _FusedDropoutAddMixin,
}
_CLASSES: dict[tuple[str, type], type] = {}


def fused_class(kind: str, cls: type) -> type:
    """The subclass of `cls` with the fused path of `kind` (cached: one class per pair)."""
    if issubclass(cls, _MIXINS[kind]):
        return cls
    key = (kind, cls)
    if key not in _CLASSES:
        # Registered under a unique module-level name so a fused model pickles
        # (torch.save(model)) and unpickles in a process that imported autopar.
        name = f"Fused{cls.__name__}"
        while name in globals():
            name += "_"
        new = type(name, (_MIXINS[kind], cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = new
        _CLASSES[key] = new
    return _CLASSES[key]


def swap_class(m: nn.Module, kind: str, **attrs) -> nn.Module:
    m.__class__ = fused_class(kind, type(m))
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def _fx_leaf(fn):
    """Keep `fn` one opaque call when fx traces code that calls it (unpickling
    a GraphModule re-traces its code; the bodies branch on tensor shapes,
    which a trace cannot). fx.wrap cannot do it: it patches only the
    wrapping module's globals, and generated code has its own."""
    import functools

    @functools.wraps(fn)
    def call(*args, **kwargs):
        proxy = next((a for a in args if isinstance(a, torch.fx.Proxy)), None)
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", call, args, kwargs)
        return fn(*args, **kwargs)

    return call


@_fx_leaf
def fused_masked_softmax(scores, mask, scale, dim=-1):
    """softmax((scores * scale).masked_fill(mask, -inf)) through the fused kernel when
    `mask` is the causal (upper-triangular) mask; any other mask runs eagerly.
    Used when the pass could not prove the mask causal from the graph; the
    check compares the mask with triu(1) on every call (a host sync on GPU)."""
    from autopar.kernels.softmax import scaled_masked_softmax

    sq, sk = scores.shape[-2], scores.shape[-1]
    causal = (
        mask is not None and dim in (-1, scores.dim() - 1) and mask.dtype == torch.bool and mask.shape[-2:] == (sq, sk)
        and all(d == 1 for d in mask.shape[:-2])
        and torch.equal(mask.reshape(sq, sk), torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(1))
    )
    if causal:
        return scaled_masked_softmax(scores, scale, causal=True)
    s = scores * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, dim=dim)


@_fx_leaf
def fused_causal_softmax(scores, scale):
    """The fusion pass proved the mask causal from the graph (a sliced triu buffer)."""
    from autopar.kernels.softmax import scaled_masked_softmax

    return scaled_masked_softmax(scores, scale, causal=True)


@_fx_leaf
def fused_scaled_softmax(scores, scale, dim=-1):
    from autopar.kernels.softmax import scaled_masked_softmax

    if dim not in (-1, scores.dim() - 1):
        return torch.softmax(scores * scale, dim=dim)
    return scaled_masked_softmax(scores, scale, causal=False)


@_fx_leaf
def swiglu_fn(gate, up):
    from autopar.kernels.swiglu import swiglu

    return swiglu(gate, up)

