"""`autopar plan` / `report` / `compile` capture the model file's loss_fn, as
`inspect --loss` does: its FLOPs, bytes and saved activations belong to the head
layer of every plan of a plain-PyTorch model file."""
import argparse

import pytest

pytest.importorskip("cost_models.estimate", reason="cost_models.estimate is not in this checkout")

from autopar.capture import capture  # noqa: E402
from autopar.cli import main  # noqa: E402
from autopar.commands.common import add_plan_arguments, plan_from_args  # noqa: E402
from autopar.plan import Plan  # noqa: E402

# A plain model file (no Hugging Face, no labels in its inputs) whose loss has a
# matmul (a contrastive loss): FlopCounterMode counts its FLOPs, and its softmax
# saves activations.
MODEL_FILE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, S = 256, 64, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(H, H)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randint(0, V, (batch_size, S)),)


def loss_fn(out, targets):
    z = F.normalize(out.float(), dim=-1)
    sim = z @ z.transpose(-1, -2) / 0.07
    return F.cross_entropy(sim.flatten(0, 1), targets.flatten())
'''


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("loss") / "contrastive.py"
    path.write_text(MODEL_FILE)
    return str(path)


def _args(model_file, *extra):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args([model_file, "--device", "a100-80g", "--gpus", "2", "--batch-size", "8", *extra])


def _module(path):
    from autopar.model_file import load_model
    return load_model(path)


def test_plan_captures_the_model_files_loss(model_file):
    plan, graph = plan_from_args(_args(model_file))
    loaded = _module(model_file)
    without = capture(loaded.model, loaded.example_inputs, name=loaded.name)
    head, bare = graph.layers[-1], without.layers[-1]
    assert head.attrs.get("loss") and any(op.name.startswith("loss:") for op in head.ops)
    # the loss's matmul FLOPs, its bytes and its saved activations are in the head
    assert graph.evaluate(head.fwd_flops, 8) > without.evaluate(bare.fwd_flops, 8)
    assert graph.evaluate(head.activation_bytes, 8) > without.evaluate(bare.activation_bytes, 8)
    fwd_bytes = lambda layer, g: sum(g.evaluate(op.fwd_bytes, 8) for op in layer.ops)  # noqa: E731
    assert fwd_bytes(head, graph) > fwd_bytes(bare, without)
    # and the plan's model FLOPs are those of the captured loss (3 x forward per sample)
    per_sample = 3 * sum(graph.evaluate(layer.fwd_flops, 1) for layer in graph.layers)
    p = plan.predicted
    assert p.tflops_per_gpu * 1e12 * p.step_time_s * plan.mesh.world_size == pytest.approx(
        per_sample * plan.global_batch_size, rel=1e-9)


def test_a_loss_the_trace_cannot_run_is_left_out_with_a_note(tmp_path, capsys):
    path = tmp_path / "item_loss.py"
    path.write_text(MODEL_FILE + "\n\ndef loss_fn(out, targets):  # .item() cannot run on the meta device\n"
                                 "    return out.float().mean() * float(out.sum().item() > 0)\n")
    plan, graph = plan_from_args(_args(str(path)))
    assert not graph.layers[-1].attrs.get("loss")
    assert any("loss_fn left out" in n for n in graph.notes)
    assert "loss_fn left out of the head layer" in capsys.readouterr().err
    assert plan.predicted.step_time_s > 0


@pytest.mark.parametrize("command", ["plan", "report", "compile"])
def test_every_planning_command_passes_the_loss(command, model_file, monkeypatch, tmp_path, capsys):
    """plan, report and compile all capture through the same path, with the loss."""
    import autopar.commands.common as common

    seen = []
    real = common.capture_loaded

    def spy(loaded, **kwargs):
        seen.append(kwargs.get("loss_fn"))
        return real(loaded, **kwargs)

    monkeypatch.setattr(common, "capture_loaded", spy)
    out = {"plan": ["--json"], "report": ["-o", str(tmp_path / "r.html")], "compile": ["-o", str(tmp_path / "b")]}
    code = main([command, model_file, "--device", "a100-80g", "--gpus", "2", "--batch-size", "8", *out[command]])
    assert code == 0, capsys.readouterr().err
    assert seen and seen[0] is not None and seen[0].__name__ == "loss_fn"
    if command == "plan":
        Plan.from_json(capsys.readouterr().out)


def test_compile_plans_with_the_users_loss(model_file, monkeypatch):
    """autopar.compile(plan=None, loss_fn=...) prices the loss it trains with, as `autopar plan` does."""
    import autopar.solve as solve
    from autopar.lower.api import captured_with_loss
    loaded = _module(model_file)
    graph = captured_with_loss(loaded.model, loaded.example_inputs, loaded.loss_fn)
    head = graph.layers[-1]
    assert head.attrs.get("loss") and any(op.name.startswith("loss:") for op in head.ops)
    # a loss the meta trace cannot run: the model as it is (planning still works)
    assert captured_with_loss(loaded.model, loaded.example_inputs, lambda out, y: out.sum().item()) is loaded.model
    seen = {}
    monkeypatch.setattr(solve, "plan", lambda model, *a, **k: seen.setdefault("model", model) and (_ for _ in ()).throw(
        RuntimeError("stop after planning")))
    import autopar
    import autopar.lower.api as api
    monkeypatch.setattr(api, "plan_on_rank0", lambda make: make())  # no process group needed to plan
    with pytest.raises(RuntimeError, match="stop after planning"):
        autopar.compile(loaded.model, "cpu:1", example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                        global_batch_size=8)
    assert seen["model"].layers[-1].attrs.get("loss")
