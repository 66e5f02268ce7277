"""Issue 32's acceptance, as a new user runs it with their own model files: a
hand-written minGPT-style decoder that imports its neighbour (`from mingpt_model
import GPT`), a BatchNorm CNN, transformers' Qwen3 and an x-transformers decoder
each go

    autopar plan -> autopar compile -> build/launch.sh (torchrun, 2 CPU ranks)
    -> Ctrl-C -> the same command again (resume) -> export -> reload

Ctrl-C is SIGINT to the job's whole process group, as a terminal sends it: every
rank finishes its step, saves it and says how to continue; the same command
resumes there and exports; the exported file loads into the model the model
file builds, strictly, and the loaded model computes a finite loss.
Each model file reads its data 40 ms a sample (`dataset()`), so a step lasts
long enough for the signal to arrive inside the run.
"""
import json
import os
import signal
import subprocess
import textwrap

import pytest
import torch

from autopar.cli import main as cli
from dist_utils import free_port, signal_after_rows

SLOW_DATA = '''
import time
import torch
from torch.utils.data import Dataset


class SlowData(Dataset):
    """(inputs, targets) pairs read at 40 ms a sample."""
    def __init__(self, make, n=4096):
        self.make, self.n = make, n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        time.sleep(0.04)
        g = torch.Generator().manual_seed(i)
        return self.make(g)


def _tokens(vocab, seq):
    def make(g):
        ids = torch.randint(0, vocab, (seq + 1,), generator=g)
        return ids[:-1], ids[1:]
    return make


# what the three token models' files share: 16 tokens of a 96-token vocabulary
def example_inputs(batch):
    return (torch.randint(0, 96, (batch, 16)),)


def loss_fn(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def dataset():
    return SlowData(_tokens(96, 16))
'''

MINGPT_MODEL = '''
import math
import torch
import torch.nn as nn
import torch.nn.functional as F


class GPTConfig:
    def __init__(self, vocab_size=96, block_size=16, n_layer=3, n_head=2, n_embd=32):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Parameter(torch.zeros(1, config.block_size, config.n_embd))
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb[:, : idx.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
'''

MODEL_FILES = {
    "mingpt": '''
from mingpt_model import GPT, GPTConfig  # the neighbour, as nanoGPT-style repositories import it
from slow_data import dataset, example_inputs, loss_fn  # noqa: F401


def build_model():
    return GPT(GPTConfig())
''',
    "cnn": '''
from slow_data import SlowData
import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + F.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    def __init__(self, c=8, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.layers = nn.Sequential(*[ConvBlock(c) for _ in range(3)])
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean(dim=(2, 3)))


def build_model():
    return SmallCNN()


def example_inputs(batch):
    return (torch.randn(batch, 3, 16, 16),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits, targets)


def dataset():
    return SlowData(lambda g: (torch.randn(3, 16, 16, generator=g), torch.randint(0, 10, (), generator=g)))
''',
    "qwen3": '''
from slow_data import dataset, example_inputs  # noqa: F401
from transformers import Qwen3Config, Qwen3ForCausalLM


def build_model():
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=64, tie_word_embeddings=True))
''',
    "xtransformers": '''
from slow_data import dataset, example_inputs, loss_fn  # noqa: F401
from x_transformers import Decoder, TransformerWrapper


def build_model():
    return TransformerWrapper(num_tokens=96, max_seq_len=16, attn_layers=Decoder(dim=32, depth=2, heads=2))
''',
}
NEEDS = {"qwen3": "transformers", "xtransformers": "x_transformers"}


def _write_files(tmp_path, name):
    src = tmp_path / "models"
    src.mkdir()
    (src / "slow_data.py").write_text(SLOW_DATA)
    (src / "mingpt_model.py").write_text(MINGPT_MODEL)
    (src / f"{name}.py").write_text(textwrap.dedent(MODEL_FILES[name]))
    return str(src / f"{name}.py")


def _launch(build, argv, log, **popen):
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "MAX_RESTARTS": "0"}
    env.pop("PYTHONPATH", None)  # the build finds its model file and neighbours on its own
    return subprocess.Popen([str(build / "launch.sh"), *argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=str(build.parent), **popen)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["mingpt", "cnn", "qwen3", "xtransformers"])
def test_own_model_file_plans_compiles_survives_ctrl_c_resumes_and_exports(tmp_path, name, capsys):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    spec = _write_files(tmp_path, name)
    plan_json, build = tmp_path / "plan.json", tmp_path / "build"
    cluster = ["--gpus", "2", "--device", "cpu", "--batch-size", "4"]
    capsys.readouterr()
    assert cli(["plan", spec, *cluster, "--json"]) == 0, capsys.readouterr().err
    plan_json.write_text(capsys.readouterr().out)
    assert cli(["compile", spec, "--gpus", "2", "--plan", str(plan_json), "-o", str(build)]) == 0, capsys.readouterr().err

    ckpt, export = tmp_path / "ckpt", tmp_path / "final.safetensors"
    argv = ["--steps", "24", "--save-every", "100", "--save-dir", str(ckpt), "--export", str(export), "--no-plot"]
    with open(tmp_path / "job.log", "w") as log:
        job = _launch(build, argv, log, start_new_session=True)  # its own process group, as a terminal's job
        sent = signal_after_rows(job, ckpt / "metrics.jsonl", lambda: os.killpg(job.pid, signal.SIGINT))
        job.wait(timeout=300)
    text = (tmp_path / "job.log").read_text()
    assert sent and "stopped by signal after step" in text and "KeyboardInterrupt" not in text, text[-3000:]
    stopped = int(text.split("stopped by signal after step ")[1].split()[0])
    assert 1 <= stopped < 24

    with open(tmp_path / "job2.log", "w") as log:
        assert _launch(build, argv, log).wait(timeout=300) == 0, (tmp_path / "job2.log").read_text()[-3000:]
    text2 = (tmp_path / "job2.log").read_text()
    assert f"at step {stopped}" in text2, text2[-2000:]
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(24))  # one row a step, across the two runs

    # reload: the exported file is the model's own state_dict, strictly, as the model file builds it
    from safetensors.torch import load_file

    from autopar.model_file import load_model
    loaded = load_model(spec, device="cpu")  # its neighbours imported from its folder
    model = loaded.model
    model.load_state_dict(load_file(str(export)), strict=True)
    x = loaded.example_inputs(2) if callable(loaded.example_inputs) else loaded.example_inputs
    with torch.no_grad():
        out = model(*x)
    logits = out.logits if hasattr(out, "logits") else out
    assert torch.isfinite(logits).all()
