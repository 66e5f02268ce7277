"""Layers whose internal sizes are tensor values (issue 29).

An eager MoE loop (DBRX's: `for e in hit.nonzero(): idx = torch.where(mask[e])`)
sizes its token lists by routing values, which the lowering's fake-tensor
probes do not have. Its output shape is fixed, so the probes answer the
value-sized ops (capture/value_answers.py) and pipeline parallelism cuts such a
model; a layer whose *output* is sized by values (a boolean mask keeping some
tokens) gives the probe two different shapes under two answers and is refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from dist_utils import one_process_sgd, run_world

HIDDEN, EXPERTS, VOCAB, SEQ, STEPS = 16, 4, 32, 6, 3


class LoopMoE(nn.Module):
    """Top-2 routing over experts held as one (experts * ffn, hidden) weight, looped over the experts hit."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(EXPERTS * 32, HIDDEN) * 0.1)
        self.w2 = nn.Parameter(torch.randn(EXPERTS * 32, HIDDEN) * 0.1)

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)
        weights, index = torch.topk(F.softmax(self.router(x), dim=-1), 2, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(index, EXPERTS).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = e[0]
            which, token = torch.where(mask[e])
            w1, w2 = self.w1.view(EXPERTS, 32, h)[e], self.w2.view(EXPERTS, 32, h)[e]
            y = F.silu(x[token] @ w1.T) @ w2 * weights[token, which, None]
            out.index_add_(0, token, y)
        return out.view(b, s, h)


class Block(nn.Module):
    def __init__(self, moe: type = LoopMoE):
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(HIDDEN), moe()

    def forward(self, x):
        return x + self.moe(self.norm(x))


class TokenDrop(nn.Module):
    """Keeps the positions a mask computed from the values selects (here: all of
    them, so one process trains): the output's size is a value to the probe."""

    def forward(self, x):
        return x[:, x[0, :, 0].abs() >= 0]


class LM(nn.Module):
    def __init__(self, block=Block):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(block() for _ in range(4))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class DropBlock(Block):
    def __init__(self):
        super().__init__()
        self.drop = TokenDrop()

    def forward(self, x):
        return self.drop(super().forward(x))


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def test_value_answers_give_shapes_and_count_what_they_answered():
    from autopar.capture.value_answers import ValueAnswers
    with FakeTensorMode(allow_non_fake_inputs=True), ValueAnswers(0.5) as answers:
        out = Block()(torch.randn(2, SEQ, HIDDEN))
        known = torch.tensor(3).item()  # a value fake tensors know is not answered
    assert tuple(out.shape) == (2, SEQ, HIDDEN) and known == 3
    assert answers.answered > EXPERTS  # the hit list, each expert's token list and index
    with FakeTensorMode(allow_non_fake_inputs=True), ValueAnswers(0.5), pytest.raises(Exception):
        if torch.randn(3).sum().item() > 0:  # a float read back is not answered: a branch would be a guess
            pass


def _world(rank, world, layouts):
    from autopar.errors import AutoparError
    from autopar.lower import compile as ap_compile
    from autopar.lower.manual_plan import plan_for_model
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g))
               for _ in range(STEPS)]
    out = {}
    for name, block, layout in layouts:
        torch.manual_seed(0)
        model = LM(block)
        ref_losses, ref = one_process_sgd(model, batches, _loss, lr=0.5)
        inputs = lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)  # noqa: E731
        try:
            plan = plan_for_model(model, example_inputs=inputs, **layout)
            pm = ap_compile(model, plan=plan, example_inputs=inputs, loss_fn=_loss, optimizer=torch.optim.SGD,
                            optimizer_kwargs=dict(lr=0.5))
            losses = [pm.train_step((x,), y) for x, y in batches]
        except AutoparError as exc:
            out[name] = {"refused": str(exc)}
            continue
        state = pm.full_state_dict()
        out[name] = {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "param_err": max(float((state[k] - p.detach()).abs().max() / p.detach().abs().max())
                                      for k, p in ref.named_parameters())}
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_eager_expert_loop_trains_under_pp_and_value_sized_outputs_are_refused():
    layouts = [("pp", Block, dict(pp=2, num_micro_batches=2, micro_batch_size=2)),
               ("drop_pp", DropBlock, dict(pp=2, num_micro_batches=2, micro_batch_size=2))]
    results = run_world(_world, 2, layouts, timeout=280)
    for r in results:
        assert "refused" not in r["pp"], r["pp"]
        assert r["pp"]["loss_err"] < 1e-5 and r["pp"]["param_err"] < 1e-5, r["pp"]
    # refused alike on both ranks, before any step, naming the cause
    assert results[0]["drop_pp"] == results[1]["drop_pp"]
    assert "sized by tensor values" in results[0]["drop_pp"].get("refused", ""), results[0]["drop_pp"]
