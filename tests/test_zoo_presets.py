"""Zoo presets build on the meta device with the published parameter counts,
follow the model-file convention, and the big ones capture quickly."""
import time

import pytest
import torch

import autopar
import gpt
import llama
import moe
import resnet
import vit
from autopar.model_file import load_model

# Published counts: torchvision (ViT, ResNet), Meta's Llama-3 model cards (exact counts of the HF checkpoints).
PUBLISHED = {
    (vit, "vit_b_16"): 86_567_656,
    (vit, "vit_h_14"): 632_045_800,
    (resnet, "resnet50"): 25_557_032,
    (llama, "llama3_8b"): 8_030_261_248,
    (llama, "llama3_70b"): 70_553_706_496,
    (llama, "llama3_405b"): 405_853_388_800,
}


@pytest.mark.parametrize("module,preset", list(PUBLISHED))
def test_preset_parameter_counts_match_published(module, preset):
    with torch.device("meta"):
        model, _ = getattr(module, preset)()
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[(module, preset)]


@pytest.mark.parametrize("spec", ["examples/gpt.py", "examples/llama.py:llama_tiny", "examples/vit.py:vit_tiny",
                                  "examples/resnet.py:resnet_tiny", "examples/moe.py:moe_tiny",
                                  "examples/vit.py", "examples/resnet.py"])
def test_model_files_follow_the_convention(spec):
    loaded = load_model(spec)
    assert next(loaded.model.parameters()).device.type == "meta"
    inputs = loaded.example_inputs(2)
    assert isinstance(inputs, tuple) and inputs[0].shape[0] == 2
    assert callable(loaded.loss_fn)


def test_gpt_defaults_unchanged():
    cfg = gpt.GPTConfig()
    assert cfg.attention_impl == "sdpa" and cfg.dropout == 0.0
    with pytest.raises(ValueError, match="attention_impl"):
        gpt.GPT(gpt.GPTConfig(vocab_size=8, seq_len=4, hidden=8, layers=1, heads=2, attention_impl="flash3"))


@pytest.mark.parametrize("module,preset", [(gpt, "gpt3_175b"), (llama, "llama3_405b")])
def test_largest_models_capture_in_seconds(module, preset):
    with torch.device("meta"):
        model, inputs = getattr(module, preset)()
    start = time.perf_counter()
    graph = autopar.capture(model, inputs)
    elapsed = time.perf_counter() - start
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    assert len({layer.signature for layer in graph.layers}) == 3  # embedding, block, head
    assert elapsed < 30  # 10 s budget on an idle machine (benchmarks/capture.py); slack for shared CI CPUs


def test_moe_small_preset():
    with torch.device("meta"):
        model, inputs = moe.moe_small()
    graph = autopar.capture(model, inputs)
    assert graph.total_params == 652_821_504
    assert graph.layers[1].attrs["experts"] == 8 and graph.layers[1].attrs["top_k"] == 2
