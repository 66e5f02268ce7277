"""A standard decoder of a given size (`--model-size 6B`, DeepSpeed-style `--model_size 6B
--num_gpus 32`): published sizes take their published shapes, other sizes the nearest
width with the depth set to the size, and the CLI states the shape it chose."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from autopar.cli import main as cli
from autopar.zoo import sized
from dist_utils import free_port


def _count(family, size):
    with torch.device("meta"):
        model, _ = getattr(sized, f"{family}_{size}")()
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_published_sizes_take_their_published_shapes():
    c = sized.gpt3_config("175B")
    assert (c.layers, c.hidden, c.heads) == (96, 12288, 96)
    assert (sized.gpt3_config("125M").layers, sized.gpt3_config("125M").hidden) == (12, 768)
    c = sized.llama3_config("70B")
    assert (c.layers, c.dim, c.heads, c.kv_heads, c.ffn_hidden) == (80, 8192, 64, 8, 28672)
    assert _count("llama3", "8B") == 8_030_261_248  # Meta's card, as examples/llama.py:llama3_8b


@pytest.mark.parametrize("family,size", [("gpt3", "6B"), ("gpt3", "2B"), ("gpt3", "20B"), ("llama3", "30B")])
def test_other_sizes_come_within_a_layer_of_the_size_asked(family, size):
    want = sized.parse_size(size)
    cfg = sized.gpt3_config(size) if family == "gpt3" else sized.llama3_config(size)
    count = _count(family, size)  # the model's own count
    assert abs(count - want) / want < 0.05, (family, size, count)
    assert cfg.layers >= 8
    assert "depth set to the size" in sized.describe(family, size)


def test_sizes_that_are_not_sizes_or_too_small_for_a_family_are_refused():
    with pytest.raises(ValueError, match="expected a number and a unit"):
        sized.parse_size("6Q")
    with pytest.raises(ValueError, match="too small for the llama3 family"):
        sized.llama3_config("1B")
    with pytest.raises(AttributeError):
        sized.gpt3_six


def test_plan_with_a_model_size_says_the_shape_and_plans_it(capsys):
    assert cli(["plan", "--model-size", "1.3B", "--gpus", "8", "--json"]) == 0
    out = capsys.readouterr()
    assert "--model-size 1.3B: a GPT-3-style decoder of 1.3B: 24 layers x hidden 2048" in out.err
    plan = json.loads(out.out)
    assert plan["model"]["source"].endswith("sized.py:gpt3_1.3B") and plan["mesh"]["pp"] * plan["mesh"]["dp"] * \
        plan["mesh"]["tp"] == 8
    # the DeepSpeed-style spellings plan the same
    assert cli(["plan", "--model_size", "1.3B", "--num_gpus", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"] == plan["mesh"]
    assert cli(["plan", "examples/gpt.py:gpt_tiny", "--model-size", "6B", "--gpus", "8"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert cli(["plan", "--gpus", "8"]) == 2
    assert "or --model-size SIZE" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compile_a_model_size_and_train_it_with_torchrun(tmp_path):
    build = tmp_path / "build"
    assert cli(["compile", "--model-size", "125M", "--gpus", "2", "--device", "cpu", "--batch-size", "2",
                "--seq-len", "32", "-o", str(build)]) == 0
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 50257, 4096).astype(np.uint16).tofile(tokens)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()), str(build / "train.py"), "--data",
                           str(tokens), "--steps", "2", "--no-plot", "--losses-out", str(tmp_path / "losses.json")],
                          capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses) == 2 and all(np.isfinite(losses)) and losses[0] > 9  # about ln(50257) = 10.8 at the start
