"""Communication compression as the lowering runs it (`Plan.grad_reduce_dtype`; what it
means per precision: autopar/compression.py).

- FSDP2 units (ZeRO >= 2, and every layer under tp, pp or HSDP): `fully_shard`'s
  `MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`. FSDP2 casts each unit's
  gradients into its bf16 reduce-scatter buffer (and HSDP's replica all-reduce runs
  on it), then casts the reduced shard back to the parameter's dtype. Under fp32
  training param_dtype stays None: the forward and backward stay fp32.
- `replicate` (DDP; ZeRO 0 / 1 on a pure data-parallel mesh): DDP's
  `bf16_compress_hook` (torch.distributed.algorithms.ddp_comm_hooks.default_hooks):
  each bucket cast to bf16, divided by the group size, all-reduced, cast back.

Both are torch's own; nothing here reduces anything itself.
"""
from __future__ import annotations

import torch

BF16 = "bf16"


def reduce_dtype(plan) -> torch.dtype | None:
    """The dtype FSDP2 reduces in for this plan's compression (None: as the precision says)."""
    return torch.bfloat16 if getattr(plan, "grad_reduce_dtype", None) == BF16 else None


def refusal(plan=None, replicated: bool = False) -> str | None:
    """Why this torch cannot run the plan's compression (None: it can, or none is asked);
    with no plan: whether it could run any (what_runs' model-independent answer).
    `replicated`: the plan runs under DDP (data_parallel.uses_replicate)."""
    if plan is not None and getattr(plan, "grad_reduce_dtype", None) is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp import MixedPrecisionPolicy
    missing = [name for name, ok in (("default_hooks.bf16_compress_hook", hasattr(default_hooks, "bf16_compress_hook")),
                                     ("MixedPrecisionPolicy.reduce_dtype",
                                      "reduce_dtype" in MixedPrecisionPolicy.__dataclass_fields__)) if not ok]
    if missing:
        return f"this torch ({torch.__version__}) has no {' or '.join(missing)}"
    return ddp_hook_refusal() if plan is not None and replicated else None


def ddp_hook_refusal() -> str | None:
    """Why DDP refuses its bf16_compress_hook with this torch (None: it takes it). torch's
    own rule (DistributedDataParallel._check_comm_hook): a CUDA / ROCm build with NCCL >=
    2.10, or XPU with XCCL; a CPU-only build refuses it whatever the backend."""
    import torch.distributed as dist
    gpu = (torch.version.cuda is not None or torch.version.hip is not None) and dist.is_nccl_available() \
        and torch.cuda.nccl.version() >= (2, 10)
    xpu = dist.is_xccl_available() and torch.xpu.is_available() if hasattr(dist, "is_xccl_available") else False
    if gpu or xpu:
        return None
    return (f"DDP's bf16_compress_hook needs a CUDA 11+ / NCCL 2.10+ or XPU / XCCL torch (this is {torch.__version__}); "
            "ZeRO 0 / 1 on a pure data-parallel mesh runs under DDP (replicate)")


def register_hook(module, dp_mesh) -> None:
    """DDP's bf16 compression hook on a `replicate`d module (registered at its lazy init)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    module.register_comm_hook(dp_mesh.get_group(), bf16_compress_hook)


def runs(stages) -> dict:
    """What reduces this rank's gradients, read back from torch's own objects (tests and
    the lowering matrix check it against the plan): {"fsdp_reduce_dtypes": sorted dtype
    names of FSDP2's parameter groups ('as held' where none is set), "ddp_hooks": the
    names of the comm hooks DDP registered or will register at its lazy init}."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import FSDPModule
    dtypes, hook_names = set(), []
    for m in (m for s in stages for m in s.modules()):
        if isinstance(m, FSDPModule):  # reduce_dtype is set at FSDP2's lazy init (the first forward)
            group = m._get_fsdp_state()._fsdp_param_group
            dtypes |= {str(p.reduce_dtype or "as held").replace("torch.", "") for p in (group.fsdp_params if group else ())}
        state = replicate.state(m) if hasattr(m, "register_comm_hook") else None
        if state is not None:
            ddp = getattr(state, "_ddp", None)
            pending = [args[1] for args, _ in state._comm_hook_args]
            hook_names += [h.__name__ for h in pending + [h for h, _ in getattr(ddp, "_comm_hooks", [])]]
    return {"fsdp_reduce_dtypes": sorted(dtypes), "ddp_hooks": hook_names}
