"""Dropout + residual add: `residual + dropout(x, p)` in one pass.

Why fuse: eager dropout writes the dropped tensor and a mask (a byte per
element), then the add reads both tensors back. The fused kernel reads x
and the residual, writes the sum, and keeps no mask at all: the mask is a
pure function of (seed, element index) through Triton's Philox generator
(`tl.rand`), so backward regenerates exactly the same mask.

The seed is an explicit argument. The fused module draws it from torch's
default CPU generator, so `torch.manual_seed` makes a run reproducible and
activation checkpointing (which restores the RNG state before recomputing)
replays the same mask.

The torch reference implements the same Philox4x32-10 stream with int64
tensor arithmetic (`philox_uniform`), so the fallback drops the same
elements as the kernel, bit for bit: the two paths are interchangeable, not
merely statistically alike.
"""
from __future__ import annotations

import torch

from autopar.kernels._runtime import HAVE_TRITON, new_empty, plain, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _dropout_add_fwd_kernel(X, R, Y, numel, p, seed, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        keep = tl.rand(seed, offs) >= p
        y = r + tl.where(keep, x / (1.0 - p), 0.0)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _dropout_bwd_kernel(DY, DX, numel, p, seed, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        keep = tl.rand(seed, offs) >= p  # the forward's mask, regenerated
        tl.store(DX + offs, tl.where(keep, dy / (1.0 - p), 0.0).to(DX.dtype.element_ty), mask=mask)


# -- Philox4x32-10 in torch (matches triton.language.random) ------------------
_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * b for a < 2**32 (int64 tensor), b < 2**32,
    without overflowing int64: split b into 16-bit halves."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_lo = a * b_lo  # < 2**48
    p_hi = a * b_hi  # < 2**48
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _M32
    return high, low


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """`tl.rand(seed, offsets)` computed with torch ops: float32 uniforms in [0, 1)."""
    offsets = offsets.to(torch.int64)
    c0 = offsets & _M32
    c1 = (offsets >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mul32(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul32(c0, 0xD2511F53)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # bitcast uint32 -> int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


def dropout_mask(seed: int, shape, p: float, device=None) -> torch.Tensor:
    """The keep-mask the fused kernel uses for a contiguous tensor of `shape`."""
    n = 1
    for d in shape:
        n *= int(d)
    return (philox_uniform(seed, torch.arange(n, device=device)) >= p).view(shape)


def _dropout_add_forward(x: torch.Tensor, residual: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    x1, r1 = x.contiguous(), residual.contiguous()
    y = new_empty(x.shape, torch.promote_types(x.dtype, residual.dtype), x.device)
    block = 1024
    _dropout_add_fwd_kernel[(triton.cdiv(x.numel(), block),)](x1, r1, y, x.numel(), p, seed, BLOCK=block)
    return y


def _dropout_backward(dy: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """d(dropout(x))/dx: the same mask, from (seed, element index); in dy's dtype."""
    dy1 = dy.contiguous()
    dx = new_empty(dy.shape, dy.dtype, dy.device)
    block = 1024
    _dropout_bwd_kernel[(triton.cdiv(dy.numel(), block),)](dy1, dx, dy.numel(), p, seed, BLOCK=block)
    return dx


# torch.library ops: compiled code calls them as opaque ops (fake versions for tracing)
_dropout_add_op = torch.library.custom_op("autopar::dropout_add", _dropout_add_forward, mutates_args=())
_dropout_add_op.register_fake(lambda x, residual, p, seed: x.new_empty(
    x.shape, dtype=torch.promote_types(x.dtype, residual.dtype)))
_dropout_backward_op = torch.library.custom_op("autopar::dropout_backward", _dropout_backward, mutates_args=())
_dropout_backward_op.register_fake(lambda dy, p, seed: torch.empty_like(dy, memory_format=torch.contiguous_format))


def _dropout_add_setup(ctx, inputs, output):
    x, residual, ctx.p, ctx.seed = inputs
    ctx.x_dtype, ctx.r_dtype = x.dtype, residual.dtype


def _dropout_add_grad(ctx, dy):
    return _dropout_backward_op(dy, ctx.p, ctx.seed).to(ctx.x_dtype), dy.to(ctx.r_dtype), None, None


_dropout_add_op.register_autograd(_dropout_add_grad, setup_context=_dropout_add_setup)


def dropout_add_reference(x, residual, p: float = 0.1, seed: int = 0, training: bool = True):
    if not training or p == 0.0:
        return x + residual
    keep = dropout_mask(seed, x.shape, p, x.device)
    return residual + torch.where(keep, x / (1.0 - p), torch.zeros_like(x))


def _check(x, residual, p, seed):
    from autopar.errors import AutoparError

    if x.shape != residual.shape:
        raise AutoparError(f"dropout_add: x shape {tuple(x.shape)} != residual shape {tuple(residual.shape)}")
    if not 0.0 <= p < 1.0:
        raise AutoparError(f"dropout_add: p must be in [0, 1), got {p}")
    if not 0 <= int(seed) < 2**63:
        raise AutoparError(f"dropout_add: seed must be a non-negative 63-bit integer, got {seed}")


def dropout_add(x, residual, p: float = 0.1, seed: int = 0, training: bool = True):
    """residual + dropout(x, p), with the mask a function of (seed, element index)."""
    _check(x, residual, p, seed)
    if not training or p == 0.0:
        return x + residual  # eager add is already one kernel
    x, residual = plain(x), plain(residual)
    if not use_triton(x, residual):
        return dropout_add_reference(x, residual, p, seed, training)
    return _dropout_add_op(x, residual, float(p), int(seed))


def new_seed() -> int:
    """A seed from torch's default generator (reproducible under torch.manual_seed)."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def make_dropout_add_inputs(seed: int, shape=None, dtype=torch.float32):
    shape = tuple(shape or (3, 5, 1000))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    return (x, r, 0.25, 1234 + seed)
