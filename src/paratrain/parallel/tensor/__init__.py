"""Tensor parallelism: which Linears to shard (`plan`) and sharding them on DTensor with a check (`apply`)."""

from __future__ import annotations

import torch


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's piece on this rank, sharing its storage (writes reach the DTensor); any other tensor itself."""
    if hasattr(tensor, "to_local"):
        with torch.no_grad():
            return tensor.to_local()  # type: ignore[no-any-return]
    return tensor
