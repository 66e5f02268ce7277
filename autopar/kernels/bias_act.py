"""Bias + activation: GELU (tanh or erf), SiLU, and the SwiGLU gate.

Why fuse: eager runs `y = x + b` and `act(y)` as two kernels (or, with the
bias inside addmm, the activation reads the GEMM output back), and in
backward the activation gradient and the bias gradient (a column sum of it)
are two more trips through HBM. Here one kernel does bias + activation, and
one backward kernel writes dx and reduces the bias gradient in the same pass
(per-tile partial column sums; a tiny torch sum finishes them).

The math is in fp32 whatever the storage dtype; outputs are stored in the
input dtype. GELU-tanh is written as x * sigmoid(2z) (the same function as
0.5 x (1 + tanh z)) so no tanh primitive is needed and nothing cancels
near zero.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.kernels._runtime import HAVE_TRITON, new_empty, next_pow2, plain, rows_of, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

ACTS = {"gelu_tanh": 0, "gelu": 1, "silu": 2}
# Constants inside the kernels: sqrt(2/pi) = 0.79788..., 1/sqrt(2) = 0.70710...,
# 1/sqrt(2 pi) = 0.39894..., 3 * 0.044715 = 0.134145.


if HAVE_TRITON:

    @triton.jit
    def _act_fwd(y, ACT: tl.constexpr):
        if ACT == 0:  # gelu, tanh approximation
            # |z| > 40 saturates the sigmoid in fp32 anyway; clamping keeps exp finite
            z = tl.minimum(tl.maximum(0.7978845608028654 * (y + 0.044715 * y * y * y), -40.0), 40.0)
            return y * tl.sigmoid(2.0 * z)
        elif ACT == 1:  # gelu, exact (erf)
            return 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
        else:  # silu
            return y * tl.sigmoid(y)

    @triton.jit
    def _act_grad(y, ACT: tl.constexpr):
        if ACT == 0:
            z = tl.minimum(tl.maximum(0.7978845608028654 * (y + 0.044715 * y * y * y), -40.0), 40.0)
            s = tl.sigmoid(2.0 * z)
            dz = 0.7978845608028654 * (1.0 + 0.134145 * y * y)
            return s + 2.0 * y * s * (1.0 - s) * dz
        elif ACT == 1:
            cdf = 0.5 * (1.0 + tl.erf(y * 0.7071067811865476))
            return cdf + y * 0.3989422804014327 * tl.exp(-0.5 * y * y)
        else:
            s = tl.sigmoid(y)
            return s * (1.0 + y * (1.0 - s))

    @triton.jit
    def _bias_act_fwd_kernel(X, B, Y, M, N, ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = _act_fwd(x + b[None, :], ACT)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_act_bwd_kernel(DY, X, B, DX, DB_PART, M, N, ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             TILES: tl.constexpr):
        # Each program owns TILES consecutive row tiles of one column block and
        # keeps their bias-gradient column sums in registers: the partial
        # buffer has cdiv(M, BM * TILES) rows, not one per tile.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        cols = pid_n * BN + tl.arange(0, BN)
        b = tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
        db = tl.zeros((BN,), dtype=tl.float32)
        for t in range(TILES):
            rows = (pid_m.to(tl.int64) * TILES + t) * BM + tl.arange(0, BM)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            offs = rows[:, None] * N + cols[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            dx = tl.where(mask, dy * _act_grad(x + b[None, :], ACT), 0.0)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            db += tl.sum(dx, axis=0)
        tl.store(DB_PART + pid_m * N + cols, db, mask=cols < N)

    @triton.jit
    def _swiglu_fwd_kernel(G, U, Y, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(DY, G, U, DG, DU, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=mask)


def _tiles(m: int, n: int) -> tuple[int, int]:
    bn = min(next_pow2(n), 256)
    bm = max(1, min(next_pow2(m), 4096 // bn))
    return bm, bn


def _launch_bias_act_fwd(x2, bias, act, out_dtype):
    m, n = x2.shape
    y = new_empty((m, n), out_dtype, x2.device)
    bm, bn = _tiles(m, n)
    _bias_act_fwd_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](x2, bias, y, m, n, ACT=ACTS[act], BM=bm, BN=bn)
    return y


def _launch_bias_act_bwd(dy2, x2, bias, act):
    m, n = x2.shape
    dx = new_empty((m, n), x2.dtype, x2.device)
    bm, bn = _tiles(m, n)
    row_tiles = triton.cdiv(m, bm)
    tiles = triton.cdiv(row_tiles, 256)  # at most 256 partial rows to sum
    grid = (triton.cdiv(row_tiles, tiles), triton.cdiv(n, bn))
    db_part = new_empty((grid[0], n), torch.float32, x2.device)
    _bias_act_bwd_kernel[grid](dy2, x2, bias, dx, db_part, m, n, ACT=ACTS[act], BM=bm, BN=bn, TILES=tiles)
    return dx, db_part.sum(0).to(bias.dtype)


class _BiasAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, act):
        x2 = rows_of(x)
        bias = bias.contiguous()
        y = _launch_bias_act_fwd(x2, bias, act, torch.promote_types(x.dtype, bias.dtype))
        ctx.save_for_backward(x2, bias)
        ctx.act, ctx.shape = act, x.shape
        return y.view(*x.shape[:-1], x.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        dx, db = _launch_bias_act_bwd(rows_of(dy), x2, bias, ctx.act)
        return dx.view(ctx.shape), db, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g, u = gate.contiguous(), up.contiguous()
        y = new_empty(g.shape, g.dtype, g.device)
        block = 1024
        _swiglu_fwd_kernel[(triton.cdiv(g.numel(), block),)](g, u, y, g.numel(), BLOCK=block)
        ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dg = new_empty(g.shape, g.dtype, g.device)
        du = new_empty(u.shape, u.dtype, u.device)
        block = 1024
        _swiglu_bwd_kernel[(triton.cdiv(g.numel(), block),)](dy.contiguous(), g, u, dg, du, g.numel(), BLOCK=block)
        return dg, du


# -- tensor parallelism --------------------------------------------------------
# Under TP (ColwiseParallel with DTensor activations) the MLP's hidden
# activations are DTensors sharded on their last dim and the bias is sharded
# on dim 0 the same way; SwiGLU's two inputs share one placement. Then the
# op is shard-local: run the kernel on the local shards and wrap the result
# with the input's placements. Any other layout (a Partial, a bias that does
# not match) takes the reference, which DTensor knows how to shard.

def _local_bias_act(x, bias, act):
    from torch.distributed.tensor import DTensor

    if not (isinstance(x, DTensor) and isinstance(bias, DTensor)) or x.device_mesh != bias.device_mesh:
        return None
    last = x.dim() - 1
    for px, pb in zip(x.placements, bias.placements):
        aligned = (px.is_replicate() and pb.is_replicate()) or (
            px.is_shard() and px.dim % x.dim() == last and pb.is_shard() and pb.dim == 0)
        if not aligned:
            return None
    xl, bl = plain(x.to_local()), plain(bias.to_local())
    if not use_triton(xl, bl):
        return None
    y = _BiasAct.apply(xl, bl, act)
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def _local_swiglu(gate, up):
    from torch.distributed.tensor import DTensor

    if not (isinstance(gate, DTensor) and isinstance(up, DTensor)) or gate.device_mesh != up.device_mesh:
        return None
    if gate.placements != up.placements or any(p.is_partial() for p in gate.placements):
        return None
    gl, ul = plain(gate.to_local()), plain(up.to_local())
    if gl.shape != ul.shape or not use_triton(gl, ul):
        return None
    y = _SwiGLU.apply(gl, ul)
    return DTensor.from_local(y, gate.device_mesh, gate.placements, run_check=False, shape=gate.shape,
                              stride=gate.stride())


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


# -- public functions --------------------------------------------------------

def _check_bias(x, bias, name):
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        from autopar.errors import AutoparError

        raise AutoparError(f"{name}: bias of shape {tuple(bias.shape)} does not match the last dim of x {tuple(x.shape)}")


def bias_gelu_reference(x, bias, approximate: str = "tanh"):
    return F.gelu(x + bias, approximate=approximate)


def bias_gelu(x, bias, approximate: str = "tanh"):
    """gelu(x + bias) over the last dim; `approximate` is 'tanh' or 'none' as in F.gelu."""
    _check_bias(x, bias, "bias_gelu")
    if approximate not in ("tanh", "none"):
        from autopar.errors import AutoparError

        raise AutoparError(f"bias_gelu: approximate must be 'tanh' or 'none', got {approximate!r}")
    act = "gelu_tanh" if approximate == "tanh" else "gelu"
    if _is_dtensor(x) and HAVE_TRITON:
        y = _local_bias_act(x, bias, act)
        return y if y is not None else bias_gelu_reference(x, bias, approximate)
    if not use_triton(x, bias):
        return bias_gelu_reference(x, bias, approximate)
    return _BiasAct.apply(x, bias, act)


def bias_silu_reference(x, bias):
    return F.silu(x + bias)


def bias_silu(x, bias):
    """silu(x + bias) over the last dim."""
    _check_bias(x, bias, "bias_silu")
    if _is_dtensor(x) and HAVE_TRITON:
        y = _local_bias_act(x, bias, "silu")
        return y if y is not None else bias_silu_reference(x, bias)
    if not use_triton(x, bias):
        return bias_silu_reference(x, bias)
    return _BiasAct.apply(x, bias, "silu")


def swiglu_reference(gate, up):
    return F.silu(gate) * up


def swiglu(gate, up):
    """silu(gate) * up: the SwiGLU gate of Llama-style MLPs (w2(silu(w1 x) * w3 x))."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return swiglu_reference(gate, up)  # broadcasting / mixed dtypes: eager semantics
    if _is_dtensor(gate) and HAVE_TRITON:
        y = _local_swiglu(gate, up)
        return y if y is not None else swiglu_reference(gate, up)
    if not use_triton(gate, up):
        return swiglu_reference(gate, up)
    return _SwiGLU.apply(gate, up)


# -- registry inputs ---------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def make_bias_act_inputs(seed: int, shape=None, dtype=torch.float32):
    shape = tuple(shape or (3, 5, 1000))
    g = _gen(seed)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    b = torch.randn(shape[-1], generator=g).to(dtype)
    return (x, b)


def make_swiglu_inputs(seed: int, shape=None, dtype=torch.float32):
    shape = tuple(shape or (3, 5, 1000))
    g = _gen(seed)
    return ((torch.randn(shape, generator=g) * 2).to(dtype), torch.randn(shape, generator=g).to(dtype))
