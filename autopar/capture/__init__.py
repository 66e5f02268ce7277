"""Capture stage: model + example inputs -> ModelGraph of costed layers.

`capture(model, example_inputs)` runs the model on the meta device (no
weights, no activations) under instrumentation and returns a `ModelGraph`
whose `layers` are `Layer`s (= cost_models.workload.LayerSpec) with FLOPs,
parameters and activation bytes as sympy expressions in B and S.
See docs/capture.md.
"""
from cost_models.workload import LayerSpec as Layer

from autopar.capture.api import capture
from autopar.capture.graph import ModelGraph

__all__ = ["capture", "ModelGraph", "Layer"]
