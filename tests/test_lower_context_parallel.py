"""Context parallelism's refusals and position finding (autopar/lower/context_parallel.py),
checked without ranks. cp running and matching one process, from a Plan through
`autopar.compile`, is tests/test_lower_cp_plan.py (zoo Llama and GPT, transformers' Llama,
GPT-2 and Mistral; with tp and dp).
"""
from __future__ import annotations

import pytest
import torch


def _zoo_llama(layers: int = 2):
    from autopar.zoo.llama import Llama, LlamaConfig
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, seq_len=16, dim=32, layers=layers, heads=4, kv_heads=2, ffn_hidden=64))


def _hf_llama(attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg)


def _zoo_gpt():
    from autopar.zoo.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, layers=2, heads=4))


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


def _hf_mistral():
    """A sliding window (32) longer than the 16-token sequence masks nothing, so cp runs
    it (transformers itself then passes is_causal)."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=32)
    cfg._attn_implementation = "sdpa"
    return MistralForCausalLM(cfg)


# name -> (model, a Hugging Face model: labels shifted by the model, called with use_cache=False)

def test_refusals_name_the_reason():
    from types import SimpleNamespace

    from autopar.errors import PlanMismatchError
    from autopar.lower import context_parallel as cp
    model = _zoo_llama()
    assert cp.refusal(model, 16, 1) is None and cp.refusal(model, 16, 2) is None
    assert "2 x cp = 4 equal chunks" in cp.refusal(model, 18, 2)
    assert "attention mask" in cp.refusal(model, 16, 2, n_inputs=2)
    assert "attn_implementation='sdpa'" in cp.refusal(_hf_llama("eager"), 16, 2)
    windowed = _hf_llama()
    windowed.config.sliding_window = 8
    assert "sliding-window" in cp.refusal(windowed, 16, 2)
    windowed.config.sliding_window = 16  # a window as long as the sequence masks nothing
    assert cp.refusal(windowed, 16, 2) is None
    no_positions = _hf_gpt2()
    no_positions.transformer.wpe = torch.nn.Embedding(66, 32)  # offset positions, OPT-style
    assert "number its tokens from 0" in cp.refusal(no_positions, 16, 2)
    masked = _zoo_llama()
    masked.register_buffer("causal_mask", torch.ones(16, 16).tril())
    assert "causal_mask" in cp.refusal(masked, 16, 2)
    with pytest.raises(PlanMismatchError, match="equal chunks"):
        cp.check(model, 18, 2)

    def graph(**attrs):
        return SimpleNamespace(layers=[SimpleNamespace(name="embed", attrs={}),
                                       SimpleNamespace(name="layers.0", attrs={"heads": 4, **attrs})])
    assert cp.graph_refusal(graph(attention="sdpa", causal=True, attn_mask=False)) is None
    assert "by hand" in cp.graph_refusal(graph(attention="eager", causal=None))
    assert "mask tensor" in cp.graph_refusal(graph(attention="sdpa", causal=False, attn_mask=True))
    assert "non-causal" in cp.graph_refusal(graph(attention="sdpa", causal=False, attn_mask=False))


def test_position_tables_found():
    from autopar.lower import context_parallel as cp
    found = sorted(name for _, name in cp.position_tables(_zoo_llama(), 16))
    assert found == ["rope_cos", "rope_sin"]
    assert [name for _, name in cp.position_tables(_zoo_gpt(), 16)] == ["pos"]  # position ids
    assert cp.position_tables(_hf_llama(), 16) == []  # its positions enter through the rotary hook
    rotaries, tables = cp.position_modules(_hf_llama())
    assert [type(m).__name__ for m in rotaries] == ["LlamaRotaryEmbedding"] and tables == []
    gpt2 = _hf_gpt2()
    assert cp.position_modules(gpt2) == ([], [gpt2.transformer.wpe])
