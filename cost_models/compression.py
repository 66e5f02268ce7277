"""Communication compression: gradients reduced in a narrower dtype than they are held
(`Layout.grad_reduce_dtype`), priced as what runs.

Bytes on the wire: every gradient reduction (DDP's all-reduce, ZeRO / FSDP2's
reduce-scatter, HSDP's replica all-reduce) moves `wire_bytes` per element instead of
the held gradient's bytes. Sources: torch's DDP communication hooks
(docs.pytorch.org/docs/stable/ddp_comm_hooks.html: `bf16_compress_hook` casts each
bucket to bf16, divides by the group size, all-reduces, casts the result back) and
FSDP2's `MixedPrecisionPolicy(reduce_dtype=...)` (fully_shard docs: gradients
reduce-scattered in reduce_dtype, the reduced shard cast back to the parameter's
dtype). ZeRO++ (Wang et al. 2023, arXiv 2306.10209, section 4) prices quantized
communication the same way: volume x bytes per element, plus the (de)quantisation
kernels, which it measures as memory-bound.

The casts are memory-bound passes over the gradients, priced with the device's copy
rate (`copy_s`, as every other copy autopar prices):
- under DDP's hook: the bucket cast down (read held, write wire) and back (read
  wire, write held), every element both ways;
- under FSDP2: the copy into the reduce-scatter buffer (priced already as a read +
  write of wire bytes) reads the held dtype instead (held - wire more bytes read),
  and the reduced shard (1/shard_ranks of the elements) is cast back.

Memory: bf16 reduction keeps no error-feedback buffer (no residual is carried to the
next step: the rounding error is dropped, as the hook and FSDP2 drop it); the
transient reduction buffers get narrower, which memory.py does not book (it books
none of them per layer): the estimate errs by that much on the high side.
"""
from __future__ import annotations

from cost_models.errors import CostModelError

GRAD_REDUCE_DTYPES = ("bf16",)
WIRE_BYTES = {"bf16": 2}


def check(value) -> None:
    if value is not None and value not in GRAD_REDUCE_DTYPES:
        raise CostModelError(f"layout.grad_reduce_dtype must be one of {', '.join(GRAD_REDUCE_DTYPES)} or None, "
                             f"got {value!r}")


def wire_bytes(held_bytes: float, value) -> float:
    """Bytes per gradient element a reduction moves: as held, or the narrower dtype asked
    (never wider: a bf16 gradient reduced in bf16 is not compressed)."""
    return min(held_bytes, WIRE_BYTES[value]) if value else held_bytes


def cast_bytes(elements: float, held: float, wire: float, fsdp: bool, shard_ranks: int) -> float:
    """Bytes read + written by the casts one reduction of `elements` gradients adds (0 when
    nothing is compressed): DDP's hook casts the bucket down and back; FSDP2 reads the
    held dtype into its wire-dtype buffer and casts the reduced shard back."""
    if wire >= held:
        return 0.0
    if fsdp:
        return elements * (held - wire) + elements / shard_ranks * (wire + held)
    return 2 * elements * (held + wire)
