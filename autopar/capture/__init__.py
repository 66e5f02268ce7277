"""Capture stage: model + example inputs -> ModelGraph of costed layers.

`capture(model, example_inputs)` runs the model on the meta device (no
weights, no activations) under instrumentation and returns a `ModelGraph`
whose `layers` are `Layer`s (= cost_models.workload.LayerSpec) with FLOPs,
parameters and activation bytes as sympy expressions in B and S.
See docs/capture.md.
"""
import inspect
import sys
import types

from cost_models.workload import LayerSpec as Layer

from autopar.capture.api import capture
from autopar.capture.graph import ModelGraph

__all__ = ["capture", "ModelGraph", "Layer"]


class _CallablePackage(types.ModuleType):
    """`autopar.capture` is this package and the function `capture` at once.

    `autopar` loads this package on first use (keeping torch out of `autopar
    --help`); Python then binds the package to the attribute `autopar.capture`,
    where users call the function. Calling the package calls the function."""

    def __call__(self, *args, **kwargs):
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
__signature__ = inspect.signature(capture)  # help() and IDEs show the function's arguments
