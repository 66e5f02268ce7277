"""Tensor parallelism for MoE experts stored as 3-D parameters (tp_experts.py).

transformers 5.x keeps a layer's experts in one module (`gate_up_proj`
(experts, 2 x ffn, hidden), `down_proj` (experts, hidden, ffn)) run by
`torch._grouped_mm`. Under tp the ffn dim of every expert is split (gate_up
strided, so each rank holds its slice of gate and of up), the experts run on
local tensors and their output is a partial sum DTensor reduces once; the
router stays whole. Checked here: what capture prices as split is what the
lowering splits, tp must divide the experts' ffn, and tiny Mixtral and
Qwen2-MoE (with its shared expert) train under tp=2 and tp + sequence
parallelism exactly as one process does (fp32, SGD, 3 steps, 1e-5).
"""
from __future__ import annotations

import logging

import pytest
import torch

from dist_utils import run_world

SEQ, VOCAB, BATCH, STEPS = 8, 128, 4, 3


def build(arch: str, **over):
    import transformers as T
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
    small.update(over)
    if arch == "mixtral":
        small.setdefault("intermediate_size", 96)
        return T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, **small))
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(num_experts=4, intermediate_size=96, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=48, **small))


def _inputs(b):
    return (torch.zeros(b, SEQ, dtype=torch.long),)


@pytest.fixture(autouse=True)
def _quiet_fake_tensor_log():
    # FakeTensorMode logs every meta kernel that refuses fp32 before capture's bf16 retry
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_lowering_splits_exactly_the_expert_gemms_capture_prices_as_split(arch):
    """The experts' column / row GEMMs are tp-sharded in capture's flow (their fused
    gate/up cut stays sharded, no gather), the router's is not, and the lowering's
    block probe finds the same experts with gate_up strided over its two pieces."""
    from autopar.capture.tp_dataflow import ModuleFlow, tp_flow
    from autopar.lower.what_runs import record_blocks

    model = build(arch)
    block = model.model.layers[0]
    plans = record_blocks(model, {0: block}, _inputs(2), {"use_cache": False})[0]
    (experts,) = plans[0].experts
    assert (experts.path, experts.column, experts.row, experts.why) == (
        "mlp.experts", {"gate_up_proj": (1, 2)}, {"down_proj": 2}, None)
    assert "mlp" not in plans[0].norms  # under sequence parallelism the experts see every token

    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.capture.dtype_fallback import Bf16ShapeFallback
    flow = ModuleFlow({0: block})
    with FakeTensorMode(allow_non_fake_inputs=True), Bf16ShapeFallback(), flow, torch.no_grad():
        model(*_inputs(2), use_cache=False)
    flow.remove()
    ops = flow.ops[0]
    f = tp_flow(ops, is_head=False)
    experts_mod, router = block.mlp.experts, block.mlp.gate
    sharded_gemms = {r.idx for r in ops if r.kind == "gemm" and r.module is experts_mod}
    assert sharded_gemms and all(f.sharded.get(i) or any(i == row.idx for row in f.rows) for i in sharded_gemms)
    assert {i for i in f.cols if i in f.valid and i in sharded_gemms} == f.experts
    router_gemms = [r.idx for r in ops if r.kind == "gemm" and r.module is router]
    assert router_gemms and not any(f.sharded.get(i) for i in router_gemms)
    assert f.gathers == [] and not f.replicated  # gate and up stay split
    assert f.expert_ffn == experts_mod.down_proj.shape[-1]


def test_tp_must_divide_the_experts_ffn_to_be_offered():
    """16 heads allow tp=16 for attention and the fused gate_up's 48 columns, but
    each expert's ffn is 24: tp=16 is not offered (tp=8 is)."""
    import autopar
    model = build("mixtral", num_attention_heads=16, num_key_value_heads=16, intermediate_size=24)
    graph = autopar.capture(model, _inputs(2))
    block = next(layer for layer in graph.layers if layer.kind == "moe_block")
    assert block.attrs["expert_ffn_hidden"] == 24
    assert 8 in block.tp_degrees and 16 not in block.tp_degrees


def _world(rank, world, cells):
    from torch.distributed.tensor import DTensor
    from autopar.errors import AutoparError
    from lower_worlds import compare, sgd_reference, train_planned
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    out = {}
    for name, arch, layout in cells:
        model = build(arch)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
        ref, ref_losses = sgd_reference(model, batches)
        try:
            pm, losses = train_planned(model, _inputs, batches, layout, BATCH // layout.get("dp", 1))
        except AutoparError as exc:
            out[name] = {"refused": str(exc)}
            continue
        state = pm.full_state_dict()
        # shard placements on the tp mesh dim (`_StridedShard` is no `Shard` and says False to is_shard())
        sharded = {k: [repr(p) for p in v.placements] for k, v in pm.module.named_parameters()
                   if isinstance(v, DTensor) and any(type(p).__name__ in ("Shard", "_StridedShard")
                                                     for p in v.placements)}
        params = {k: p.detach() for k, p in ref.named_parameters()}
        out[name] = {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "param_err": compare({k: state[k] for k in params}, params),
                     "shapes_ok": all(tuple(state[k].shape) == tuple(p.shape) for k, p in params.items()),
                     "sharded": sharded}
    return out


CELLS = [
    ("mixtral_tp", "mixtral", dict(tp=2)),
    ("mixtral_tp_sp", "mixtral", dict(tp=2, sequence_parallel=True)),
    ("qwen2_moe_tp", "qwen2_moe", dict(tp=2)),
    ("qwen2_moe_tp_sp", "qwen2_moe", dict(tp=2, sequence_parallel=True)),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_experts_split_over_tp_train_as_one_process():
    results = run_world(_world, 2, CELLS, timeout=540)
    for name, *_ in CELLS:
        for rank in range(2):
            r = results[rank][name]
            assert "refused" not in r, (rank, name, r)
            assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, (rank, name, r)
            assert r["shapes_ok"], name  # the full state dict has the model's own shapes
            # every layer's experts split on the tp mesh: gate_up strided over gate and up, down on its ffn dim
            experts = {k: v for k, v in r["sharded"].items() if ".experts." in k}
            assert len(experts) == 2 * 2, (name, sorted(r["sharded"]))
            assert all(v == ["_StridedShard(dim=1, sf=2)"] for k, v in experts.items() if k.endswith("gate_up_proj"))
            assert all(v == ["Shard(dim=2)"] for k, v in experts.items() if k.endswith("down_proj"))
            assert not any(".mlp.gate." in k for k in r["sharded"]), name  # the router stays whole


def _snapshot_world(rank, world, root):
    """A snapshot saved with the experts split over tp (gate_up strided) loads
    onto other plans: the same weights and optimizer state, resharded by DCP."""
    from autopar.train import snapshot
    from lower_worlds import compare, train_planned
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2)]
    pm, _ = train_planned(build("mixtral"), _inputs, batches[:1], dict(tp=2), BATCH)
    path = snapshot.save(pm, root, 1, {})
    saved = pm.full_state_dict()
    after = pm.train_step(batches[1], batches[1])
    out = {}
    for name, layout in (("dp", dict(dp=2)), ("tp_sp", dict(tp=2, sequence_parallel=True))):
        torch.manual_seed(7)  # other weights, to be overwritten
        other, _ = train_planned(build("mixtral", initializer_range=0.5), _inputs, [], layout,
                                 BATCH // layout.get("dp", 1))
        snapshot.load(other, path)
        # the next step from the loaded weights and momentum equals the saving plan's next step
        out[name] = {"weights": compare(other.full_state_dict(), saved),
                     "next_loss": abs(other.train_step(batches[1], batches[1]) - after) / abs(after)}
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_snapshot_of_split_experts_loads_on_other_plans(tmp_path):
    for rank in run_world(_snapshot_world, 2, str(tmp_path / "ckpt"), timeout=240):
        for name, r in rank.items():
            assert r["weights"] == 0.0 and r["next_loss"] < 1e-5, (name, r)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("sp", [False, True])
def test_the_lowering_check_runs_the_split_experts_and_counts_their_reduction(arch, sp):
    """The planner's check (what_runs: the split block on fake tensors over a fake
    tp group) passes through the experts' local run and sees the one reduction of
    their partial sums: an all-reduce, or a reduce-scatter into sequence shards."""
    from autopar.lower.what_runs import block_failures

    model = build(arch)
    blocks = dict(enumerate(model.model.layers))
    issued: dict = {}
    failures, undecided = block_failures(model, blocks, _inputs(2), {"use_cache": False}, 2, sp, collectives=issued)
    assert (failures, undecided) == ({}, [])
    forward = [kind for kind, _, phase in issued[0] if phase == "fwd"]
    if sp:  # attention and experts: each gathers its input and reduce-scatters its output
        assert forward.count("reduce_scatter") == 2 and forward.count("all_gather") == 2, forward
    else:  # attention, experts (and Qwen2-MoE's shared expert, reduced on its own)
        assert forward == ["all_reduce"] * (2 if arch == "mixtral" else 3), forward


def test_experts_it_cannot_split_are_refused_with_the_reason():
    """GPT-OSS's experts add biases (the down projection's after the GEMM, which a
    partial sum would count tp times): refused naming them, not run replicated."""
    import transformers as T

    from autopar.lower.what_runs import block_failures
    torch.manual_seed(0)
    model = T.GptOssForCausalLM(T.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        layer_types=["full_attention"] * 2))
    failures, _ = block_failures(model, dict(enumerate(model.model.layers)), _inputs(2), {"use_cache": False}, 2,
                                 False)
    assert "experts 'mlp.experts' cannot be split over tp: its parameters gate_up_proj_bias, down_proj_bias" \
        in failures[0]


class _Experts(torch.nn.Module):
    """Experts as 3-D weights, called per expert with `linear` on `param[e]`;
    `residual` adds the input to the down projection's output inside the module."""

    def __init__(self, residual: bool):
        super().__init__()
        self.residual = residual
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 64, 32) * 0.1)
        self.down_proj = torch.nn.Parameter(torch.randn(2, 32, 32) * 0.1)

    def forward(self, x):
        out = 0
        for e in range(2):
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down_proj[e])
        return out + x if self.residual else out


@pytest.mark.parametrize("residual", [False, True])
def test_experts_found_from_their_dataflow_and_refused_where_a_partial_sum_would_be_wrong(residual):
    """Not transformers' class: any module whose 3-D weights feed a column and a row
    GEMM (here `linear` on `param[e]`). Whatever reads the down projection's output
    inside it must keep a partial sum a partial sum; adding the whole input is refused."""
    from autopar.lower.what_runs import record_blocks

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), _Experts(residual))
    plans = record_blocks(model, {0: model[1]}, (torch.randn(4, 32),), {})[0]
    (experts,) = plans[0].experts
    if residual:
        assert "joins a whole tensor to the down projection's output" in experts.why
    else:
        assert (experts.column, experts.row, experts.why) == ({"gate_up_proj": (1, 2)}, {"down_proj": 2}, None)
