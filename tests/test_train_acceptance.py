"""The issue's acceptance command, as a user types it: `autopar compile` a model of
transformers' zoo for 4 CPU ranks, then `torchrun --nproc_per_node 4 build/train.py
--data tokens.bin --steps 20 --save-dir ckpt --save-every 5`."""
import json
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

from autopar.cli import main as cli
from dist_utils import free_port
from train_worlds import EXAMPLES

ROOT = os.path.dirname(EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("factory", ["gpt2_tiny", "llama_tiny"])
def test_zoo_model_trains_on_a_token_file_with_snapshots(tmp_path, factory):
    """A token file with structure to learn (a repeating 7-token phrase in noise) and a
    Hugging Face GPT-2 / Llama: 20 steps on the planned layout, snapshots at 5, 10, 15,
    20 (the newest 3 kept), one metrics row a step beside the plan's predictions, and the
    loss of the last 5 steps below that of the first 5."""
    tokens = tmp_path / "tokens.bin"
    rng = np.random.default_rng(0)
    phrase = np.array([3, 14, 15, 92, 65, 35, 89], dtype=np.uint16)
    data = np.tile(phrase, 4000)
    noise = rng.random(data.size) < 0.1
    data[noise] = rng.integers(0, 256, noise.sum())
    data.tofile(tokens)
    build = tmp_path / "build"
    spec = os.path.join(EXAMPLES, "hf_models.py") + ":" + factory
    assert cli(["compile", spec, "--gpus", "4", "--device", "cpu", "--batch-size", "8", "--seq-len", "32",
                "-o", str(build)]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), str(build / "train.py"), "--data", str(tokens), "--steps", "20",
         "--save-dir", str(ckpt), "--save-every", "5", "--lr", "3e-3", "--quiet"],
        capture_output=True, text=True, timeout=800, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import importlib.util
    # the run plotted at its end; TensorBoard events beside the metrics where tensorboard is installed
    # (torchtitan, a dev dependency for the export tests, pulls it in)
    board = ["tensorboard"] if importlib.util.find_spec("tensorboard") is not None else []
    assert sorted(os.listdir(ckpt)) == ["metrics.jsonl", "metrics.png", "step-00000010", "step-00000015",
                                       "step-00000020"] + board
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(20))
    assert all(r["predicted_step_time_s"] and r["tokens_per_s"] for r in rows)
    losses = [r["loss"] for r in rows]
    assert statistics.mean(losses[-5:]) < statistics.mean(losses[:5]), losses
    assert "predicted vs measured" in proc.stdout
