"""Learning rate: linear warmup, then cosine or linear decay to a floor.

The shape GPT-3 (warmup, cosine to 10%), Llama (2,000 warmup steps, cosine to
10%) and torchtitan (warmup, linear decay) train with, as a torch LambdaLR, so
its position is one step counter: a snapshot records it (`last_epoch`, behind
the training step by the fp16 steps the loss scaler skipped), and a resumed
run builds the schedule there (`start_step`), on whatever optimizer param
groups the new plan has.
"""
from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR

from autopar.errors import AutoparError

DECAYS = ("cosine", "linear", "constant")


def lr_factor(step: int, *, warmup: int, total: int, decay: str = "cosine", min_ratio: float = 0.1) -> float:
    """The multiplier of the peak learning rate at optimizer step `step` (0-based):
    (step + 1) / warmup during warmup, then from 1 down to `min_ratio` at `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_scheduler(optimizer, *, warmup: int, total: int, decay: str = "cosine", min_ratio: float = 0.1,
                 start_step: int = 0) -> LambdaLR:
    """The schedule, at optimizer step `start_step` (a resumed run: the learning rate
    of that step is set now, as torch's schedulers resume with `last_epoch`)."""
    if decay not in DECAYS:
        raise AutoparError(f"--decay {decay}: unknown", hint=f"choose from {', '.join(DECAYS)}")
    if warmup < 0 or total < 1 or not 0.0 <= min_ratio <= 1.0:
        raise AutoparError(f"learning-rate schedule: warmup {warmup}, steps {total}, min ratio {min_ratio} "
                           "(need warmup >= 0, steps >= 1, 0 <= min ratio <= 1)")
    if start_step:
        for group in optimizer.param_groups:  # the peak rate LambdaLR scales (it sets it itself at step 0)
            group.setdefault("initial_lr", group["lr"])
    return LambdaLR(optimizer, lambda step: lr_factor(step, warmup=warmup, total=total, decay=decay,
                                                      min_ratio=min_ratio), last_epoch=start_step - 1)
