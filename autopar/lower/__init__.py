"""Lower stage: Plan + model -> this rank's ParallelModel on torch.distributed.

One file per parallelism over one DeviceMesh ("pp", "dp", "tp"):
mesh.py, model_layers.py, pipeline_parallel.py, tensor_parallel.py,
checkpointing.py, data_parallel.py, materialize.py; parallel_model.py composes
them; api.py is `autopar.compile`; emit.py writes a runnable build/.
See docs/lowering.md for how each plan field maps onto torch.distributed.
"""
from autopar.lower.api import compile, load_plan
from autopar.lower.manual_plan import plan_for_model
from autopar.lower.parallel_model import LoweringWarning, ParallelModel, lower

__all__ = ["compile", "ParallelModel", "LoweringWarning", "lower", "load_plan", "plan_for_model"]
