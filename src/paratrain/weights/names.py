"""A model's tensors by name: every name of a tied weight leads to one canonical name (its first)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and buffers under every name they have (a tied weight once per name)."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def canonical_names(model: nn.Module) -> dict[str, str]:
    """name -> the first name of the same tensor (itself for an untied one)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, t in named_tensors(model):
        out[name] = first.setdefault(id(t), name)
    return out


def saved_names(model: nn.Module) -> set[str]:
    """What a state dict holds: parameters and persistent buffers, under every name."""
    return set(model.state_dict(keep_vars=True).keys())
