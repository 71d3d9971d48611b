"""torch.nn.DataParallel: one process driving every visible GPU (kept for the tutorials; ddp is faster)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Config
from ..errors import ParatrainError
from ..parallel.data_parallel import evaluate, forward_backward
from ..parallel.dims import ParallelDims
from .base import Backward, Context, LossFn


class DataParallel:
    name = "dp"
    needs_process_group = False
    sharded_state = False
    microbatched = False
    scheduled = False
    comm_hooks = False
    axes: tuple[str, ...] = ()
    in_process = "replicas"

    def degrees(self, config: Config, world: int) -> ParallelDims:
        """One process (DataParallel's devices are not ranks); `check` refuses a world this layout cannot run."""
        return ParallelDims()

    def check(self, ctx: Context) -> None:
        if ctx.gpus == 0 or ctx.device.type != "cuda":
            raise ParatrainError(
                "strategy 'dp' (torch.nn.DataParallel) needs CUDA GPUs and none are visible; on CPU use "
                "strategy='ddp' and start one worker per core: paratrain run --nproc N script.py"
            )
        if ctx.placement.world_size > 1:
            raise ParatrainError(
                "strategy 'dp' runs in a single process that drives all GPUs, but "
                f"{ctx.placement.world_size} processes were launched; launch one process, or use strategy='ddp'"
            )

    def bound(self, ctx: Context) -> float:
        return float(ctx.gpus)

    def devices(self, ctx: Context) -> list[torch.device]:
        return [torch.device("cuda", i) for i in range(ctx.gpus)]

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return 0, 1

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        pass  # one process: gradients meet on the first GPU inside backward

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        return forward_backward(model, inputs, targets, loss_fn, backward)

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return 1

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model


STRATEGY = DataParallel()
