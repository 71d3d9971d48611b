"""Parameters tied across pipeline stages: one parameter in effect, as Megatron's embedding group does.

A language model's head often shares its weight with the token embedding. Split into stages, the
embedding sits on the first stage and the head on the last; in separate processes each rank holds its
own copy of the shared tensor. Both copies start equal (every rank builds the model from one seed), so
they stay equal if every copy receives the sum of the gradients all its holders computed and the same
optimizer update: after backward, at the end of an accumulation window, the holders' gradients are
summed over the pipeline's process group, and each rank steps its copy as usual.

In one process (`mp`) the stages hold the very same Parameter, so autograd already sums its gradient;
only stages on different devices would need copies, which are refused until that is supported.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ParatrainError
from ..tensor import local_part


def shared_parameters(model: nn.Module, stages: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter, list[int]]]:
    """(name, parameter, stage indices) of parameters more than one stage holds, in the model's order."""
    holders: dict[int, list[int]] = {}
    for index, stage in enumerate(stages):
        for p in stage.parameters():
            holders.setdefault(id(p), []).append(index)
    return [(name, p, holders[id(p)]) for name, p in model.named_parameters() if len(holders.get(id(p), [])) > 1]


def check_one_device(model: nn.Module, stages: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
    """One process: a parameter shared by stages on different devices cannot be one tensor."""
    for name, _, held_by in shared_parameters(model, stages):
        where = sorted({str(devices[i]) for i in held_by})
        if len(where) > 1:
            raise ParatrainError(
                f"{type(model).__name__}.{name} is shared by stages {held_by} on {', '.join(where)}; one process "
                "cannot keep one parameter on two devices. Give a balance that puts those layers on one stage, "
                "or use strategy='pp' (one process per stage keeps the tied copies equal)"
            )


class TiedGradients:
    """Sums the gradients of parameters tied across this pipeline's ranks (collective over `group`)."""

    def __init__(self, model: nn.Module, stages: Sequence[nn.Module], rank_of_stage: Callable[[int], int],
                 my_rank: int, group: Any) -> None:
        self.group = group
        self.shard: tuple[int, int] | None = None
        """(coordinate, size) on the data-parallel mesh where FSDP shards the stages (`follow`): every holder
        then keeps dim-0 rows of the tied gradient, the same rows on every rank of this pipeline."""
        self.entries: list[tuple[nn.Parameter | None, torch.Size, torch.dtype]] = []
        self.counted_elsewhere: set[int] = set()
        """ids of this rank's tied copies that an earlier holder counts in the model's gradient norm."""
        self._summed: dict[int, weakref.ref[torch.Tensor]] = {}
        """The gradient tensors the last `reduce` wrote (by parameter id), until the next window starts."""
        self._carried: dict[int, torch.Tensor] = {}
        """What those gradients held when the next window started without clearing them (see `window_starts`)."""
        for _, p, held_by in shared_parameters(model, stages):
            ranks = {rank_of_stage(i) for i in held_by}
            if len(ranks) > 1:
                self.entries.append((p if my_rank in ranks else None, p.shape, p.dtype))
                if my_rank in ranks and my_rank != min(ranks):
                    self.counted_elsewhere.add(id(p))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def follow(self, now: dict[int, nn.Parameter], coordinate: int, size: int) -> None:
        """The stages were sharded (`sharded.shard_stages`): the entries become the FSDP2 parameters that replaced
        the originals (`now`, by the original's id), whose gradients are this rank's rows."""
        self.shard = (coordinate, size)
        self.replaced(now)

    def replaced(self, now: dict[int, nn.Parameter]) -> None:
        """Parameters replaced by others (`now`, by the original's id): sharded, or made real (`weights.fill`)."""
        self.counted_elsewhere = {id(now[i]) for i in self.counted_elsewhere if i in now}
        self.entries = [(now.get(id(p), p) if p is not None else None, shape, dtype)
                        for p, shape, dtype in self.entries]

    def _local_shape(self, shape: torch.Size) -> torch.Size:
        """The rows FSDP2 keeps on this rank (torch.chunk's split of dim 0)."""
        if self.shard is None or not shape:
            return shape
        coordinate, size = self.shard
        per = -(-shape[0] // size)
        return torch.Size((max(0, min(per, shape[0] - coordinate * per)), *shape[1:]))

    def window_starts(self) -> None:
        """Before each micro-step's backward; it acts at the first one after a `reduce`. A loop that calls
        forward_backward again without clearing the gradients (no optimizer step, or `zero_grad(set_to_none=False)`)
        accumulates onto sums the last window already made, equal on every holder; what they held is kept so that
        only the new part is summed, as DDP's average of each backward adds up over backwards."""
        if not self._summed:  # inside a window, or before any sum: what is carried stays as it is
            return
        for p, _, _ in self.entries:
            ref = self._summed.get(id(p)) if p is not None else None
            grad = p.grad if p is not None else None
            if grad is not None and ref is not None and ref() is grad:
                self._carried[id(p)] = _local(grad).clone()
        self._summed = {}

    def _contribution(self, p: nn.Parameter | None, shape: torch.Size, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        if p is None or p.grad is None:
            return torch.zeros(shape, dtype=dtype, device=device).reshape(-1)
        carried = self._carried.get(id(p))
        return _local(p.grad) if carried is None else _local(p.grad) - carried

    def reduce(self, device: torch.device) -> None:
        """Every holder's gradient becomes the sum over all holders (zeros stand in for ranks without it)."""
        for dtype in sorted({e[2] for e in self.entries}, key=str):  # the same order on every rank
            group = [(p, self._local_shape(shape)) for p, shape, d in self.entries if d == dtype]
            lone = group[0][0] if len(group) == 1 else None
            if (lone is not None and lone.grad is not None and id(lone) not in self._carried
                    and local_part(lone.grad).is_contiguous()):  # GPT's one tie: summed where it lies, no copy
                dist.all_reduce(_local(lone.grad), group=self.group)
                self._summed[id(lone)] = weakref.ref(lone.grad)
                continue
            flat = torch.cat([self._contribution(p, shape, dtype, device) for p, shape in group])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for p, shape in group:
                n = shape.numel()
                if p is not None:
                    summed = flat[offset : offset + n].view(shape)
                    carried = self._carried.get(id(p))
                    if carried is not None:
                        summed = summed + carried.view(shape)
                    if p.grad is not None:
                        local_part(p.grad).copy_(summed)  # in place: a DTensor's local rows share its storage
                    elif hasattr(p, "to_local"):
                        from torch.distributed.tensor import DTensor

                        p.grad = DTensor.from_local(summed.clone(), p.device_mesh, p.placements,  # type: ignore[attr-defined]
                                                    shape=p.shape, stride=p.stride())
                    else:
                        p.grad = summed.clone()
                    if p.grad is not None:
                        self._summed[id(p)] = weakref.ref(p.grad)
                offset += n
        self._carried = {}


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The local rows, flat: a view where they are contiguous (then writes reach the gradient)."""
    return local_part(grad).reshape(-1)
