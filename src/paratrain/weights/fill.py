"""Giving a split meta model this rank's storage.

`materialize` runs after the layout has split the model: every tensor still on the meta device (a whole tensor,
an FSDP shard, a tensor-parallel piece, a pipeline stage's layer) gets storage for its local piece only, swapped
in place so everything that holds it (FSDP's state, a traced stage's graph, the optimizer) sees the new data,
and is filled with exactly its slice of the source's value."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from ..memstats import give_back_freed
from ..parallel.tensor import local_part
from .build import is_empty
from .names import named_tensors
from .sources import Source


def piece(source: Source, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of the tensor named `name`: a slice read directly where the placement is a plain split."""
    if not hasattr(t, "to_local"):
        return source.piece(name)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    if all(type(p) in (Shard, Replicate) for p in placements):
        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        return source.piece(name, [slice(o, o + s) for o, s in zip(offset, shape)])
    whole = source.piece(name)  # a strided split: cut from the whole tensor, here, with no communication
    return distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()


def materialize(model: nn.Module, source: Source, device: torch.device, prefix: str = "",
                everything: bool = False) -> dict[int, Any]:
    """Storage on `device` for every meta tensor of `model` (as split; `prefix` its name in the source's model),
    filled from `source`; with `everything`, the real tensors a checkpoint holds are loaded too. Returns the
    Parameters replaced rather than swapped, for `settle` on what the layout built around the model."""
    empty = {name for name, t in named_tensors(model) if is_empty(t)}
    if everything:
        empty |= {name for name, _ in named_tensors(model) if source.holds(f"{prefix}.{name}" if prefix else name)}
    if not empty:
        return {}
    gc.collect()  # a trace's dead weak references to the tensors would stop the swap
    replaced = _allocate(model, device)
    done: set[int] = set()
    with torch.no_grad():
        for name, t in named_tensors(model):
            if name in empty and id(t) not in done:
                done.add(id(t))
                local_part(t).copy_(piece(source, f"{prefix}.{name}" if prefix else name, t))
    return replaced


def _allocate(model: nn.Module, device: torch.device) -> dict[int, Any]:
    """Empty storage for each meta tensor's local piece, swapped into the very object (its attributes kept), so what
    holds the Parameter (FSDP's state, a traced graph, tied-weight bookkeeping) holds the real one. A Parameter a
    cache refers to weakly cannot be swapped: it is replaced, and the replacements returned (by the old one's id)."""
    replaced: dict[int, Any] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is None or not is_empty(t):
                    continue
                if id(t) in replaced:  # a tied weight's other name: the same replacement
                    table[key] = replaced[id(t)]
                    continue
                new = torch.empty_like(t, device=device)
                if isinstance(t, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=t.requires_grad)
                kept = dict(t.__dict__)
                try:
                    torch.utils.swap_tensors(t, new)
                except RuntimeError:
                    table[key] = new  # type: ignore[assignment]  # weakly referenced: replaced; holders re-read
                    new.__dict__.update({k: v for k, v in kept.items() if k not in new.__dict__})
                    replaced[id(t)] = new
                    continue
                t.__dict__.update({k: v for k, v in kept.items() if k not in t.__dict__})
    return replaced


def settle(model: nn.Module, replaced: dict[int, Any] | None = None) -> None:
    """What holds copies of the tensors reads them again: FSDP2 its padded shards, a traced stage its graphs, a
    pipeline its tied weights (`replaced`: new Parameters by the old ones' ids)."""
    for module in model.modules():
        if replaced and callable(getattr(module, "replaced", None)):
            module.replaced(replaced)  # type: ignore[operator]
        state = getattr(module, "_get_fsdp_state", None)
        if state is not None:
            with torch.no_grad():
                for group in state()._fsdp_param_groups:  # type: ignore[operator]
                    for param in group.fsdp_params:
                        param.reset_sharded_param()
            give_back_freed()  # each re-padded shard frees the one it copied: hand those back as they go
        if callable(getattr(module, "repoint", None)):
            module.repoint()  # type: ignore[operator]
