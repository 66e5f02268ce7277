"""train.py --init-from (issue 32: fine-tuning from pretrained weights): a safetensors
file or a Hugging Face folder, loaded tensor by tensor into this rank's shards under
any plan; the whole model afterwards is the file's, bit for bit."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_world

CELLS = [("zero3", dict(dp=2, zero=3, micro_batch_size=2)), ("tp", dict(tp=2, micro_batch_size=4)),
         ("pp", dict(pp=2, schedule="1f1b", micro_batch_size=2, num_micro_batches=2))]


def _world(rank, world, spec, lacking):
    import lower_worlds as lw
    from autopar.errors import AutoparError
    from autopar.lower import compile, plan_for_model
    from autopar.train.pretrained import load_pretrained

    out = {}
    for name, layout in CELLS:
        model, example, loss_fn = lw.build("gpt", seed=0)
        plan = plan_for_model(model, example_inputs=example, **layout)
        pm = compile(model, plan=plan, example_inputs=example, loss_fn=loss_fn)
        try:
            load_pretrained(pm, lacking)
            refused = None
        except AutoparError as exc:
            refused = exc.message
        count = load_pretrained(pm, spec)
        full = pm.full_state_dict(buffers=True)
        out[name] = {"count": count, "refused": refused,
                     "state": {k: v.float().numpy().copy() for k, v in full.items()}}
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("form", ["file", "hf_folder"])
def test_pretrained_weights_load_into_every_layout(tmp_path, form):
    import gpt
    from safetensors.torch import save_file

    torch.manual_seed(7)
    pretrained = gpt.gpt_tiny()[0]
    weights = {k: v.detach().clone().contiguous() for k, v in pretrained.state_dict().items()}
    if form == "file":
        save_file(weights, str(tmp_path / "w.safetensors"))
        spec = f"safetensors:{tmp_path / 'w.safetensors'}"
    else:  # a Hugging Face folder keeps one name of a tied pair
        (tmp_path / "ckpt").mkdir()
        save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(tmp_path / "ckpt" / "model.safetensors"))
        spec = f"hf:{tmp_path / 'ckpt'}"
    lacking = tmp_path / "lacking.safetensors"
    save_file({k: v for k, v in weights.items() if not k.startswith("blocks.1.")}, str(lacking))
    for per_rank in run_world(_world, 2, spec, str(lacking), timeout=550):
        for name, r in per_rank.items():
            assert r["count"] > 0 and "lacks" in r["refused"] and "blocks.1." in r["refused"], (name, r["refused"])
            for k, v in r["state"].items():
                assert (v == weights[k].float().numpy()).all(), (name, k)
