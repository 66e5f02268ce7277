"""Pure analytic cost models: shapes x layout x hardware -> time and memory.

This package never imports autopar: autopar imports it. Every public
function takes plain data (the workload types in `workload.py`, a `Layout`,
a `ClusterSpec`) so it can be tested and challenged on its own.
"""
from cost_models.workload import B, S, LayerSpec, ModelSpec, OpSpec, evaluate

__all__ = ["B", "S", "LayerSpec", "ModelSpec", "OpSpec", "evaluate"]
