"""Errors raised by the cost models.

They are `ValueError`s so that plain Python callers can catch them without
importing anything of ours; autopar's CLI turns them into exit code 2. A
`ProfileError` always names the offending field and the file it came from,
because the person who has to fix it is looking at that file.
"""
from __future__ import annotations


class CostModelError(ValueError):
    """An input the cost model cannot price (bad layout, unknown dtype...)."""


class ProfileError(CostModelError):
    """A malformed hardware profile or cluster file, or an unknown name."""

    def __init__(self, message: str, *, field: str | None = None, file: str | None = None):
        self.field = field
        self.file = file
        where = []
        if field:
            where.append(f"field '{field}'")
        if file:
            where.append(f"in {file}")
        super().__init__(f"{message} ({' '.join(where)})" if where else message)


class ClusterSizeError(CostModelError):
    """A GPU count that does not fill whole nodes. `message` says why, `hint`
    the counts that would work, spelled as the caller spells them (the CLI's
    `--gpus 16`, the API's `gpus=16`)."""

    def __init__(self, message: str, *, hint: str):
        self.message = message
        self.hint = hint
        super().__init__(f"{message}\n  hint: {hint}")
