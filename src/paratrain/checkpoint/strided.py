"""Tensors whose rank pieces DCP's DTensor index cannot describe: a DTensor split as a strided slice
(`_StridedShard`: a fused projection's q, k and v parts, or an expert weight's gate and up halves, each split over
the tensor ranks; FSDP's shard of a tensor-parallel shard) holds its part of the whole tensor in another order than
a plain split would, often as several separate regions, and DCP reads one region per rank off a DTensor.

Writing such tensors whole (as this module did) or loading them whole made every rank hold the whole of all of them
at once: under fsdp+tp every column-parallel weight and its optimizer state, a save at 3.44 GB per rank for a
3.2 GB model on 4 ranks whose goal is 1.62 GB. But which elements a rank holds does not depend on the values, so
the piece can be described instead of moved: splitting an index range per dimension as DTensor splits the tensor
(locally, no collective) gives the whole tensor's indices the rank holds, in its order, and their runs of
consecutive indices are its regions. torch >= 2.14's DCP takes a plain tensor that names several regions (its
`CheckpointableTensor`: a global shape and, per region, where it sits in the whole tensor and in the local one), so
DCP writes straight from the rank's own storage and loads straight into it: nothing is gathered or allocated but
DCP's own staging (a region that is not all of its tensor's storage is copied to be written, and its writer keeps
the last such copy of each tensor until the rank's file is done). The checkpoint still holds each tensor under its
name and whole shape, in chunks as any DTensor's, so it loads into any layout and any layout's loads into this one.

An older torch's DCP takes one region per tensor, so there each strided tensor, one at a time, is gathered and
kept as the rank's rows of a plain split on the same mesh (`Shard` for `_StridedShard`), which DCP describes; a
load reads the plain split and re-splits it, one tensor at a time: a second copy of the rank's share of the
strided tensors plus one gathered tensor, and still never the whole model.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

try:  # torch >= 2.14
    from torch.distributed.checkpoint.protocol import CheckpointableTensor  # noqa: F401

    NATIVE = True
except ImportError:  # pragma: no cover - older torch
    NATIVE = False
"""Whether DCP takes several regions of one local tensor (else: the plain-split fallback)."""

Region = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""(offsets in the whole tensor, offsets in the local tensor, sizes)."""


def _is_strided_placement(p: Any) -> bool:
    return type(p).__name__ == "_StridedShard"


def _is_strided(value: Any) -> bool:
    return any(_is_strided_placement(p) for p in getattr(value, "placements", ()))


def _entries(tree: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """(dict, key) of every strided DTensor in nested state dicts, in one order on every rank."""
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, dict):
            yield from _entries(value)
        elif _is_strided(value):
            yield tree, key


def _copied(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: (_copied(v) if isinstance(v, dict) else v) for k, v in tree.items()}


def _indices(shape: torch.Size, mesh: Any, placements: Any, dim: int) -> torch.Tensor:
    """The whole tensor's indices along `dim` that this rank holds, in its local order: an index range split as
    DTensor splits the tensor along `dim` (each rank takes its own chunks; no collective)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    along: list[Any] = []
    for p in placements:
        if _is_strided_placement(p) and p.dim % len(shape) == dim:  # (not a Shard subclass in every torch)
            along.append(type(p)(0, split_factor=p.split_factor))
        elif isinstance(p, Shard) and p.dim % len(shape) == dim:
            along.append(Shard(0))
        else:
            along.append(Replicate())
    if all(isinstance(p, Replicate) for p in along):  # not split along `dim`: all of it, in order
        return torch.arange(shape[dim])
    return distribute_tensor(torch.arange(shape[dim]), mesh, along, src_data_rank=None).to_local()


def regions(value: Any) -> list[Region]:
    """This rank's piece of DTensor `value` as regions of the whole tensor: per dimension the runs of consecutive
    indices, crossed."""
    runs: list[list[tuple[int, int, int]]] = []
    for dim in range(value.ndim):
        idx = _indices(value.shape, value.device_mesh, value.placements, dim)
        if idx.numel() == 0:
            return []
        cuts = (torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1).tolist()
        starts, ends = [0, *cuts], [*cuts, idx.numel()]
        runs.append([(int(idx[s]), s, e - s) for s, e in zip(starts, ends)])
    return [(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
            for combo in itertools.product(*runs)]


def _described(value: Any) -> torch.Tensor:
    """The rank's local tensor (its storage, not a copy) naming its regions of the whole tensor, for DCP."""
    local = value.to_local().detach()  # a new tensor object on the same storage, to carry the attributes
    found = regions(value)
    if not found and value.numel() == 0:  # nothing to hold anywhere: a whole empty tensor, written once
        return torch.empty(value.shape, dtype=value.dtype, device=local.device)
    local.global_shape = tuple(value.shape)  # type: ignore[attr-defined]
    local.global_offsets = tuple(r[0] for r in found)  # type: ignore[attr-defined]
    local.local_offsets = tuple(r[1] for r in found)  # type: ignore[attr-defined]
    local.local_sizes = tuple(r[2] for r in found)  # type: ignore[attr-defined]
    return local


def _plain(value: Any) -> list[Any]:
    """`value`'s placements with each strided split as a plain one on the same mesh dimension (DCP describes it)."""
    from torch.distributed.tensor import Shard

    return [Shard(p.dim) if _is_strided_placement(p) else p for p in value.placements]


def _plain_empty(value: Any) -> Any:
    """An uninitialised DTensor of `value`'s shape in the plain split: this rank's rows only."""
    from torch.distributed.tensor import DTensor

    plain = _plain(value)
    shape = [len(_indices(value.shape, value.device_mesh, plain, d)) for d in range(value.ndim)]
    local = torch.empty(shape, dtype=value.dtype, device=value.to_local().device)
    return DTensor.from_local(local, value.device_mesh, plain, run_check=False, shape=value.shape,
                              stride=value.stride())


def _plain_copy(value: Any) -> Any:
    """Collective: `value` in the plain split; the whole tensor lives only inside this call."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    plain = _plain(value)
    with torch.no_grad():
        whole = value.full_tensor()
        local = distribute_tensor(whole, value.device_mesh, plain, src_data_rank=None).to_local().clone()
        del whole
    return DTensor.from_local(local, value.device_mesh, plain, run_check=False, shape=value.shape,
                              stride=value.stride())


def for_save(state_dicts: dict[str, Any]) -> dict[str, Any]:
    """The state dicts with each strided DTensor replaced by what DCP can write (the input is left alone);
    collective on an older torch only."""
    out = _copied(state_dicts)
    for tree, key in list(_entries(out)):
        tree[key] = _described(tree[key]) if NATIVE else _plain_copy(tree[key])
    return out


class ForLoad:
    """Around a load: each strided DTensor stands aside for what DCP can fill (its own local tensor, described, or
    on an older torch a plain split of its shape); `restore` puts it back (collective on an older torch: each
    plain split is gathered and re-split, one tensor at a time)."""

    def __init__(self, target: dict[str, Any]) -> None:
        self.aside: list[tuple[dict[str, Any], str, Any]] = []
        for tree, key in list(_entries(target)):
            kept = tree[key]
            self.aside.append((tree, key, kept))
            tree[key] = _described(kept) if NATIVE else _plain_empty(kept)

    def restore(self) -> None:
        from torch.distributed.tensor import distribute_tensor

        for tree, key, kept in self.aside:
            if not NATIVE and kept.numel():
                with torch.no_grad():
                    whole = tree[key].full_tensor()
                    tree[key] = None  # this tensor's plain split goes before the next is gathered
                    piece = distribute_tensor(whole, kept.device_mesh, kept.placements, src_data_rank=None)
                    kept.to_local().copy_(piece.to_local())
                    del whole, piece
            tree[key] = kept
