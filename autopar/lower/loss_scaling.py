"""fp16 training: dynamic loss scaling over every dp / tp / pp shard.

fp16 holds numbers up to 65504 and loses gradients below about 6e-8, so the
loss is multiplied by a large power of two before backward and the gradients
divided by it before the optimizer step. When any gradient on any rank comes
back Inf or NaN, every rank skips that step and the scale halves; after
`growth_interval` clean steps it doubles. torch's ShardedGradScaler does this
for sharded gradients and agrees on the overflow with one all-reduce over the
process group it is given: here the whole world, so pipeline stages and tensor
shards skip together.

What differs from ShardedGradScaler as shipped: gradients are unscaled on
their local shards. Its own unscale hands the DTensor gradients to DTensor,
which reduces the Inf flag over each gradient's mesh inside every foreach call
(one collective per group of gradients, and an error for a call that mixes
FSDP's 1-D and FSDP x TP 2-D gradients). The world all-reduce in `unscale_`
already makes the flag global, once per step.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError


class LossScaler(ShardedGradScaler):
    """ShardedGradScaler over the world group that unscales local gradient shards.

    `found_inf()` after `unscale_`: whether this step overflowed somewhere (every rank
    gets the same answer). The scale is a power of two, so scaling and unscaling
    are exact in fp32 and the reported loss is the unscaled one bit for bit.
    """

    def __init__(self, device: str, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        super().__init__(device=device, init_scale=init_scale, growth_interval=growth_interval,
                         process_group=dist.group.WORLD)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        grads = defaultdict(lambda: defaultdict(list))  # device -> dtype -> local gradients
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                    grads[g.device][g.dtype].append(g)
        found = {}
        with torch.no_grad():
            for device, by_dtype in grads.items():
                found[device] = found_inf.to(device, copy=True)
                for same in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(same, found[device], inv_scale.to(device))
        # A rank whose stages hold no gradient still joins the all-reduce in unscale_.
        return found or {found_inf.device: found_inf}

    def configure(self, init_scale: float | None = None, growth_interval: int | None = None) -> None:
        """Before the first step (or a snapshot's state): the starting scale (a power
        of two) and the clean steps before it doubles."""
        if init_scale is not None:
            if init_scale <= 0 or 2 ** round(math.log2(init_scale)) != init_scale:
                raise AutoparError(f"the initial loss scale must be a power of two, got {init_scale}",
                                   hint="e.g. 65536 (2**16, torch's default) or 4096")
            self._init_scale, self._scale = float(init_scale), None
        if growth_interval is not None:
            if growth_interval < 1:
                raise AutoparError(f"the loss-scale growth interval must be >= 1 step, got {growth_interval}")
            self._growth_interval = int(growth_interval)

    def snapshot(self) -> dict:
        """What a resumed run needs to scale as an uninterrupted one (JSON numbers)."""
        return {"scale": self.scale_value(),
                "growth_tracker": int(self._growth_tracker.item()) if self._growth_tracker is not None
                else self._init_growth_tracker}

    def restore(self, state: dict) -> None:
        self._init_scale, self._init_growth_tracker = float(state["scale"]), int(state["growth_tracker"])
        self._scale = self._growth_tracker = None  # set from those at the next step

    def begin_step(self, device) -> None:
        """Read the scale once per step (one host sync, not one per micro-batch)."""
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(device))
        self.current = float(self._scale.item())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # A Python number, not GradScaler.scale's tensor: the loss may be a DTensor
        # (vocab-parallel loss), which refuses arithmetic with a plain tensor.
        return loss * self.current

    def scale_value(self) -> float:
        return float(self.get_scale())

    def found_inf(self, optimizer) -> bool:
        state = self._per_optimizer_states[id(optimizer)]
        return any(bool(v.item()) for v in state.get("found_inf_per_device", {}).values())


class ScaledLoss:
    """The loss a pipeline schedule backpropagates: the user's, times the step's scale.
    (The schedule calls backward itself; train_step divides the reported losses back.)"""

    def __init__(self, loss_fn, scaler: LossScaler):
        self.loss_fn, self.scaler = loss_fn, scaler

    def __call__(self, output, target):
        return self.scaler.scale_loss(self.loss_fn(output, target))
