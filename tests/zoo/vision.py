"""Convolutional models: a small CNN with BatchNorm (and optionally Dropout) whose top-level children run
one after another with a flatten in forward (so a pipeline traces it), and torchvision's ResNet-50 at
32x32 (BatchNorm everywhere, residual blocks grouped into layer1..layer4)."""

from __future__ import annotations

import torch
from torch import nn

from .case import seeded
from .data import CLASSES


class SmallCNN(nn.Module):
    def __init__(self, dropout: float = 0.0, classes: int = CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.bn2 = nn.BatchNorm2d(16)
        self.act2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(2)
        if dropout > 0:  # no placeholder child otherwise: the BatchNorm-only variant has no dropout at all
            self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(16 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        x = torch.flatten(self.pool(self.act2(self.bn2(self.conv2(x)))), 1)
        return self.fc(self.drop(x) if hasattr(self, "drop") else x)


def build_cnn(seed: int, dropout: float = 0.0) -> SmallCNN:
    with seeded(seed):
        return SmallCNN(dropout)


def build_resnet50(seed: int) -> nn.Module:
    from torchvision.models import resnet50

    with seeded(seed):
        return resnet50(num_classes=CLASSES, zero_init_residual=True)  # stable at lr 0.01 from the first step
