"""Residual add + LayerNorm / RMSNorm in one pass.

Why fuse: a pre-norm transformer computes `h = x + residual` and then
`norm(h)`; eager reads x and residual, writes h, reads h again, and writes
the normed output (plus mean/rstd). The fused kernel reads x and residual
once and writes h and the output; backward reads h (not x and residual),
adds the gradient arriving through the residual stream, and reduces the
weight and bias gradients in the same pass (per-program partial sums over
the rows it owns, finished by a small torch sum).

Both functions return `(out, h)`: the normed output and the residual stream
after the add, which the next residual add consumes. `h` is rounded to the
storage dtype before it is normalised, exactly as eager does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from autopar.kernels._runtime import (
    HAVE_TRITON, MAX_ROW_BLOCK, new_empty, plain, next_pow2, num_warps_for, reduce_programs, rows_of, use_triton,
)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_norm_fwd_kernel(X, R, W, B, Y, H, MEAN, RSTD, N, eps,
                             HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                             RMS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        h = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_R:
            h += tl.load(R + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            h = h.to(H.dtype.element_ty)
            tl.store(H + row * N + cols, h, mask=mask)
            h = h.to(tl.float32)
        if RMS:
            mean = 0.0
            xc = h
        else:
            mean = tl.sum(h, axis=0) / N
            xc = tl.where(mask, h - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        y = xc * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _add_norm_bwd_kernel(DY, DH, H, W, MEAN, RSTD, DX, DW_PART, DB_PART, M, N,
                             HAS_DH: tl.constexpr, HAS_W: tl.constexpr, RMS: tl.constexpr,
                             G: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            w = tl.where(mask, 1.0, 0.0)
        dw_acc = tl.zeros((BLOCK,), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK,), dtype=tl.float32)
        zero64 = pid.to(tl.int64) * 0  # widens `row` to int64 (row * N can pass 2**31)
        for row in range(pid, M, G):
            off = (zero64 + row) * N + cols
            h = tl.load(H + off, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + off, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            if RMS:
                xhat = h * rstd
            else:
                xhat = tl.where(mask, (h - tl.load(MEAN + row)) * rstd, 0.0)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / N
            if RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                c2 = tl.sum(wdy, axis=0) / N
                dx = (wdy - (xhat * c1 + c2)) * rstd
            if HAS_DH:  # gradient arriving through the residual stream
                dx += tl.load(DH + off, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=mask)
            dw_acc += dy * xhat
            db_acc += dy
        tl.store(DW_PART + pid * N + cols, dw_acc, mask=mask)
        tl.store(DB_PART + pid * N + cols, db_acc, mask=mask)


def _launch_forward(x, residual, weight, bias, eps: float, rms: bool):
    """-> (y, h, mean, rstd) as (m, n) rows; h is x's rows when there is no residual."""
    n = x.shape[-1]
    x2 = rows_of(x)
    m = x2.shape[0]
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(h_dtype, weight.dtype) if (rms and weight is not None) else h_dtype
    r2 = rows_of(residual) if residual is not None else x2
    h2 = new_empty((m, n), h_dtype, x.device) if residual is not None else x2
    y = new_empty((m, n), out_dtype, x.device)
    mean = new_empty((m,), torch.float32, x.device)
    rstd = new_empty((m,), torch.float32, x.device)
    block = next_pow2(n)
    w = weight.contiguous() if weight is not None else x2
    b = bias.contiguous() if bias is not None else x2
    _add_norm_fwd_kernel[(m,)](
        x2, r2, w, b, y, h2, mean, rstd, n, eps,
        HAS_R=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
        RMS=rms, BLOCK=block, num_warps=num_warps_for(block))
    return y, h2, mean, rstd


def _add_norm_forward(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor],
                      bias: Optional[torch.Tensor], eps: float, rms: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h2, mean, rstd = _launch_forward(x, residual, weight, bias, eps, rms)
    return y.view(x.shape), h2.view(x.shape), mean, rstd


def _norm_forward(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                  rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, _, mean, rstd = _launch_forward(x, None, weight, bias, eps, rms)
    return y.view(x.shape), mean, rstd


def _norm_backward(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor, weight: Optional[torch.Tensor],
                   mean: torch.Tensor, rstd: torch.Tensor, rms: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dx in h's dtype, shaped as h; dweight and dbias as fp32 column sums)."""
    h2 = rows_of(h)
    m, n = h2.shape
    g = reduce_programs(m, h2.device)
    dx = new_empty((m, n), h2.dtype, h2.device)
    dw_part = new_empty((g, n), torch.float32, h2.device)
    db_part = new_empty((g, n), torch.float32, h2.device)
    block = next_pow2(n)
    dy2 = rows_of(dy)
    dh2 = rows_of(dh) if dh is not None else dy2
    _add_norm_bwd_kernel[(g,)](
        dy2, dh2, h2, weight if weight is not None else h2, mean, rstd, dx, dw_part, db_part, m, n,
        HAS_DH=dh is not None, HAS_W=weight is not None, RMS=rms,
        G=g, BLOCK=block, num_warps=num_warps_for(block))
    return dx.view(h.shape), dw_part.sum(0), db_part.sum(0)


def _out_dtype(x, residual, weight, rms):
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return (torch.promote_types(h_dtype, weight.dtype) if (rms and weight is not None) else h_dtype), h_dtype


def _add_norm_fake(x, residual, weight, bias, eps, rms):
    out_dtype, h_dtype = _out_dtype(x, residual, weight, rms)
    rows = x.numel() // x.shape[-1]
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=h_dtype),
            x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32))


def _norm_fake(x, weight, bias, eps, rms):
    y, _, mean, rstd = _add_norm_fake(x, None, weight, bias, eps, rms)
    return y, mean, rstd


def _norm_backward_fake(dy, dh, h, weight, mean, rstd, rms):
    n = h.shape[-1]
    return h.new_empty(h.shape), h.new_empty((n,), dtype=torch.float32), h.new_empty((n,), dtype=torch.float32)


# torch.library ops: compiled code (a torch.compile'd block) calls them as opaque ops,
# with their fake (shape-only) versions for tracing and the backward op for autograd
_add_norm_op = torch.library.custom_op("autopar::add_norm", _add_norm_forward, mutates_args=())
_add_norm_op.register_fake(_add_norm_fake)
_norm_op = torch.library.custom_op("autopar::norm", _norm_forward, mutates_args=())
_norm_op.register_fake(_norm_fake)
_norm_backward_op = torch.library.custom_op("autopar::norm_backward", _norm_backward, mutates_args=())
_norm_backward_op.register_fake(_norm_backward_fake)


def _setup(ctx, inputs, output):
    if len(inputs) == 6:  # add_norm: (x, residual, weight, bias, eps, rms) -> (y, h, mean, rstd)
        x, residual, weight, bias, _, rms = inputs
        h = output[1]
    else:  # norm: (x, weight, bias, eps, rms) -> (y, mean, rstd)
        (x, weight, bias, _, rms), residual = inputs, None
        h = x
    ctx.save_for_backward(h, weight, output[-2], output[-1])
    ctx.rms, ctx.has_bias = rms, bias is not None
    ctx.x_dtype, ctx.r_dtype = x.dtype, residual.dtype if residual is not None else None


def _grads(ctx, dy, dh):
    h, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _norm_backward_op(dy, dh, h, weight, mean, rstd, ctx.rms)
    dw = dw.to(weight.dtype) if weight is not None else None
    db = db.to(weight.dtype if weight is not None else h.dtype) if ctx.has_bias else None
    return dx.to(ctx.x_dtype), (dx.to(ctx.r_dtype) if ctx.r_dtype is not None else None), dw, db


def _add_norm_grad(ctx, dy, dh, _dmean, _drstd):
    dx, dres, dw, db = _grads(ctx, dy, dh)
    return dx, dres, dw, db, None, None


def _norm_grad(ctx, dy, _dmean, _drstd):
    dx, _, dw, db = _grads(ctx, dy, None)
    return dx, dw, db, None, None


_add_norm_op.register_autograd(_add_norm_grad, setup_context=_setup)
_norm_op.register_autograd(_norm_grad, setup_context=_setup)


def _apply(x, residual, weight, bias, eps: float, rms: bool):
    """(out, h): the op with a residual, or the norm alone (h is x)."""
    if residual is None:
        return _norm_op(x, weight, bias, float(eps), rms)[0], x
    out, h, _, _ = _add_norm_op(x, residual, weight, bias, float(eps), rms)
    return out, h


def _local_add_norm(x, residual, weight, bias, eps, rms):
    """Sequence parallelism: x and the residual are DTensors sharded on a
    non-normalised dim (the sequence), the norm's parameters replicated. Each
    rank normalises its own rows, so the kernel runs on the local shards; the
    weight / bias gradients computed from local rows are partial sums, which
    `to_local(grad_placements=Partial)` tells DTensor to reduce."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not (isinstance(x, DTensor) and isinstance(residual, DTensor)) or x.placements != residual.placements:
        return None
    last = x.dim() - 1
    if any(p.is_partial() or (p.is_shard() and p.dim % x.dim() == last) for p in x.placements):
        return None
    params = [t for t in (weight, bias) if t is not None]
    if not all(isinstance(t, DTensor) and t.device_mesh == x.device_mesh and all(p.is_replicate() for p in t.placements)
               for t in params):
        return None
    grad_pl = [Partial() if p.is_shard() else Replicate() for p in x.placements]
    xl, rl = plain(x.to_local()), plain(residual.to_local())
    wl = weight.to_local(grad_placements=grad_pl) if weight is not None else None
    bl = bias.to_local(grad_placements=grad_pl) if bias is not None else None
    if not use_triton(xl, rl, wl, bl):
        return None
    out, h = _apply(xl, rl, wl, bl, eps, rms)

    def wrap(t):
        return DTensor.from_local(t, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())

    return wrap(out), wrap(h)


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _check(x, residual, weight, name):
    from autopar.errors import AutoparError

    if residual is not None and residual.shape != x.shape:
        raise AutoparError(f"{name}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise AutoparError(f"{name}: weight shape {tuple(weight.shape)} must be ({x.shape[-1]},)")


def add_layernorm_reference(x, residual, weight, bias, eps: float = 1e-5):
    h = x if residual is None else x + residual
    return F.layer_norm(h, h.shape[-1:], weight, bias, eps), h


def add_layernorm(x, residual, weight, bias, eps: float = 1e-5):
    """(layer_norm(x + residual), x + residual). `residual`, `weight`, `bias` may be None."""
    _check(x, residual, weight, "add_layernorm")
    x, residual = plain(x), plain(residual)
    if _is_dtensor(x) and HAVE_TRITON and residual is not None:
        pair = _local_add_norm(x, residual, weight, bias, eps, rms=False)
        if pair is not None:
            return pair
    if not use_triton(x, residual, weight, bias) or next_pow2(x.shape[-1]) > MAX_ROW_BLOCK:
        return add_layernorm_reference(x, residual, weight, bias, eps)
    return _apply(x, residual, weight, bias, eps, False)


def add_rmsnorm_reference(x, residual, weight, eps: float = 1e-6):
    h = x if residual is None else x + residual
    hf = h.float()
    out = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return (out * weight if weight is not None else out), h


def add_rmsnorm(x, residual, weight, eps: float = 1e-6):
    """(rms_norm(x + residual) * weight, x + residual), normalised in fp32 as Llama does."""
    _check(x, residual, weight, "add_rmsnorm")
    x, residual = plain(x), plain(residual)
    if _is_dtensor(x) and HAVE_TRITON and residual is not None:
        pair = _local_add_norm(x, residual, weight, None, eps, rms=True)
        if pair is not None:
            return pair
    if not use_triton(x, residual, weight) or next_pow2(x.shape[-1]) > MAX_ROW_BLOCK:
        return add_rmsnorm_reference(x, residual, weight, eps)
    return _apply(x, residual, weight, None, eps, True)


def make_add_layernorm_inputs(seed: int, shape=None, dtype=torch.float32):
    shape = tuple(shape or (3, 5, 1000))
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    b = (0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return (x, r, w, b)


def make_add_rmsnorm_inputs(seed: int, shape=None, dtype=torch.float32):
    x, r, w, _ = make_add_layernorm_inputs(seed, shape, dtype)
    return (x, r, w)
