"""SwiGLU's gate, silu(gate) * up, in one kernel each way.

Why fuse: eager runs silu(gate) (read, write) and the product (read both, write),
and in backward the silu gradient and the two products are more trips through HBM.
Here one kernel reads gate and up and writes the output; one backward kernel writes
both input gradients. The math is in fp32 whatever the storage dtype.

(This file held the bias + GELU / SiLU kernel too: it ran slower than eager and than
torch.compile of the same chain on an H200, 0.79x and 0.88x (issue 31), and was deleted.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.kernels._runtime import HAVE_TRITON, new_empty, plain, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

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


def _swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.contiguous(), up.contiguous()
    y = new_empty(g.shape, g.dtype, g.device)
    block = 1024
    _swiglu_fwd_kernel[(triton.cdiv(g.numel(), block),)](g, u, y, g.numel(), BLOCK=block)
    return y


def _swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, u = gate.contiguous(), up.contiguous()
    dg = new_empty(g.shape, g.dtype, g.device)
    du = new_empty(u.shape, u.dtype, u.device)
    block = 1024
    _swiglu_bwd_kernel[(triton.cdiv(g.numel(), block),)](dy.contiguous(), g, u, dg, du, g.numel(), BLOCK=block)
    return dg, du


# torch.library ops: compiled code (a torch.compile'd block) calls them as opaque ops,
# with their fake (shape-only) versions for tracing and their backward op for autograd
_swiglu_op = torch.library.custom_op("autopar::swiglu", _swiglu_forward, mutates_args=())
_swiglu_op.register_fake(lambda gate, up: torch.empty_like(gate, memory_format=torch.contiguous_format))
_swiglu_backward_op = torch.library.custom_op("autopar::swiglu_backward", _swiglu_backward, mutates_args=())
_swiglu_backward_op.register_fake(lambda dy, gate, up: (torch.empty_like(gate, memory_format=torch.contiguous_format),
                                                        torch.empty_like(up, memory_format=torch.contiguous_format)))


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    return tuple(_swiglu_backward_op(dy, *ctx.saved_tensors))


_swiglu_op.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


# -- tensor parallelism --------------------------------------------------------
# Under TP (ColwiseParallel with DTensor activations) the MLP's hidden
# activations are DTensors sharded on their last dim; SwiGLU's two inputs share
# one placement. Then the op is shard-local: run the kernel on the local shards
# and wrap the result with the input's placements. Any other layout (a Partial)
# takes the reference, which DTensor knows how to shard.

def _local_swiglu(gate, up):
    from torch.distributed.tensor import DTensor

    if not (isinstance(gate, DTensor) and isinstance(up, DTensor)) or gate.device_mesh != up.device_mesh:
        return None
    if gate.placements != up.placements or any(p.is_partial() for p in gate.placements):
        return None
    gl, ul = plain(gate.to_local()), plain(up.to_local())
    if gl.shape != ul.shape or not use_triton(gl, ul):
        return None
    y = _swiglu_op(gl, ul)
    return DTensor.from_local(y, gate.device_mesh, gate.placements, run_check=False, shape=gate.shape,
                              stride=gate.stride())


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


# -- public functions --------------------------------------------------------

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
    return _swiglu_op(gate, up)


# -- registry inputs ---------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def make_swiglu_inputs(seed: int, shape=None, dtype=torch.float32):
    shape = tuple(shape or (3, 5, 1000))
    g = _gen(seed)
    return ((torch.randn(shape, generator=g) * 2).to(dtype), torch.randn(shape, generator=g).to(dtype))
