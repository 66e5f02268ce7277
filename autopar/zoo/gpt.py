"""GPT (GPT-2 / GPT-3 family) in plain PyTorch, written the way people write it.

Nothing here knows about autopar: a fused qkv projection split by the full
hidden size, heads reshaped with the full head count, residual adds, learned
position embeddings, and the output head tied to the token embedding.

Model-file convention (used by `autopar inspect/plan/compile`):
  build_model() -> nn.Module, example_inputs(batch_size) -> tuple,
  plus one factory per preset, selected as `examples/gpt.py:gpt3_175b`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    seq_len: int = 1024
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    ffn_mult: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    # "sdpa": F.scaled_dot_product_attention (flash on GPUs); "math": softmax(QK^T/sqrt(d))V
    # written out, as in the Megatron paper's activation analysis (saves the s x s scores).
    attention_impl: str = "sdpa"


PRESETS = {
    "gpt_tiny": GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=4, heads=4),
    "gpt2_small": GPTConfig(hidden=768, layers=12, heads=12),
    "gpt2_medium": GPTConfig(hidden=1024, layers=24, heads=16),
    "gpt2_xl": GPTConfig(hidden=1600, layers=48, heads=25),
    "gpt3_1_3b": GPTConfig(seq_len=2048, hidden=2048, layers=24, heads=16),
    "gpt3_6_7b": GPTConfig(seq_len=2048, hidden=4096, layers=32, heads=32),
    "gpt3_13b": GPTConfig(seq_len=2048, hidden=5120, layers=40, heads=40),
    "gpt3_175b": GPTConfig(seq_len=2048, hidden=12288, layers=96, heads=96),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.hidden = cfg.hidden
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = cfg.dropout
        self.attention_impl = cfg.attention_impl
        if cfg.attention_impl == "math":
            self.attn_drop = nn.Dropout(cfg.dropout)
            # True above the diagonal: the future positions a token may not see.
            self.register_buffer("future", torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1),
                                 persistent=False)
        elif cfg.attention_impl != "sdpa":
            raise ValueError(f"attention_impl must be 'sdpa' or 'math', got {cfg.attention_impl!r}")

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q = q.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        k = k.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        v = v.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        if self.attention_impl == "math":
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
            scores = scores.masked_fill(self.future[:s, :s], float("-inf"))
            y = self.attn_drop(F.softmax(scores, dim=-1)) @ v
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_mult * cfg.hidden)
        self.proj = nn.Linear(cfg.ffn_mult * cfg.hidden, cfg.hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        x = x + self.drop(self.mlp(self.ln_2(x)))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.register_buffer("pos", torch.arange(cfg.seq_len), persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        b, s = idx.shape
        x = self.drop(self.wte(idx) + self.wpe(self.pos[:s]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _factory(name: str):
    def make():
        cfg = PRESETS[name]
        return GPT(cfg), lambda batch_size: example_inputs(batch_size, cfg)
    make.__name__ = name
    make.__doc__ = f"GPT preset {name}: {PRESETS[name]}"
    return make


for _name in PRESETS:
    globals()[_name] = _factory(_name)


def build_model(cfg: GPTConfig | None = None) -> nn.Module:
    """Default model of this file: GPT-2 small."""
    return GPT(cfg or PRESETS["gpt2_small"])


def example_inputs(batch_size: int, cfg: GPTConfig | None = None) -> tuple:
    cfg = cfg or PRESETS["gpt2_small"]
    return (torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
