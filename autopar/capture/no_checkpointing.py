"""Capture measures a model without its own activation checkpointing.

Users often enable checkpointing in the file that builds the model
(`model.gradient_checkpointing_enable()` in transformers, `checkpoint(block, x)`
in a nanoGPT fork, torch's `checkpoint_wrapper`). Measured as is, a block
would save only its input and its backward would carry a second forward, and
the planner, which chooses checkpointing per layer itself, would count the
recomputation twice. So while capture runs, `torch.utils.checkpoint.checkpoint`
runs the wrapped function plainly: its two code paths look these names up in
the module at call time, which reaches every caller, including the
`functools.partial(checkpoint, ...)` objects transformers and
checkpoint_wrapper keep. The patch is process-wide while capture runs and is
always restored; `state.used` tells capture to say so in graph.notes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.utils.checkpoint as torch_checkpoint


@dataclass
class CheckpointState:
    used: bool = False


@contextlib.contextmanager
def checkpointing_off():
    state = CheckpointState()

    def plain_generator(*args, **kwargs):  # non-reentrant path: no hooks, no recompute
        state.used = True
        yield

    class PlainFunction:  # reentrant path: CheckpointFunction.apply(function, preserve, *args)
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            state.used = True
            return function(*args)

    saved = torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction
    torch_checkpoint._checkpoint_without_reentrant_generator = plain_generator
    torch_checkpoint.CheckpointFunction = PlainFunction
    try:
        yield state
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction = saved
