"""Inputs inferred for model files that only build the model, and the
sequence-length fallbacks of the fit."""
import pytest
import torch
import torch.nn as nn

import autopar
from autopar.capture.auto_inputs import infer_example_inputs, learned_position_table
from autopar.errors import ModelFileError
from autopar.model_file import load_model
from cost_models.workload import S, evaluate


class TokenModel(nn.Module):
    """nanoGPT-like: config with block_size, learned positions, forward(idx, targets=None)."""

    class Config:
        block_size = 4096
        vocab_size = 100

    def __init__(self):
        super().__init__()
        self.config = self.Config()
        self.wte = nn.Embedding(100, 16)
        self.wpe = nn.Embedding(4096, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
                                     for _ in range(2)])
        self.head = nn.Linear(16, 100)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_token_model_gets_ids_targets_and_a_capped_length():
    inferred = infer_example_inputs(TokenModel())
    ids, targets = inferred(3)
    assert ids.shape == (3, 2048) and targets.shape == (3, 2048) and ids.dtype == torch.long
    assert 0 <= int(ids.min()) and int(ids.max()) < 100
    assert "min(config.block_size 4096, 2048)" in inferred.description and "targets" in inferred.description
    assert torch.equal(inferred(3)[0], ids)  # deterministic


def test_seq_len_overrides_and_is_checked_against_learned_positions():
    assert infer_example_inputs(TokenModel(), seq_len=256)(1)[0].shape == (1, 256)
    assert "from --seq-len" in infer_example_inputs(TokenModel(), seq_len=256).description
    assert learned_position_table(TokenModel()) == ("wpe", 4096)
    with pytest.raises(ModelFileError, match="longer than the model's learned position table wpe"):
        infer_example_inputs(TokenModel(), seq_len=8192)
    with pytest.raises(ModelFileError, match="positive"):
        infer_example_inputs(TokenModel(), seq_len=0)


def test_conv_model_gets_images_and_says_the_size_was_assumed():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))
    inferred = infer_example_inputs(model)
    assert inferred(2)[0].shape == (2, 3, 224, 224)
    assert "assumed" in inferred.description and inferred.seq_len is None


class NeedsMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, src, src_mask):
        return self.emb(src) * src_mask


def test_forward_with_other_required_inputs_is_not_guessed():
    assert infer_example_inputs(NeedsMask()) is None


def test_nothing_to_infer_keeps_the_model_file_error(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import torch\ndef build_model(): return torch.nn.Linear(4, 4)\n")
    with pytest.raises(ModelFileError) as info:
        load_model(str(path))
    assert "defines no example_inputs" in info.value.message and "cannot be inferred for Linear" in info.value.message
    assert "def example_inputs(batch_size)" in info.value.hint


def test_model_file_with_only_a_model_is_captured(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import sys\nsys.path.insert(0, %r)\nfrom test_capture_inputs import TokenModel\n"
                    "def build_model():\n    print('building')  # model code prints: must not reach stdout\n"
                    "    return TokenModel()\n" % str(__import__("pathlib").Path(__file__).parent))
    loaded = load_model(str(path), seq_len=64)
    assert loaded.inputs_note.startswith("example inputs inferred: idx (batch, 64) in [0, 100)")
    graph = autopar.capture(loaded.model, loaded.example_inputs)
    assert graph.seq_len == 64 and graph.total_params == sum(p.numel() for p in loaded.model.parameters())
    # targets were passed, so the loss (log-softmax of the logits) is part of the head
    assert any(op.kind == "softmax" for op in graph.layers[-1].ops)


class Thresholded(nn.Module):
    """A cost that switches on past a length (as a sliding window's mask does)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.extra = nn.Linear(16, 16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.extra(x) if x.shape[1] > 32 else x * 2


def test_piecewise_cost_is_fitted_near_the_traced_length():
    graph = autopar.capture(Thresholded(), lambda b: (torch.randn(b, 64, 16),))
    assert any("fitted in s near 64" in note for note in graph.notes) and graph.seq_fit == "local"
    head = graph.layers[-1]
    assert evaluate(head.fwd_flops, 2, 64) == 2 * 2 * 64 * 16 * 16  # exact at the traced length
    assert S in head.fwd_flops.free_symbols


def test_hf_inferred_inputs_follow_the_model_kind():
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=4096))
        bert = BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=64, max_position_embeddings=128))
    (kwargs,) = infer_example_inputs(gpt2)(2)
    assert set(kwargs) == {"input_ids", "labels", "use_cache"} and kwargs["input_ids"].shape == (2, 2048)
    assert kwargs["use_cache"] is False  # training keeps no KV cache
    (kwargs,) = infer_example_inputs(bert, seq_len=128)(2)
    assert set(kwargs) == {"input_ids", "attention_mask", "labels"} and bool(kwargs["attention_mask"].all())
    with pytest.raises(ModelFileError, match="bert.embeddings.position_embeddings"):
        infer_example_inputs(bert, seq_len=256)


def test_capture_without_example_inputs_infers_them():
    graph = autopar.capture(TokenModel())
    assert graph.seq_len == 2048 and graph.seq_fit == "wide"
    assert graph.notes[0].startswith("example inputs inferred: idx (batch, 2048)")
    with pytest.raises(autopar.errors.CaptureError, match="none can be inferred for Linear"):
        autopar.capture(nn.Linear(4, 4))


def test_seq_len_is_refused_for_costs_measured_at_one_length(tmp_path, capsys):
    from autopar.cli import main

    path = tmp_path / "fixed.py"
    path.write_text("import sys, torch\nsys.path.insert(0, %r)\nfrom test_capture_models import FixedPositions\n"
                    "def build_model(): return FixedPositions()\n"
                    "def example_inputs(b): return (torch.randint(0, 32, (b, 16)),)\n"
                    % str(__import__("pathlib").Path(__file__).parent))
    assert main(["inspect", str(path), "--seq-len", "8"]) == 2
    assert "measured at sequence length 16 only" in capsys.readouterr().err


def test_hf_labels_follow_the_head():
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification, BertForTokenClassification, BertModel

    config = BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                        vocab_size=64, max_position_embeddings=64, num_labels=3)
    shapes = {}
    for cls in (BertForSequenceClassification, BertForTokenClassification, BertModel):
        with torch.device("meta"):
            model = cls(config)
        (kwargs,) = infer_example_inputs(model)(2)
        labels = kwargs.get("labels")
        shapes[cls.__name__] = None if labels is None else (tuple(labels.shape), int(labels.max()) < 3)
    assert shapes == {"BertForSequenceClassification": ((2,), True), "BertForTokenClassification": ((2, 64), True),
                      "BertModel": None}
