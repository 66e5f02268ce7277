"""User-facing errors.

An AutoparError carries a message a person can act on (what went wrong, where,
and what to do). The CLI prints it without a traceback and exits with
`exit_code` (2 for bad input); library callers can catch it.
"""
from __future__ import annotations


class AutoparError(Exception):
    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if not hint else f"{message}\n  hint: {hint}")


class CaptureError(AutoparError):
    """The model could not be traced (names the module path and the op)."""


class ModelFileError(AutoparError):
    """A model file does not follow the model-file convention."""


class ClusterSpecError(AutoparError):
    """A malformed cluster or hardware-profile file, or an unknown name."""


class InfeasibleError(AutoparError):
    """No layout fits in memory / no mesh factors the GPU count.

    When the reason is memory, the raiser can attach what it measured so the
    CLI can say what would fit (autopar/commands/advice.py) instead of only
    that nothing does:
      min_bytes_per_gpu: the smallest per-GPU footprint any layout reaches
      capacity_bytes: usable memory per GPU of the device planned for
      smallest_world: the smallest GPU count found to fit (None: not searched / none)
      device: the device profile's name
      fixes: the changes planned and found to fit (autopar/solve/what_fits.py):
        dicts with `change` 'release' | 'gpus' | 'device'; [] = none found,
        None = not searched
    All optional: an InfeasibleError without them prints as before.
    """

    def __init__(self, message: str, *, hint: str | None = None, min_bytes_per_gpu: float | None = None,
                 capacity_bytes: float | None = None, smallest_world: int | None = None,
                 device: str | None = None, fixes: list[dict] | None = None):
        super().__init__(message, hint=hint)
        self.min_bytes_per_gpu = min_bytes_per_gpu
        self.capacity_bytes = capacity_bytes
        self.smallest_world = smallest_world
        self.device = device
        self.fixes = fixes


class ModelOutputError(AutoparError):
    """The model returns nothing autopar can hand to loss_fn(logits, targets)
    as the logits (autopar/lower/model_io.py `logits_of`)."""


class PlanMismatchError(AutoparError):
    """A plan does not match the model, the world size or the schema."""
