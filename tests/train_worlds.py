"""Rank functions for the training-job tests: the emitted job itself
(`autopar.train.main`) on hand-written plans, one spawned world per run."""
from __future__ import annotations

import os

import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
GPT_TINY = os.path.join(EXAMPLES, "gpt.py") + ":gpt_tiny"


def write_plan(path: str, **layout) -> str:
    """A hand plan for gpt_tiny with this layout (autopar.lower.manual_plan), saved as JSON."""
    from autopar.lower.manual_plan import plan_for_model
    from gpt import gpt_tiny
    model, example = gpt_tiny()
    plan_for_model(model, example_inputs=example, name="gpt_tiny", **layout).save(path)
    return path


def main_world(rank, world, spec, plan_path, argv):
    """One run of the training job, as `torchrun train.py ARGV` runs it on this rank."""
    from autopar.train import main
    torch.set_num_threads(1)
    return main(spec, plan_path, argv)


def load_safetensors(path: str) -> dict:
    from safetensors.torch import load_file
    return load_file(path)


def gpt_tiny_tokens(tmp_path, n: int = 64 * 16 + 1) -> str:
    """tokens.bin in `tmp_path`: n random ids of gpt_tiny's 128-token vocabulary (uint16)."""
    import numpy as np
    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 128, n).astype(np.uint16).tofile(path)
    return str(path)
