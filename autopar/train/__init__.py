"""The training runtime around a compiled model: data, schedule, metrics, the
job `autopar compile` emits (`run.main`)."""
from autopar.train.run import main

__all__ = ["main"]
