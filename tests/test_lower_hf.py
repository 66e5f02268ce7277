"""Hugging Face transformers models, as users build them, lowered by autopar.

`LlamaForCausalLM(LlamaConfig(...))` (GQA, RoPE, blocks at `model.layers`,
attention called with keyword arguments and returning a tuple),
`GPT2LMHeadModel(GPT2Config(...))` (transformers' Conv1D with (in, out)
weights, fused qkv, tied head, blocks at `transformer.h`), and the
Mistral / Qwen2 (q/k/v biases) / tied-Llama variants. Each layout trains 3
SGD steps with the model's own loss (loss_fn=None) and must equal one
process training the same model with `model(x, labels=y).loss`, to the
tolerance of tests/test_lower_equivalence.py (1e-5 relative).
"""
import pytest
import torch

pytest.importorskip("transformers")

from dist_utils import run_world  # noqa: E402
from lower_worlds import HF_VOCAB, equivalence_world, hf_meta_world, hf_model, hf_precision_world  # noqa: E402

from autopar.errors import AutoparError, PlanMismatchError  # noqa: E402
from autopar.lower import plan_for_model  # noqa: E402

TOL = 1e-5

TWO_RANK = [
    ("dp_zero0", dict(dp=2)),
    ("dp_zero3", dict(dp=2, zero=3, num_micro_batches=2)),
    ("tp", dict(tp=2)),
    ("tp_sp", dict(tp=2, sequence_parallel=True)),
    ("pp_1f1b_selective_ckpt", dict(pp=2, schedule="1f1b", num_micro_batches=2, checkpoint="selective")),
]
# Weights tensor parallelism must split in every block (proof that TP ran,
# not a replicated model giving the same numbers).
SPLIT = {
    "hf_llama": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"],
    "hf_gpt2": ["attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "mlp.c_fc.weight",
                "mlp.c_fc.bias", "mlp.c_proj.weight"],
}
BLOCKS = {"hf_llama": "model.layers", "hf_gpt2": "transformer.h"}
VOCAB_SPLIT = {"hf_llama": ["model.embed_tokens.weight", "lm_head.weight"], "hf_gpt2": ["transformer.wte.weight"]}


def _check(results):
    for name, r in results[0].items():
        for other in results[1:]:  # every rank reports the same global loss
            assert other[name]["losses"] == r["losses"], name
        assert r["loss_rel"] < TOL, (name, r["losses"], r["ref_losses"])
        assert r["param_rel"] < TOL, (name, r["param_rel"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["hf_llama", "hf_gpt2"])
def test_hf_two_rank_layouts_match_single_process(model):
    results = run_world(equivalence_world, 2, model, TWO_RANK, "sgd", timeout=280)
    _check(results)
    for r in results:
        for layout in ("tp", "tp_sp"):
            sharded = set(r[layout]["tp_sharded"])
            want = {f"{BLOCKS[model]}.{i}.{w}" for i in range(4) for w in SPLIT[model]} | set(VOCAB_SPLIT[model])
            assert want <= sharded, (layout, sorted(want - sharded))
            assert r[layout]["loss_parallel"], layout  # HF's own loss runs on vocab-sharded logits
        assert r["dp_zero0"]["tp_sharded"] == [] and r["dp_zero0"]["notes"] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_variants_match_single_process():
    """Mistral, Qwen2 (q/k/v biases, split column-wise with their weights) and
    Llama with a tied head, under TP+SP (blocks fully recomputed: HF decoder
    layers inside checkpoint_wrapper) and a 2-stage pipeline; Llama fed a
    left-padding attention mask and -100 labels under PP, ZeRO-3 and TP+SP
    (the mask reaches the CPU attention kernel as a DTensor: autopar's
    sharding rule places it)."""
    layouts = []
    # a padding mask as second input (it travels with the activation between stages) and
    # -100 labels on the padding: micro-batches and dp ranks score different token counts,
    # and the loss must still be the mean over the global batch's scored tokens
    layouts += [("hf_llama_pp_1f1b", dict(model="hf_llama", pp=2, schedule="1f1b", num_micro_batches=2)),
                ("hf_llama_pp_1f1b_padding_mask", dict(model="hf_llama", pp=2, schedule="1f1b", num_micro_batches=2,
                                                       attention_mask=True)),
                ("hf_llama_dp_zero3_padding_mask", dict(model="hf_llama", dp=2, zero=3, num_micro_batches=2,
                                                        attention_mask=True)),
                ("hf_llama_tp_sp_padding_mask", dict(model="hf_llama", tp=2, sequence_parallel=True,
                                                     attention_mask=True))]
    # a vocabulary tp=2 does not divide: embedding and head stay whole, blocks split
    layouts += [("hf_gpt2_odd_vocab_tp_sp", dict(model="hf_gpt2_odd_vocab", tp=2, sequence_parallel=True))]
    for m in ("hf_mistral", "hf_qwen2", "hf_llama_tied"):
        layouts += [(f"{m}_tp_sp", dict(model=m, tp=2, sequence_parallel=True, checkpoint="full")),
                    (f"{m}_pp_gpipe", dict(model=m, pp=2, schedule="gpipe", num_micro_batches=2))]
    results = run_world(equivalence_world, 2, "hf_llama", layouts, "sgd", timeout=280)
    _check(results)
    assert "model.layers.0.self_attn.q_proj.bias" in results[0]["hf_qwen2_tp_sp"]["tp_sharded"]
    odd = results[0]["hf_gpt2_odd_vocab_tp_sp"]["tp_sharded"]
    assert "transformer.h.0.attn.c_attn.weight" in odd and "transformer.wte.weight" not in odd
    # the mask matters: the masked model's losses are not the unmasked one's
    masked, plain = results[0]["hf_llama_pp_1f1b_padding_mask"], results[0]["hf_llama_pp_1f1b"]
    assert all(abs(a - b) > 1e-4 for a, b in zip(masked["ref_losses"], plain["ref_losses"]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_four_rank_layouts_match_single_process_and_say_what_they_substitute():
    layouts = [
        ("llama_pp_x_tp", dict(model="hf_llama", pp=2, tp=2, schedule="1f1b", num_micro_batches=2,
                               sequence_parallel=True)),
        ("gpt2_dp_x_tp_zero3", dict(model="hf_gpt2", dp=2, tp=2, zero=3)),
        ("llama_pp_x_dp_zero1", dict(model="hf_llama", pp=2, dp=2, zero=1, schedule="gpipe",
                                     num_micro_batches=2)),
        # 4 stages of one block on 2 pp ranks; the tied wte / lm_head ends on different ranks
        ("gpt2_interleaved_x_dp", dict(model="hf_gpt2", pp=2, dp=2, schedule="interleaved", virtual_stages=2,
                                       num_micro_batches=2)),
    ]
    results = run_world(equivalence_world, 4, "hf_llama", layouts, "sgd", timeout=280)
    _check(results)
    notes = results[0]["llama_pp_x_dp_zero1"]["notes"]
    # ZeRO-1 under pp runs as ZeRO-2: said, naming the layers, not silent
    assert len(notes) == 1 and "zero 1 lowered as zero 2" in notes[0] and "model.layers.0" in notes[0], notes
    assert results[0]["gpt2_dp_x_tp_zero3"]["notes"] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_meta_models_are_materialised_per_shard_by_their_own_init():
    """`with torch.device("meta"): LlamaForCausalLM(cfg)` at scale: each rank
    allocates only its shards; HF's _init_weights (found by autopar, no
    init_fn passed) sets weights (normal, std = initializer_range 0.02),
    norms (ones) and the RoPE inv_freq buffers (equal to a CPU-built model's)."""
    results = run_world(hf_meta_world, 2, timeout=280)
    for r in results:
        for name, m in r.items():
            assert m["local_bytes"] < 0.75 * m["full_bytes"], name  # sharded, not whole copies
            assert all(0.015 < s < 0.025 for s in m["linear_std"].values()), (name, m["linear_std"])
            assert m["norms_are_ones"], name
            assert m["inv_freq_ok"] in (True, None), name  # None: GPT-2 has no RoPE buffers
            assert all(0 < l < 10 for l in m["losses"]) and m["losses"][1] < m["losses"][0], (name, m["losses"])
    assert results[0]["hf_llama_tp_sp"]["inv_freq_ok"] is True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_bf16_plans_train_close_to_fp32():
    """bf16 compute (FSDP2 MixedPrecisionPolicy) under TP+SP and PP 1F1B: the
    losses stay within bf16's 2e-2 of fp32 training (as test_lower_runtime
    states for the example models); master weights stay fp32."""
    for r in run_world(hf_precision_world, 2, timeout=280):
        for name, m in r.items():
            rel = max(abs(a - b) / b for a, b in zip(m["losses"], m["ref_losses"]))
            assert 0 < rel < 2e-2, (name, m["losses"], m["ref_losses"])  # > 0: bf16 really ran
            assert m["param_dtype"] == "torch.float32", name


# -- single process ----------------------------------------------------------------

def test_hand_plans_take_nested_blocks_from_capture():
    model = hf_model("hf_llama")
    plan = plan_for_model(model, pp=2, schedule="gpipe", num_micro_batches=2, tp=2)
    names = [c.name for c in plan.layer_choices]
    assert names == ["embedding", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "head"]
    first, *_, last = plan.layer_choices
    assert first.module_paths == ["model.embed_tokens", "model.rotary_emb"] and first.tp_style == "vocab"
    assert last.module_paths == ["model.norm", "lm_head"] and last.tp_style == "vocab"
    assert {c.tp_style for c in plan.layer_choices[1:-1]} == {"colwise_rowwise"}
    assert [s.layer_names for s in plan.stages] == [names[:3], names[3:]]


def test_hand_plan_refuses_a_tp_degree_the_heads_do_not_allow():
    model = hf_model("hf_llama")  # 4 query heads, 2 key/value heads
    with pytest.raises(PlanMismatchError, match=r"model.layers.0.*tp=4.*allows tp in 1, 2"):
        plan_for_model(model, tp=4)
    # a vocabulary tp does not divide only keeps the embedding and head whole
    styles = [c.tp_style for c in plan_for_model(hf_model("hf_gpt2_odd_vocab"), tp=2).layer_choices]
    assert styles == ["replicate"] + ["colwise_rowwise"] * 4 + ["replicate"]


def test_one_f_one_b_with_too_few_micro_batches_is_an_error_not_gpipe():
    model = hf_model("hf_gpt2")
    with pytest.raises(PlanMismatchError, match="1f1b with pp=2 needs at least 2 micro-batches") as err:
        plan_for_model(model, pp=2, schedule="1f1b", num_micro_batches=1)
    assert "gpipe" in err.value.hint
    from autopar.lower.pipeline_parallel import check_schedule
    plan = plan_for_model(model, pp=2, schedule="gpipe", num_micro_batches=1)
    plan.schedule = "1f1b"  # e.g. a plan JSON edited by hand
    with pytest.raises(PlanMismatchError, match="1f1b"):
        check_schedule(plan)


def test_model_outputs_and_losses():
    from autopar.lower.model_io import HFTokenLoss, forward_kwargs, logits_of, resolve_loss_fn
    model = hf_model("hf_llama")
    torch.manual_seed(0)
    x = torch.randint(0, HF_VOCAB, (2, 8))
    out = model(x, **forward_kwargs(model))
    assert forward_kwargs(model) == {"use_cache": False} and out.past_key_values is None
    assert logits_of(out) is out.logits and logits_of((out.logits,)) is out.logits
    loss_fn = resolve_loss_fn(model, None)
    assert isinstance(loss_fn, HFTokenLoss) and loss_fn.shift
    # the model's own loss, as its forward computes it with labels
    assert torch.equal(loss_fn(out.logits, x), model(x, labels=x).loss)
    # token weighting: sum / (scored tokens) is the same mean for one share
    labels = x.clone()
    labels[0, :5] = -100
    loss_fn.tokens_per_share = float(loss_fn.scored_tokens(labels))
    assert loss_fn.tokens_per_share == 2 * 7 - 4
    assert torch.allclose(loss_fn(out.logits, labels), model(x, labels=labels).loss, rtol=1e-6)
    assert logits_of({"hidden": out.logits}) is out.logits  # a dict's only tensor
    with pytest.raises(AutoparError, match="several tensors and none under the key 'logits'"):
        logits_of({"hidden": out.logits, "scores": out.logits})
    with pytest.raises(AutoparError, match="needs loss_fn") as err:
        resolve_loss_fn(torch.nn.Linear(2, 2), None)
    assert "cross_entropy" in err.value.hint


def test_own_loss_is_the_models_own_or_refused():
    """loss_fn=None reproduces what model(x, labels=y).loss computes (masked LM
    and seq2seq score every position, causal LMs the shifted ones), with the
    global-batch token weighting; any other own loss is refused, never
    approximated by a causal-LM loss."""
    import transformers as T
    from autopar.lower.model_io import resolve_loss_fn
    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    bert = T.BertForMaskedLM(T.BertConfig(**small, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    x = torch.randint(0, 64, (2, 8))
    labels = torch.full_like(x, -100)
    labels[:, 2] = x[:, 2]
    labels[1, 5] = x[1, 5]
    loss_fn = resolve_loss_fn(bert, None)
    assert not loss_fn.shift
    logits = bert(x).logits
    assert torch.allclose(loss_fn(logits, labels), bert(x, labels=labels).loss, rtol=1e-6)
    loss_fn.tokens_per_share = float(loss_fn.scored_tokens(labels))  # one share: the same mean
    assert loss_fn.tokens_per_share == 3
    assert torch.allclose(loss_fn(logits, labels), bert(x, labels=labels).loss, rtol=1e-6)

    t5 = T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                 num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)).eval()
    dec = t5._shift_right(x)
    t5_loss = resolve_loss_fn(t5, None)
    assert torch.allclose(t5_loss(t5(x, decoder_input_ids=dec).logits, x), t5(x, labels=x).loss, rtol=1e-6)

    classifier = T.BertForSequenceClassification(T.BertConfig(**small))
    with pytest.raises(AutoparError, match="cannot reproduce exactly") as err:
        resolve_loss_fn(classifier, None)
    assert "loss_fn" in err.value.hint
    moe = T.MixtralForCausalLM(T.MixtralConfig(**small, num_local_experts=2, output_router_logits=True))
    with pytest.raises(AutoparError, match="router load-balancing loss"):
        resolve_loss_fn(moe, None)


def test_tensor_parallel_roles_of_hf_blocks_come_from_data_flow():
    from autopar.lower.model_io import forward_kwargs
    from autopar.lower.tensor_parallel import probe_blocks
    from autopar.lower.tp_styles import is_transposed_linear
    got = {}
    for name in ("hf_llama", "hf_gpt2"):
        model = hf_model(name)
        block = model.get_submodule(BLOCKS[name] + ".1")
        plan = probe_blocks(model, {1: block}, (torch.zeros(2, 8, dtype=torch.long),), forward_kwargs(model))[1]
        got[name] = {s.name: (s.colwise, s.rowwise, s.main_input) for s in plan.subs}
    # Llama's attention is called with keywords (hidden_states=...) and returns (output, weights)
    assert got["hf_llama"] == {"self_attn": (["q_proj", "k_proj", "v_proj"], "o_proj", "hidden_states"),
                               "mlp": (["gate_proj", "up_proj"], "down_proj", 0)}
    # GPT-2's Conv1D are linears with transposed weights; c_proj's output passes a dropout
    assert got["hf_gpt2"] == {"attn": (["c_attn"], "c_proj", 0), "mlp": (["c_fc"], "c_proj", 0)}
    assert is_transposed_linear(hf_model("hf_gpt2").transformer.h[0].attn.c_attn)


def test_example_inputs_lowering_cannot_feed_are_refused_with_what_to_pass_instead():
    """Keyword inputs (capture's inferred form) are fed positionally, labels as targets; what cannot
    be fed that way is refused before any process group is needed."""
    from autopar.lower import compile
    model = hf_model("hf_llama")
    plan = plan_for_model(model)
    x = torch.zeros(1, 16, dtype=torch.long)
    with pytest.raises(AutoparError, match=r"positional tensors.*#1 \(str\)") as err:
        compile(model, example_inputs=(x, "not a tensor"), loss_fn=None, plan=plan)
    assert "labels go to train_step" in err.value.hint
    with pytest.raises(AutoparError, match="not the first parameters"):  # inputs_embeds is forward's 5th
        compile(model, example_inputs=({"inputs_embeds": torch.zeros(1, 16, 64)},), loss_fn=None, plan=plan)
