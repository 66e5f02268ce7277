"""User-facing errors.

An AutoparError carries a message a person can act on (what went wrong, where,
and what to do). The CLI prints it without a traceback and exits with
`exit_code` (2 for bad input); library callers can catch it.
"""


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
    """No layout fits in memory / no mesh factors the GPU count."""


class PlanMismatchError(AutoparError):
    """A plan does not match the model, the world size or the schema."""
