"""One process, one device: the reference every other strategy is checked against."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Config
from ..errors import ParatrainError
from ..parallel.data_parallel import evaluate, forward_backward
from ..parallel.dims import ParallelDims
from .base import Backward, Context, LossFn


class Single:
    name = "single"
    needs_process_group = False
    sharded_state = False
    microbatched = False
    scheduled = False
    comm_hooks = False
    axes: tuple[str, ...] = ()
    in_process = None

    def degrees(self, config: Config, world: int) -> ParallelDims:
        """One process; `check` refuses a world this layout cannot run."""
        return ParallelDims()

    def check(self, ctx: Context) -> None:
        if ctx.placement.world_size > 1:
            raise ParatrainError(
                f"strategy 'single' runs in one process but {ctx.placement.world_size} were launched; "
                "use strategy='ddp' for several workers, or launch one process"
            )

    def bound(self, ctx: Context) -> float:
        return 1.0

    def devices(self, ctx: Context) -> list[torch.device]:
        return [ctx.device]

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return 0, 1

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        pass  # nothing to synchronise

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        return forward_backward(model, inputs, targets, loss_fn, backward)

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return 1

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model


STRATEGY = Single()
