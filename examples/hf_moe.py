"""Mixture-of-experts models at their published sizes (transformers configs), as a model file.

    autopar plan examples/hf_moe.py:mixtral_8x22b --gpus 256 --device h100 --batch-size 512 --seq-len 4096
    autopar plan examples/hf_moe.py:qwen3_235b_a22b --gpus 1024 --device h100 --batch-size 1024 --seq-len 4096
    autopar plan examples/hf_moe.py:deepseek_v3 --gpus 2048 --device h100 --batch-size 4096 --seq-len 4096

The autopar CLI builds every factory under `torch.device("meta")`: no weights
are allocated. The configs are the model cards' config.json values
(mistralai/Mixtral-8x22B-v0.1, Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3);
the router's load-balancing loss is off (output_router_logits=False, the
configs' default), which is what autopar's lowering trains.
"""
from __future__ import annotations

import transformers
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

transformers.logging.set_verbosity_error()


def mixtral_8x22b():
    """141B parameters, 39B active: 56 layers, 8 experts, top-2."""
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
        num_key_value_heads=8, max_position_embeddings=65536, rope_theta=1e6, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False))


def qwen3_235b_a22b():
    """235B parameters, 22B active: 94 layers, 128 experts, top-8."""
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, rope_theta=1e6, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False))


def deepseek_v3():
    """671B parameters, 37B active: 61 layers (the first 3 dense), 256 routed experts, top-8, one shared
    expert, multi-head latent attention. (Its multi-token-prediction module is not in transformers' model.)"""
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840, rope_theta=10000.0,
        tie_word_embeddings=False))


def mixtral_tiny():
    """The same structure at toy size, for tests."""
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2))
