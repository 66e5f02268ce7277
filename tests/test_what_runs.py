"""Plan only what runs (issue 12): the planner is told which layouts the
lowering can run for a model (autopar/lower/what_runs.py) and offers no
other, with the reason in the plan; and the losses autopar weighs by their
targets.

Each refusal here is checked against what the real lowering does on gloo
ranks in benchmarks/results/lowering_matrix.md: T5's blocks run unsplit
under tensor parallelism there ("ok*"), pipelines over its two block stacks
are refused; Llama runs every layout.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import AutoparError, InfeasibleError
from autopar.lower.model_io import UserTokenMeanLoss, is_mean_over_scored_targets, own_token_loss
from autopar.lower.what_runs import limits

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 64, 8


def _t5():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    model = transformers.T5ForConditionalGeneration(cfg)
    inputs = lambda b: (torch.ones(b, SEQ, dtype=torch.long),) * 3  # noqa: E731  ids, mask, decoder ids
    return model, inputs


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg), lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)


def test_encoder_decoder_limits_name_the_pipeline_and_sequence_parallel_reasons():
    model, inputs = _t5()
    graph = autopar.capture(model, inputs)
    hook = sys.excepthook
    got = limits(model, graph, inputs)
    assert got["checked"] is True
    assert "2 block stacks" in got["pipeline"] and "encoder.block" in got["pipeline"]
    # T5's attention adds a per-head position bias; split by heads, DTensor's output strides no longer
    # fit T5's reshape, so the block runs only unsplit: whole on every rank, not what a tp plan prices
    assert "would run whole on every tp rank" in got["tp"]["2"] and "'encoder.block." in got["tp"]["2"]
    # the fake process group is gone, and tracebacks are not prefixed "[rank0]" afterwards
    assert not dist.is_initialized() and sys.excepthook is hook


def test_a_model_that_runs_every_layout_is_not_limited():
    model, inputs = _llama()
    got = limits(model, autopar.capture(model, inputs), inputs)
    counted = got.pop("tp_collectives")
    assert got == {"checked": True, "pipeline": None, "tp": {}, "sequence_parallel": {}, "unverified": [],
                   "tp_checked": [2], "runs_whole": {}}
    # and what its blocks issue split (Hugging Face's Llama: Megatron's two all-reduces each way)
    assert counted["2"]["plain"] == [{"block": "model.layers.0", "fwd": "all_reduce 1, all_reduce 1",
                                      "bwd": "all_reduce 1, all_reduce 1"}]


def test_planner_offers_no_layout_the_lowering_refuses_and_says_why():
    model, inputs = _t5()
    plan = autopar.plan(model, "cpu:1", inputs, global_batch_size=8, precision="fp32")
    assert plan.mesh.pp == 1 and not plan.sequence_parallel
    assert "2 block stacks" in plan.solver["lowering_limits"]["pipeline"]
    # ... and the terminal plan and the HTML report say what was not offered, and why
    from autopar.report.html import render_html
    from autopar.report.tables import not_offered
    lines = not_offered(plan)
    assert lines[0].startswith("pipeline parallelism: pipeline parallelism over 2 block stacks")
    assert any(l.startswith("tensor parallelism over 2: block 'encoder.block.") for l in lines)
    html = render_html(plan)
    assert "Not offered: autopar cannot lower them for this model" in html and "2 block stacks" in html
    with pytest.raises(InfeasibleError, match="lowering cannot run it .pipeline parallelism over 2 block stacks"):
        autopar.plan(model, "cpu:1", inputs, global_batch_size=8, precision="fp32", constraints={"pp": 2})
    with pytest.raises(InfeasibleError, match="lowering cannot run it .block 'encoder.block.[01]' cannot run split"):
        autopar.plan(model, "cpu:1", inputs, global_batch_size=8, precision="fp32", constraints={"tp": 2})


T5_FILE = """import torch, transformers
def build_model():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0))
def example_inputs(b):
    return (torch.ones(b, 8, dtype=torch.long),) * 3
"""


def test_the_cli_offers_no_tp_the_lowering_cannot_run(tmp_path, capsys):
    """Guards the mutation 'the CLI planning without the lowering check' (issue 35 item 4f:
    commands/common.py passing check_lowering=limits to the planner). `autopar plan` builds
    the model on the meta device; T5's blocks cannot run split over tp 2 (as the test above
    finds on a CPU-built T5), so a pinned --tp 2 is refused with that reason rather than
    planned. (Before this test the check on a meta-built model let T5's split through: its
    split blocks now run on CPU fake tensors, as a CPU-built model's do.)"""
    from autopar.cli import main

    (tmp_path / "t5_tiny.py").write_text(T5_FILE)
    code = main(["plan", str(tmp_path / "t5_tiny.py"), "--gpus", "2", "--device", "cpu", "--batch-size", "8",
                 "--precision", "fp32", "--tp", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "lowering cannot run it" in err and "cannot run split over tp=2" in err, err[-2000:]


def test_limits_inside_a_process_group_are_those_of_a_fresh_process():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    model, inputs = _llama()
    graph = autopar.capture(model, inputs)
    fresh = limits(model, graph, inputs)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        got = limits(model, graph, inputs)
    finally:
        dist.destroy_process_group()
    assert got == fresh and got["checked"] is True


# -- losses weighed by their targets ------------------------------------------------------
def _flat_ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _mean_of_row_means(logits, y):
    return torch.stack([F.cross_entropy(l, t) for l, t in zip(logits, y)]).mean()


def test_a_mean_over_scored_targets_is_recognised_and_other_losses_are_not():
    assert is_mean_over_scored_targets(_flat_ce)
    assert not is_mean_over_scored_targets(_mean_of_row_means)  # a mean of means: used as given
    assert not is_mean_over_scored_targets(lambda l, y: F.cross_entropy(l.flatten(0, 1), y.flatten(),
                                                                         reduction="sum"))
    assert not is_mean_over_scored_targets(lambda l, y: l[..., 0].mean())  # not a per-target loss at all


def test_weighed_micro_batches_give_the_whole_batch_mean():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 11, generator=g)
    y = torch.randint(0, 11, (4, 6), generator=g)
    y[0, :5] = -100
    y[2, :1] = -100
    loss = UserTokenMeanLoss(_flat_ce)
    loss.tokens_per_share = float((y != -100).sum()) / 4  # 4 shares: one row each
    total = sum(loss(logits[i:i + 1], y[i:i + 1]) for i in range(4)) / 4
    assert torch.allclose(total, _flat_ce(logits, y), rtol=1e-6)
    plain = sum(_flat_ce(logits[i:i + 1], y[i:i + 1]) for i in range(4)) / 4
    assert not torch.allclose(plain, _flat_ce(logits, y), rtol=1e-3)  # what dp used to compute


def test_own_loss_of_classifiers_and_distilbert():
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, num_labels=5))
    loss = own_token_loss(vit)
    pixels, labels = torch.randn(3, 3, 16, 16), torch.tensor([0, 4, 2])
    assert torch.allclose(loss(vit(pixels).logits, labels), vit(pixels, labels=labels).loss)
    with pytest.raises(AutoparError, match="float labels"):
        loss.scored_tokens(torch.rand(3, 5))
    vit.config.problem_type = "multi_label_classification"
    with pytest.raises(AutoparError, match="cannot reproduce"):
        own_token_loss(vit)
    distil = transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, hidden_dim=64, dropout=0.0, attention_dropout=0.0))
    x = torch.randint(0, VOCAB, (2, SEQ))
    y = x.clone()
    y[0, :3] = -100
    assert torch.allclose(own_token_loss(distil)(distil(x).logits, y), distil(x, labels=y).loss)
    distil.mlm_loss_fct = nn.CrossEntropyLoss(label_smoothing=0.1)  # another objective: refused
    with pytest.raises(AutoparError, match="cannot reproduce"):
        own_token_loss(distil)


# -- pipeline stand-ins for blocks returning tuples ---------------------------------------
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x), self.fc(x).softmax(-1)  # (activation, weights), like GPT-J's attention


class _TupleLM(nn.Module):
    def __init__(self, read_weights: bool):
        super().__init__()
        self.read_weights = read_weights
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx):
        x, extra = self.emb(idx), 0
        for block in self.blocks:
            out = block(x)
            x = out[0]
            if self.read_weights:  # the second output is used: a skipped block cannot provide it
                extra = extra + out[1].mean()
        return self.head(x) + extra


def test_a_blocks_unread_extra_output_does_not_rule_out_pipelines():
    inputs = lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)  # noqa: E731
    for read, ok in ((False, True), (True, False)):
        model = _TupleLM(read)
        got = limits(model, autopar.capture(model, inputs, loss_fn=_flat_ce), inputs)
        assert (got["pipeline"] is None) == ok, (read, got["pipeline"])
    assert "later elements (FakeTensor) are read" in got["pipeline"]


def test_every_stage_runs_its_stand_ins_on_fake_tensors_before_pipelines_are_offered(monkeypatch):
    """ViT's forward reads `embeddings.patch_embeddings.num_patches` on every
    stage. With stand-ins that do not pass attribute reads to the real module
    (as before this check existed) the lowering matrix saw later stages crash
    while the first waited; the fake-tensor run of every stage now finds it
    before the planner offers a pipeline."""
    from autopar.lower import pipeline_parallel
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5))
    inputs = lambda b: (torch.zeros(b, 3, 16, 16),)  # noqa: E731
    graph = autopar.capture(vit, inputs)
    assert limits(vit, graph, inputs)["pipeline"] is None
    monkeypatch.setattr(pipeline_parallel._ZeroOutput, "__getattr__", nn.Module.__getattr__)
    got = limits(vit, graph, inputs)
    assert "pipeline stage 1 of 2 fails on its stand-ins" in got["pipeline"] and "patch_embeddings" in got["pipeline"]
    blocks = [m for m in vit.modules() if type(m).__name__ == "ViTLayer"]
    assert len(blocks) == 2 and not any(b._forward_pre_hooks for b in blocks)  # tried stages leave no hooks


def _deep_llama(layers=6, **extra):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra)
    return transformers.LlamaForCausalLM(cfg), lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)


def test_stacks_of_identical_blocks_are_checked_on_two_and_give_the_whole_models_answer(monkeypatch):
    """limits cuts a stack of identical blocks to two (short_stacks.py): the same answer as the
    whole model's, the model restored after, and the whole model asked when the short one refuses."""
    from autopar.lower import what_runs
    model, inputs = _deep_llama()
    graph = autopar.capture(model, inputs)
    calls = []
    real = what_runs._limits
    monkeypatch.setattr(what_runs, "_limits", lambda m, g, *a: calls.append(len(m.model.layers)) or real(m, g, *a))
    short = limits(model, graph, inputs)
    assert calls == [2] and len(model.model.layers) == 6  # asked of two blocks only, then put back
    calls.clear()
    monkeypatch.setattr(what_runs, "_short_answer", lambda *a: None)
    assert limits(model, graph, inputs) == short and calls == [6]
    # a refusal on the short stack is asked again of the whole model
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(what_runs, "_limits",
                        lambda m, g, *a: calls.append(len(m.model.layers)) or {**real(m, g, *a), "pipeline": "no"})
    assert limits(model, graph, inputs)["pipeline"] == "no" and calls == [2, 6]


def test_blocks_that_differ_keep_the_whole_stack():
    """Per-layer windows (a config attribute that differs between blocks) are not one computation."""
    from autopar.lower.short_stacks import short_stacks
    model, inputs = _deep_llama()
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.window = 4 if i % 2 else 8
    graph = autopar.capture(model, inputs)
    with short_stacks(model, graph, ["model.layers"]) as short:
        assert short is None and len(model.model.layers) == 6
    model, inputs = _deep_llama()
    with short_stacks(model, graph, ["model.layers"]) as short:
        assert len(model.model.layers) == 2 and len(short.layers) == len(graph.layers) - 4
