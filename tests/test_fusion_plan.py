"""Fused ops in the Plan and in the cost model: the planner records the fusion
pass's chains in `Plan.fusions`, the cost model charges the HBM bytes they
save (on GPU profiles only), and the CLI switches it with --fusion/--no-fusion."""
import copy
import json

import pytest
import sympy
import torch

from conftest import ROOT
from cost_models.estimate import layer_cost
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout
from cost_models.workload import B, S, LayerSpec, ModelSpec, OpSpec

from autopar.cli import main
from autopar.kernels.fusion import find_fusions, fusion_savings_by_layer
from autopar.plan import Plan
from autopar.solve import plan
from autopar.solve.fusion_costs import charge_fusions

from gpt import GPT, GPTConfig, example_inputs, gpt_tiny
from llama import llama_tiny

GPT_FILE = str(ROOT / "examples" / "gpt.py")
# Large enough that the memory-bound ops run above their launch floor on an H100
# (a 256-wide toy is launch-bound: fusing saves bytes but no time there).
MID = GPTConfig(vocab_size=4096, seq_len=1024, hidden=768, layers=4, heads=12)


def _plan(model, cluster, cfg, **kw):
    return plan(model, cluster, example_inputs=lambda b: example_inputs(b, cfg), global_batch_size=64,
                constraints={"tp": 1, "pp": 1, "micro_batch": 8}, **kw)


@pytest.fixture(scope="module")
def mid_plans():
    torch.manual_seed(0)
    model = GPT(MID)
    return {"fused": _plan(model, "dgx-h100:1", MID), "eager": _plan(model, "dgx-h100:1", MID, fusion=False),
            "model": model}


def _runs(fusions, engine=None):
    """The chains autopar's program runs with its own kernel, of those the pass found."""
    from autopar.engine import AUTOPAR
    return [f for f in fusions if (engine or AUTOPAR).runs_fused(f["pattern"])]


def test_plan_records_the_fusion_pass_chains():
    model, ex = llama_tiny()
    p = plan(model, "dgx-h100:1", example_inputs=ex, global_batch_size=8)
    assert p.fusions == _runs(find_fusions(model, _capture(model, ex)))
    patterns = {f["pattern"] for f in p.fusions}
    assert {"add_rmsnorm", "swiglu"} <= patterns
    blocks = {l.name for s in p.stages for l in s.layers if l.kind == "transformer_block"}
    assert {f["layer"] for f in p.fusions if f["pattern"] == "swiglu"} == blocks
    assert p.assumptions["fusion"] == {"enabled": True, "chains": len(p.fusions), "charged": True}
    # the records survive the Plan's JSON round trip unchanged
    assert Plan.from_json(p.to_json()).fusions == p.fusions
    # a chain autopar has no winning kernel for is found, not planned (GPT's bias + GELU, and
    # its add + LayerNorm in eager blocks): the plan prices and lists what runs
    gpt, gex = gpt_tiny()
    found = {f["pattern"] for f in find_fusions(gpt)}
    planned = {f["pattern"] for f in plan(gpt, "dgx-h100:1", example_inputs=gex, global_batch_size=8).fusions}
    assert {"bias_gelu", "add_layernorm"} <= found and not {"bias_gelu", "add_layernorm"} & planned


@pytest.mark.triton
def test_planned_fusions_apply_to_the_model():
    """What autopar.compile(fusion=True) does with a solver-made plan: every
    recorded in-model chain is swapped in, and the loss is unchanged."""
    from autopar.kernels.fusion import apply_fusions

    torch.manual_seed(0)
    model, ex = llama_tiny()
    p = plan(model, "dgx-h100:1", example_inputs=ex, global_batch_size=8)
    reference = copy.deepcopy(model)
    tokens = ex(2)[0]
    fused = apply_fusions(model, Plan.from_json(p.to_json()).fusions)
    kinds = sorted(type(m).__name__ for m in fused.modules() if type(m).__name__.startswith("Fused"))
    # the same swaps as the graph-free pass makes (the path test_kernels_fusion checks numerically)
    direct = apply_fusions(copy.deepcopy(reference), find_fusions(reference))
    assert kinds == sorted(type(m).__name__ for m in direct.modules() if type(m).__name__.startswith("Fused"))
    assert "FusedRMSNorm" in kinds
    fused.eval(), reference.eval()
    torch.testing.assert_close(fused(tokens), reference(tokens), rtol=1e-5, atol=1e-5)


def _capture(model, ex):
    from autopar.capture import capture
    return capture(model, ex)


def test_fusion_off_records_none():
    model, ex = gpt_tiny()
    p = plan(model, "dgx-h100:1", example_inputs=ex, global_batch_size=8, fusion=False)
    assert p.fusions == []
    assert p.assumptions["fusion"]["enabled"] is False and p.assumptions["fusion"]["charged"] is False


def test_a_bare_model_spec_plans_unfused_and_says_why():
    model, ex = gpt_tiny()
    graph = _capture(model, ex)
    p = plan(graph, "dgx-h100:1", global_batch_size=8)
    assert p.fusions == [] and "no nn.Module" in p.assumptions["fusion"]["why_none"]
    # given the module beside the graph (as the CLI does), the chains are found
    p = plan(graph, "dgx-h100:1", global_batch_size=8, module=model)
    assert p.fusions == _runs(find_fusions(model, graph)) and p.fusions


def test_fused_plan_predicts_a_faster_step_on_a_gpu(mid_plans):
    fused, eager = mid_plans["fused"], mid_plans["eager"]
    assert (fused.mesh.pp, fused.mesh.dp, fused.mesh.tp, fused.micro_batch_size) == \
           (eager.mesh.pp, eager.mesh.dp, eager.mesh.tp, eager.micro_batch_size)
    assert fused.predicted.step_time_s < eager.predicted.step_time_s
    assert fused.predicted.time_breakdown["compute_s"] < eager.predicted.time_breakdown["compute_s"]
    # communication and memory are not what fusion changes
    assert fused.predicted.time_breakdown["dp_comm_s"] == pytest.approx(eager.predicted.time_breakdown["dp_comm_s"])
    assert fused.predicted.peak_memory_bytes == pytest.approx(eager.predicted.peak_memory_bytes)


def test_the_lowering_says_when_priced_fused_kernels_run_unfused(mid_plans):
    """What is priced is what runs: a plan charged with fused kernels, lowered without
    them (autopar.compile's fusion=False) and its blocks eager, says so; swapped in, or
    priced compiled and compiled (inductor fuses the blocks' chains), it does not."""
    from autopar.engine import COMPILED
    from autopar.lower.api import fusions_priced_otherwise

    fused, eager = mid_plans["fused"], mid_plans["eager"]
    note = fusions_priced_otherwise(fused, fusion=False, compiling=False)
    assert len(note) == 1 and f"{len(fused.fusions)} fused kernel chains" in note[0]
    assert fusions_priced_otherwise(fused, fusion=True, compiling=False) == []
    assert fusions_priced_otherwise(eager, fusion=False, compiling=False) == []  # --no-fusion: nothing charged
    compiled = copy.deepcopy(fused)
    compiled.assumptions["engine"] = COMPILED.to_dict()
    assert fusions_priced_otherwise(compiled, fusion=False, compiling=True) == []
    assert fusions_priced_otherwise(compiled, fusion=False, compiling=False) != []


def test_cpu_profile_runs_the_torch_fallback_and_saves_nothing():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, seq_len=256, hidden=256, layers=2, heads=4)
    model = GPT(cfg)
    cpu = ClusterSpec.resolve("cpu").to_dict()
    cpu.update(nodes=1, gpus_per_node=8)
    cpu.pop("world_size", None)
    cluster = ClusterSpec.from_dict(cpu)
    fused, eager = _plan(model, cluster, cfg), _plan(model, cluster, cfg, fusion=False)
    assert fused.fusions and fused.assumptions["fusion"]["charged"] is False
    assert fused.predicted.step_time_s == eager.predicted.step_time_s


def test_fused_plan_json_is_deterministic(mid_plans):
    again = _plan(mid_plans["model"], "dgx-h100:1", MID)
    assert again.to_json() == mid_plans["fused"].to_json()


def test_charge_fusions_copies_layers_and_splits_signatures(mid_plans):
    model = mid_plans["model"]
    graph = _capture(model, lambda b: example_inputs(b, MID))
    fusions = find_fusions(model, graph)
    device = ClusterSpec.resolve("dgx-h100:1").device_profile
    charged = charge_fusions(graph, fusions, device)
    assert charged is not graph and all(l.fused_bytes_saved_fwd == 0 for l in graph.layers)
    blocks = [l for l in charged.layers if l.kind == "transformer_block"]
    # identical blocks fuse identically: still one signature between them, not the unfused one
    assert len({l.signature for l in blocks}) == 1
    assert blocks[0].signature != graph.layers[charged.layers.index(blocks[0])].signature
    want = fusion_savings_by_layer([f for f in fusions if f["layer"] == blocks[0].name], B * S,
                                   dtype_bytes=graph.dtype_bytes, seq=S, heads=blocks[0].attrs.get("heads"))
    assert sympy.simplify(blocks[0].fused_bytes_saved_bwd - want[blocks[0].name]["bwd_saved"]) == 0
    assert blocks[0].eval("fused_bytes_saved_bwd", 1, MID.seq_len) > 0


# -- the cost model on a hand-written layer ------------------------------------
def _mlp_layer(**fused):
    h, f = 4096, 16384
    tokens = B * S
    ops = [OpSpec("fc1", "gemm", fwd_flops=2 * tokens * h * f, bwd_flops=4 * tokens * h * f,
                  fwd_bytes=2 * (tokens * h + h * f + tokens * f), bwd_bytes=4 * (tokens * h + h * f + tokens * f),
                  gemm=(tokens, f, h)),
           OpSpec("gelu", "elementwise", fwd_flops=8 * tokens * f, bwd_flops=16 * tokens * f,
                  fwd_bytes=2 * 2 * tokens * f, bwd_bytes=3 * 2 * tokens * f),
           OpSpec("add_norm", "norm", fwd_flops=8 * tokens * h, bwd_flops=16 * tokens * h,
                  fwd_bytes=5 * 2 * tokens * h, bwd_bytes=8 * 2 * tokens * h)]
    return LayerSpec(name="mlp", kind="mlp", params=2 * h * f, param_bytes=4 * h * f,
                     fwd_flops=2 * tokens * h * f, bwd_flops=4 * tokens * h * f, activation_bytes=2 * tokens * f,
                     output_bytes=2 * tokens * h, ops=ops, signature="mlp", **fused)


def _cost(layer, micro_batch=4):
    model = ModelSpec(name="m", layers=[layer], seq_len=2048)
    layout = Layout(pp=1, dp=1, tp=1, micro_batch_size=micro_batch, num_micro_batches=1)
    return layer_cost(layer, model, layout, ClusterSpec.resolve("h100-sxm"))


def test_layer_cost_charges_fused_bytes():
    tokens, f, h = B * S, 16384, 4096
    eager = _cost(_mlp_layer())
    zero = _cost(_mlp_layer(fused_bytes_saved_fwd=0, fused_bytes_saved_bwd=0))
    assert (zero.fwd_s, zero.bwd_s) == (eager.fwd_s, eager.bwd_s)
    saved_fwd, saved_bwd = 2 * tokens * h, 2 * tokens * f + 4 * 2 * tokens * h
    fused = _cost(_mlp_layer(fused_bytes_saved_fwd=saved_fwd, fused_bytes_saved_bwd=saved_bwd))
    assert fused.fwd_s < eager.fwd_s and fused.bwd_s < eager.bwd_s
    # at these sizes the ops are byte-bound: the time saved is the bytes saved over the HBM rate
    dev = ClusterSpec.resolve("h100-sxm").device_profile
    hbm = dev.memory_bandwidth * dev.memory_efficiency
    b, s = 4, 2048
    assert eager.fwd_s - fused.fwd_s == pytest.approx(float(saved_fwd.subs({B: b, S: s})) / hbm, rel=1e-9)
    assert eager.bwd_s - fused.bwd_s == pytest.approx(float(saved_bwd.subs({B: b, S: s})) / hbm, rel=1e-9)
    # the GEMM's memory-bound part and the flops are untouched
    assert fused.model_flops == eager.model_flops


def test_layer_cost_never_saves_more_than_the_memory_bound_ops_take():
    eager = _cost(_mlp_layer(), micro_batch=1)
    huge = _cost(_mlp_layer(fused_bytes_saved_fwd=10**15, fused_bytes_saved_bwd=10**15), micro_batch=1)
    dev = ClusterSpec.resolve("h100-sxm").device_profile
    gemm_only = _cost(LayerSpec(**{**_mlp_layer().__dict__, "ops": _mlp_layer().ops[:1], "signature": "gemm"}),
                      micro_batch=1)
    launches = 2 * dev.kernel_launch_s  # the two memory-bound ops still launch
    assert huge.fwd_s == pytest.approx(gemm_only.fwd_s + launches, rel=1e-9)
    assert huge.bwd_s == pytest.approx(gemm_only.bwd_s + launches, rel=1e-9)
    negative = _cost(_mlp_layer(fused_bytes_saved_fwd=-10**9, fused_bytes_saved_bwd=-10**9), micro_batch=1)
    assert (negative.fwd_s, negative.bwd_s) == (eager.fwd_s, eager.bwd_s)


# -- the CLI -------------------------------------------------------------------
@pytest.mark.parametrize("flag, expect_chains", [("--fusion", True), ("--no-fusion", False)])
def test_cli_fusion_flag(capsys, flag, expect_chains):
    code = main(["plan", f"{GPT_FILE}:gpt_tiny", "--gpus", "4", "--batch-size", "8", "--json", flag])
    out = capsys.readouterr()
    assert code == 0, out.err
    p = Plan.from_json(out.out)
    assert bool(p.fusions) is expect_chains
    assert p.assumptions["fusion"]["enabled"] is expect_chains


@pytest.mark.triton
def test_compile_with_a_solver_made_plan_runs_the_fused_modules(monkeypatch):
    """autopar.compile(..., plan=None, fusion=True) on one process: the planner
    records the chains, lowering swaps them in, and training matches fusion=False."""
    import torch.distributed as dist

    import autopar
    from conftest import free_port
    from gpt import loss_fn

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    cpu = ClusterSpec.resolve("cpu").to_dict()
    cpu.update(nodes=1, gpus_per_node=1)
    cpu.pop("world_size", None)
    cluster = ClusterSpec.from_dict(cpu)
    results = {}
    try:
        for fusion in (False, True):
            torch.manual_seed(0)
            model, example = llama_tiny()  # add + RMSNorm and SwiGLU: kernels of eager blocks
            pm = autopar.compile(model, cluster, example_inputs=example, global_batch_size=2, loss_fn=loss_fn,
                                 fusion=fusion, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5})
            g = torch.Generator().manual_seed(1)
            losses = [pm.train_step((torch.randint(0, 128, (2, 16), generator=g),),
                                    torch.randint(0, 128, (2, 16), generator=g)) for _ in range(2)]
            results[fusion] = (losses, sorted({type(m).__name__ for s in pm.stages for m in s.modules()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (plain, plain_names), (fused, fused_names) = results[False], results[True]
    assert "FusedRMSNorm" in fused_names
    assert not any(n.startswith("Fused") for n in plain_names)
    # the plan trains in bf16 (its precision): one bf16 ulp at a loss of ~4.9 is 0.03
    for a, b in zip(fused, plain):
        assert abs(a - b) <= 1e-2 * abs(b)


def test_each_engine_is_priced_with_the_chains_it_fuses(mid_plans):
    """autopar swaps its Triton kernel in for the chains its kernels win (eager blocks: not
    bias + GeLU, whose kernel it deleted, nor add + LayerNorm). Megatron fuses bias + GeLU
    and dropout + add, not the residual add with the next LayerNorm. Eager PyTorch fuses
    none, so its plan is priced unfused. A priced fusion it never runs would make the
    estimate too fast."""
    from autopar.engine import AUTOPAR_FUSED, ENGINES, Engine

    model = mid_plans["model"]
    found = {f["pattern"] for f in find_fusions(model)}
    own = {f["pattern"] for f in mid_plans["fused"].fusions}
    assert {"add_layernorm", "bias_gelu"} <= found and own == found & set(AUTOPAR_FUSED)
    meg = _plan(model, "dgx-h100:1", MID, engine=ENGINES["megatron"])
    assert {f["pattern"] for f in meg.fusions} == found & {"bias_gelu", "swiglu", "scaled_softmax", "dropout_add"}
    eager = _plan(model, "dgx-h100:1", MID, engine=ENGINES["pytorch"])
    assert eager.fusions == [] and "pytorch engine runs none" in eager.assumptions["fusion"]["why_none"]
    step = {k: p.predicted.step_time_s for k, p in (("own", mid_plans["fused"]), ("meg", meg), ("eager", eager))}
    assert step["eager"] == pytest.approx(mid_plans["eager"].predicted.step_time_s, rel=1e-9)
    # the engine and its fused chains travel in the plan's JSON (lists come back as the preset's tuple)
    assert Engine.from_dict(json.loads(meg.to_json())["assumptions"]["engine"]) == ENGINES["megatron"]
