"""A head that reads its Linear's weight instead of calling it (issue 29).

MobileBERT's MLM head computes `x.matmul(cat([decoder.weight.t(), dense.weight]))`
with `decoder.weight` tied to the word embeddings. Splitting that Linear over
the vocabulary handed the user's matmul a DTensor and crashed the first
backward ("the local_tensor argument only accepts torch.Tensor"). A Linear
the model never calls, and every module tied to its weight, now stays whole
under tp (on every pipeline stage alike), named in the model's notes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import one_process_sgd, run_world

VOCAB, HIDDEN, SEQ, STEPS = 32, 16, 6, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 64), nn.Linear(64, HIDDEN)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    """MobileBERT's shape: the decoder Linear is read by weight, never called."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        return x.matmul(self.decoder.weight.t()) + self.decoder.bias


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = Head()
        self.head.decoder.weight = self.embed.weight  # tied

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _world(rank, world, layouts, model_cls=None):
    from autopar.lower import compile as ap_compile
    from autopar.lower.manual_plan import plan_for_model
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g))
               for _ in range(STEPS)]
    out = {}
    for name, layout in layouts:
        torch.manual_seed(0)
        model = (model_cls or LM)()
        ref_losses, ref = one_process_sgd(model, batches, _loss, lr=0.5)
        inputs = lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)  # noqa: E731
        plan = plan_for_model(model, example_inputs=inputs, **layout)
        pm = ap_compile(model, plan=plan, example_inputs=inputs, loss_fn=_loss, optimizer=torch.optim.SGD,
                        optimizer_kwargs=dict(lr=0.5))
        losses = [pm.train_step((x,), y) for x, y in batches]
        state = pm.full_state_dict()
        out[name] = {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "param_err": max(float((state[k] - p.detach()).abs().max() / p.detach().abs().max())
                                      for k, p in ref.named_parameters()),
                     "notes": list(pm.notes)}
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_head_read_by_weight_stays_whole_under_tp_and_pp_x_tp():
    layouts = [("tp", dict(tp=2, micro_batch_size=4)), ("pp_tp", dict(pp=2, tp=2, num_micro_batches=2, micro_batch_size=2))]
    tp_only = run_world(_world, 2, layouts[:1], timeout=280)
    pp_tp = run_world(_world, 4, layouts[1:], timeout=280)
    for name, results in (("tp", tp_only), ("pp_tp", pp_tp)):
        for r in results:
            assert r[name]["loss_err"] < 1e-5 and r[name]["param_err"] < 1e-5, (name, r[name])
            assert any("head.decoder" in n and "reads its weight" in n for n in r[name]["notes"]), r[name]["notes"]


class RootHead(nn.Module):
    """A small LM whose root computes its head from the embedding's weight: no
    head module at all (capture's layer 'head' names none)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, tokens):
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        return h @ self.emb.weight.T


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_head_the_root_computes_trains_under_dp_zero3_and_tp():
    """Such a model was refused by every layout (resolve: "layer 'head' names module
    'head', which this model does not have"); under tp the embedding whose weight
    the root reads now stays whole (a vocab split would hand the root a DTensor)."""
    layouts = [("dp", dict(dp=2, micro_batch_size=2)), ("zero3", dict(dp=2, zero=3, micro_batch_size=2)),
               ("tp", dict(tp=2, micro_batch_size=4))]
    results = run_world(_world, 2, layouts, RootHead, timeout=280)
    for r in results:
        for name, _ in layouts:
            assert r[name]["loss_err"] < 1e-5 and r[name]["param_err"] < 1e-5, (name, r[name])
        assert any(n.startswith("emb: the model reads its parameters outside its forward") for n in r["tp"]["notes"])


class RootReads(nn.Module):
    """Layers the root walks (ModuleDicts), an in-place add into a layer's output,
    and the embedding's weight read by the root for its head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(o=nn.Linear(HIDDEN, HIDDEN))) for _ in range(2))

    def forward(self, x):
        h = self.emb(x)
        for l in self.layers:
            y = l["o"](h)
            y += h  # in place into o's output
            h = y
        return h @ self.emb.weight.T


def test_layers_read_or_written_outside_their_forward_are_found():
    """FSDP2 unshards a unit around its own forward and hooks its outputs: a root
    that reads the embedding's weight for its head, or adds into a layer's output
    in place, would crash the first ZeRO-3 step (an mm of a DTensor shard; a freed
    storage in the backward). Such layers stay in the root unit."""
    from autopar.lower.weight_reads import read_outside

    m = RootReads()
    layers = {"emb": m.emb, "layers.0.o": m.layers[0]["o"], "layers.1.o": m.layers[1]["o"]}
    assert read_outside(m, layers, (torch.zeros(2, SEQ, dtype=torch.long),), {}) == {"emb", "layers.0.o", "layers.1.o"}



def test_a_head_read_by_weight_is_priced_whole_as_it_runs():
    """What is priced is what runs: the planner's check of the lowering names the
    head and its tied embedding as run whole, and the plan records (and the cost
    model prices) them replicated; without that answer it would price a
    vocabulary split the lowering never makes."""
    import autopar
    from autopar.lower.what_runs import limits

    inputs = lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)  # noqa: E731

    def styles(check):
        p = autopar.plan(LM(), "cpu:2", example_inputs=inputs, constraints=dict(tp=2), global_batch_size=8,
                         check_lowering=check)
        return {l.name: l.tp_style for s in p.stages for l in s.layers}, p

    def forgetful(*a, **k):  # the same check, its runs_whole answer dropped
        out = limits(*a, **k)
        out.pop("runs_whole", None)
        return out

    kept, plan = styles(limits)
    assert kept["head"] == kept["embed"] == "replicate" and kept["blocks.0"] == "colwise_rowwise", kept
    assert "head.decoder: the model reads its weight" in plan.solver["lowering_limits"]["runs_whole"]["head"]
    from autopar.report.tables import not_offered  # and the terminal plan / report say so
    assert any(line.startswith("a vocabulary split of layer head:") for line in not_offered(plan))
    dropped, _ = styles(forgetful)
    assert dropped["head"] == dropped["embed"] == "vocab", dropped


def test_a_tied_weight_read_by_either_holder_is_not_read_outside():
    """GPT's tied embedding and lm_head: the embedding's forward reads the head's
    weight, which is its own. Counted as read outside, every tied LM would keep
    both in the root FSDP2 unit and run its embedding and head whole under tp."""
    from autopar.lower.weight_reads import read_outside

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x))

    m = Tied()
    assert read_outside(m, {"emb": m.emb, "head": m.head}, (torch.zeros(2, SEQ, dtype=torch.long),), {}) == set()


def test_an_in_place_op_on_a_new_tensor_is_not_a_write_into_a_freed_output():
    """Outputs are known by id: a freed layer output's id taken by a later tensor that an
    in-place op writes (ResNet's ReLU(inplace=True)) was read as a write into that layer's
    output, on some ranks and not others, so the ranks built different FSDP2 units and
    their all-gathers did not match (a gloo abort under load, test_train_vision)."""
    from autopar.lower.weight_reads import read_outside

    class Freed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            for _ in range(20):  # many chances for an id to come back
                y = self.a(x)
                z = y * 2
                del y
                x = torch.relu_(z + 1)
            return self.b(x)

    m = Freed()
    assert read_outside(m, {"a": m.a, "b": m.b}, (torch.randn(2, HIDDEN),), {}) == set()
