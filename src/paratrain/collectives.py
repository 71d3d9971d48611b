"""Collectives as the user calls them: no-ops on one process, a timeout always, a readable op name."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import unknown_name

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def active(group: object = None) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1  # type: ignore[arg-type]


def all_reduce(value: torch.Tensor | float, op: str = "mean", device: torch.device | None = None,
               group: object = None) -> torch.Tensor:
    """The reduced value, as a new tensor on every rank (the input is left alone)."""
    if op not in _OPS:
        raise unknown_name("reduce op", op, _OPS)
    tensor = torch.as_tensor(value, device=device).detach().clone()
    if not active(group):
        return tensor
    if not tensor.is_floating_point() and op == "mean":
        tensor = tensor.double()
    dist.all_reduce(tensor, op=_OPS[op], group=group)  # type: ignore[arg-type,call-overload]
    if op == "mean":
        tensor /= dist.get_world_size(group)  # type: ignore[arg-type]
    return tensor


def barrier() -> None:
    if active():
        dist.barrier()


def mean_over_world(values: list[float], device: torch.device | None = None) -> list[float]:
    """Element-wise mean of a list of floats over all ranks (in float64, so ranks agree exactly)."""
    return all_reduce(torch.tensor(values, dtype=torch.float64), "mean", device=device).tolist()  # type: ignore[no-any-return]


def max_over_world(value: float, device: torch.device | None = None) -> float:
    return float(all_reduce(torch.tensor(value, dtype=torch.float64), "max", device=device))
