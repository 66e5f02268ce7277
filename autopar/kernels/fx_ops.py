"""Recognising ops and modules in a traced fx graph, for the fusion patterns
(autopar/kernels/patterns/): which function or method a node calls, which
module it runs, whether a user class computes RMSNorm."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autopar.kernels import fused_modules as fm

ADD = {operator.add, torch.add}
MUL = {operator.mul, torch.mul}
GELU = {F.gelu}
SILU = {F.silu}
SOFTMAX = {F.softmax, torch.softmax}
DROPOUT = {F.dropout}


def is_fn(n: fx.Node, fns: set, method: str | None = None) -> bool:
    if n.op == "call_function" and n.target in fns:
        return True
    return method is not None and n.op == "call_method" and n.target == method


def module_of(n: fx.Node, modules: dict) -> nn.Module | None:
    return modules.get(n.target) if n.op == "call_module" else None


def is_rmsnorm(m: nn.Module) -> bool:
    """torch's RMSNorm, or a user RMSNorm (Llama / HF style: a 1-D `weight` and an eps).
    A user class is only trusted after `rmsnorm_probe` agrees numerically."""
    # _parameters, not getattr: while fx traces, module attribute access
    # returns proxies for parameters.
    w = m._parameters.get("weight")
    if isinstance(m, nn.RMSNorm):
        return w is not None
    return ("rmsnorm" in type(m).__name__.lower() and isinstance(w, nn.Parameter) and w.dim() == 1
            and any(isinstance(getattr(m, a, None), float) for a in ("eps", "variance_epsilon", "epsilon")))


def rmsnorm_probe(m: nn.Module) -> bool:
    """Does this module compute weight * x / sqrt(mean(x^2) + eps)? Run on two
    random rows, one scaled down so eps matters, with a random weight put in
    for the call (a freshly initialised all-ones weight could not show that
    the module multiplies by it), then the real weight is restored."""
    from autopar.kernels.add_norm import add_rmsnorm_reference

    if isinstance(m, nn.RMSNorm):
        return True
    w = m.weight
    if w.is_meta or type(w.data) is not torch.Tensor:
        return True  # nothing to run on; the name and attributes matched
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, w.shape[0], generator=g) * torch.tensor([[1.0], [1e-3]])
    x = x.to(device=w.device, dtype=w.dtype)
    probe_w = (1 + 0.5 * torch.randn(w.shape[0], generator=g)).to(device=w.device, dtype=w.dtype)
    saved = w.detach().clone()
    tol = 1e-3 if w.dtype == torch.float32 else 3e-2
    try:
        with torch.no_grad():
            w.copy_(probe_w)
            want, _ = add_rmsnorm_reference(x, None, w, fm.norm_eps(m))
            got = m(x)
    except Exception:
        return False
    finally:
        with torch.no_grad():
            w.copy_(saved)
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max())))


def is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) or is_rmsnorm(m)


def other_arg(n: fx.Node, a: Any) -> Any:
    x, y = n.args[0], n.args[1]
    return y if x is a else x


def only_user(n: fx.Node, user: fx.Node) -> bool:
    return list(n.users) == [user]
