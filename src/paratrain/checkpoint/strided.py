"""Tensors whose rank pieces DCP cannot describe: a DTensor split as a strided slice (`_StridedShard`: a fused
projection's q, k and v parts, or an expert weight's gate and up halves, each split over the tensor ranks) holds
several separate regions of the whole tensor on each rank, and DCP's index gives each rank one region per tensor.

Such tensors are written whole, one at a time (each rank holds the same values, which DCP writes once), and read
whole, each rank then keeping its own pieces; so a checkpoint holds them under their names and shapes as one process
would, and loads into any layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _is_strided(value: Any) -> bool:
    return any(type(p).__name__ == "_StridedShard" for p in getattr(value, "placements", ()))


def _entries(tree: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """(dict, key) of every strided DTensor in nested state dicts, in one order on every rank."""
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, dict):
            yield from _entries(value)
        elif _is_strided(value):
            yield tree, key


def made_whole(state_dicts: dict[str, Any]) -> dict[str, Any]:
    """Collective: the state dicts with each strided DTensor replaced by its whole tensor (the input is left alone)."""
    out = {k: (made_whole(v) if isinstance(v, dict) else v) for k, v in state_dicts.items()}
    for tree, key in list(_entries(out)):
        tree[key] = tree[key].full_tensor()
    return out


class WholeForLoad:
    """Around a load: strided DTensors stand aside for whole tensors DCP fills, then each rank copies its pieces
    back into them (`restore`)."""

    def __init__(self, target: dict[str, Any]) -> None:
        self.aside: list[tuple[dict[str, Any], str, Any]] = []
        for tree, key in list(_entries(target)):
            kept = tree[key]
            self.aside.append((tree, key, kept))
            tree[key] = torch.empty(kept.shape, dtype=kept.dtype, device=kept.to_local().device)

    def restore(self) -> None:
        from torch.distributed.tensor import distribute_tensor

        for tree, key, kept in self.aside:
            piece = distribute_tensor(tree[key], kept.device_mesh, kept.placements, src_data_rank=None)
            with torch.no_grad():
                kept.to_local().copy_(piece.to_local())
            tree[key] = kept
