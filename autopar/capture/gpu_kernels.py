"""Run the GPU training kernels' autograd behaviour during capture.

Dropout: on CPU/meta, F.dropout decomposes into bernoulli_ + mul and saves a
mask in the input dtype (2 bytes in bf16); on GPUs it is `native_dropout`,
which saves a 1-byte bool mask. Capture routes dropout to native_dropout.

Attention:
On the meta device F.scaled_dot_product_attention falls back to the math
decomposition (bmm, softmax, dropout, upcast to fp32), which saves the
(s x s) score matrix for backward. Training on GPUs runs the flash kernel,
which saves only q, k, v, the output and the logsumexp. To measure what
training really keeps, capture sends every SDPA call to the CPU flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`), which has a meta
implementation and a differentiable backward with the same saved tensors as
the CUDA kernel. Models that write attention out by hand (softmax(QK^T)V)
are measured as written.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_efficient = torch.ops.aten._scaled_dot_product_efficient_attention


def _as_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A (..., heads, s, d) view of grouped k/v with no copy. Meta tensors hold
    no values, so which kv head a query head reads does not matter; what
    matters is that no expanded copy exists (the GPU kernel reads the kv
    heads in place) and that the view keeps k/v's dataflow for capture."""
    size = (*t.shape[:-3], heads, *t.shape[-2:])
    stride = (*t.stride()[:-3], 0, *t.stride()[-2:])
    return t.as_strided(size, stride, t.storage_offset())


class _GroupedQueryFlash(torch.autograd.Function):
    """Flash attention over grouped k/v, as the CUDA kernel runs it
    (`enable_gqa=True`): it saves q, the kvh-head k and v, the output and the
    logsumexp; the backward sums the per-query-head k/v gradients of each group."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale):
        heads = query.shape[-3]
        out, lse = _flash(query, _as_heads(key, heads), _as_heads(value, heads), dropout_p, is_causal,
                          attn_mask=attn_mask, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse, attn_mask)
        ctx.args = (dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, attn_mask = ctx.saved_tensors
        dropout_p, is_causal, scale = ctx.args
        heads, kv_heads = query.shape[-3], key.shape[-3]
        gq, gk, gv = _flash_backward(grad_out.contiguous(), query, _as_heads(key, heads), _as_heads(value, heads),
                                     out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        group = (kv_heads, heads // kv_heads)
        gk = gk.unflatten(-3, group).sum(-3)
        gv = gv.unflatten(-3, group).sum(-3)
        return gq, gk, gv, None, None, None, None


def flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    squeeze = query.dim() == 3  # (heads, s, d) without a batch dim
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # The kernels take an additive float mask.
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf"))
    grouped = enable_gqa and key.shape[-3] != query.shape[-3]
    dv = value.shape[-1]
    if dv != query.shape[-1]:
        # v narrower than q / k (DeepSeek's MLA: 128 against 192): the CPU flash kernel's
        # meta output takes q's width, so v is padded and the output sliced back, as
        # transformers feeds flash attention 2 these heads (modeling_deepseek_v3.py)
        value = F.pad(value, (0, query.shape[-1] - dv))
    if attn_mask is not None and attn_mask.requires_grad:
        # A learned additive bias (T5's relative positions): the flash kernel
        # takes no bias gradient; on GPUs SDPA runs the memory-efficient kernel,
        # which saves the same tensors plus the bias.
        if grouped:
            key, value = (_as_heads(t, query.shape[-3]) for t in (key, value))
        bias = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        out = _efficient(query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]
    elif grouped:
        out = _GroupedQueryFlash.apply(query, key, value, attn_mask, dropout_p, is_causal, scale)
    else:
        out, _ = _flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    out = out[..., :dv] if out.shape[-1] != dv else out
    return out.squeeze(0) if squeeze else out


def native_dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0.0:
        return input
    out, _ = torch.native_dropout(input, p, True)
    return input.copy_(out) if inplace else out


_SDPA = F.scaled_dot_product_attention
_DROPOUTS = {F.dropout, torch.dropout}


class GPUKernelsMode(TorchFunctionMode):
    """Catches direct calls (including `from torch.nn.functional import ...`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return flash_sdpa(*args, **kwargs)
        if func in _DROPOUTS:  # F.dropout(input, p, training, inplace) / torch.dropout(input, p, train)
            return native_dropout(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def gpu_kernels():
    """The mode, plus the module attributes torch's own functional code calls
    (nn.MultiheadAttention -> F.multi_head_attention_forward -> F.scaled_dot_product_attention
    / F.dropout): a function-mode handler runs with the mode switched off, so
    calls nested inside another torch function are caught here instead. The
    patch is process-wide while capture runs and is always restored."""
    saved = F.scaled_dot_product_attention, F.dropout
    F.scaled_dot_product_attention, F.dropout = flash_sdpa, native_dropout
    try:
        with GPUKernelsMode():
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout = saved
