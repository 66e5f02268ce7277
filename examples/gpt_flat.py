"""GPT written Megatron-style: each block holds its Linears directly.

No attention or MLP sub-module: the block's own `forward` calls ln_1, qkv,
proj, ln_2, fc1 and fc2, all direct children of the block. The fused qkv
projection is viewed as (heads, 3 * head_dim) before it is split into q, k
and v, as Megatron-LM lays it out (each head's q, k and v side by side), so a
column split of qkv keeps whole heads on each tp rank. `qkv_layout="split"`
splits the fused output by the full hidden size first (GPT-2's layout).
Causal attention by F.scaled_dot_product_attention; the head is tied to the
token embedding unless `tie_embeddings=False`.

Nothing here knows about autopar. Model-file convention as examples/gpt.py:
    autopar plan examples/gpt_flat.py:gpt3_175b --gpus 1024 --device a100-80g --batch-size 1536
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class FlatGPTConfig:
    vocab_size: int = 51200
    seq_len: int = 1024
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    ffn_mult: int = 4
    tie_embeddings: bool = True
    qkv_layout: str = "heads"  # "heads": Megatron's (heads, 3 * head_dim); "split": GPT-2's split by hidden


PRESETS = {
    "gpt_flat_tiny": FlatGPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=4, heads=4),
    "gpt3_1_3b": FlatGPTConfig(seq_len=2048, hidden=2048, layers=24, heads=16),
    # Megatron-LM's 3.6B weak-scaling point (Narayanan et al. 2021, table 1)
    "gpt_3_6b": FlatGPTConfig(seq_len=2048, hidden=3072, layers=30, heads=32),
    "gpt3_175b": FlatGPTConfig(seq_len=2048, hidden=12288, layers=96, heads=96),
}


class Block(nn.Module):
    def __init__(self, cfg: FlatGPTConfig):
        super().__init__()
        h = cfg.hidden
        self.heads, self.qkv_layout = cfg.heads, cfg.qkv_layout
        self.ln_1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, cfg.ffn_mult * h)
        self.fc2 = nn.Linear(cfg.ffn_mult * h, h)

    def forward(self, x):
        b, s, h = x.shape
        d = h // self.heads
        qkv = self.qkv(self.ln_1(x))
        if self.qkv_layout == "heads":
            q, k, v = qkv.view(b, s, self.heads, 3 * d).split(d, dim=-1)
        else:
            q, k, v = (t.view(b, s, self.heads, d) for t in qkv.split(h, dim=-1))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x)), approximate="tanh"))


class FlatGPT(nn.Module):
    def __init__(self, cfg: FlatGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        s = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _factory(name: str):
    def make():
        cfg = PRESETS[name]
        return FlatGPT(cfg), lambda batch_size: example_inputs(batch_size, cfg)
    make.__name__ = name
    make.__doc__ = f"flat-block GPT preset {name}: {PRESETS[name]}"
    return make


for _name in PRESETS:
    globals()[_name] = _factory(_name)


def build_model(cfg: FlatGPTConfig | None = None) -> nn.Module:
    """Default model of this file: the 1.3B preset."""
    return FlatGPT(cfg or PRESETS["gpt3_1_3b"])


def example_inputs(batch_size: int, cfg: FlatGPTConfig | None = None) -> tuple:
    cfg = cfg or PRESETS["gpt3_1_3b"]
    return (torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
