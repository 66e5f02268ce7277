"""Pure analytic cost models: shapes x layout x hardware -> time and memory.

This package never imports autopar: autopar imports it. Every public
function takes plain data (the workload types in `workload.py`, a `Layout`,
a `ClusterSpec`) so it can be tested and challenged on its own.

    from cost_models import ClusterSpec, Layout
    from cost_models.analytic import llama
    from cost_models.estimate import estimate
    model = llama("8b", hidden=4096, heads=32, kv_heads=8, layers=32, seq_len=8192,
                  vocab_size=128256, ffn_hidden=14336)
    est = estimate(model, Layout(dp=64, zero=3, checkpoint="selective"), ClusterSpec.resolve("dgx-h100:8"))

How every number is computed, with its constants: docs/cost_model.md.
"""
from cost_models.errors import CostModelError, ProfileError

# The names below load on first use (PEP 562): `cost_models.estimate` and
# `cost_models.workload` import sympy (a quarter of a second), and
# `autopar --help` reads only the errors and the hardware profiles.
# `estimate` the function is not re-exported here: it would shadow the module
# `cost_models.estimate` that docs/INTERFACES.md names.
_LAZY = {"Estimate": "estimate", "LayerCost": "layer", "layer_cost": "layer",
         "ClusterSpec": "hardware", "DeviceProfile": "devices", "LinkProfile": "devices",
         "get_device": "devices", "get_link": "devices", "Layout": "layout",
         "B": "workload", "S": "workload", "LayerSpec": "workload", "ModelSpec": "workload",
         "OpSpec": "workload", "evaluate": "workload"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"cost_models.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cost_models' has no attribute {name!r}")

__all__ = ["B", "S", "LayerSpec", "ModelSpec", "OpSpec", "evaluate", "ClusterSpec", "DeviceProfile", "LinkProfile",
           "get_device", "get_link", "Layout", "layer_cost", "Estimate", "LayerCost", "CostModelError",
           "ProfileError"]
