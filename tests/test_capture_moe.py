"""MoE layers as people write them, recognised from the captured dataflow (capture/moe.py).

Tiny configs of transformers' Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 (shared
experts), DBRX (2-D fused experts), GPT-OSS (expert biases) and a hand-written
top-k router over an nn.ModuleList of experts (looped over all experts, or
over the experts hit, as transformers 4.x's Mixtral did), on the meta device.
Every number is computed here from the config (bf16: 2 bytes a parameter).
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from test_lower_expert_parallel import VOCAB, HandWritten, HandWrittenMoE, build

H, E, K = 32, 4, 2


class HitLoopMoE(HandWrittenMoE):
    """transformers 4.x's Mixtral loop: only the experts hit, indexed by a tensor."""

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(F.softmax(self.gate(flat), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(flat)
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(mask[e[0]])
            out = out.index_add(0, token, self.experts[e[0]](flat[token]) * weights[token, slot, None])
        return out.view_as(x)


def _hit_loop():
    model = HandWritten()
    torch.manual_seed(0)
    model.layers = nn.ModuleList(HitLoopMoE() for _ in range(2))
    return model


def _glu(ffn):  # gate, up, down of one expert, bf16
    return 3 * ffn * H * 2


def _two_linears(ffn):  # hand-written expert: Linear(H, ffn) and Linear(ffn, H) with biases
    return (2 * ffn * H + ffn + H) * 2


# arch -> (model, expert bytes, shared-expert bytes, router bytes, form, expert GEMM FLOPs per routed row)
CASES = {
    "mixtral": (lambda: build("mixtral"), E * _glu(48), 0, E * H * 2, "fused", 2 * 3 * 48 * H),
    "qwen3_moe": (lambda: build("qwen3_moe"), E * _glu(24), 0, E * H * 2, "fused", 2 * 3 * 24 * H),
    "olmoe": (lambda: build("olmoe"), E * _glu(24), 0, E * H * 2, "fused", 2 * 3 * 24 * H),
    "deepseek_v3": (lambda: build("deepseek_v3"), E * _glu(24), _glu(24), E * H * 2, "fused", 2 * 3 * 24 * H),
    "dbrx": (lambda: build("dbrx"), E * _glu(24), 0, E * H * 2, "fused", 2 * 3 * 24 * H),
    # gate_up (H, 2 ffn) + bias, down (ffn, H) + bias per expert; the router has a bias
    "gpt_oss": (lambda: build("gpt_oss"), E * (_glu(24) + (2 * 24 + H) * 2), 0, (E * H + E) * 2, "fused",
                2 * 3 * 24 * H),
    "hand": (lambda: build("hand"), E * _two_linears(24), 0, E * H * 2, "module_list", 2 * 2 * 24 * H),
    "hand_hit_loop": (_hit_loop, E * _two_linears(24), 0, E * H * 2, "module_list", 2 * 2 * 24 * H),
}


def _inputs(arch):
    if arch.startswith("hand"):
        return lambda b: (torch.zeros(b, 8, dtype=torch.long), torch.zeros(b, 8, dtype=torch.long))
    return (torch.zeros(2, 8, dtype=torch.long),)


@pytest.mark.parametrize("arch", list(CASES))
def test_moe_layers_are_recognised_with_their_sizes(arch, caplog):
    import autopar
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    make, expert_bytes, shared_bytes, router_bytes, form, row_flops = CASES[arch]
    graph = autopar.capture(make(), _inputs(arch))
    moe = [layer for layer in graph.layers if layer.kind == "moe_block"]
    assert len(moe) == 2, [layer.kind for layer in graph.layers]
    for layer in moe:
        a = layer.attrs
        assert (a["experts"], a["top_k"], a["moe_hidden"], a["experts_form"]) == (E, K, H, form), a
        assert a["expert_param_bytes"] == expert_bytes, a
        assert a["dense_param_bytes"] == layer.param_bytes - expert_bytes  # attention, norms, router, shared
        assert a["router_param_bytes"] == router_bytes, a
        assert (a["shared_experts"], a["shared_expert_param_bytes"]) == (bool(shared_bytes), shared_bytes), a
        # tokens x top_k rows per micro-batch, fitted in B and S
        for b, s in ((1, 8), (3, 8), (2, 5)):
            assert layer.eval("ep_routed_tokens", b, s) == b * s * K, (b, s, layer.ep_routed_tokens)
            # the experts' GEMMs on those rows (balanced routing), twice that backward
            assert layer.eval("ep_expert_fwd_flops", b, s) == b * s * K * row_flops, layer.ep_expert_fwd_flops
            assert layer.eval("ep_expert_bwd_flops", b, s) == 2 * b * s * K * row_flops, layer.ep_expert_bwd_flops
    dense = [layer for layer in graph.layers if layer.kind != "moe_block"]
    assert all(layer.ep_routed_tokens == 0 and "expert_param_bytes" not in layer.attrs for layer in dense)


def test_a_dense_decoder_has_no_moe_facts():
    import autopar
    from autopar.zoo.gpt import GPT, GPTConfig
    graph = autopar.capture(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, layers=2, heads=2)),
                            (torch.zeros(2, 16, dtype=torch.long),))
    assert all(layer.ep_routed_tokens == 0 and "experts" not in layer.attrs for layer in graph.layers)


def test_the_captured_numbers_price_the_ep_exchange():
    """capture -> cost: a captured Mixtral layer at 2 x 8 tokens moves 2 x 8 x top-2 rows of
    32 bf16 values per all-to-all, and each of 2 ep ranks keeps half the experts."""
    import autopar
    from cost_models.expert_parallel import MoeLayerShape, ep_layer_cost
    from cost_models.hardware import ClusterSpec
    graph = autopar.capture(build("mixtral"), _inputs("mixtral"))
    layer = next(layer for layer in graph.layers if layer.kind == "moe_block")
    shape = MoeLayerShape.from_layer(layer, 2, 8, graph.dtype_bytes)
    cost = ep_layer_cost(shape, 2, ClusterSpec.preset("dgx-h100"))
    assert cost.send_bytes == 2 * 8 * K * H * 2
    assert cost.param_bytes_per_rank == E * _glu(48) / 2 + layer.param_bytes - E * _glu(48)
    assert cost.expert_flops_per_rank == 3 * 2 * 8 * K * 2 * 3 * 48 * H
    with pytest.raises(Exception, match="carries no MoE facts"):
        MoeLayerShape.from_layer(graph.layers[0], 2, 8, 2)
