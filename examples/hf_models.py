"""Hugging Face transformers models, as a model file: factories only.

    autopar inspect examples/hf_models.py:llama_tiny
    autopar plan examples/hf_models.py:llama3_8b --gpus 64
    autopar plan examples/hf_models.py:mixtral_8x7b --gpus 256 --seq-len 4096

Each factory builds the model from a config, the way a training script does
(`LlamaForCausalLM(LlamaConfig(...))`), and defines no example inputs:
autopar infers them from the model (token ids of shape (batch, seq) in
[0, vocab_size), with labels so the model's own loss is costed; an all-ones
attention mask for encoders; decoder ids for encoder-decoders; pixel values
for vision models). The sequence length is --seq-len, else
min(max_position_embeddings, 2048).

The autopar CLI builds every factory under `torch.device("meta")`, so the
real-size presets (Llama-3 70B / 405B, Mixtral 8x7B) allocate no weights.
The real-size configs are the published ones (the model cards' config.json);
`*_tiny` presets keep the same structure at toy sizes for tests.
"""
from __future__ import annotations

import transformers
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, T5Config, T5ForConditionalGeneration, ViTConfig,
                          ViTForImageClassification)

# Building from a config logs the generation defaults at INFO/WARNING; a plan's output is not the place.
transformers.logging.set_verbosity_error()

_TINY_DECODER = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=256, max_position_embeddings=128)


# -- decoder-only LMs ---------------------------------------------------------------
def gpt2_tiny():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128))


def gpt2_xl():
    """GPT-2 XL, 1.56B: learned positions (1024), tied lm_head, fused c_attn."""
    return GPT2LMHeadModel(GPT2Config(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024))


def llama_tiny():
    return LlamaForCausalLM(LlamaConfig(**_TINY_DECODER))


def llama3_8b():
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False))


def llama3_70b():
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False))


def llama3_405b():
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False))


def mistral_tiny():
    return MistralForCausalLM(MistralConfig(**_TINY_DECODER, sliding_window=64))


def mistral_7b():
    """Mistral-7B-v0.1: sliding-window attention (4096)."""
    return MistralForCausalLM(MistralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096))


def qwen2_tiny():
    return Qwen2ForCausalLM(Qwen2Config(**_TINY_DECODER))


def qwen2_7b():
    """Qwen2-7B: q/k/v biases, 28 heads over 4 kv heads."""
    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
        tie_word_embeddings=False))


def mixtral_tiny():
    return MixtralForCausalLM(MixtralConfig(**_TINY_DECODER, num_local_experts=4, num_experts_per_tok=2))


def mixtral_8x7b():
    """Mixtral-8x7B: 8 experts, top-2 routing (data-dependent; capture assumes balanced routing)."""
    return MixtralForCausalLM(MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, num_local_experts=8,
        num_experts_per_tok=2, rope_theta=1000000.0))


# -- encoders, encoder-decoders, vision ----------------------------------------------
def bert_tiny():
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      intermediate_size=128, vocab_size=256, max_position_embeddings=128))


def bert_large():
    return BertForMaskedLM(BertConfig(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                                      intermediate_size=4096, vocab_size=30522, max_position_embeddings=512))


def t5_tiny():
    return T5ForConditionalGeneration(T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16,
                                               num_heads=4, d_ff=128, vocab_size=256))


def t5_large():
    """T5 v1.0 large, 738M: relative position bias (learned, so attention takes a bias gradient)."""
    return T5ForConditionalGeneration(T5Config(num_layers=24, num_decoder_layers=24, d_model=1024, d_kv=64,
                                               num_heads=16, d_ff=4096, vocab_size=32128))


def vit_tiny():
    return ViTForImageClassification(ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                               intermediate_size=128, image_size=32, patch_size=8,
                                               num_labels=10))


def vit_huge():
    """ViT-H/14 at 224 x 224, 1000 classes."""
    return ViTForImageClassification(ViTConfig(num_hidden_layers=32, hidden_size=1280, num_attention_heads=16,
                                               intermediate_size=5120, image_size=224, patch_size=14,
                                               num_labels=1000))


def build_model():
    return llama_tiny()
