"""When the Triton path runs, and the small shared helpers every kernel uses.

Rule (`use_triton`): Triton runs when `TRITON_INTERPRET=1` is set (the CPU
interpreter, so tests on a GPU-less machine exercise the real kernels) or
when the tensor lives on a CUDA device and Triton imports. Everything else
(CPU tensors without the interpreter, meta tensors, DTensors whose sharding
a row kernel cannot see) takes the torch reference, which has identical
semantics. `AUTOPAR_KERNELS=torch` forces the reference everywhere (a
debugging switch: bisect a numerical problem to a kernel or not).
"""
from __future__ import annotations

import os

import torch

try:  # Triton is optional at import time: a CPU-only install still works.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAVE_TRITON = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True if the Triton kernels should run for these input tensors."""
    if not HAVE_TRITON or os.environ.get("AUTOPAR_KERNELS", "").lower() == "torch":
        return False
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_meta or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return False  # meta / DTensor / other subclasses: the reference handles them
    if interpreting():
        return all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in tensors)
    return all(not isinstance(t, torch.Tensor) or t.is_cuda for t in tensors)


# Row kernels (norms, softmax) hold one row in registers; past this many
# columns they would spill badly, so wider rows take the torch reference.
MAX_ROW_BLOCK = 65536


def plain(t):
    """An AsyncCollectiveTensor (what TP's async reduce-scatter hands out as a
    local tensor) waited into a plain tensor, keeping autograd; anything else
    unchanged. Triton needs real storage."""
    if type(t).__name__ == "AsyncCollectiveTensor":
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(t)
    return t


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def reduce_programs(rows: int, device: torch.device) -> int:
    """Programs for kernels that loop over rows and accumulate per-column
    partial sums (weight / bias gradients): one per SM on a GPU keeps the
    partial buffer tiny; the interpreter runs programs one by one, so few."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, 2 * sms))
    return max(1, min(rows, 4))


def num_warps_for(block: int) -> int:
    # Wider rows need more threads to keep loads vectorised without spilling.
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


# -- output allocation -------------------------------------------------------
# Every kernel allocates its outputs through `new_empty`, so a test can poison
# them (fill with NaN) and prove that the kernel writes every element: an
# element a mask forgot would stay NaN.
_POISON = [False]


class poison_outputs:
    """Context manager: outputs allocated by the kernels start as NaN."""

    def __enter__(self):
        self._old = _POISON[0]
        _POISON[0] = True
        return self

    def __exit__(self, *exc):
        _POISON[0] = self._old
        return False


def new_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if _POISON[0] and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """(..., N) -> contiguous (M, N) view: every kernel works on rows."""
    return x.contiguous().view(-1, x.shape[-1]) if x.dim() > 0 else x.view(1, 1)
