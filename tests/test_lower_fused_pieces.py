"""A fused projection the model reshapes into its pieces, and block stacks held
in an nn.Sequential (issue 29: timm's ViT got no tensor parallelism at all).

timm's attention computes `qkv(x).reshape(B, N, 3, heads, head_dim)` and
unbinds the 3. Split plainly over tp, the reshape would cut the 3 across
ranks (DTensor: "Cannot unflatten unevenly sharded tensor"). The dataflow
finds the pieces (TPFlow.pieces) and the lowering shards such a Linear
strided: each rank holds its heads of q, k and v, the attention runs on its
heads, and a block issues Megatron's two all-reduces each way. Its blocks sit
in `self.blocks = nn.Sequential(...)`: a stack like a ModuleList.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import one_process_sgd, run_world

DIM, HEADS, CLASSES, STEPS = 32, 4, 10, 3


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """timm's shape, without the root-held cls token / position table (which no
    pipeline stage can stand in for): patches -> nn.Sequential of blocks -> head."""

    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, DIM, 4, 4)
        self.blocks = nn.Sequential(*[Block() for _ in range(4)])
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, x):
        x = self.blocks(self.patch_embed(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(x).mean(1))


def _inputs(b):
    return (torch.zeros(b, 3, 16, 16),)


def test_the_dataflow_finds_the_pieces_and_prices_no_gather():
    import autopar
    graph = autopar.capture(ViT(), _inputs)
    block = next(l for l in graph.layers if l.name == "blocks.0")
    assert block.tp_degrees == (1, 2, 4) and block.tp_gather_bytes == 0, (block.tp_degrees, block.tp_gather_bytes)

    from autopar.lower.what_runs import record_blocks
    m = ViT()
    plans, _, _ = record_blocks(m, {0: m.blocks[0]}, _inputs(1), {}, {})
    assert plans[0].pieces == {"attn.qkv": 3}, plans[0]


def test_what_a_split_block_issues_is_megatrons_two_all_reduces():
    import autopar
    from autopar.lower.what_runs import limits
    m = ViT()
    got = limits(m, autopar.capture(m, _inputs), _inputs, tp_degrees=[2])
    assert got["tp"] == {} and got["pipeline"] is None, got
    assert got["tp_collectives"]["2"]["plain"] == [{"block": "blocks.0", "fwd": "all_reduce 1, all_reduce 1",
                                                    "bwd": "all_reduce 1, all_reduce 1"}]


def _world(rank, world, layouts):
    from autopar.lower import compile as ap_compile
    from autopar.lower import state_dict as lsd
    from autopar.lower.manual_plan import plan_for_model
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, CLASSES, (8,), generator=g))
               for _ in range(STEPS)]
    out = {}
    for name, layout in layouts:
        torch.manual_seed(0)
        model = ViT()
        ref_losses, ref = one_process_sgd(model, batches, F.cross_entropy, lr=0.5)
        plan = plan_for_model(model, example_inputs=_inputs, **layout)
        pm = ap_compile(model, plan=plan, example_inputs=_inputs, loss_fn=F.cross_entropy,
                        optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.5))
        losses = [pm.train_step((x,), y) for x, y in batches]
        state = pm.full_state_dict()
        # a snapshot's view of the strided weights: written plainly, read back exactly
        tensors = lsd.model_tensors(pm)
        plain, restore = lsd.for_dcp(tensors)
        before = {k: t.to_local().clone() for k, t in tensors.items() if plain[k] is not t}  # resharded
        with torch.no_grad():
            for k in before:
                tensors[k].to_local().zero_()
        restore()  # what DCP loaded into the plain stand-ins, copied back
        out[name] = {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "param_err": max(float((state[k] - p.detach()).abs().max() / p.detach().abs().max())
                                      for k, p in ref.named_parameters()),
                     "resharded": len(before) >= 8,  # each block's qkv weight and bias
                     "restored": all(torch.equal(tensors[k].to_local(), v) for k, v in before.items()),
                     "qkv": str(getattr(tensors.get("model.blocks.0.attn.qkv.weight"), "placements", None))}
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_timm_style_vit_trains_under_tp_dp_x_tp_and_pp():
    two = run_world(_world, 2, [("tp", dict(tp=2, micro_batch_size=8)),
                                ("pp", dict(pp=2, num_micro_batches=2, micro_batch_size=4))], timeout=280)
    four = run_world(_world, 4, [("dp_tp", dict(dp=2, tp=2, micro_batch_size=4))], timeout=280)
    for results, names in ((two, ("tp", "pp")), (four, ("dp_tp",))):
        for r in results:
            for name in names:
                assert r[name]["loss_err"] < 1e-5 and r[name]["param_err"] < 1e-5, (name, r[name])
                assert r[name]["restored"], (name, r[name])
    assert all(r[n]["resharded"] for r in two + four for n in ("tp", "dp_tp") if n in r)
    assert "_StridedShard(dim=0, sf=3)" in two[0]["tp"]["qkv"]  # each rank its heads of q, k and v


def test_a_model_that_is_one_sequential_is_not_a_block_stack():
    """Its numbered children are the whole model (input projection and head too):
    no stack, so tp is refused with the reason instead of splitting the ends as blocks."""
    from autopar.errors import PlanMismatchError
    from autopar.lower.manual_plan import plan_for_model
    from autopar.lower.model_layers import resolve

    m = nn.Sequential(nn.Linear(8, DIM), Block(), Block(), nn.Linear(DIM, 4))
    inputs = lambda b: (torch.randn(b, 5, 8),)  # noqa: E731
    assert all(l.position == "pre" for l in resolve(m, plan_for_model(m, example_inputs=inputs)).layers)
    with pytest.raises(PlanMismatchError, match="no repeated blocks"):
        plan_for_model(m, example_inputs=inputs, tp=2)
