"""ResNet-50 (He et al. 2016) in plain PyTorch, laid out like torchvision's:
stem (conv1, bn1, relu, maxpool), four stages `layer1..layer4` of Bottleneck
blocks (the first block of a stage downsamples through a 1x1 conv), global
average pool and a linear classifier. The model knows nothing about autopar;
`dataset()` lends autopar's stand-in image set to the training job.

Presets: resnet_tiny (tests), resnet50, resnet101.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ResNetConfig:
    blocks: tuple = (3, 4, 6, 3)
    width: int = 64  # channels of the stem; stage i has width * 2**i mid channels
    num_classes: int = 1000
    image_size: int = 224


PRESETS = {
    "resnet_tiny": ResNetConfig(blocks=(1, 2, 1, 1), width=8, num_classes=10, image_size=64),
    "resnet50": ResNetConfig(blocks=(3, 4, 6, 3)),
    "resnet101": ResNetConfig(blocks=(3, 4, 23, 3)),
}


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, mid: int, stride: int = 1):
        super().__init__()
        out = mid * self.expansion
        self.conv1 = nn.Conv2d(in_ch, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.conv1 = nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = w
        for i, n in enumerate(cfg.blocks):
            mid = w * 2 ** i
            stage = []
            for j in range(n):
                stage.append(Bottleneck(in_ch, mid, stride=2 if (j == 0 and i > 0) else 1))
                in_ch = mid * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, cfg.num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _factory(name: str):
    def make():
        cfg = PRESETS[name]
        return ResNet(cfg), lambda batch_size: example_inputs(batch_size, cfg)
    make.__name__ = name
    make.__doc__ = f"ResNet preset {name}: {PRESETS[name]}"
    return make


for _name in PRESETS:
    globals()[_name] = _factory(_name)


def build_model(cfg: ResNetConfig | None = None) -> nn.Module:
    """Default model of this file: ResNet-50."""
    return ResNet(cfg or PRESETS["resnet50"])


def example_inputs(batch_size: int, cfg: ResNetConfig | None = None) -> tuple:
    cfg = cfg or PRESETS["resnet50"]
    return (torch.randn(batch_size, 3, cfg.image_size, cfg.image_size),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits, targets)


def dataset(model):
    """What `train.py` trains on without --data: autopar's stand-in image set (10
    classes of gratings, made on the fly) at this model's image size. For real
    images return e.g. torchvision.datasets.ImageFolder(root, transform=...) here."""
    from autopar.train.data import StripeImages
    return StripeImages(model.cfg.image_size, classes=model.cfg.num_classes)
