"""Context parallelism lowered from a Plan (Mesh.cp): `autopar.compile` builds the
(pp, dp, cp, tp) mesh, shards the parameters over dp x cp, cuts every sequence over
the cp ranks (torch's ring attention) and trains as one process does (gloo, CPU,
fp32, 3 SGD steps, 1e-5). A plan cp cannot run is refused on every rank before any
process group; a lowering that ignored Plan.mesh.cp would fail the world size check
or hold the whole sequence (checked below)."""
import pytest
import torch

from dist_utils import run_world
from lower_worlds import SEQ, equivalence_world

TOL = 1e-5


def _cp_seen_world(rank, world):
    """What one rank's model sees under a cp 2 plan: the sequence length its blocks get."""
    import autopar
    from autopar.lower.manual_plan import plan_for_model
    from lower_worlds import GLOBAL_BATCH, batches, build
    model, example, loss_fn = build("llama")
    plan = plan_for_model(model, example_inputs=example, cp=2, seq_len=SEQ, micro_batch_size=GLOBAL_BATCH)
    pm = autopar.compile(model, plan=plan, example_inputs=example, loss_fn=loss_fn,
                         optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1))
    seen = []
    block = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))[0]
    block.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    x, y = batches()[0]
    pm.train_step((x,), y)
    return {"seen": seen, "data_group": pm.mesh["dp", "cp"].size(), "cp_rank": pm.mesh["cp"].get_local_rank()}


def _planned_cp(path) -> str:
    """What the planner writes for a pinned --cp 2 on 2 CPU ranks (fp32, as the reference
    trains), saved as JSON: the cp layout the planner offers must run as one process does."""
    from autopar.solve.planner import scaled_cluster
    from cost_models.hardware import ClusterSpec
    from lower_worlds import GLOBAL_BATCH, build
    import autopar
    model, example, _ = build("llama")
    p = autopar.plan(model, scaled_cluster(ClusterSpec.resolve("cpu"), 1, 2), example, global_batch_size=GLOBAL_BATCH,
                     constraints={"cp": 2}, precision="fp32", fusion=False)
    assert p.mesh.cp == 2 and p.mesh.world_size == 2
    p.save(str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp2_plan_matches_one_process(tmp_path):
    planned = ("planned", {"plan_json": _planned_cp(tmp_path / "plan.json")})
    layouts = [planned, ("cp2", dict(cp=2, seq_len=SEQ)), ("cp2_zero3_mb2", dict(cp=2, seq_len=SEQ, zero=3,
                                                                         num_micro_batches=2)),
               # transformers' own causal loss: labels shifted over the whole sequence, then cut
               ("hf_llama_cp2", dict(model="hf_llama", cp=2, seq_len=SEQ)),
               # position ids in a buffer (zoo GPT), a learned position table (GPT-2), a window longer
               # than the sequence (Mistral, which then passes is_causal)
               ("gpt_cp2", dict(model="gpt", cp=2, seq_len=SEQ)), ("hf_gpt2_cp2", dict(model="hf_gpt2", cp=2)),
               ("hf_mistral_cp2", dict(model="hf_mistral", cp=2))]
    results = run_world(equivalence_world, 2, "llama", layouts, "sgd", timeout=280)
    for name, r in results[0].items():
        assert results[1][name]["losses"] == r["losses"], name
        assert r["loss_rel"] < TOL, (name, r["losses"], r["ref_losses"])
        assert r["param_rel"] < TOL, (name, r["param_rel"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp2_x_tp2_and_cp2_x_dp2_plans_match_one_process():
    layouts = [("cp2_tp2", dict(cp=2, tp=2, seq_len=SEQ, zero=3)), ("cp2_dp2", dict(cp=2, dp=2, seq_len=SEQ))]
    results = run_world(equivalence_world, 4, "llama", layouts, "sgd", timeout=280)
    for name, r in results[0].items():
        assert all(x[name]["losses"] == r["losses"] for x in results), name
        assert r["loss_rel"] < TOL, (name, r["losses"], r["ref_losses"])
        assert r["param_rel"] < TOL, (name, r["param_rel"])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_lowering_reads_plan_mesh_cp():
    """Each rank's blocks see SEQ / 2 tokens and the parameters are sharded over 2 ranks:
    a lowering that dropped mesh.cp would run the whole sequence (and the world check fails)."""
    for rank, r in enumerate(run_world(_cp_seen_world, 2, timeout=180)):
        assert r["seen"] == [SEQ // 2], r
        assert r["cp_rank"] == rank and r["data_group"] == 2


def test_refused_before_any_group():
    """Every rank raises alike, from the plan and the model alone (no process group exists here)."""
    import torch.distributed as dist

    from autopar.errors import PlanMismatchError
    from autopar.lower import context_parallel as cp
    from autopar.lower.manual_plan import plan_for_model
    from lower_worlds import build
    model, example, _ = build("llama")
    with pytest.raises(PlanMismatchError, match="2 x cp = 4 equal chunks"):
        plan_for_model(model, example_inputs=example, cp=2, seq_len=18)
    plan = plan_for_model(model, example_inputs=example, cp=2, seq_len=SEQ)
    # the gradients of dp 1 x cp 2 are reduced over the 2 cp ranks: compressing them is no contradiction
    assert plan_for_model(model, example_inputs=example, cp=2, seq_len=SEQ, precision="bf16",
                          grad_reduce_dtype="bf16").grad_reduce_dtype == "bf16"
    masked = (torch.zeros(2, SEQ, dtype=torch.long), torch.ones(2, SEQ, dtype=torch.long))
    with pytest.raises(PlanMismatchError, match="mesh.cp 2 cannot run: .*attention mask"):
        cp.check_plan(model, plan, masked)
    plan.mesh.pp = 2
    assert "under a pipeline" in cp.plan_refusal(model, plan, example(2))
    assert not dist.is_initialized()


def test_what_runs_says_where_cp_cannot_run():
    """The planner reads it (lowering_limits["cp"]): present only where cp cannot cut the model."""
    import autopar
    from autopar.lower.what_runs import limits
    from lower_worlds import build
    model, example, _ = build("llama")
    assert "cp" not in limits(model, autopar.capture(model, example), example)
    model.register_buffer("causal_mask", torch.ones(SEQ, SEQ).tril())  # a precomputed mask: not splittable
    assert "causal_mask" in limits(model, autopar.capture(model, example), example)["cp"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_training_data_path_under_cp(tmp_path):
    """autopar.train's pieces under cp 2 x dp 2: each dp rank reads its share of a token file
    (the cp ranks of one dp rank the same samples, which the step cuts), clipping by the global
    gradient norm over dp x cp shards, warmup + cosine, AdamW; as one process on the whole batch."""
    from lower_worlds import training_runtime_world
    from test_train_runtime import _token_file
    path = _token_file(tmp_path, n=64 * 16 + 1)
    results = run_world(training_runtime_world, 4, path, [("cp2_dp2", dict(cp=2, dp=2, zero=3))], timeout=380)
    r = results[0]["cp2_dp2"]
    assert abs(r["norms"][0] / r["ref_norms"][0] - 1) < 1e-6, (r["norms"], r["ref_norms"])
    assert r["norm_rel"] < 1e-4 and r["loss_rel"] < 1e-4 and r["param_rel"] < 1e-3, r
    assert all(res == results[0] for res in results[1:])
