"""Vision Transformer (ViT, Dosovitskiy et al. 2021) in plain PyTorch.

Written the way the common implementations write it: a strided Conv2d patch
embedding, a learned class token and position embedding held directly as
parameters of the root module, pre-norm encoder blocks built on
nn.MultiheadAttention, and a linear classification head on the class token.
The model knows nothing about autopar; `dataset()` lends autopar's stand-in
image set to the training job.

Presets: vit_tiny (tests), vit_b_16 (86M), vit_l_16, vit_h_14 (632M).
Model-file convention: build_model(), example_inputs(batch_size), and one
factory per preset (`examples/vit.py:vit_h_14`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    mlp_dim: int = 3072
    num_classes: int = 1000
    dropout: float = 0.0


PRESETS = {
    "vit_tiny": ViTConfig(image_size=32, patch_size=8, hidden=32, layers=3, heads=4, mlp_dim=64, num_classes=10),
    "vit_b_16": ViTConfig(patch_size=16, hidden=768, layers=12, heads=12, mlp_dim=3072),
    "vit_l_16": ViTConfig(patch_size=16, hidden=1024, layers=24, heads=16, mlp_dim=4096),
    "vit_h_14": ViTConfig(patch_size=14, hidden=1280, layers=32, heads=16, mlp_dim=5120),
}


class EncoderBlock(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(cfg.hidden, cfg.heads, dropout=cfg.dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden, cfg.mlp_dim), nn.GELU(), nn.Dropout(cfg.dropout),
            nn.Linear(cfg.mlp_dim, cfg.hidden), nn.Dropout(cfg.dropout),
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + self.dropout(y)
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image_size {cfg.image_size} is not a multiple of patch_size {cfg.patch_size}")
        self.cfg = cfg
        patches = (cfg.image_size // cfg.patch_size) ** 2
        self.conv_proj = nn.Conv2d(cfg.channels, cfg.hidden, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.pos_embedding = nn.Parameter(torch.empty(1, patches + 1, cfg.hidden).normal_(std=0.02))
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList([EncoderBlock(cfg) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.head = nn.Linear(cfg.hidden, cfg.num_classes)

    def forward(self, images):
        x = self.conv_proj(images)  # (b, hidden, h/p, w/p)
        x = x.flatten(2).transpose(1, 2)  # (b, patches, hidden)
        cls = self.class_token.expand(x.shape[0], -1, -1)
        x = self.dropout(torch.cat([cls, x], dim=1) + self.pos_embedding)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x)[:, 0])


def _factory(name: str):
    def make():
        cfg = PRESETS[name]
        return ViT(cfg), lambda batch_size: example_inputs(batch_size, cfg)
    make.__name__ = name
    make.__doc__ = f"ViT preset {name}: {PRESETS[name]}"
    return make


for _name in PRESETS:
    globals()[_name] = _factory(_name)


def build_model(cfg: ViTConfig | None = None) -> nn.Module:
    """Default model of this file: ViT-B/16."""
    return ViT(cfg or PRESETS["vit_b_16"])


def example_inputs(batch_size: int, cfg: ViTConfig | None = None) -> tuple:
    cfg = cfg or PRESETS["vit_b_16"]
    return (torch.randn(batch_size, cfg.channels, cfg.image_size, cfg.image_size),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits, targets)


def dataset(model):
    """What `train.py` trains on without --data: autopar's stand-in image set (10
    classes of gratings, made on the fly) at this model's image size. For real
    images return e.g. torchvision.datasets.ImageFolder(root, transform=...) here."""
    from autopar.train.data import StripeImages
    return StripeImages(model.cfg.image_size, classes=model.cfg.num_classes)
