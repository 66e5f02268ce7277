"""Vision models in the training job: BatchNorm under bf16 plans, and a ResNet and a
ViT trained from their model file's dataset() on their planned layouts."""
import json
import math
import os
import statistics

import pytest

from dist_utils import run_world
from train_worlds import EXAMPLES, main_world


def _compile(spec: str, batch: int, out) -> str:
    from autopar.cli import main as cli
    assert cli(["compile", spec, "--gpus", "2", "--device", "cpu", "--batch-size", str(batch), "-o", str(out)]) == 0
    return os.path.join(out, "plan.json")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_batchnorm_keeps_fp32_weights_under_bf16_and_same_stats_on_every_rank(tmp_path):
    """The planned ResNet layout (dp 2, FSDP) in bf16 used to fail on every rank with
    "expected scalar type BFloat16 but found Float"."""
    from lower_worlds import batchnorm_world
    plan = _compile(os.path.join(EXAMPLES, "resnet.py") + ":resnet_tiny", 8, tmp_path / "build")
    assert json.load(open(plan))["precision"] == "bf16"
    results = run_world(batchnorm_world, 2, plan, timeout=300)
    bf16, fp32 = results[0]["bf16"], results[0]["fp32"]
    assert bf16["dtypes"] == {"conv": "torch.bfloat16", "weight": "torch.float32", "out": "torch.bfloat16"}, bf16
    assert fp32["dtypes"]["weight"] == "torch.float32"
    # The first loss (no update yet) to bf16 rounding. Later ones drift apart further: on
    # this tiny ResNet with 4-sample BatchNorm, one process under autocast is already 2.3 %
    # from fp32 after one SGD step (measured), so they are only required finite.
    assert abs(bf16["losses"][0] / fp32["losses"][0] - 1) < 1e-2, (bf16["losses"], fp32["losses"])
    assert all(math.isfinite(l) for l in bf16["losses"])
    for precision in ("bf16", "fp32"):
        assert results[1][precision]["stats"] == results[0][precision]["stats"]  # averaged over dp
        assert results[1][precision]["losses"] == results[0][precision]["losses"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("spec,batch", [("resnet.py:resnet_tiny", 8), ("vit.py:vit_tiny", 16)])
def test_vision_model_trains_from_its_dataset_in_bf16(tmp_path, spec, batch):
    """`autopar compile` (2 CPU ranks, bf16) then train.py without --data: the model
    file's dataset(model) (autopar's stand-in image set at the model's image size) feeds
    it, and the loss falls: the mean of the last 10 of 40 steps below 3/4 of the first 10."""
    spec = os.path.join(EXAMPLES, spec)
    plan = _compile(spec, batch, tmp_path / "build")
    metrics = tmp_path / "metrics.jsonl"
    assert run_world(main_world, 2, spec, plan, ["--steps", "40", "--lr", "3e-3", "--quiet",
                                                 "--metrics", str(metrics)], timeout=600) == [0, 0]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 40 and statistics.mean(losses[-10:]) < 0.75 * statistics.mean(losses[:10]), losses
    assert rows[0]["samples_per_s"] and rows[0]["predicted_samples_per_s"]
