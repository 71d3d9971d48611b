"""Collectives as the user calls them: no-ops on one process, a timeout always, a readable op name."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import unknown_name
from .parallel import step_state

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


def mean_later(value: torch.Tensor, divide_by: int | None = None, group: object = None) -> torch.Tensor:
    """The sum over ranks of `value / divide_by` (default: the world size, so the mean), started now and
    waited for when first read.

    A training step's loss is returned on every rank but often never read: a blocking all-reduce would
    stall every step for it. The result is torch's AsyncCollectiveTensor, which waits on first use; one
    that is never read is waited for by the next call (or `settle`), so at most one is in flight."""
    tensor = value.detach().float()
    if not active(group):
        return tensor / divide_by if divide_by else tensor.clone()
    from torch.distributed import _functional_collectives as funcol

    settle()
    size = divide_by or dist.get_world_size(group)  # type: ignore[arg-type]
    out = funcol.all_reduce(tensor / size, "sum", group or dist.group.WORLD)  # type: ignore[arg-type]
    step_state.active().reductions.append(out)  # the active run's: waited for by its next reduction
    return out


def settle() -> None:
    """Wait for every reduction `mean_later` started (a no-op for those already read)."""
    started = step_state.active().reductions
    while started:
        pending = started.pop()
        wait = getattr(pending, "trigger_wait", None)
        if wait is not None:
            wait()


def broadcast_objects(box: list) -> None:
    """Rank 0's picklable objects into `box` on every rank (within the process group's timeout)."""
    if active():
        dist.broadcast_object_list(box, src=0)


def barrier() -> None:
    if active():
        dist.barrier()


def mean_over_world(values: list[float], device: torch.device | None = None) -> list[float]:
    """Element-wise mean of a list of floats over all ranks (in float64, so ranks agree exactly)."""
    return all_reduce(torch.tensor(values, dtype=torch.float64), "mean", device=device).tolist()  # type: ignore[no-any-return]


def max_over_world(value: float, device: torch.device | None = None) -> float:
    return float(all_reduce(torch.tensor(value, dtype=torch.float64), "max", device=device))
