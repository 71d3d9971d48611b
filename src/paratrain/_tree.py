"""Mapping a function over the tensors of nested lists, tuples and dicts (model inputs and outputs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """The same structure with `fn` applied to each tensor. Containers keep their type: a Hugging Face
    `ModelOutput` stays one (the user's loss reads `output.logits`), a namedtuple stays one."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        items = [map_tensors(fn, v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        mapped = {k: map_tensors(fn, v) for k, v in value.items()}
        if type(value) is dict:
            return mapped
        return type(value)(**mapped) if all(isinstance(k, str) for k in mapped) else type(value)(mapped)
    return value


def nbytes(value: Any) -> int:
    """Bytes of every tensor in a nested value (a batch, a layer's output)."""
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested output, in `map_tensors` order."""
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(keep, value)
    return found
