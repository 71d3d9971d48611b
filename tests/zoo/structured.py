"""Models by the shape of the values between their layers: a plain nn.Sequential MLP (one tensor from
layer to layer: the control every strategy handles), the same as a small language model whose output
layer is tied to its embedding (a tie with no other hurdle), a dict-in / dict-out classifier
(`forward(inputs: dict[str, Tensor]) -> {"logits": ...}`, with a padding mask), and an nn.Sequential
whose layers hand tuples (hidden, skip) to each other."""

from __future__ import annotations

import torch
from torch import nn

from .case import seeded
from .data import VOCAB


class DictClassifier(nn.Module):
    """{"input_ids": (b, t) long, "mask": (b, t) float} -> {"logits": (b, classes)} by masked mean pooling."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask = inputs["mask"].unsqueeze(-1)
        hidden = self.encoder(self.embed(inputs["input_ids"]))
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return {"logits": self.head(pooled)}


class Open(nn.Module):
    """x -> (hidden, skip)"""

    def __init__(self, features: int, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        return torch.tanh(h), h


class Mix(nn.Module):
    """(hidden, skip) -> (hidden', skip): a residual that keeps the skip branch travelling alongside."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, skip = pair
        return torch.tanh(self.lin(h)) + 0.5 * skip, skip


class Close(nn.Module):
    """(hidden, skip) -> output"""

    def __init__(self, dim: int, outputs: int) -> None:
        super().__init__()
        self.out = nn.Linear(2 * dim, outputs)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.out(torch.cat(pair, dim=-1))


def build_mlp(seed: int, features: int = 16, dim: int = 32, outputs: int = 4) -> nn.Sequential:
    with seeded(seed):
        return nn.Sequential(nn.Linear(features, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Tanh(),
                             nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, outputs))


def build_tied_sequential(seed: int, vocab: int = VOCAB, dim: int = 32) -> nn.Sequential:
    """Embedding -> MLP -> Linear head whose weight is the embedding's: a per-token language model."""
    with seeded(seed):
        embed = nn.Embedding(vocab, dim)
        body = [nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Tanh()]
        head = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(embed.weight, std=0.5)
    head.weight = embed.weight
    return nn.Sequential(embed, *body, head)


def build_dict_classifier(seed: int) -> DictClassifier:
    with seeded(seed):
        return DictClassifier()


def build_tuple_sequential(seed: int, features: int = 16, dim: int = 32, outputs: int = 4) -> nn.Sequential:
    with seeded(seed):
        return nn.Sequential(Open(features, dim), Mix(dim), Mix(dim), Mix(dim), Close(dim, outputs))
