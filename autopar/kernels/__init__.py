"""Fused kernels (Triton) for the memory-bound chains of a transformer.

Each public function dispatches: the Triton kernel when `use_triton` says so
(a CUDA tensor, or `TRITON_INTERPRET=1` on CPU), otherwise the torch
reference with the same semantics. Forward and backward are
`torch.autograd.Function`s with Triton kernels for both.

REGISTRY maps a kernel name to `(triton_fn, reference_fn, make_inputs)`;
`make_inputs(seed, shape=None, dtype=torch.float32)` returns fresh random
positional arguments for both functions (tests and benchmarks use it).
The fusion pass that finds these chains in a model and swaps them in is
`autopar.kernels.fusion` (find_fusions / apply_fusions).
"""
from __future__ import annotations

from autopar.kernels._runtime import HAVE_TRITON, poison_outputs, use_triton
from autopar.kernels.add_norm import (
    add_layernorm, add_layernorm_reference, add_rmsnorm, add_rmsnorm_reference,
    make_add_layernorm_inputs, make_add_rmsnorm_inputs,
)
from autopar.kernels.bias_act import (
    bias_gelu, bias_gelu_reference, bias_silu, bias_silu_reference, make_bias_act_inputs,
    make_swiglu_inputs, swiglu, swiglu_reference,
)
from autopar.kernels.cross_entropy import (
    cross_entropy, cross_entropy_reference, linear_cross_entropy, linear_cross_entropy_reference,
    make_cross_entropy_inputs, make_linear_cross_entropy_inputs,
)
from autopar.kernels.dropout_add import dropout_add, dropout_add_reference, dropout_mask, make_dropout_add_inputs
from autopar.kernels.softmax import make_softmax_inputs, scaled_masked_softmax, scaled_masked_softmax_reference


def _bias_gelu_erf(x, bias):
    return bias_gelu(x, bias, approximate="none")


def _bias_gelu_erf_reference(x, bias):
    return bias_gelu_reference(x, bias, approximate="none")


REGISTRY = {
    "bias_gelu": (bias_gelu, bias_gelu_reference, make_bias_act_inputs),
    "bias_gelu_erf": (_bias_gelu_erf, _bias_gelu_erf_reference, make_bias_act_inputs),
    "bias_silu": (bias_silu, bias_silu_reference, make_bias_act_inputs),
    "swiglu": (swiglu, swiglu_reference, make_swiglu_inputs),
    "add_layernorm": (add_layernorm, add_layernorm_reference, make_add_layernorm_inputs),
    "add_rmsnorm": (add_rmsnorm, add_rmsnorm_reference, make_add_rmsnorm_inputs),
    "scaled_masked_softmax": (scaled_masked_softmax, scaled_masked_softmax_reference, make_softmax_inputs),
    "dropout_add": (dropout_add, dropout_add_reference, make_dropout_add_inputs),
    "cross_entropy": (cross_entropy, cross_entropy_reference, make_cross_entropy_inputs),
    "linear_cross_entropy": (linear_cross_entropy, linear_cross_entropy_reference, make_linear_cross_entropy_inputs),
}

__all__ = [
    "REGISTRY", "HAVE_TRITON", "use_triton", "poison_outputs",
    "bias_gelu", "bias_silu", "swiglu", "add_layernorm", "add_rmsnorm", "scaled_masked_softmax",
    "dropout_add", "dropout_mask", "cross_entropy", "linear_cross_entropy",
]
