"""Rank functions for the lowering tests (importable by spawned ranks).

Each function runs many layouts inside one spawned world (spawning costs
seconds) and returns plain numbers; the tests assert on them.
"""
from __future__ import annotations

import copy

import torch

from autopar.lower import compile, plan_for_model

SEQ = 16
GLOBAL_BATCH = 8
STEPS = 3


def build(model_name: str, seed: int = 0, device=None):
    import gpt
    import llama
    torch.manual_seed(seed)
    factory = {"gpt": gpt.gpt_tiny, "llama": llama.llama_tiny, "llama_tied": _llama_tied}[model_name]
    model, example = factory()
    return model, example, gpt.loss_fn


def _llama_tied():
    import llama
    cfg = copy.replace(llama.PRESETS["llama_tiny"], tie_embeddings=True)
    return llama.Llama(cfg), lambda b: llama.example_inputs(b, cfg)


def batches(seed: int = 123, vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def make_optimizer(kind):
    if kind == "sgd":
        return torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}


def reference(model_name: str, optim: str):
    model, _, loss_fn = build(model_name)
    cls, kw = make_optimizer(optim)
    opt = cls(model.parameters(), **kw)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def compare(params, ref_params) -> float:
    """Largest per-tensor relative difference max|p - ref| / max|ref|."""
    assert set(params) == set(ref_params), (sorted(params), sorted(ref_params))
    worst = 0.0
    for k, ref in ref_params.items():
        worst = max(worst, ((params[k] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
    return worst


def equivalence_world(rank, world, model_name, layouts, optim):
    """For each layout (kwargs of plan_for_model): losses per step and the
    worst relative parameter difference against one process after STEPS steps."""
    ref_losses, ref_params = reference(model_name, optim)
    out = {}
    for name, kw in layouts:
        model, example, loss_fn = build(model_name)
        dp = kw.get("dp", 1)
        n_mb = kw.setdefault("num_micro_batches", 1)
        kw.setdefault("micro_batch_size", GLOBAL_BATCH // (dp * n_mb))
        plan = plan_for_model(model, **kw)
        cls, okw = make_optimizer(optim)
        pm = compile(model, example_inputs=example, loss_fn=loss_fn, optimizer=cls, optimizer_kwargs=okw,
                     plan=plan)
        losses = [pm.train_step((x,), y) for x, y in batches()]
        state = pm.full_state_dict()
        out[name] = {"losses": losses, "ref_losses": ref_losses,
                     "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "param_rel": compare(state, ref_params)}
    return out
