"""Context-parallel facts read off a captured layer (autopar/capture/cp_facts.py)
and the lowering's refusal from them (context_parallel.graph_refusal)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.capture import capture
from autopar.lower.context_parallel import graph_refusal
from test_lower_context_parallel import _hf_llama, _zoo_llama

KEYS = ("attention", "attn_mask", "position_mixing", "cp_kv_elems_per_token", "causal")
CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


class _MaskedBlock(nn.Module):
    """GPT-style attention given an explicit boolean mask instead of is_causal."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.o(y.transpose(1, 2).reshape(b, t, 32))


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(64, 32), nn.ModuleList([_MaskedBlock()]), nn.Linear(32, 64)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _facts(model):
    graph = capture(model, (torch.randint(0, 64, (2, 16)),), dtype="fp32")
    return graph, [{k: layer.attrs.get(k) for k in KEYS} for layer in graph.layers if "heads" in layer.attrs]


def test_cp_facts_and_refusals_from_the_graph():
    # zoo Llama: 4 heads of 8 after repeat_kv (kv_heads 2): the ring moves what SDPA reads
    graph, facts = _facts(_zoo_llama())
    assert facts == [{"attention": "sdpa", "attn_mask": False, "position_mixing": [CPU_FLASH],
                      "cp_kv_elems_per_token": 2 * 4 * 8, "causal": True}] * 2
    assert graph_refusal(graph) is None
    graph, facts = _facts(_Masked())
    assert facts[0]["attn_mask"] is True and facts[0]["causal"] is False
    assert "mask tensor" in graph_refusal(graph)
    graph, facts = _facts(_hf_llama("eager"))
    assert facts[0]["attention"] == "eager" and facts[0]["position_mixing"] == ["aten._softmax"]
    assert "by hand" in graph_refusal(graph, positions_handled=True)  # a transformers model


def test_a_captured_layer_priced_under_cp():
    """capture -> cost: the zoo Llama's block, fitted in B and S, priced at 8192 tokens
    under cp 2 (cost_models/context_parallel.attention_layer_shape feeds cp_layer_cost)."""
    import pytest

    from cost_models.compute import op_times
    from cost_models.context_parallel import attention_layer_shape, cp_layer_cost
    from cost_models.errors import CostModelError
    from cost_models.hardware import ClusterSpec
    graph, _ = _facts(_zoo_llama())
    cluster = ClusterSpec.preset("dgx-h100", nodes=1)
    block = graph.layers[1]
    shape = attention_layer_shape(block, 1, 8192, cluster, byte_scale=0.5)  # captured fp32, trained bf16
    attention = [op for op in block.ops if op.kind == "attention"]
    assert len(attention) == 1 and shape.kv_elems_per_token == 64
    want = op_times(attention[0], 1, 8192, cluster.device_profile, byte_scale=0.5)
    assert (shape.attn_fwd_s, shape.attn_bwd_s) == pytest.approx(want)
    assert shape.activation_bytes == pytest.approx(block.eval("activation_bytes", 1, 8192) * 0.5)
    cost = cp_layer_cost(shape, 2, cluster)
    assert cost.kv_shard_bytes == 4096 * 64 * 2  # 1 x 8192 / 2 tokens x 64 elements x 2 bytes
    assert cost.activation_bytes_per_rank == pytest.approx(shape.activation_bytes / 2)
    with pytest.raises(CostModelError, match="tok_embeddings"):
        attention_layer_shape(graph.layers[0], 1, 8192, cluster)


def test_positions_counted_in_the_forward_are_refused():
    from autopar.lower.context_parallel import refusal
    from autopar.zoo.gpt import GPT, GPTConfig

    class ArangeGPT(GPT):  # positions made in the forward, not kept in a buffer
        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    model = ArangeGPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, layers=1, heads=4))
    graph, _ = _facts(model)
    assert graph.layers[0].attrs.get("arange_positions") is True
    assert "torch.arange" in refusal(model, 16, 2, graph=graph)
    assert graph_refusal(_facts(_zoo_llama())[0]) is None  # buffers, no arange
    hf = _hf_llama()
    hf_graph, _ = _facts(hf)
    assert any(layer.attrs.get("arange_positions") for layer in hf_graph.layers)
    assert refusal(hf, 16, 2, graph=hf_graph) is None  # transformers' positions are handed over
