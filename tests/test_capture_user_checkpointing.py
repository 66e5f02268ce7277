"""A model that checkpoints its own activations is measured without it: the
plan chooses checkpointing per layer, and counting the model's own
recomputation as well would charge it twice."""
import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import autopar
from cost_models.workload import evaluate


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        if mode == "wrapper":
            self.blocks = nn.ModuleList([checkpoint_wrapper(b) for b in self.blocks])

    def forward(self, x):
        for block in self.blocks:
            if self.mode in ("reentrant", "non_reentrant"):
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=self.mode == "reentrant")
            else:
                x = block(x)
        return x


def _block_numbers(mode):
    graph = autopar.capture(Stack(mode), lambda b: (torch.randn(b, 32, 16),))
    block = next(l for l in graph.layers if l.name.startswith("blocks"))
    return graph, [evaluate(getattr(block, f), 2, 32) for f in ("activation_bytes", "fwd_flops", "bwd_flops")]


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant", "wrapper"])
def test_own_checkpointing_is_measured_as_the_plain_model(mode):
    _, plain = _block_numbers("none")
    graph, checkpointed = _block_numbers(mode)
    assert checkpointed == plain
    assert any("checkpoints its own activations" in note for note in graph.notes)
    # restored after capture: checkpointing works again outside it
    assert torch_checkpoint.CheckpointFunction.__name__ == "CheckpointFunction"


def test_torch_compiled_model_is_captured_under_its_own_names():
    model = Stack("none")
    graph = autopar.capture(torch.compile(model), lambda b: (torch.randn(b, 32, 16),))
    assert [l.name for l in graph.layers] == ["blocks.0", "blocks.1"]
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    assert any("torch.compile" in note for note in graph.notes)
