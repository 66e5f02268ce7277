"""`torch.autocast` on the meta device: a no-op while capture and the fake probes run.

Models switch autocast off around precision-sensitive code with the device
of their input (x-transformers' rotary embedding:
`with autocast(t.device.type, enabled=False)`). On the meta device that
context raises ("unsupported scalarType"), so a model that trains fine on
any real device could not be captured. Capture and the lowering's probes
read shapes in the dtype they chose, so an autocast region on meta changes
nothing: it is entered and left as a no-op. Autocast on every other device
is untouched, and the patch is restored on exit.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def autocast_is_a_no_op_on_meta():
    cls = torch.amp.autocast_mode.autocast
    init, enter, leave = cls.__init__, cls.__enter__, cls.__exit__

    def __init__(self, device_type, *args, **kwargs):
        self._on_meta = device_type == "meta"
        if not self._on_meta:
            init(self, device_type, *args, **kwargs)

    def __enter__(self):
        return self if getattr(self, "_on_meta", False) else enter(self)

    def __exit__(self, *exc):
        return None if getattr(self, "_on_meta", False) else leave(self, *exc)

    cls.__init__, cls.__enter__, cls.__exit__ = __init__, __enter__, __exit__
    try:
        yield
    finally:
        cls.__init__, cls.__enter__, cls.__exit__ = init, enter, leave
