"""Replica groups over sharded layouts: what one rank holds of the model, as plain tensors, and back.

Under `fsdp` or `tp` inside a group, parameters, gradients and optimizer state are DTensors over the group's own
mesh (a pipeline stage's are plain tensors of its own layers). Rank l of every group runs the same layout on the
same in-group world, so it holds the same piece: the work between groups is per rank and needs only the local
pieces. The gradients' pieces are averaged with rank l of the other groups, and a rank that rejoins copies the
pieces of its counterpart (never a gathered model, and never a DTensor, whose mesh is the sender's group's, on
the wire).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from ..parallel.tensor import local_part

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_sharded(value: object) -> TypeGuard[DTensor]:
    """A DTensor: a piece of a tensor laid out over this group's mesh."""
    if not isinstance(value, torch.Tensor) or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def like(piece: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """`piece` (a rank's local piece) as the tensor `template` is on this rank: a DTensor over this group's mesh
    with the template's placements and global shape, or `piece` itself."""
    if not is_sharded(template):
        return piece
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(piece, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict with each DTensor as its local piece."""
    return {name: local_part(value) if isinstance(value, torch.Tensor) else value
            for name, value in model.state_dict().items()}


def load_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """`model_state` of the same layout's same rank, loaded through `load_state_dict` (its hooks run)."""
    mine = model.state_dict()
    model.load_state_dict({name: like(value, mine[name]) if name in mine and isinstance(value, torch.Tensor)
                           else value for name, value in state.items()})


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with each DTensor as its local piece; `sharded` names them (param index, key)."""
    state = optimizer.state_dict()
    sharded: list[tuple[int, str]] = []
    pieces: dict[Any, dict[str, Any]] = {}
    for index, values in state["state"].items():
        pieces[index] = {}
        for key, value in values.items():
            if is_sharded(value):
                sharded.append((index, key))
                value = value.to_local()
            pieces[index][key] = value
    return {**state, "state": pieces, "sharded": sharded}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """`optimizer_state` of the same rank: each local piece becomes a DTensor laid out as its parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    values = {index: dict(entry) for index, entry in state["state"].items()}
    for index, key in state["sharded"]:
        values[index][key] = like(values[index][key], params[index])
    optimizer.load_state_dict({k: v for k, v in state.items() if k != "sharded"} | {"state": values})
