"""The fusion pass on the example models: what it finds, and that a model
with the fused kernels (Triton, interpreter mode) trains like the original."""
import copy

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import AutoparError
from autopar.kernels.fusion import PATTERNS, apply_fusions, find_fusions, fusion_bytes
from cost_models.workload import B, S

from gpt import GPTConfig, GPT, gpt_tiny
from gpt import loss_fn as gpt_loss
from llama import llama_tiny


def _loss_and_grads(model, tokens, targets):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _fused_kernel_names(model):
    return sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused")})


@pytest.mark.parametrize("factory", [gpt_tiny, llama_tiny], ids=["gpt_tiny", "llama_tiny"])
def test_fused_model_matches_unfused(factory):
    torch.manual_seed(0)
    model, example_inputs = factory()
    reference = copy.deepcopy(model)
    fusions = find_fusions(model)
    names_before = [n for n, _ in model.named_parameters()]
    state_before = set(model.state_dict())
    fused = apply_fusions(model, fusions)
    assert [n for n, _ in fused.named_parameters()] == names_before
    assert set(fused.state_dict()) == state_before
    assert len(_fused_kernel_names(fused)) > 0 or factory is llama_tiny
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2, 16), generator=g)
    targets = torch.randint(0, 128, (2, 16), generator=g)
    want_loss, want_grads = _loss_and_grads(reference, tokens, targets)
    got_loss, got_grads = _loss_and_grads(fused, tokens, targets)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name], want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_gpt_chains_found_per_block():
    model, _ = gpt_tiny()
    fusions = find_fusions(model)
    per_block = {}
    for f in fusions:
        per_block.setdefault(f["layer"], set()).add(f["pattern"])
    for i in range(4):
        assert per_block[f"blocks.{i}"] == {"add_layernorm", "bias_gelu", "dropout_add"}
    head = [f for f in fusions if f["pattern"] == "linear_cross_entropy"]
    assert head and head[0]["modules"] == ["lm_head"] and head[0]["width"] == 128
    assert find_fusions(model) == fusions  # deterministic


def test_llama_chains_found_per_block():
    model, _ = llama_tiny()
    fusions = find_fusions(model)
    layer0 = {f["pattern"]: f for f in fusions if f["layer"] == "layers.0"}
    assert set(layer0) == {"add_rmsnorm", "swiglu"}
    assert layer0["add_rmsnorm"]["modules"] == ["layers.0.ffn_norm"] and layer0["add_rmsnorm"]["width"] == 32
    assert layer0["swiglu"]["width"] == 64


def test_fused_graph_calls_the_fused_modules():
    model, _ = gpt_tiny()
    fused = apply_fusions(model, find_fusions(model))
    block = fused.blocks[0]
    assert isinstance(block, torch.fx.GraphModule)
    assert isinstance(block.ln_2, nn.LayerNorm) and type(block.ln_2).__name__ == "FusedLayerNorm"
    assert isinstance(block.mlp.fc, nn.Linear) and type(block.mlp.fc).__name__ == "FusedLinear"
    code = block.code
    assert "gelu" not in code  # the activation moved into mlp.fc's kernel
    # attention stays a leaf call: its `self.training` check runs at call time
    assert "self.attn(" in code


def test_patterns_filter_and_only_listed_fusions_apply():
    model, _ = gpt_tiny()
    only = find_fusions(model, patterns=["bias_gelu"])
    assert {f["pattern"] for f in only} == {"bias_gelu"}
    fused = apply_fusions(model, only[:1])  # just blocks.0
    assert type(fused.blocks[0].mlp.fc).__name__ == "FusedLinear"
    assert type(fused.blocks[1].mlp.fc) is nn.Linear
    assert type(fused.blocks[0].ln_2) is nn.LayerNorm


def test_dropout_fused_in_training_is_seeded_and_drops():
    cfg = GPTConfig(vocab_size=64, seq_len=8, hidden=24, layers=2, heads=2, dropout=0.5)
    torch.manual_seed(0)
    model = GPT(cfg)
    fused = apply_fusions(copy.deepcopy(model), find_fusions(model))
    tokens = torch.randint(0, 64, (2, 8))
    fused.eval(), model.eval()
    torch.testing.assert_close(fused(tokens), model(tokens), rtol=1e-5, atol=1e-6)  # eval: no dropout
    fused.train()
    torch.manual_seed(5)
    a = fused(tokens)
    torch.manual_seed(5)
    b = fused(tokens)
    c = fused(tokens)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.isfinite(a).all()


class _HandAttention(nn.Module):
    """Attention written without SDPA: scale, causal mask, softmax."""

    def __init__(self, dim=16, seq=12):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = x.shape[1]
        att = (q @ k.transpose(-2, -1)) * 0.25
        att = att.masked_fill(self.mask[:s, :s], float("-inf"))
        return F.softmax(att, dim=-1) @ v


class _HandModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_HandAttention(), _HandAttention()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_scaled_causal_softmax_chain():
    torch.manual_seed(0)
    model = _HandModel()
    reference = copy.deepcopy(model)
    fusions = find_fusions(model)
    assert [f["pattern"] for f in fusions] == ["scaled_softmax", "scaled_softmax"]
    assert fusions[0]["params"] == {"scale": 0.25, "masked": True}
    fused = apply_fusions(model, fusions)
    assert "fused_masked_softmax" in fused.layers[0].code
    assert set(fused.state_dict()) == set(reference.state_dict())
    x = torch.randn(2, 12, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    fused(x).square().sum().backward()
    reference(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


def test_fusion_bytes_fused_moves_less():
    model, _ = gpt_tiny()
    for f in find_fusions(model):
        b = fusion_bytes(f, rows=4096, dtype_bytes=2)
        assert b["fwd_fused"] + b["bwd_fused"] < b["fwd_unfused"] + b["bwd_unfused"]
        assert b["saved"] > 0
    ln = next(f for f in find_fusions(model) if f["pattern"] == "add_layernorm")
    sym = fusion_bytes(ln, rows=B * S)
    assert sympy.simplify(sym["saved"] - 5 * B * S * 32 * 2) == 0  # (5+8) - (4+4) row-widths, bf16


def test_fusion_errors_are_actionable():
    with pytest.raises(AutoparError):
        find_fusions(gpt_tiny()[0], patterns=["nope"])
    with pytest.raises(AutoparError):
        apply_fusions(gpt_tiny()[0], [{"bad": 1}])
    with pytest.raises(AutoparError):
        fusion_bytes({"pattern": "scaled_softmax", "width": None}, rows=8)
    with pytest.raises(AutoparError):
        find_fusions("not a model")
    assert set(PATTERNS) >= {f["pattern"] for f in find_fusions(llama_tiny()[0])}
