"""Blocks that hold their Linears directly (issue 29).

Which Linears tensor parallelism splits is read off the dataflow of the
block's own ops by capture's `tp_flow` (the analysis the cost model prices),
wherever the Linears sit in the module tree: a Megatron-style GPT whose
blocks call qkv, proj, fc1 and fc2 themselves (examples/gpt_flat.py), GQA
and a gated MLP held by the block, transformers' Conv1D, torch's
nn.TransformerEncoderLayer (its MLP Linears are the block's; its packed
attention is no Linear and stays whole). What is priced as split is what is
split, the split block issues Megatron's collectives, and it trains as one
process does under tp, tp + sequence parallelism and pp x tp.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import run_world

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import gpt_flat  # noqa: E402

HIDDEN, HEADS, SEQ, VOCAB = 32, 4, 8, 64


def _gpt(**kw) -> nn.Module:
    torch.manual_seed(0)
    return gpt_flat.FlatGPT(gpt_flat.FlatGPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=HIDDEN, layers=4,
                                                   heads=HEADS, **kw))


class FlatLlamaBlock(nn.Module):
    """GQA (2 kv heads) and a gated MLP, every Linear a direct child of the block."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.wq, self.wk, self.wv = (nn.Linear(HIDDEN, n, bias=False) for n in (HIDDEN, HIDDEN // 2, HIDDEN // 2))
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.w1, self.w3 = nn.Linear(HIDDEN, 64, bias=False), nn.Linear(HIDDEN, 64, bias=False)
        self.w2 = nn.Linear(64, HIDDEN, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, s, HEADS, -1).transpose(1, 2)
        k, v = (f(h).view(b, s, HEADS // 2, -1).transpose(1, 2).repeat_interleave(2, dim=1) for f in (self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class GatedOutputBlock(nn.Module):
    """RWKV's channel mix: `gate` is a Linear whose output never reaches another
    Linear (it scales the row Linear's output): not a tensor-parallel pair."""

    def __init__(self):
        super().__init__()
        self.key, self.value, self.gate = nn.Linear(HIDDEN, 64), nn.Linear(64, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.sigmoid(self.gate(x)) * self.value(torch.relu(self.key(x)) ** 2)


class SharedLinearBlock(nn.Module):
    """`up` is called twice, the second time on a row Linear's output: one
    Linear in two roles cannot be split for both, so its pairs stay whole."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 64), nn.Linear(64, HIDDEN)

    def forward(self, x):
        y = x + self.down(F.gelu(self.up(x)))
        return y + self.up(y)[..., :HIDDEN]


class BlockLM(nn.Module):
    def __init__(self, block):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(block() for _ in range(4))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _conv1d_block():
    from transformers.pytorch_utils import Conv1D

    class Conv1DBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(HIDDEN)
            self.c_fc, self.c_proj = Conv1D(64, HIDDEN), Conv1D(HIDDEN, 64)

        def forward(self, x):
            return x + self.c_proj(F.gelu(self.c_fc(self.ln(x))))
    return Conv1DBlock()


def _encoder_layer():
    return nn.TransformerEncoderLayer(HIDDEN, HEADS, 64, dropout=0.0, batch_first=True, norm_first=True)


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _tokens(b):
    return (torch.zeros(b, SEQ, dtype=torch.long),)


def _model(name: str) -> nn.Module:
    if name.startswith("gpt_flat"):
        return _gpt(qkv_layout="split" if "split" in name else "heads", tie_embeddings="untied" not in name)
    if name == "conv1d":
        pytest.importorskip("transformers")
        return BlockLM(_conv1d_block)
    return BlockLM({"llama": FlatLlamaBlock, "gated_output": GatedOutputBlock, "shared_linear": SharedLinearBlock,
                    "encoder_layer": _encoder_layer}[name])


@pytest.mark.parametrize("name, colwise, rowwise", [
    ("gpt_flat", ["qkv", "fc1"], ["proj", "fc2"]),
    ("gpt_flat_split", ["qkv", "fc1"], ["proj", "fc2"]),  # GPT-2's split by hidden: q, k, v gathered
    ("llama", ["wq", "wk", "wv", "w1", "w3"], ["wo", "w2"]),
    ("conv1d", ["c_fc"], ["c_proj"]),
    ("encoder_layer", ["linear1"], ["linear2"]),  # nn.MultiheadAttention's in_proj_weight is no Linear
    ("gated_output", ["key"], ["value"]),
    ("shared_linear", [], []),
])
def test_pairs_come_from_the_dataflow_wherever_the_linears_sit(name, colwise, rowwise):
    from autopar.lower.tensor_parallel import probe_blocks
    model = _model(name)
    plan = probe_blocks(model, {1: model.blocks[1]}, _tokens(2))[1]
    assert (plan.subs, plan.colwise, plan.rowwise, plan.rowwise_whole) == ([], colwise, rowwise, [])


def _split_weights(model, sequence_parallel=False) -> dict:
    """{parameter: placement} of block 1 split over a fake tp=2 mesh (fake tensors, as the planner's check)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    from autopar.lower import tensor_parallel, what_runs
    block = model.blocks[1]
    plan = tensor_parallel.probe_blocks(model, {1: block}, _tokens(2))[1]
    with what_runs.fake_tp_mesh(2) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
        blk = what_runs._empty_copy(block, "cpu")
        tensor_parallel.parallelize_block(blk, plan, mesh, sequence_parallel=sequence_parallel, first=True,
                                          last=True)
        return {n: str(p.placements[0]) for n, p in blk.named_parameters() if isinstance(p, DTensor)}


def test_what_is_priced_as_split_is_what_is_split():
    import autopar
    model = _gpt()
    placed = _split_weights(model)
    assert placed == {"ln_1.weight": "R", "ln_1.bias": "R", "qkv.weight": "S(0)", "qkv.bias": "S(0)",
                      "proj.weight": "S(1)", "proj.bias": "R", "ln_2.weight": "R", "ln_2.bias": "R",
                      "fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)", "fc2.bias": "R"}
    # capture's pricing: the weight GEMMs tp divides are those of the split Linears
    graph = autopar.capture(model, _tokens)
    priced = {op.name.split(":")[0] for op in graph.layers[2].ops if op.gemm and op.tp_sharded}
    split = {n.rsplit(".", 1)[0] for n, p in placed.items() if p.startswith("S")}
    assert priced == split == {"qkv", "proj", "fc1", "fc2"}
    assert set(graph.layers[2].tp_degrees) >= {2, 4}


def test_a_split_that_shards_no_weight_fails_this_check():
    """The guard the tests above rely on: a block whose Linears form no pair has no sharded weight."""
    placed = _split_weights(_model("shared_linear"))
    assert placed and not any(p.startswith("S") for p in placed.values())


def test_flat_blocks_are_offered_and_issue_megatrons_collectives():
    """One all-reduce per pair each way (two with sequence parallelism: an
    all-gather in, a reduce-scatter out), however many Linears read the
    region's input (q, k, v share one: tp_styles.SharedInput)."""
    import autopar
    from autopar.lower.what_runs import limits
    for name in ("gpt_flat", "llama"):
        model = _model(name)
        got = limits(model, autopar.capture(model, _tokens), _tokens, tp_degrees=[2])
        assert got["tp"] == {} and got["sequence_parallel"] == {}, (name, got)
        plain, sp = got["tp_collectives"]["2"]["plain"][0], got["tp_collectives"]["2"]["sp"][0]
        assert (plain["fwd"], plain["bwd"]) == ("all_reduce 1, all_reduce 1",) * 2, (name, plain)
        assert sp["fwd"] == "all_gather 1, reduce_scatter 1, all_gather 1, reduce_scatter 1", (name, sp)
        assert sorted(sp["bwd"].split(", ")) == ["all_gather 1", "all_gather 1", "reduce_scatter 1",
                                                 "reduce_scatter 1"], (name, sp)


def test_175b_flat_gpt_plans_with_tensor_parallelism(capsys):
    """`autopar plan` of the flat GPT-3 175B on 1024 A100s considers tp 2-8 (none
    is refused by the lowering check) and prices a pinned tp 8 x pp 16."""
    from autopar.cli import main
    from autopar.plan import Plan
    model = f"{EXAMPLES}/gpt_flat.py:gpt3_175b"
    cluster = ("--gpus", "1024", "--device", "a100-80g", "--batch-size", "1536", "--json")
    assert main(["plan", model, *cluster]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    checked = plan.solver["lowering_limits"]
    assert {2, 4, 8} <= set(checked["tp_checked"]) and checked["tp"] == {}, checked
    assert plan.mesh.tp > 1
    assert main(["plan", model, *cluster, "--tp", "8", "--pp", "16"]) == 0
    pinned = Plan.from_json(capsys.readouterr().out)
    assert (pinned.mesh.tp, pinned.mesh.pp) == (8, 16) and pinned.predicted.step_time_s > 0


# -- trains as one process does (fp32, SGD with momentum, 3 steps) ---------------------------------

def _world(rank, world, cells):
    import autopar
    from autopar.lower.manual_plan import plan_for_model
    out = {}
    for cell, name, layout in cells:
        model = _model(name)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, VOCAB, (4, SEQ), generator=g) for _ in range(3)]
        ref = copy.deepcopy(model)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        ref_losses = []
        for x in batches:
            loss = _ce(ref(x), x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        mb = 4 // layout.get("num_micro_batches", 1)
        plan = plan_for_model(model, example_inputs=_tokens, micro_batch_size=mb, **layout)
        pm = autopar.compile(model, plan=plan, example_inputs=_tokens, loss_fn=_ce, optimizer=torch.optim.SGD,
                             optimizer_kwargs=dict(lr=0.1, momentum=0.9))
        losses = [pm.train_step(x, x) for x in batches]
        state = pm.full_state_dict()
        out[cell] = {
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": max(float((state[k] - p.detach()).abs().max() / p.detach().abs().max().clamp_min(1e-3))
                             for k, p in ref.named_parameters()),
            "tp_sharded": sorted(k.split("blocks.", 1)[-1] for k, p in pm.module.named_parameters()
                                 if type(p).__name__ == "DTensor" and any(pl.is_shard() for pl in p.placements)),
        }
    return out


# the Linears of the block each rank holds (stage 0 under pp holds blocks 0-1)
_SPLIT = {"fc1.bias", "fc1.weight", "fc2.weight", "proj.weight", "qkv.bias", "qkv.weight"}
CELLS = [
    ("tp", "gpt_flat", dict(tp=2)),
    ("tp_sp", "gpt_flat", dict(tp=2, sequence_parallel=True)),
    ("split_untied_tp_sp", "gpt_flat_split_untied", dict(tp=2, sequence_parallel=True)),
    ("llama_tp_sp", "llama", dict(tp=2, sequence_parallel=True)),
]


def _check(r, blocks=range(4), split=_SPLIT):
    assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, r
    sharded = {n.split(".", 1)[1] for n in r["tp_sharded"] if n.split(".", 1)[0].isdigit()}
    assert sharded == split, r["tp_sharded"]
    assert {int(n.split(".", 1)[0]) for n in r["tp_sharded"] if n[0].isdigit()} == set(blocks), r["tp_sharded"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_flat_blocks_train_as_one_process_under_tp_and_sequence_parallelism():
    results = run_world(_world, 2, CELLS, timeout=360)
    for cell, name, _ in CELLS:
        for rank in (0, 1):
            split = {"wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w3.weight", "w2.weight"} \
                if name == "llama" else _SPLIT
            _check(results[rank][cell], split=split)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_flat_blocks_train_as_one_process_under_pp_x_tp():
    cells = [("pp_tp", "gpt_flat", dict(pp=2, tp=2, num_micro_batches=2))]
    results = run_world(_world, 4, cells, timeout=360)
    for rank in range(4):
        _check(results[rank]["pp_tp"], blocks=range(2) if rank < 2 else range(2, 4))
