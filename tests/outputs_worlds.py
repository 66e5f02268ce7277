"""Rank functions and models for tests/test_lower_outputs_and_pg.py (importable by spawned ranks).

Models the repository's examples never had (issue 29): a language model whose
forward returns a dict, and a ConvNeXt-like model whose blocks hand on
channels-last (non-contiguous) activations.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ, BATCH, STEPS = 32, 16, 8, 4, 3


class MLPBlock(nn.Module):
    """A pre-norm residual MLP: its `mlp` child is a column/row-parallel Linear pair tp can split."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class DictLM(nn.Module):
    """Returns {"logits": ..., "aux": ...} (or, with key="out", {"out": logits} alone)."""

    def __init__(self, key: str = "logits"):
        super().__init__()
        self.key = key
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(4))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        if self.key == "logits":
            return {"logits": logits, "aux": x.mean(), "note": "not a tensor"}
        return {self.key: logits}


def token_ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: depthwise conv, then LayerNorm and the MLP on channels-last
    (N, H, W, C) through permutes, the residual added there and permuted back. Its
    output is a permuted view, not contiguous, and so is its input's gradient
    (under torch.autograd.grad, as pipeline stages take it)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1, self.act, self.pw2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pw2(self.act(self.pw1(self.norm(y))))
        return (y + x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class TinyConvNeXt(nn.Module):
    """stem -> blocks (nn.ModuleList) -> pooled LayerNorm head. `channels_last`:
    the stem's output is converted with x.to(memory_format=torch.channels_last)."""

    def __init__(self, channels_last: bool = False, dim: int = 8, classes: int = 5):
        super().__init__()
        self.channels_last = channels_last
        self.stem = nn.Conv2d(3, dim, 2, stride=2)
        self.blocks = nn.ModuleList(ConvNeXtBlock(dim) for _ in range(4))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.stem(x)
        if self.channels_last:
            x = x.to(memory_format=torch.channels_last)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x.mean((2, 3))))


def build(arch: str):
    """(model, example_inputs, loss_fn, batches: [(inputs, targets)], one-process loss(model, x, y))."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if arch.startswith("dict"):
        model = DictLM("out" if arch == "dict_out" else "logits")
        key = model.key
        data = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                 torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(STEPS)]
        return (model, lambda b: (torch.zeros(b, SEQ, dtype=torch.long),), token_ce, data,
                lambda m, x, y: token_ce(m(x)[key], y))
    model = TinyConvNeXt(channels_last=arch == "convnext_channels_last")
    data = [(torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
            for _ in range(STEPS)]
    return (model, lambda b: (torch.zeros(b, 3, 8, 8),), F.cross_entropy, data,
            lambda m, x, y: F.cross_entropy(m(x), y))


def train_world(rank, world, cells):
    """Each cell (name, arch, layout) trained STEPS SGD steps under autopar and in
    one process: the largest relative error of the losses and of the parameters,
    or the refusal's message."""
    import autopar
    from autopar.errors import AutoparError
    from autopar.lower.manual_plan import plan_for_model
    from lower_worlds import compare, tp_sharded
    out = {}
    for name, arch, layout in cells:
        model, example, loss_fn, data, one_loss = build(arch)
        ref = copy.deepcopy(model)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        ref_losses = []
        for x, y in data:
            loss = one_loss(ref, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        try:
            mb = BATCH // layout.get("dp", 1) // layout.get("num_micro_batches", 1)
            plan = plan_for_model(model, example_inputs=example, micro_batch_size=mb, **layout)
            pm = autopar.compile(model, plan=plan, example_inputs=example, loss_fn=loss_fn,
                                 optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
            losses = [pm.train_step(x, y) for x, y in data]
        except AutoparError as exc:
            out[name] = {"refused": str(exc)}
            continue
        ref_params = {k: p.detach() for k, p in ref.named_parameters()}
        state = pm.full_state_dict()
        out[name] = {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "param_err": compare({k: state[k] for k in ref_params}, ref_params),
                     "tp_sharded": tp_sharded(pm)}
    return out


class RenormMLP(nn.Module):
    """An MLP whose hidden activation is renormalised (torch.renorm, a max-norm
    per sample): DTensor has no sharding rule for it, so tp cannot split it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.fc2(F.gelu(torch.renorm(self.fc1(x), 2, 0, 10.0)))


class RenormLM(DictLM):
    """DictLM's blocks with RenormMLP, returning the logits tensor."""

    def __init__(self):
        super().__init__()
        for b in self.blocks:
            b.mlp = RenormMLP()

    def forward(self, idx):
        return super().forward(idx)["logits"]


def planning_answers() -> dict:
    """What the lowering check and the planner say about RenormLM on 2 CPU ranks:
    limits() for tp 2 and 4, the plan's mesh and lowering limits, and the
    refusal of a tp=2 plan (InfeasibleError's message)."""
    import autopar
    from autopar.errors import InfeasibleError
    from autopar.lower.what_runs import limits
    model, example = RenormLM(), (lambda b: (torch.zeros(b, SEQ, dtype=torch.long),))
    graph = autopar.capture(model, example)
    cluster = autopar.ClusterSpec(gpus=2, device="cpu")
    plan = autopar.plan(model, cluster, example, global_batch_size=BATCH, precision="fp32")
    try:
        autopar.plan(model, cluster, example, global_batch_size=BATCH, precision="fp32", constraints={"tp": 2})
        tp2 = "planned"
    except InfeasibleError as exc:
        tp2 = exc.message
    return {"limits": limits(model, graph, example, tp_degrees=[2, 4]), "mesh": str(plan.mesh),
            "plan_limits": plan.solver["lowering_limits"], "tp2": tp2}


def planning_world(rank, world):
    """planning_answers() inside a gloo world; then the real group still works
    (an all_reduce), and autopar.compile(plan=None) plans (on rank 0) and trains."""
    import torch.distributed as dist

    import autopar
    answers = planning_answers()
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    example = lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)  # noqa: E731
    pm = autopar.compile(RenormLM(), autopar.ClusterSpec(gpus=2, device="cpu"), example_inputs=example,
                         global_batch_size=BATCH, loss_fn=token_ce, precision="fp32")
    g = torch.Generator().manual_seed(1)
    loss = pm.train_step(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                         torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
    return {**answers, "all_reduce": float(x), "compiled_mesh": str(pm.plan.mesh),
            "compiled_limits": pm.plan.solver["lowering_limits"], "loss": loss}
