"""Architectures a user tried that the matrix lacked (issue 29), built as their authors write them.

  resnet_bn      examples/resnet.py's ResNet: BatchNorm (synchronised over dp; micro-batching refused)
  convnext       a user's ConvNeXt: depthwise conv, channels-last LayerNorm + Linear pair (permuted
                 block outputs handed between pipeline stages)
  dict_lm        a user's LM returning {"logits": ..., "aux": ...}
  deberta        transformers' DebertaV2ForMaskedLM (disentangled attention)
  albert         transformers' AlbertForMaskedLM (one shared layer applied N times: no block stack)
  dbrx           transformers' DbrxForCausalLM (fused experts, an eager loop over the experts hit)
  xstyle_lm      x-transformers' layout: layers as ModuleLists [norms, block, residual] the decoder
                 walks itself, autocast switched off by the input's device
The flat-block GPT (Megatron-style, tied head) is `ex_gpt_flat` in archs.py.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from arch_kit import (HEADS, HIDDEN, KV_HEADS, LAYERS, SEED, VOCAB, Arch, _gen, _masked_lm, _random_labels,
                      _tokens, token_cross_entropy)

_EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


def _images(size: int, classes: int):
    def images(batch, generator=None):
        return (torch.randn(batch, 3, size, size, generator=_gen(generator)),)

    def labels(inputs, generator):
        return torch.randint(0, classes, (inputs[0].shape[0],), generator=generator)
    return images, labels


def resnet_bn():
    """In fp64: at the matrix's lr 0.5 this ResNet diverges (loss 2.25 -> 16 in 3
    steps) and BatchNorm over 8 samples (2 x 2 pixels in the last stage)
    amplifies fp32 rounding ~1e4-fold: torch's kernel against the same
    arithmetic summed in another order ends 5.8e-3 apart in one process, which
    no distributed run can beat. In fp64 rounding stays ~1e-11 while a semantic
    difference does not shrink (per-rank statistics instead of the dp group's
    end 1e-2 off), so the check still tells one from the other."""
    if _EXAMPLES not in sys.path:
        sys.path.insert(0, _EXAMPLES)
    import resnet
    torch.manual_seed(SEED)
    model, _ = resnet.resnet_tiny()
    images, labels = _images(resnet.PRESETS["resnet_tiny"].image_size, resnet.PRESETS["resnet_tiny"].num_classes)

    def images64(batch, generator=None):
        return tuple(t.double() for t in images(batch, generator))
    return Arch(model.double(), images64, labels, resnet.loss_fn)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):  # x: (N, C, H, W)
        y = self.dwconv(x).permute(0, 2, 3, 1)  # channels last
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)  # a non-contiguous (permuted) output


class ConvNeXt(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, stride=4)
        self.blocks = nn.ModuleList(ConvNeXtBlock(dim) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x.mean((-2, -1))))


def convnext():
    torch.manual_seed(SEED)
    images, labels = _images(16, 10)
    return Arch(ConvNeXt(), images, labels, F.cross_entropy)


class DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, h = x.shape
        y = self.ln1(x)
        q, k, v = (f(y).view(b, s, HEADS, h // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class DictLM(nn.Module):
    """Returns a dict, as research code often does; the logits under "logits"."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(DictBlock() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return {"logits": self.head(x), "hidden": x}


def dict_lm():
    torch.manual_seed(SEED)
    return Arch(DictLM(), _tokens(), _random_labels(), token_cross_entropy)


class _XAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(3))
        self.to_out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, HEADS, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        with torch.autocast(x.device.type, enabled=False):  # as x-transformers' rotary embedding
            q = q.float() / math.sqrt(1.0)
        return self.to_out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))


class _XFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x):
        return self.ff(x)


class _XResidual(nn.Module):
    def forward(self, out, residual):
        return out + residual


class XStyleLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.ModuleList([nn.LayerNorm(HIDDEN)]), _XAttention() if i % 2 == 0 else _XFeedForward(),
                           _XResidual()]) for i in range(LAYERS))
        self.final_norm = nn.LayerNorm(HIDDEN)
        self.to_logits = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.token_emb(idx)
        for norms, block, residual in self.layers:
            x = residual(block(norms[0](x)), x)
        return self.to_logits(self.final_norm(x))


def xstyle_lm():
    torch.manual_seed(SEED)
    return Arch(XStyleLM(), _tokens(), _random_labels(), token_cross_entropy)


DBRX = dict(d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS, max_seq_len=64, vocab_size=VOCAB,
            ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
            attn_config={"kv_n_heads": KV_HEADS, "rope_theta": 10000.0, "clip_qkv": 8.0})


def dbrx():
    from arch_kit import _tf
    tf = _tf()
    torch.manual_seed(SEED)
    return Arch(tf.DbrxForCausalLM(tf.DbrxConfig(**DBRX)), _tokens(), _random_labels(), None)


ARCHS = {
    "resnet_bn": resnet_bn,
    "convnext": convnext,
    "dict_lm": dict_lm,
    "deberta": _masked_lm("DebertaV2Config", "DebertaV2ForMaskedLM", hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0),
    "albert": _masked_lm("AlbertConfig", "AlbertForMaskedLM", embedding_size=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0),
    "dbrx": dbrx,
    "xstyle_lm": xstyle_lm,
}
FAMILY = {"resnet_bn": "vision (BatchNorm)", "convnext": "vision", "dict_lm": "user code", "deberta": "encoder (MLM)",
          "albert": "encoder (MLM)", "dbrx": "MoE causal LM", "xstyle_lm": "other library"}
NEEDS = {"deberta": ("DebertaV2Config", "DebertaV2ForMaskedLM"), "albert": ("AlbertConfig", "AlbertForMaskedLM"),
         "dbrx": ("DbrxConfig", "DbrxForCausalLM")}
