"""Scale + causal mask + softmax over attention scores (where SDPA is not used).

Why fuse: hand-written attention does `scores * scale`, `masked_fill(mask,
-inf)` and `softmax` as three kernels over a (batch, heads, q, k) tensor,
the largest activation of the layer. The fused kernel reads the scores once
and writes the probabilities once; backward needs only the probabilities
(dx = scale * p * (dp - sum(dp * p))), never the masked scores.

Causal masking is top-left aligned, as `F.scaled_dot_product_attention(...,
is_causal=True)` does: query i sees keys 0..i.
"""
from __future__ import annotations

import torch

from autopar.kernels._runtime import HAVE_TRITON, MAX_ROW_BLOCK, new_empty, next_pow2, num_warps_for, rows_of, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _softmax_fwd_kernel(X, Y, SQ, N, scale, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < N
        if CAUSAL:
            valid = valid & (cols <= row % SQ)
        x = tl.load(X + row * N + cols, mask=valid, other=0.0).to(tl.float32) * scale
        x = tl.where(valid, x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        y = e / tl.sum(e, axis=0)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=cols < N)

    @triton.jit
    def _softmax_bwd_kernel(DY, Y, DX, N, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        y = tl.load(Y + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        dx = scale * y * (dy - tl.sum(dy * y, axis=0))
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)


def _softmax_forward(x: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    x2 = rows_of(x)
    m, n = x2.shape
    sq = x.shape[-2] if x.dim() >= 2 else 1
    y = new_empty((m, n), x.dtype, x.device)
    block = next_pow2(n)
    _softmax_fwd_kernel[(m,)](x2, y, sq, n, scale, CAUSAL=causal, BLOCK=block, num_warps=num_warps_for(block))
    return y.view(x.shape)


def _softmax_backward(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    y2 = rows_of(y)
    m, n = y2.shape
    dx = new_empty((m, n), y.dtype, y.device)
    block = next_pow2(n)
    _softmax_bwd_kernel[(m,)](rows_of(dy), y2, dx, n, scale, BLOCK=block, num_warps=num_warps_for(block))
    return dx.view(y.shape)


# torch.library ops: compiled code calls them as opaque ops (fake versions for tracing)
_softmax_op = torch.library.custom_op("autopar::scaled_masked_softmax", _softmax_forward, mutates_args=())
_softmax_op.register_fake(lambda x, scale, causal: torch.empty_like(x, memory_format=torch.contiguous_format))
_softmax_backward_op = torch.library.custom_op("autopar::scaled_masked_softmax_backward", _softmax_backward,
                                               mutates_args=())
_softmax_backward_op.register_fake(lambda dy, y, scale: torch.empty_like(y, memory_format=torch.contiguous_format))


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _softmax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return _softmax_backward_op(dy, y, ctx.scale), None, None


_softmax_op.register_autograd(_softmax_grad, setup_context=_softmax_setup)


def scaled_masked_softmax_reference(x, scale: float = 1.0, causal: bool = True):
    s = x * scale
    if causal:
        sq, sk = x.shape[-2], x.shape[-1]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, dim=-1)


def scaled_masked_softmax(x, scale: float = 1.0, causal: bool = True):
    """softmax(x * scale with keys j > query i masked out) over the last dim of (..., q, k)."""
    if causal and x.dim() < 2:
        from autopar.errors import AutoparError

        raise AutoparError(f"scaled_masked_softmax: causal masking needs (..., q, k) scores, got shape {tuple(x.shape)}")
    if not use_triton(x) or next_pow2(x.shape[-1]) > MAX_ROW_BLOCK:
        return scaled_masked_softmax_reference(x, scale, causal)
    return _softmax_op(x, float(scale), bool(causal))


def make_softmax_inputs(seed: int, shape=None, dtype=torch.float32):
    # (batch, heads, q, k); the scale is a plain float argument.
    shape = tuple(shape or (2, 3, 7, 1000))
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(shape, generator=g) * 4).to(dtype), 0.125)
