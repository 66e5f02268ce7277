"""ParallelModel.eval_step (issue 32's held-out evaluation): the loss of a batch under
the plan's layout, without training, equals one process's eval-mode loss, and it
trains nothing (the next train step is the one it would have been)."""
from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_world

CELLS = [("dp_zero3", dict(dp=2, zero=3, micro_batch_size=2, num_micro_batches=2)),
         ("tp", dict(tp=2, micro_batch_size=2, num_micro_batches=4)),
         ("pp", dict(pp=2, schedule="1f1b", micro_batch_size=2, num_micro_batches=4))]


def _world(rank, world):
    import lower_worlds as lw
    from autopar.lower import compile, plan_for_model

    out = {}
    for name, layout in CELLS:
        model, example, loss_fn = lw.build("gpt")
        reference = copy.deepcopy(model).eval()
        plan = plan_for_model(model, example_inputs=example, **layout)
        pm = compile(model, plan=plan, example_inputs=example, loss_fn=loss_fn, optimizer=torch.optim.SGD,
                     optimizer_kwargs={"lr": 0.5})
        (x, y), (x2, y2) = lw.batches()[:2]
        with torch.no_grad():
            want = float(loss_fn(reference(x), y))
        got = pm.eval_step((x,), y)
        again = pm.eval_step((x,), y)
        first_train = pm.train_step((x2,), y2)
        out[name] = {"got": got, "want": want, "again": again, "first_train": first_train}
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eval_step_is_one_process_eval_loss_under_dp_tp_pp_and_trains_nothing():
    import lower_worlds as lw

    model, _, loss_fn = lw.build("gpt")
    (x, y), (x2, y2) = lw.batches()[:2]
    with torch.no_grad():
        first_train = float(loss_fn(model(x2), y2))  # the first step's loss, evaluated before it or not
    for rank_result in run_world(_world, 2, timeout=550):
        for name, r in rank_result.items():
            assert abs(r["got"] - r["want"]) <= 1e-5 * abs(r["want"]), (name, r)
            assert r["again"] == pytest.approx(r["got"], rel=1e-6), (name, r)  # nothing moved
            assert abs(r["first_train"] - first_train) <= 1e-5 * first_train, (name, r)
