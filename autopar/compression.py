"""Communication compression: what `Plan.grad_reduce_dtype` means, and which plans may say it.

`grad_reduce_dtype = "bf16"`: the data-parallel gradient reduction (DDP's all-reduce,
FSDP2's reduce-scatter, HSDP's replica all-reduce) moves bf16 on the wire, and the
result is cast back to the dtype the gradients are held in. By training precision:

- fp32: gradients computed and held in fp32, reduced in bf16 (half the bytes);
  FSDP2 `MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)` (no param_dtype: the
  forward stays fp32), or DDP's `bf16_compress_hook` under `replicate`.
- bf16 with fp32 main gradients (`main_grads` "fp32" / "fp32-unfused", Megatron's and
  torchtitan's default): the reduction that ran in fp32 runs in bf16; the main
  gradients stay fp32 (FSDP2 casts the reduced shard back, DDP's hook the bucket).
- bf16 with `main_grads` "same" (autopar's own engine): the gradients are already
  reduced in bf16; the field says what runs anyway (no change, no new price).
- fp16: refused. An fp16 gradient (loss-scaled) cast to bf16 loses 3 mantissa bits
  for range it already has; fp16 plans reduce in fp16 (`main_grads` "same") or fp32.

Not a field, by decision: the parameter all-gather dtype. FSDP2 gathers in its
`param_dtype`, which is the dtype the forward computes in: bf16 gathers under fp32
master weights are what a bf16 plan already runs (fp32 sharded parameters,
param_dtype bf16), and under an fp32 plan they would be bf16 training, i.e. another
`precision`. float8 gathers are torchao's `enable_fsdp_float8_all_gather`, already
chosen with the float8 Linears (`LayerChoice.float8`, ZeRO >= 2; refused on devices
without float8). A second field would state one thing twice.

Not offered: 8-bit gradients with error feedback (ZeRO++'s qgZ, 1-bit Adam). torch
2.13 has no maintained quantized reduction: FSDP2's `set_custom_reduce_scatter` takes
a collective autopar would have to write; `ddp_comm_hooks.quantization_hooks` is
undocumented (not in the DDP communication hooks page) and quantizes per channel in
Python loops; torchao quantizes weights (float8 all-gather), not gradients. PowerSGD
(`ddp_comm_hooks.powerSGD_hook`, documented, error feedback) is low rank, not 8-bit,
and runs under DDP only; it is left for a later field.
"""
from __future__ import annotations

from autopar.plan_schema import GRAD_REDUCE_DTYPES


def problem(value, precision: str, dp: int) -> str | None:
    """Why a plan of `precision` over `dp` ranks cannot reduce in `value` (None: it can,
    or nothing was asked)."""
    if value is None:
        return None
    if value not in GRAD_REDUCE_DTYPES:
        return (f"grad_reduce_dtype must be one of {', '.join(GRAD_REDUCE_DTYPES)} (or absent: reduced as held), "
                f"got {value!r}")
    if precision == "fp16":
        return ("grad_reduce_dtype bf16 under fp16 training: a loss-scaled fp16 gradient cast to bf16 loses 3 "
                "mantissa bits; reduce in fp16 (main_grads same) or fp32")
    if dp <= 1:
        return f"grad_reduce_dtype {value} with dp {dp}: no gradient is reduced; drop the field"
    return None

