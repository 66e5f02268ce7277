"""Models beyond Llama/GPT-2, as their authors wrote them, under TP and PP:
each layout trains exactly as one process does (fp32, SGD with momentum, 3
steps: every step's loss and every parameter within 1e-5 relative) or is
refused on every rank, before any collective, with the reason.

What each model exercises:
  qwen3 / olmo2        q/k norms inside attention (plain norm weights meeting
                       head-sharded q and k)
  nn.TransformerEncoder torch's own layer: nn.MultiheadAttention's packed
                       in_proj_weight, Linears called by the block itself;
                       under sequence parallelism attention must still see
                       the whole sequence
  bert (masked LM)     its own loss (no label shift); its BertEmbeddings pre
                       layer on later pipeline stages becomes zeros of its
                       output's shape; under TP the LM head's `bias` is the
                       same Parameter as its decoder Linear's (a tied end
                       that must follow the split one)
  user loss, -100      a loss that is a mean over the targets that are not
                       -100, with rows scoring different counts: dp ranks
                       must weigh it by its targets, not average means
  tuple blocks (pp)    blocks return (activation, weights) and the model
                       reads only [0]: later stages' stand-ins return None
                       for the unread weights
  gpt2 pp x tp         tied embedding and head on different pipeline ranks,
                       both vocab-split: their gradients are summed shard by
                       shard (4 ranks)
  mixtral (MoE)        pipelines run; under tensor parallelism the experts'
                       3-D weights are split on their ffn dim and run on local
                       tensors (tp_experts.py; more in test_lower_moe_tp.py)
  odd sequence         sequence parallelism over a sequence tp does not
                       divide: refused on both ranks
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from dist_utils import run_world

pytestmark = pytest.mark.slow
SEQ, VOCAB, BATCH, STEPS = 8, 64, 4, 3


class TorchEncoderLM(nn.Module):
    """A user's model around torch's nn.TransformerEncoder."""

    def __init__(self, norm_first: bool):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


class TupleBlock(nn.Module):
    """A block returning (activation, attention weights) as GPT-J's does; the model reads only [0]."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        h = self.fc(x)
        return x + h, h.softmax(-1)


class TupleLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(TupleBlock() for _ in range(4))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)[0]
        return self.head(x)


def _ce(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def build(arch: str):
    import transformers as T
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, max_position_embeddings=64)
    if arch == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=8, num_key_value_heads=2, **small)), None
    if arch == "olmo2":
        return T.Olmo2ForCausalLM(T.Olmo2Config(num_key_value_heads=2, eos_token_id=None, **small)), None
    if arch == "bert":
        return T.BertForMaskedLM(T.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                              **small)), None
    if arch == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                                    num_experts_per_tok=2, **small)), None
    if arch == "bert_dropout":
        return T.BertForMaskedLM(T.BertConfig(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                                              **small)), None
    if arch == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), None
    if arch == "tuple_blocks":
        return TupleLM(), _ce
    if arch.startswith("torch_encoder"):
        return TorchEncoderLM(norm_first=arch.endswith("pre_norm")), _ce
    raise KeyError(arch)


def _targets(x, layout):
    """The inputs as targets; with "ignore", rows scoring 2, 5, 8 and 8 targets (-100 elsewhere)."""
    if not layout.get("ignore"):
        return x
    y = x.clone()
    y[0, :6] = -100
    y[1, :3] = -100
    return y


def _world(rank, world, cells):
    import autopar
    from autopar.errors import AutoparError
    from autopar.lower.manual_plan import plan_for_model
    out = {}
    for name, arch, seq, layout in cells:
        cells_layout = layout
        model, loss_fn = build(arch)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, VOCAB, (BATCH, seq), generator=g) for _ in range(STEPS)]
        ref = copy.deepcopy(model)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        layout = dict(layout)
        ref_losses = []
        for x in batches:
            y = _targets(x, layout)
            loss = loss_fn(ref(x), y) if loss_fn else ref(x, labels=y).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        inputs = lambda b, seq=seq: (torch.zeros(b, seq, dtype=torch.long),)  # noqa: E731
        layout.pop("ignore", None)
        try:
            mb = BATCH // layout.get("dp", 1) // layout.get("num_micro_batches", 1)
            plan = plan_for_model(model, example_inputs=inputs, micro_batch_size=mb, **layout)
            pm = autopar.compile(model, plan=plan, example_inputs=inputs, loss_fn=loss_fn,
                                 optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
            losses = [pm.train_step(x, _targets(x, cells_layout)) for x in batches]
        except AutoparError as exc:
            out[name] = {"refused": str(exc)}
            continue
        state = pm.full_state_dict()
        out[name] = {
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": max(float((state[k] - p.detach()).abs().max() / p.detach().abs().max().clamp_min(1e-3))
                             for k, p in ref.named_parameters()),
            "tp_sharded": sorted(k for k, p in pm.module.named_parameters()
                                 if type(p).__name__ == "DTensor" and any(pl.is_shard() for pl in p.placements)),
        }
    return out


CELLS = [
    ("qwen3_tp", "qwen3", SEQ, dict(tp=2)),
    ("qwen3_tp_sp", "qwen3", SEQ, dict(tp=2, sequence_parallel=True)),
    ("olmo2_tp_sp", "olmo2", SEQ, dict(tp=2, sequence_parallel=True)),
    ("encoder_tp", "torch_encoder", SEQ, dict(tp=2)),
    ("encoder_tp_sp", "torch_encoder", SEQ, dict(tp=2, sequence_parallel=True)),
    ("encoder_pre_norm_tp_sp", "torch_encoder_pre_norm", SEQ, dict(tp=2, sequence_parallel=True)),
    ("bert_dp", "bert", SEQ, dict(dp=2)),
    ("bert_pp", "bert", SEQ, dict(pp=2, num_micro_batches=2)),
    ("bert_tp", "bert", SEQ, dict(tp=2)),
    ("user_loss_ignore_dp", "torch_encoder", SEQ, dict(dp=2, num_micro_batches=2, ignore=True)),
    ("tuple_blocks_pp", "tuple_blocks", SEQ, dict(pp=2, num_micro_batches=2)),
    ("qwen3_tp_sp_odd_sequence", "qwen3", SEQ + 1, dict(tp=2, sequence_parallel=True)),
    ("mixtral_tp", "mixtral", SEQ, dict(tp=2)),
    ("mixtral_pp", "mixtral", SEQ, dict(pp=2, num_micro_batches=2)),
]
CELLS_4 = [
    ("gpt2_pp_tp", "gpt2", SEQ, dict(pp=2, tp=2, num_micro_batches=2)),
    ("bert_pp_tp", "bert", SEQ, dict(pp=2, tp=2, num_micro_batches=2)),
]


@pytest.mark.timeout(600)
def test_architectures_train_as_one_process_or_are_refused_on_every_rank():
    results = run_world(_world, 2, CELLS, timeout=540)
    for name, *_ in CELLS:
        # every rank reached the same verdict (a refusal on one rank only would hang the other)
        assert ("refused" in results[0][name]) == ("refused" in results[1][name]), name
    r = results[0]
    for name in ("qwen3_tp", "qwen3_tp_sp", "olmo2_tp_sp", "encoder_tp", "encoder_tp_sp",
                 "encoder_pre_norm_tp_sp", "bert_dp", "bert_pp", "bert_tp", "user_loss_ignore_dp",
                 "tuple_blocks_pp", "mixtral_tp", "mixtral_pp"):
        assert "refused" not in r[name], (name, r[name])
        assert r[name]["loss_err"] < 1e-5 and r[name]["param_err"] < 1e-5, (name, r[name])
    # q/k norms run replicated inside head-split attention
    assert "model.model.layers.0.self_attn.q_proj.weight" in r["qwen3_tp_sp"]["tp_sharded"]  # stage.model.<user path>
    assert "model.bert.embeddings.word_embeddings.weight" in r["bert_tp"]["tp_sharded"]  # = the decoder's weight
    assert "needs tp to divide the sequence" in r["qwen3_tp_sp_odd_sequence"]["refused"]
    # MoE experts (transformers' grouped_mm on 3-D weights) split over tp
    assert "model.model.layers.0.mlp.experts.down_proj" in r["mixtral_tp"]["tp_sharded"]
    assert "sequence of 9" in r["qwen3_tp_sp_odd_sequence"]["refused"]


@pytest.mark.timeout(600)
def test_tied_ends_on_different_pipeline_ranks_under_tp_train_as_one_process():
    results = run_world(_world, 4, CELLS_4, timeout=540)
    for name, *_ in CELLS_4:
        for rank in range(4):
            assert "refused" not in results[rank][name], (rank, name, results[rank][name])
        r = results[0][name]
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, (name, r)


def _dropout_world(rank, world):
    """Dropout under TP + SP: one process's masks cannot be reproduced, but
    the tp ranks must stay one model. Parameters every tp rank holds whole
    (norms, biases of row-parallel Linears) get no cross-rank reduction, so a
    mask drawn differently on the ranks for a replicated activation would
    let them drift apart silently."""
    import autopar
    from torch.distributed.tensor import DTensor
    from autopar.lower.manual_plan import plan_for_model
    torch.manual_seed(0)
    model, _ = build("bert_dropout")
    inputs = lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)  # noqa: E731
    plan = plan_for_model(model, example_inputs=inputs, tp=2, sequence_parallel=True, micro_batch_size=BATCH)
    pm = autopar.compile(model, plan=plan, example_inputs=inputs, optimizer=torch.optim.SGD,
                         optimizer_kwargs=dict(lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    losses = [pm.train_step(x, x) for x in (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS))]
    whole = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in pm.module.named_parameters()
             if not (isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements))}
    # plain lists: tensors sent back from a spawned rank would travel as shared memory the exiting rank closes
    return {"losses": losses, "whole": {n: t.detach().flatten().tolist() for n, t in whole.items()}}


@pytest.mark.timeout(300)
def test_dropout_under_tp_and_sp_keeps_the_tp_ranks_one_model():
    a, b = run_world(_dropout_world, 2, timeout=240)
    assert a["losses"] == b["losses"] and all(l == l for l in a["losses"])  # same, finite
    assert a["whole"].keys() == b["whole"].keys() and len(a["whole"]) > 10
    for name, t in a["whole"].items():
        assert t == b["whole"][name], name
