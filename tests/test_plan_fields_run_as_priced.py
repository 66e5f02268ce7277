"""Every plan field runs as priced, or is not offered (issue 12, item 5).

ZeRO 0/1 keep whole gradients, which only DDP's `replicate` does; the
lowering uses it on a pure data-parallel mesh where no layer uses FSDP2.
Everywhere else those layers run as ZeRO 2, so the planner states and prices
ZeRO 2 there (`solve.layout.lowered_zero_levels`), and the two rules must
agree. Optimizer-only offload has no FSDP2 equivalent: never offered,
refused when pinned or written into a plan.
"""
from __future__ import annotations

import itertools

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.lower import data_parallel
from autopar.plan import LayerChoice, Mesh, Plan, Stage
from autopar.solve.layout import layout_of, lowered_zero_levels
from autopar.solve.search_space import Candidate
from autopar.solve.table import option_space
from cost_models.analytic import gpt


def _plan(pp, dp, tp, zeros, offloads):
    layers = [LayerChoice(name=f"l{i}", kind="transformer_block", zero=z, offload=o)
              for i, (z, o) in enumerate(zip(zeros, offloads))]
    return Plan(model={}, global_batch_size=dp, seq_len=8, precision="fp32", mesh=Mesh(pp=pp, dp=dp, tp=tp),
                sequence_parallel=False, schedule="1f1b", virtual_stages=1, micro_batch_size=1, num_micro_batches=1,
                stages=[Stage(index=0, pp_rank=0, layers=layers)], solver={}, assumptions={})


def test_solver_and_lowering_agree_on_which_layers_keep_whole_gradients():
    for (pp, dp, tp), zeros, offs in itertools.product(
            [(1, 1, 1), (1, 4, 1), (1, 2, 2), (2, 2, 1)], itertools.product(range(4), repeat=2),
            itertools.product(("none", "params"), repeat=2)):
        if any(o == "params" and z != 3 for z, o in zip(zeros, offs)):
            continue
        cand = Candidate(pp=pp, dp=dp, tp=tp, micro_batch_size=1, num_micro_batches=1, schedule="1f1b",
                         virtual_stages=1, sequence_parallel=False)
        levels = lowered_zero_levels(cand, list(zeros), list(offs))
        plan = _plan(pp, dp, tp, zeros, offs)
        if dp > 1 and data_parallel.uses_replicate(plan):
            assert levels == list(zeros)  # replicate: the levels as planned
            assert not data_parallel.zero_substitutions(plan)
        elif dp > 1:
            assert all(l >= 2 for l in levels), ((pp, dp, tp), zeros, offs, levels)
            # what the lowering says it substitutes is exactly what the solver relabels
            relabelled = [f"l{i}" for i, (z, l) in enumerate(zip(zeros, levels)) if z != l]
            said = " ".join(data_parallel.zero_substitutions(plan))
            assert all(name in said for name in relabelled)


def test_the_plan_states_and_prices_zero_2_where_zero_0_would_run_as_2():
    model = gpt("g", hidden=1024, heads=16, layers=4, seq_len=1024, vocab_size=32000)
    plan = autopar.plan(model, "dgx-a100", global_batch_size=64, constraints={"tp": 2, "pp": 2, "zero": 0})
    assert plan.mesh.dp > 1
    assert {c.zero for c in plan.layer_choices} == {2}
    assert layout_of(plan).layer_zero == [2] * len(plan.layer_choices)
    flat = autopar.plan(model, "dgx-a100", global_batch_size=64, constraints={"tp": 1, "pp": 1})
    zeros = {c.zero for c in flat.layer_choices}
    assert zeros <= {0, 1} or zeros <= {2, 3}, zeros  # never a whole-gradient layer among FSDP2 ones


def test_optimizer_only_offload_is_not_offered_and_refused_when_asked():
    assert all(off != "optimizer" for _, _, off in option_space(offload=True))
    model = gpt("g", hidden=1024, heads=16, layers=4, seq_len=1024, vocab_size=32000)
    with pytest.raises(AutoparError, match="--offload optimizer cannot run.*CPUOffloadPolicy"):
        autopar.plan(model, "dgx-a100", global_batch_size=64, constraints={"offload": "optimizer", "zero": 2})
    torch = pytest.importorskip("torch")
    from autopar.lower.manual_plan import plan_for_model
    lm = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    with pytest.raises(AutoparError, match="offload='optimizer' cannot run"):
        plan_for_model(lm, dp=2, zero=2, offload="optimizer")


def test_a_layer_of_several_modules_is_never_planned_as_recomputed():
    """The lowering wraps one module per layer; a head of final norm + output
    Linear runs without recomputation, so the plan never says otherwise."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    inputs = lambda b: (torch.zeros(b, 8, dtype=torch.long),)  # noqa: E731
    plan = autopar.plan(model, "cpu:1", inputs, global_batch_size=8, precision="fp32",
                        constraints={"checkpoint": "full"})
    for c in plan.layer_choices:
        assert c.checkpoint == ("full" if len(c.module_paths) == 1 else "none"), (c.name, c.module_paths)
    assert any(len(c.module_paths) > 1 for c in plan.layer_choices)
    assert layout_of(plan).layer_checkpoint == [c.checkpoint for c in plan.layer_choices]
