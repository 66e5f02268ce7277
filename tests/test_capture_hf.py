"""Capture on models as people bring them: Hugging Face transformers classes
built from configs (examples/hf_models.py) and Karpathy's nanoGPT
(examples/nanogpt.py), with inputs inferred from the model."""
import functools
import subprocess
import sys

import pytest
import torch

import autopar
from autopar.model_file import load_model
from cost_models import analytic
from cost_models.workload import S, evaluate

pytest.importorskip("transformers")

# factory -> (block kind, number of blocks, what the inferred inputs must say)
HF = {
    "gpt2_tiny": ("transformer_block", 2, "input_ids (batch, 128) in [0, 256)"),
    "llama_tiny": ("transformer_block", 2, "labels (batch, 128)"),
    "mistral_tiny": ("transformer_block", 2, "max_position_embeddings 128"),
    "qwen2_tiny": ("transformer_block", 2, "input_ids"),
    "mixtral_tiny": ("moe_block", 2, "input_ids"),
    "bert_tiny": ("transformer_block", 2, "attention_mask of ones"),
    "t5_tiny": ("transformer_block", 4, "decoder_input_ids (batch, 64)"),
    "vit_tiny": ("transformer_block", 2, "pixel_values (batch, 3, 32, 32) from config.image_size"),
}


def _capture(spec, **kw):
    loaded = load_model(spec, **kw)
    return loaded, autopar.capture(loaded.model, loaded.example_inputs, name=loaded.name)


@functools.lru_cache(maxsize=None)
def _captured(spec):
    """One capture per model file for the whole module (tests only read the graphs).
    T5 has no position limit (2048 by default); 64 keeps its four distinct blocks quick."""
    return _capture(spec, seq_len=64 if "t5" in spec else None)


@pytest.mark.parametrize("factory", sorted(HF))
def test_hf_model_captures_from_its_config_alone(factory):
    kind, blocks, note = HF[factory]
    loaded, graph = _captured(f"examples/hf_models.py:{factory}")
    assert note in loaded.inputs_note
    assert graph.total_params == sum(p.numel() for p in loaded.model.parameters())
    assert [l.kind for l in graph.layers].count(kind) == blocks
    assert graph.layers[0].kind == "embedding" and graph.layers[-1].kind == "head"
    block = next(l for l in graph.layers if l.kind == kind)
    config = loaded.model.config
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or config.num_heads
    assert block.attrs["heads"] == heads
    assert block.attrs["kv_heads"] == (getattr(config, "num_key_value_heads", None) or heads)
    for layer in graph.layers:  # every number is a finite non-negative value at the traced size
        for field in ("fwd_flops", "bwd_flops", "activation_bytes"):
            assert evaluate(getattr(layer, field), 2, graph.seq_len) >= 0


def test_llama_block_flops_equal_the_analytic_count():
    _, graph = _captured("examples/hf_models.py:llama_tiny")
    block = graph.layers[1]
    c = graph.layers[1].attrs
    expected = analytic.block(1, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, gated_mlp=True, norm="rmsnorm",
                              bias=False, fused_qkv=False, rope=True)
    assert (c["hidden"], c["ffn_hidden"]) == (64, 128)
    for b, s in ((1, 128), (4, 2048)):
        got, want = evaluate(block.fwd_flops, b, s), evaluate(expected.fwd_flops, b, s)
        assert abs(got - want) <= 0.01 * want
    assert block.params == expected.params


def test_grouped_query_sdpa_saves_kv_at_kv_heads():
    """HF Llama calls SDPA with enable_gqa=True: k/v are saved with kv_heads,
    not expanded; the same model with repeat_kv (eager GQA) saves more by
    exactly the expansion of k and v."""
    _, gqa = _captured("examples/hf_models.py:llama_tiny")
    block = gqa.layers[1]
    attention = [op for op in block.ops if op.kind == "attention"]
    assert len(attention) == 1 and evaluate(attention[0].bwd_flops, 1, 128) > 0  # backward maps to the kernel

    from transformers.integrations import sdpa_attention

    original = sdpa_attention.use_gqa_in_sdpa
    sdpa_attention.use_gqa_in_sdpa = lambda *a, **k: False  # the repeat_kv path
    try:
        _, repeated = _capture("examples/hf_models.py:llama_tiny")
    finally:
        sdpa_attention.use_gqa_in_sdpa = original
    b, s, heads, kv_heads, head_dim = 2, 128, 4, 2, 16
    expansion = 2 * b * s * (heads - kv_heads) * head_dim * 2  # k and v, bf16
    assert evaluate(repeated.layers[1].activation_bytes, b, s) - evaluate(block.activation_bytes, b, s) == expansion
    assert evaluate(repeated.layers[1].bwd_flops, b, s) == evaluate(block.bwd_flops, b, s)


def test_mixtral_experts_cost_top_k_expert_passes_per_token():
    """transformers runs Mixtral's experts as one grouped GEMM over the routed
    tokens: k expert MLPs (gate, up, down) per token."""
    _, graph = _captured("examples/hf_models.py:mixtral_tiny")
    block = graph.layers[1]
    h, f, k, experts, kv = 64, 128, 2, 4, 32
    per_token = 2 * (2 * h * h + 2 * h * kv) + 2 * h * experts + k * 2 * 3 * h * f
    assert evaluate(block.fwd_flops, 1, 128) == per_token * 128 + 4 * 128 * 128 * h
    assert block.attrs["experts"] == experts and block.attrs["top_k"] == k
    grouped = [op for op in block.ops if op.name == "mlp.experts:_grouped_mm"]
    assert grouped and grouped[0].kind == "gemm" and grouped[0].tp_sharded
    assert block.tp_allreduces == 2  # attention out-projection + expert down-projection


def test_t5_learned_position_bias_runs_as_memory_efficient_attention():
    _, graph = _captured("examples/hf_models.py:t5_tiny")
    names = [l.name for l in graph.layers]
    assert names[1:5] == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    kernels = {op.name.split(":")[-1] for l in graph.layers for op in l.ops if op.kind == "attention"}
    assert "_scaled_dot_product_efficient_attention" in kernels  # the bias takes a gradient
    assert "vocab_size" not in graph.layers[1].attrs  # the relative-position table is not a vocabulary
    assert graph.layers[0].attrs["vocab_size"] == graph.layers[-1].attrs["vocab_size"] == 256


def test_bert_head_projects_to_the_vocabulary():
    _, graph = _captured("examples/hf_models.py:bert_tiny")
    head = graph.layers[-1]
    assert head.name == "cls" and head.attrs["vocab_size"] == 256
    assert graph.layers[1].attrs["causal"] is False


def test_sliding_window_model_falls_back_to_a_local_fit():
    """Mistral builds a mask only past its window (64 < 128 here): costs are
    polynomial on each side of it, so capture fits near the traced length."""
    _, graph = _captured("examples/hf_models.py:mistral_tiny")
    assert any("fitted in s near 128" in note for note in graph.notes)
    assert S in graph.layers[1].fwd_flops.free_symbols


def test_nanogpt_as_written():
    loaded, graph = _captured("examples/nanogpt.py:nanogpt_tiny")
    assert "targets (batch, 64)" in loaded.inputs_note and "config.block_size 64" in loaded.inputs_note
    model = loaded.model
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    assert graph.layers[-1].shared_params == ["transformer.wte.weight"]  # tied lm_head counted once
    h, blocks = 64, [l for l in graph.layers if l.kind == "transformer_block"]
    assert len(blocks) == 2
    for b, s in ((1, 64), (3, 32)):  # 24 s h^2 + 4 s^2 h per sample
        assert evaluate(blocks[0].fwd_flops, b, s) == b * (24 * s * h * h + 4 * s * s * h)
    # the head runs the full-sequence logits and the loss, because targets were passed
    assert evaluate(graph.layers[-1].fwd_flops, 1, 64) == 2 * 64 * h * 256


def test_root_parameters_are_listed_in_module_paths():
    loaded, graph = _captured("examples/vit.py:vit_tiny")
    listed = [p for layer in graph.layers for p in layer.module_paths]
    for name, _ in loaded.model.named_parameters():
        assert any(name == p or name.startswith(p + ".") for p in listed), name
    assert {"class_token", "pos_embedding"} <= set(graph.layers[0].module_paths)


@pytest.mark.slow
@pytest.mark.parametrize("factory,params", [("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496),
                                            ("mixtral_8x7b", 46_702_792_704)])
def test_real_size_configs_capture_on_meta_without_weights(factory, params):
    code = ("import resource, sys; sys.path.insert(0, '.');"
            "from autopar.model_file import load_model; import autopar;"
            f"m = load_model('examples/hf_models.py:{factory}');"
            "g = autopar.capture(m.model, m.example_inputs);"
            "print(g.total_params, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    total, rss_mb = map(int, out.stdout.split()[-2:])
    assert total == params
    assert rss_mb < 1500  # no weight is ever allocated: a 70B model in bf16 would be 140 GB


def test_eager_moe_loop_over_hit_experts_is_refused_with_the_line_and_a_fix():
    from transformers import MixtralConfig, MixtralForCausalLM

    from autopar.capture.auto_inputs import infer_example_inputs
    from autopar.errors import CaptureError

    config = MixtralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=64, vocab_size=64, max_position_embeddings=64, num_local_experts=4)
    config._experts_implementation = "eager"  # `for expert_idx in expert_hit: if expert_idx == ...`
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    with pytest.raises(CaptureError) as info:
        autopar.capture(model, infer_example_inputs(model))
    err = info.value
    assert "module model.layers.0.mlp.experts" in err.message and "_local_scalar_dense" in err.message
    assert "modeling_mixtral.py" in err.message and "if expert_idx == self.num_experts" in err.message
    assert "range(num_experts)" in err.hint and err.__cause__ is None


def test_hf_mask_checks_are_answered_only_while_capturing():
    from transformers import masking_utils

    before = (masking_utils.find_packed_sequence_indices, masking_utils.fast_all,
              masking_utils._ignore_causal_mask_sdpa)
    _captured("examples/hf_models.py:llama_tiny")
    _capture("examples/hf_models.py:qwen2_tiny")
    assert (masking_utils.find_packed_sequence_indices, masking_utils.fast_all,
            masking_utils._ignore_causal_mask_sdpa) == before
    # a decoder with no padding keeps the causal flash path (no (s, s) mask is built)
    _, graph = _captured("examples/hf_models.py:llama_tiny")
    assert graph.layers[1].attrs["causal"] is True


@pytest.mark.slow
def test_plan_cli_on_a_file_with_only_a_model(capsys):
    import json

    from autopar.cli import main

    assert main(["plan", "examples/hf_models.py:llama_tiny", "--gpus", "8", "--device", "h100-sxm",
                 "--seq-len", "64", "--json", "--time-limit", "0.2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["seq_len"] == 64 and plan["model"]["total_params"] == 106_816
