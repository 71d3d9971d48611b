"""Replicas that average their gradients after the backward, where DDP cannot wrap the model: a tensor-parallel
model (DDP's reducer does not take DTensor shards) and a rank's pipeline stages (torch's stages drive DDP's reducer
by hand, which fails its bucket rebuild after the first step with several micro-batches, and a zero-bubble weight
backward bypasses its hooks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..._tree import tensors_in
from . import average_gradients

if TYPE_CHECKING:
    from ...strategies.base import LossFn
    from ..pipeline.pipelining import PipelineModule


class Replicas(nn.Module):
    """A (tensor-parallel) model whose gradients are averaged over its data-parallel replicas after each
    backward that ends an accumulation window."""

    def __init__(self, module: nn.Module, group: Any, size: int, skip: set[nn.Parameter] | None = None) -> None:
        super().__init__()
        self.module, self.group, self.size = module, group, size
        self.flat_grads: dict[torch.dtype, torch.Tensor] = {}  # see average_gradients
        self.sync = True
        self.skip = {id(p) for p in skip or ()}
        """Parameters whose gradients are reduced elsewhere (experts: `parallel.expert`)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        if self.sync and torch.is_grad_enabled():
            # As DDP does: a hook on the output queues the average for the end of this backward pass, so the
            # user's own `loss.backward()` averages too.
            first = next((t for t in tensors_in(out) if t.requires_grad), None)
            if first is not None:
                first.register_hook(self._queue)
        return out

    def _queue(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self.average)  # type: ignore[attr-defined]
        return grad

    def average(self) -> None:
        average_gradients((p for p in self.module.parameters() if id(p) not in self.skip), self.group, self.size,
                          self.flat_grads)


class Stages(nn.Module):
    """One pipeline rank's (tensor-parallel) stages, and the replicas that hold the same stages."""

    def __init__(self, pipe: PipelineModule, group: Any, size: int, skip: set[nn.Parameter] | None = None) -> None:
        super().__init__()
        self.pipe, self.group, self.size = pipe, group, size
        self.skip = {id(p) for p in skip or ()}
        """Parameters another axis reduces itself (experts)."""
        self.flat_grads: dict[torch.dtype, torch.Tensor] = {}  # see average_gradients
        self.sync = True

    @property
    def plan(self) -> Any:
        return self.pipe.plan

    def forward(self, inputs: Any, targets: Any = None, loss_fn: LossFn | None = None, loss_scale: int = 1) -> Any:
        return self.pipe(inputs, targets, loss_fn, loss_scale)

    def average(self) -> None:
        if self.size > 1:
            average_gradients([p for p in self.pipe.parameters() if id(p) not in self.skip], self.group, self.size,
                              self.flat_grads)
