"""Single-process checks of the lowering pieces (no process group needed)."""
import copy

import pytest
import torch

import gpt
import llama
from autopar.errors import PlanMismatchError
from autopar.lower import compile, load_plan, plan_for_model
from autopar.lower.model_layers import resolve
from autopar.lower.tensor_parallel import probe_blocks
from autopar.plan import Plan


def test_plan_for_model_takes_its_layers_from_capture():
    model, _ = gpt.gpt_tiny()
    plan = plan_for_model(model, pp=2, schedule="gpipe", num_micro_batches=2)
    names = [c.name for c in plan.layer_choices]
    assert names == ["embedding", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    # capture's layers: the embedding layer lists every module run before the blocks
    assert plan.layer_choices[0].module_paths == ["wte", "wpe", "drop"]
    assert [c.kind for c in plan.layer_choices] == ["embedding"] + ["transformer_block"] * 4 + ["head"]
    assert plan.layer_choices[-1].module_paths == ["ln_f", "lm_head"]
    assert [s.layer_names for s in plan.stages] == [["embedding", "blocks.0", "blocks.1"],
                                                    ["blocks.2", "blocks.3", "head"]]
    layout = resolve(model, plan)
    assert layout.blocks_path == "blocks" and layout.num_blocks == 4
    assert [l.position for l in layout.layers] == ["pre"] + ["block"] * 4 + ["post"]
    assert layout.tied == [["wte.weight", "lm_head.weight"]]
    # Round trip through JSON keeps everything lowering reads.
    again = Plan.from_json(plan.to_json())
    assert again.model["param_shapes"]["wte.weight"] == [128, 32]


@pytest.mark.parametrize("factory, expected", [
    (gpt.gpt_tiny, {"attn": (["qkv"], "proj"), "mlp": (["fc"], "proj")}),
    (llama.llama_tiny, {"attention": (["wq", "wk", "wv"], "wo"), "feed_forward": (["w1", "w3"], "w2")}),
])
def test_tensor_parallel_roles_come_from_data_flow(factory, expected):
    model, example = factory()
    blocks = model.blocks if hasattr(model, "blocks") else model.layers
    plans = probe_blocks(model, {0: blocks[0]}, example(2))
    got = {s.name: (sorted(s.colwise), s.rowwise) for s in plans[0].subs}
    assert got == {k: (sorted(v[0]), v[1]) for k, v in expected.items()}
    # norms are the parameter-holding children without Linears
    assert len(plans[0].norms) == 2
    # Llama's attention takes the RoPE cos/sin tensors too: they become replicated DTensors.
    if factory is llama.llama_tiny:
        assert plans[0].subs[0].arg_is_tensor == [True, True, True]


def test_probe_works_on_a_meta_model():
    with torch.device("meta"):
        model, example = llama.llama_tiny()
    plans = probe_blocks(model, {1: model.layers[1]}, example(1))
    assert plans[1].subs[1].rowwise == "w2"


def test_model_that_differs_from_the_plan_is_refused_before_any_collective():
    model, example = gpt.gpt_tiny()
    plan = plan_for_model(model, dp=2)
    other, _ = llama.llama_tiny()
    with pytest.raises(PlanMismatchError, match="differs from the planned one"):
        compile(other, example_inputs=example, loss_fn=gpt.loss_fn, plan=plan)
    wider = gpt.GPT(gpt.GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=4, heads=4, ffn_mult=2))
    with pytest.raises(PlanMismatchError, match="parameters"):
        compile(wider, example_inputs=example, loss_fn=gpt.loss_fn, plan=plan)
    # same parameter count, one shape different
    shaped = copy.deepcopy(plan)
    shaped.model["param_shapes"]["wpe.weight"] = [32, 16]
    with pytest.raises(PlanMismatchError, match="wpe.weight"):
        compile(model, example_inputs=example, loss_fn=gpt.loss_fn, plan=shaped)


def test_plan_json_of_another_schema_is_refused(tmp_path):
    model, _ = gpt.gpt_tiny()
    d = plan_for_model(model).to_dict()
    d["schema_version"] = 99
    path = tmp_path / "plan.json"
    import json
    path.write_text(json.dumps(d))
    with pytest.raises(PlanMismatchError, match="schema version 99"):
        load_plan(str(path))
    with pytest.raises(PlanMismatchError, match="not found"):
        load_plan(str(tmp_path / "missing.json"))


def test_missing_launcher_environment_is_a_clear_error(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    model, example = gpt.gpt_tiny()
    with pytest.raises(PlanMismatchError, match="torchrun"):
        compile(model, example_inputs=example, loss_fn=gpt.loss_fn, plan=plan_for_model(model, dp=2))


def test_pipeline_cut_inside_the_head_is_refused():
    model, _ = gpt.gpt_tiny()
    plan = plan_for_model(model, pp=2, schedule="gpipe", stage_layers=[5, 1])  # fine: head alone on the last stage
    resolve(model, plan)
    from autopar.lower.pipeline_parallel import check_stage_cuts
    check_stage_cuts(resolve(model, plan), 2)
    bad = plan_for_model(model, pp=2, schedule="gpipe", stage_layers=[3, 3])
    bad.stages[0].layers, bad.stages[1].layers = bad.stages[1].layers, bad.stages[0].layers
    with pytest.raises(PlanMismatchError):
        check_stage_cuts(resolve(model, bad), 2)


def test_loss_parallel_probe_checks_the_users_loss_numerically(tmp_path):
    """Cross-entropy runs on vocab-sharded logits; a loss loss_parallel
    cannot honour (label smoothing) is detected and keeps gathered logits."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from autopar.lower.tensor_parallel import loss_parallel_works
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        assert loss_parallel_works(gpt.loss_fn, mesh, (2, 4, 16))
        smoothed = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), label_smoothing=0.2)
        assert not loss_parallel_works(smoothed, mesh, (2, 4, 16))
        assert not loss_parallel_works(lambda out, t: out[0], mesh, (2, 4, 16))  # not a scalar loss
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("main_grads, reduce_dtype", [("fp32", torch.float32), ("fp32-unfused", torch.float32),
                                                      ("same", torch.bfloat16)])
def test_main_grads_choose_the_fsdp_reduce_dtype(tmp_path, main_grads, reduce_dtype):
    """bf16 plans: fp32 main gradients -> FSDP2 reduces in fp32
    (MixedPrecisionPolicy(reduce_dtype=float32)); "same" -> in bf16, as priced."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model, example = llama.llama_tiny()
        plan = plan_for_model(model, precision="bf16", zero=2, main_grads=main_grads, micro_batch_size=2)
        pm = compile(model, example_inputs=example, loss_fn=gpt.loss_fn, plan=plan, optimizer=torch.optim.SGD,
                     optimizer_kwargs={"lr": 0.1})
        x = torch.randint(0, 128, (2, 16))
        assert pm.train_step((x,), x) > 0  # FSDP2 fixes its dtypes at the first forward
        block = pm.module.model.layers[0]
        # FSDPParam.reduce_dtype None means "reduce in param_dtype"
        dtypes = {(p.param_dtype, p.reduce_dtype or p.param_dtype)
                  for p in block._get_fsdp_state()._fsdp_param_group.fsdp_params}
        assert dtypes == {(torch.bfloat16, reduce_dtype)}
        assert next(block.parameters()).grad.dtype == torch.float32  # sharded grads keep the param dtype
    finally:
        dist.destroy_process_group()


def test_planned_main_grads_are_read_from_the_cost_model_assumptions():
    from autopar.lower.data_parallel import main_grads, mixed_precision
    model, _ = gpt.gpt_tiny()
    plan = plan_for_model(model)
    plan.assumptions = {"cost_model": {"main_grads": "same"}}  # where the planner records it
    assert main_grads(plan) == "same"
    plan.assumptions = {}
    assert main_grads(plan) == "fp32"  # says nothing: fp32 reductions
    assert mixed_precision("fp32", "same") is None
    with pytest.raises(PlanMismatchError, match="main_grads"):
        plan_for_model(model, main_grads="fp16")


def test_zero_levels_lowering_cannot_honour_are_named_not_silent():
    from autopar.lower.data_parallel import zero_substitutions
    model, _ = gpt.gpt_tiny()
    # pure data parallelism: ZeRO-1 is replicate + ZeroRedundancyOptimizer, as planned
    assert zero_substitutions(plan_for_model(model, dp=2, zero=1)) == []
    assert zero_substitutions(plan_for_model(model, pp=2, zero=1, schedule="gpipe")) == []  # dp=1: nothing sharded
    notes = zero_substitutions(plan_for_model(model, pp=2, dp=2, zero=1, schedule="gpipe"))
    assert len(notes) == 1
    assert notes[0].startswith("zero 1 lowered as zero 2 for layer(s) embedding, blocks.0, blocks.1, blocks.2 "
                               "and 2 more: under tensor/pipeline parallelism")
    # one ZeRO-3 layer makes the whole data-parallel wrapper FSDP2: the others are said too
    mixed = plan_for_model(model, dp=2, zero=0)
    mixed.layer_choices[1].zero = 3
    notes = zero_substitutions(mixed)
    assert len(notes) == 1 and "zero 0 lowered as zero 2" in notes[0] and "blocks.0" not in notes[0]
    assert "other layers' FSDP2 sharding" in notes[0] and "optimizer state" in notes[0]


def test_layers_may_own_parameters_no_module_of_theirs_holds():
    """ViT's class_token / pos_embedding sit on the root: a layer lists them by
    parameter path; lowering keeps them in the root FSDP unit, and a pipeline,
    which could only copy them to every stage, refuses them."""
    import vit
    from autopar.lower.pipeline_parallel import StageModule
    model, example = vit.vit_tiny()
    plan = plan_for_model(model, example_inputs=example)
    embedding = plan.layer_choices[0]
    for name in ("class_token", "pos_embedding"):  # what capture lists (added if an older capture did not)
        if name not in embedding.module_paths:
            embedding.module_paths.append(name)
    layout = resolve(model, plan)
    assert layout.layers[0].param_paths == ["class_token", "pos_embedding"]
    assert "class_token" not in layout.layers[0].paths and layout.layers[0].position == "pre"
    piped = plan_for_model(model, example_inputs=example, pp=2, schedule="gpipe")
    piped.layer_choices[0].module_paths = embedding.module_paths
    with pytest.raises(PlanMismatchError, match="class_token, pos_embedding"):
        StageModule(model, resolve(model, piped), 1, 2)


def test_transposed_conv1d_heads_split_over_the_vocabulary(tmp_path):
    """transformers' Conv1D (weight (in, out)) as a head: column-parallel
    means its weight's dim 1 and its bias are split; outputs unchanged."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from transformers.pytorch_utils import Conv1D
    from autopar.lower.tensor_parallel import parallelize_vocab
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        head = torch.nn.Sequential(torch.nn.LayerNorm(4), Conv1D(16, 4))
        x = torch.randn(2, 3, 4)
        expected = head(x)
        parallelize_vocab(head, init_device_mesh("cpu", (1,)), position="post")
        w, b = head[1].weight, head[1].bias
        assert isinstance(w, DTensor) and w.placements == (Shard(1),) and b.placements == (Shard(0),)
        assert torch.allclose(head(x), expected)
    finally:
        dist.destroy_process_group()
