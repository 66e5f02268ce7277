"""Per-op facts at the aten level: FLOPs, bytes moved, op kind, GEMM shape.

FLOPs come from `torch.utils.flop_counter.flop_registry` (the formulas
FlopCounterMode uses: a multiply-add is 2 FLOPs, causal attention counted
unmasked). Additions: the CPU flash-attention kernel that capture routes
scaled_dot_product_attention to (see gpu_kernels.py) has no formula upstream,
so it gets the same formula as the CUDA flash kernel; `_grouped_mm` (MoE
experts in one grouped GEMM) has none either.
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _flash_cpu_fwd(query, key, value, *args, out_val=None, **kwargs):
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _flash_cpu_bwd(grad_out, query, key, value, *args, out_val=None, **kwargs):
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _grouped_mm(a, b, *args, out_val=None, **kwargs):
    """MoE experts as one grouped GEMM: each row of `a` meets one group's
    (k, n) matrix, so 2 * rows * k * n. When both operands are 2-D the groups
    split k instead (the weight gradient): the output holds one (m, n) per group."""
    k = a.shape[-1]
    flops = 2 * out_val.numel() * k
    return flops // out_val.shape[0] if a.dim() == 2 and b.dim() == 2 else flops


_EXTRA_FORMULAS = {
    aten._grouped_mm: _grouped_mm,
    aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_bwd,
}

GEMM_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm}
CONV_OPS = {aten.convolution, aten._convolution, aten.convolution_backward}
ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
}
SOFTMAX_OPS = {aten._softmax, aten._safe_softmax, aten._log_softmax,
               aten._softmax_backward_data, aten._log_softmax_backward_data}
NORM_OPS = {aten.native_layer_norm, aten.native_layer_norm_backward, aten._fused_rms_norm,
            aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
            aten._native_batch_norm_legit_no_training, aten.native_batch_norm_backward,
            aten.native_group_norm, aten.native_group_norm_backward}
EMBEDDING_OPS = {aten.embedding, aten.embedding_dense_backward}
REDUCTION_OPS = {aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var_mean, aten.var,
                 aten.topk, aten.sort, aten.argmax, aten.nll_loss_forward, aten.nll_loss_backward}
# Ops that return a view or only metadata: no bytes move.
_NO_DATA_OPS = {aten.detach, aten.lift_fresh, aten.empty, aten.empty_like, aten.empty_strided,
                aten._unsafe_view, aten.alias, aten.sym_size, aten.sym_stride, aten.sym_numel}


def op_kind(packet) -> str:
    if packet in GEMM_OPS or packet in CONV_OPS:
        return "gemm"
    if packet in ATTENTION_OPS:
        return "attention"
    if packet in SOFTMAX_OPS:
        return "softmax"
    if packet in NORM_OPS:
        return "norm"
    if packet in EMBEDDING_OPS:
        return "embedding"
    if packet in REDUCTION_OPS:
        return "reduction"
    return "elementwise"


def flops_of(func, args, kwargs, out) -> int:
    packet = func._overloadpacket
    formula = _EXTRA_FORMULAS.get(packet) or flop_registry.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def moves_no_data(func) -> bool:
    return func.is_view or func._overloadpacket in _NO_DATA_OPS


def gemm_shape(func, args, out) -> tuple | None:
    """(m, n, k) of a forward GEMM with batch dims folded into m (implicit GEMM for conv)."""
    packet = func._overloadpacket
    if packet is aten.mm:
        a, b = args[0], args[1]
        return (a.shape[0], b.shape[1], a.shape[1])
    if packet is aten.addmm:
        a, b = args[1], args[2]
        return (a.shape[0], b.shape[1], a.shape[1])
    if packet is aten.bmm:
        a, b = args[0], args[1]
        return (a.shape[0] * a.shape[1], b.shape[2], a.shape[2])
    if packet is aten.baddbmm:
        a, b = args[1], args[2]
        return (a.shape[0] * a.shape[1], b.shape[2], a.shape[2])
    if packet is aten._grouped_mm:
        a, b = args[0], args[1]
        groups = out.shape[0] if a.dim() == 2 and b.dim() == 2 else 1
        return (out.numel() // out.shape[-1] // groups, out.shape[-1], a.shape[-1])
    if packet in (aten.convolution, aten._convolution):
        w = args[1]
        return (out.shape[0] * math.prod(out.shape[2:]), w.shape[0], math.prod(w.shape[1:]))
    return None
