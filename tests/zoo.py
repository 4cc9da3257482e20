"""Small models built from torch.nn only, for capture tests."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (16, 32, 32, 10), dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for fan_in, fan_out in itertools.pairwise(sizes[:-1]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU(inplace=True), nn.Dropout(dropout)]
        layers.append(nn.Linear(sizes[-2], sizes[-1]))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Convolutions with BatchNorm, max and average pooling, and a linear classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, groups=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class Regression(nn.Module):
    """Returns its own loss (no loss_fn); has frozen, shared (used twice) and unused layers."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.encode(torch.tanh(self.encode(x)))
        return F.mse_loss(self.frozen(h), y)
