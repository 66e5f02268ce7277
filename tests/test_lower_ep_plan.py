"""Plan.mesh.ep lowered (autopar/lower/expert_parallel.py through `lower`): tiny
transformers Mixtral and Qwen3-MoE (fp32, gloo, 3 SGD steps) under ep 2 on 2 ranks
and ep 2 x efsdp 2 (dp 4) on 4 ranks train as one process on the whole batch
(1e-5); each rank holds experts / ep of every MoE layer (mutation: a lowering
that ignores ep holds all 4 and fails); DBRX's plan with ep is refused on every
rank before any process group, with its reason.
"""
from __future__ import annotations

import pytest
import torch

from cost_models.hardware import ClusterSpec
from dist_utils import run_world

TOL = 1e-5
SEQ, BATCH, STEPS, VOCAB = 16, 8, 3, 128


def build(arch: str):
    import transformers as T
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
    if arch == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, intermediate_size=48, **small))
    if arch == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(num_experts=4, intermediate_size=48, moe_intermediate_size=24,
                                                      head_dim=8, **small))
    if arch == "dbrx":
        return T.DbrxForCausalLM(T.DbrxConfig(
            d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=VOCAB,
            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2}))
    raise KeyError(arch)


def _example(b):
    return (torch.zeros(b, SEQ, dtype=torch.long),)


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def _reference(arch):
    model = build(arch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        loss = model(x, labels=y, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _expert_rows(model) -> list:
    from autopar.lower.expert_parallel import local_expert_modules
    from torch.distributed.tensor import DTensor
    rows = set()
    for m in local_expert_modules(model):
        for p in m.parameters():
            rows.add(p.shape[0] if not isinstance(p, DTensor) else p.size(0))  # global size over efsdp
    return sorted(rows)


def ep_world(rank, world, cases):
    import autopar
    from autopar.errors import AutoparError
    from autopar.lower.manual_plan import plan_for_model
    out = {}
    for name, arch, kw in cases:
        model = build(arch)
        dp, mutate = kw["dp"], kw.pop("mutate_ep", None)
        try:
            if "plan_json" in kw:  # the planner's plan, saved as JSON
                from autopar.plan import Plan
                plan = Plan.load(kw["plan_json"])
            else:
                mbs = BATCH // (dp * kw.get("num_micro_batches", 1))
                plan = plan_for_model(model, example_inputs=_example, precision="fp32", micro_batch_size=mbs,
                                      **{k: v for k, v in kw.items() if k != "ep"} if mutate else kw)
            if mutate:  # a plan edited after planning: ep set where the model cannot run it
                plan.mesh.ep = mutate
            pm = autopar.compile(model, plan=plan, example_inputs=_example, optimizer=torch.optim.SGD,
                                 optimizer_kwargs=dict(lr=0.1))
        except AutoparError as exc:
            out[name] = {"refused": str(exc)}
            continue
        losses = [pm.train_step((x,), y) for x, y in _batches()]
        ref_losses, ref_params = _reference(arch)
        full = pm.full_state_dict()  # every expert whole again (collective over ep)
        full_rel = max(((full[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item()
                       for k, v in ref_params.items()) if set(full) == set(ref_params) else float("inf")
        out[name] = {"losses": losses, "ref": ref_losses, "full_rel": full_rel,
                     "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "param_rel": _param_rel(model, ref_params, rank, plan), "expert_rows": _expert_rows(model)}
    return out


def _param_rel(model, ref_params, rank, plan) -> float:
    """Worst relative parameter difference; an expert weight against this rank's experts
    (ep rank = dp rank % ep: ep is the inner part of dp)."""
    from torch.distributed.tensor import DTensor
    ep = plan.mesh.ep or 1
    worst = 0.0
    for name, p in model.named_parameters():
        ref = ref_params[name.replace(".experts.local.", ".experts.")]
        mine = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if mine.shape != ref.shape:
            per = ref.shape[0] // ep
            ref = ref[(rank % ep) * per:(rank % ep + 1) * per]
        worst = max(worst, ((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
    return worst


def _planned(path, dp: int) -> str:
    """The planner's plan for a pinned --ep 2 on `dp` CPU ranks (fp32, as the reference trains)."""
    import autopar
    from autopar.solve.planner import scaled_cluster
    p = autopar.plan(build("mixtral"), scaled_cluster(ClusterSpec.resolve("cpu"), 1, dp), _example,
                     global_batch_size=BATCH, constraints={"dp": dp, "ep": 2, "micro_batch": BATCH // dp},
                     precision="fp32", fusion=False)
    assert p.mesh.ep == 2, p.mesh
    p.save(str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ep_2_on_2_ranks_matches_one_process_and_dbrx_is_refused_everywhere(tmp_path):
    # DBRX first: its refusals come before this world's first process group
    cases = [("dbrx_ep2", "dbrx", dict(dp=2, ep=2, zero=3)),
             ("dbrx_ep2_edited", "dbrx", dict(dp=2, ep=2, zero=3, mutate_ep=2)),
             ("mixtral_ep2_zero3", "mixtral", dict(dp=2, ep=2, zero=3)),
             ("qwen3_ep2_zero2", "qwen3_moe", dict(dp=2, ep=2, zero=2)),
             ("planned_ep2", "mixtral", dict(dp=2, plan_json=_planned(tmp_path / "plan.json", 2)))]
    results = run_world(ep_world, 2, cases, timeout=280)
    for rank, res in enumerate(results):
        for name in ("mixtral_ep2_zero3", "qwen3_ep2_zero2", "planned_ep2"):
            r = res[name]
            assert "refused" not in r, (rank, name, r)
            assert r["loss_rel"] < TOL and r["param_rel"] < TOL and r["full_rel"] < TOL, (rank, name, r)
            assert r["expert_rows"] == [2], (name, r)  # 2 of the 4 experts on each rank
        for name in ("dbrx_ep2", "dbrx_ep2_edited"):
            assert "2-D (experts x ffn, hidden)" in res[name]["refused"], res[name]
        # the edited plan is refused by the lowering's preflight (check_plan: before any
        # process group or mesh is made, on every rank alike)
        assert "mesh.ep 2 cannot run" in res["dbrx_ep2_edited"]["refused"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ep_2_x_efsdp_2_on_4_ranks_matches_one_process():
    cases = [("mixtral_dp4_ep2", "mixtral", dict(dp=4, ep=2, zero=3)),
             # pp 2 x dp 2 (ep 2): each stage's experts over its own ep group, 1F1B over 2 micro-batches
             ("mixtral_pp2_dp2_ep2", "mixtral", dict(pp=2, dp=2, ep=2, zero=2, schedule="1f1b",
                                                     num_micro_batches=2)),
             ("mixtral_dp4", "mixtral", dict(dp=4, zero=3))]  # no ep: every expert on every rank
    results = run_world(ep_world, 4, cases, timeout=280)
    for rank, res in enumerate(results):
        for name in ("mixtral_dp4_ep2", "mixtral_pp2_dp2_ep2"):
            r = res[name]
            assert "refused" not in r, (rank, name, r)
            assert r["loss_rel"] < TOL and r["full_rel"] < TOL, (rank, name, r)
            assert r["expert_rows"] == [2], (name, r)
        assert res["mixtral_dp4_ep2"]["param_rel"] < TOL
        assert res["mixtral_dp4"]["expert_rows"] == [] and res["mixtral_dp4"]["loss_rel"] < TOL


def test_what_runs_says_dbrx_cannot_split_its_experts():
    """what_runs' "ep" answer (the planner then offers no ep): DBRX's 2-D experts, with the
    reason; Mixtral and Qwen3-MoE have none."""
    from autopar.lower.expert_parallel import ep_refusal, moe_refusal
    assert "2-D (experts x ffn, hidden)" in moe_refusal(build("dbrx"))
    assert moe_refusal(build("mixtral")) is None and moe_refusal(build("qwen3_moe")) is None
    assert "do not split over 3" in ep_refusal(build("mixtral"), 3)
