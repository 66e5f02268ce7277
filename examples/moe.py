"""A small mixture-of-experts transformer (Mixtral-style) in plain PyTorch.

Each block is pre-norm attention followed by a sparse MoE feed-forward: a
linear router, top-k over experts, softmax over the chosen logits, and a
Python loop over experts that gathers each expert's tokens with
`torch.where(selected == i)` — the way the reference implementations write
it. Which tokens an expert gets depends on values, so tracers that need
static shapes cannot follow it; autopar.capture assumes balanced routing
(tokens * top_k / experts per expert) inside a top-k routed layer.

Presets: moe_tiny (tests), moe_small (8 experts, top-2: 653M parameters, about 200M active per token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MoEConfig:
    vocab_size: int = 32000
    seq_len: int = 2048
    dim: int = 1024
    layers: int = 8
    heads: int = 16
    experts: int = 8
    top_k: int = 2
    ffn_hidden: int = 2816
    norm_eps: float = 1e-5


PRESETS = {
    "moe_tiny": MoEConfig(vocab_size=128, seq_len=16, dim=32, layers=2, heads=4, experts=4, top_k=2, ffn_hidden=64),
    "moe_small": MoEConfig(),
}


class Expert(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = nn.ModuleList([Expert(cfg) for _ in range(cfg.experts)])

    def forward(self, x):
        b, s, d = x.shape
        tokens = x.view(-1, d)
        logits = self.gate(tokens)
        weights, selected = torch.topk(logits, self.top_k, dim=-1)
        weights = F.softmax(weights, dim=-1, dtype=torch.float).to(x.dtype)
        out = torch.zeros_like(tokens)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected == i)
            out = out.index_add(0, token_idx, weights[token_idx, slot, None] * expert(tokens[token_idx]))
        return out.view(b, s, d)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.heads = cfg.heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.moe_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = SparseMoE(cfg)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _factory(name: str):
    def make():
        cfg = PRESETS[name]
        return MoETransformer(cfg), lambda batch_size: example_inputs(batch_size, cfg)
    make.__name__ = name
    make.__doc__ = f"MoE preset {name}: {PRESETS[name]}"
    return make


for _name in PRESETS:
    globals()[_name] = _factory(_name)


def build_model(cfg: MoEConfig | None = None) -> nn.Module:
    """Default model of this file: moe_small (8 experts, top-2)."""
    return MoETransformer(cfg or PRESETS["moe_small"])


def example_inputs(batch_size: int, cfg: MoEConfig | None = None) -> tuple:
    cfg = cfg or PRESETS["moe_small"]
    return (torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
