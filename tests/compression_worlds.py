"""Rank functions for the compression tests (importable by spawned ranks): a small
decoder trained on a hand plan, compressed or not, with the losses and what reduces
its gradients read back from torch's objects (autopar.lower.compression.runs)."""
from __future__ import annotations

import torch

from autopar.lower import compile, plan_for_model
from lower_worlds import GLOBAL_BATCH, SEQ, build


def _batches(steps: int, seed: int = 123, vocab: int = 128, distinct: int = 4):
    """`steps` batches cycling over `distinct` fixed ones, targets the inputs shifted by
    one position (next-token prediction on data it can memorise: the loss falls)."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(distinct)]
    return [(t[:, :-1], t[:, 1:]) for t in (tokens[i % distinct] for i in range(steps))]


OPTIMIZER = (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.0})


def train_world(rank, world, layouts, steps, optimizer=OPTIMIZER):
    """{name: {"losses": per step, "runs": compression.runs(stages), "grad_dtypes": ...}} for
    each (name, plan_for_model kwargs) layout, every one from the same seed and batches,
    plus "one_process" and "one_process_bf16_grads" (the same training in this process,
    the second with every gradient rounded to bf16 before the step: the yardstick)."""
    from autopar.lower import compression
    out = {name: one_process(steps, optimizer, rounded) for name, rounded in
           (("one_process", False), ("one_process_bf16_grads", True))}
    for name, kw in layouts:
        model, example, loss_fn = build("gpt")
        size = GLOBAL_BATCH // (kw.get("dp", 1) * kw.get("num_micro_batches", 1))
        plan = plan_for_model(model, example_inputs=example, micro_batch_size=size, **kw)
        pm = compile(model, example_inputs=example, loss_fn=loss_fn, plan=plan, optimizer=optimizer[0],
                     optimizer_kwargs=optimizer[1])
        losses = [pm.train_step((x,), y) for x, y in _batches(steps)]
        out[name] = {"losses": losses, "runs": compression.runs(pm.stages),
                     "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})}
    return out


def one_process(steps: int, optimizer, round_grads: bool) -> dict:
    """The same training in one process (fp32); with `round_grads`, each gradient rounded to
    bf16 once before the optimizer step, what one bf16 rounding does to the trajectory."""
    model, _, loss_fn = build("gpt")
    opt = optimizer[0](model.parameters(), **optimizer[1])
    losses = []
    for x, y in _batches(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if round_grads:
            for p in model.parameters():
                p.grad = p.grad.bfloat16().float()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


def replicate_world(rank, world):
    """The DDP hooks apply_replicate registers (pending until DDP's lazy init, which this
    CPU torch would refuse for the bf16 hook: preflight refuses such plans first)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.lower import compression, data_parallel
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("as_held", None)):
        m = data_parallel.apply_replicate(torch.nn.Linear(4, 4), mesh["dp"], dtype)
        out[name] = compression.runs([m])
    return out
