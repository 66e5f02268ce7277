"""Float8 Linears (issue 31, item 3): planned, priced, lowered, refused.

The plan names, per layer, the nn.Linears that run float8 (`LayerChoice.float8`,
torchao's Float8Linear with tensorwise dynamic scaling). torch 2.13 runs
`torch._scaled_mm` on the CPU, so the lowering is checked on gloo ranks: the same
float8 plan under DP + ZeRO 3, TP and PP trains as one process running it with the
same micro-batches (each micro-batch's tensorwise scales are then the same: tp
all-reduces its shards' amax), within 1e-5 relative after 3 steps; where FSDP2
shards the weights without tp (ZeRO 3 over dp) it all-gathers them in float8. The float8 run
differs from the one without float8 by far more than that, so a lowering that
ignored the field fails.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_world

TOLERANCE = 1e-5


def _float8_plan(model, example, *, float8: bool, **layout):
    from autopar.capture import capture
    from autopar.lower import plan_for_model
    from cost_models.float8 import linear_paths

    graph = capture(model, example(layout.get("micro_batch_size", 1)), dtype=torch.float32)
    plan = plan_for_model(model, example_inputs=example, graph=graph, **layout)
    if float8:  # the Linears that are multiples of 16 split 2 ways too, so every cell converts the same ones
        for layer, choice in zip(graph.layers, plan.layer_choices):
            choice.float8 = linear_paths(layer, plan.micro_batch_size, graph.seq_len, 2)
    return plan


def _train(model_name, layout, float8, torch_compile=False):
    import lower_worlds as lw
    from autopar.lower import compile

    model, example, loss_fn = lw.build(model_name)
    plan = _float8_plan(model, example, float8=float8, **layout)
    pm = compile(model, plan=plan, example_inputs=example, loss_fn=loss_fn, optimizer=torch.optim.SGD,
                 optimizer_kwargs={"lr": 0.5, "momentum": 0.9}, torch_compile=torch_compile)
    losses = [pm.train_step(x, y) for x, y in lw.batches()]
    from torchao.float8.float8_linear import Float8Linear

    converted = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))  # FSDP2 subclasses it
    # weights FSDP2 all-gathers in float8 (a DTensor over torchao's weight wrapper)
    gathered = sum(type(getattr(m.weight, "_local_tensor", None)).__name__ == "WeightWithDynamicFloat8CastTensor"
                   for m in model.modules() if isinstance(m, Float8Linear))
    # numpy, not tensors: a tensor crosses the result queue as a shared-memory handle the exiting rank closes
    state = {k: v.detach().float().numpy().copy() for k, v in pm.full_state_dict().items()}
    return {"losses": losses, "state": state, "converted": converted, "gathered_in_float8": gathered,
            "planned": sorted(p for c in plan.layer_choices for p in c.float8)}


def _world(rank, world, cells):
    return {cell: _train(model_name, layout, float8, compiled) for cell, model_name, layout, float8, compiled in cells}


def _err(a, b) -> float:
    loss = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
    params = max(float(abs(a["state"][k] - p).max() / max(abs(p).max(), 1e-3)) for k, p in b["state"].items())
    return max(loss, params)


ONE = dict(micro_batch_size=2, num_micro_batches=4)  # the global batch of 8 in the same micro-batches
REFERENCE = [("float8", "llama", ONE, True, False), ("bf16", "llama", ONE, False, False)]
CELLS = [
    ("zero3", "llama", dict(dp=2, zero=3, micro_batch_size=2, num_micro_batches=2), True, False),
    ("tp", "llama", dict(tp=2, **ONE), True, False),
    ("pp", "llama", dict(pp=2, schedule="1f1b", **ONE), True, False),
    ("zero3_compiled", "llama", dict(dp=2, zero=3, micro_batch_size=2, num_micro_batches=2), True, True),
]
# FSDP2 over tp (2-D weights)
CELLS_4 = [("tp_dp_zero3", "llama", dict(tp=2, dp=2, zero=3, micro_batch_size=2, num_micro_batches=2), True, False)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_float8_plans_train_as_one_process_under_zero3_tp_pp_tp_x_dp_and_compiled():
    ref = run_world(_world, 1, REFERENCE, timeout=400)[0]
    f8, bf16 = ref["float8"], ref["bf16"]
    # wq, wo, w1, w2, w3 of every block and the untied head (wk and wv: 16 outputs, 8 per tp rank),
    # and float8 changes the numbers
    assert len(f8["converted"]) == 5 * 4 + 1 and f8["converted"] == f8["planned"], f8["converted"]
    assert bf16["converted"] == [] and _err(f8, bf16) > 100 * TOLERANCE, _err(f8, bf16)
    results = run_world(_world, 2, CELLS, timeout=850)
    results = [{**mine, **theirs} for mine, theirs in zip(results, run_world(_world, 4, CELLS_4, timeout=850))]
    for rank in (0, 1):
        for cell, *_ in CELLS + CELLS_4:
            r = results[rank][cell]
            assert _err(r, f8) < TOLERANCE, (cell, rank, _err(r, f8), _err(r, bf16))
            assert r["converted"] == r["planned"] == f8["planned"], (cell, r["converted"])
            # FSDP2 all-gathers every float8 weight in float8 where it shards them (ZeRO 3 over dp 2)
            # (not over tp: there it trained 12% away from one process, so it runs bf16 all-gathers)
            gathers = cell.startswith("zero3")
            assert r["gathered_in_float8"] == (len(r["planned"]) if gathers else 0), (cell, r)


def test_a_plan_naming_a_module_that_is_not_a_linear_is_refused_before_anything_is_built():
    import lower_worlds as lw
    from autopar.errors import PlanMismatchError
    from autopar.lower import float8

    model, example, _ = lw.build("llama")
    plan = _float8_plan(model, example, float8=True)
    plan.layer_choices[1].float8 = ["layers.0.attention_norm"]
    with pytest.raises(PlanMismatchError, match="holds a RMSNorm, not an nn.Linear"):
        float8.convert(model, plan)
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
