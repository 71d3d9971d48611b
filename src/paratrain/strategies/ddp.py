"""DistributedDataParallel: one process per device, gradients all-reduced in buckets during backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._tree import map_tensors
from ..config import Config
from ..errors import ParatrainError
from ..parallel import parallelize
from ..parallel.batchnorm import for_replicas
from ..parallel.data_parallel import apply_ddp, evaluate, forward_backward, set_ddp_sync
from ..parallel.dims import ParallelDims
from .base import Backward, Context, LossFn


class DDP:
    name = "ddp"
    needs_process_group = True
    sharded_state = False
    microbatched = False
    scheduled = False
    comm_hooks = True

    def degrees(self, config: Config, world: int) -> ParallelDims:
        """Every worker a replica; `check` refuses a world this layout cannot run."""
        return ParallelDims(dp_replicate=world)

    def check(self, ctx: Context) -> None:
        if not dist.is_available():
            raise ParatrainError("this torch build has no torch.distributed; install a build with it")
        if ctx.config.comm_hook == "powersgd" and ctx.device.type != "cuda":
            raise ParatrainError(
                "comm_hook='powersgd' issues its collectives from completion callbacks, which gloo (CPU workers) "
                "can run in a different order on each rank once the gradients span several buckets (a collective "
                "mismatch); on CPU workers use comm_hook='bf16' (lossy) or 'auto' (exact), or run powersgd on GPUs")

    def bound(self, ctx: Context) -> float:
        return float(ctx.placement.world_size)

    def devices(self, ctx: Context) -> list[torch.device]:
        return [ctx.device]

    def wrap(self, model: nn.Module, ctx: Context, example: Any) -> nn.Module:
        model = for_replicas(model, ctx.config.batchnorm, ctx.device, ctx.placement.world_size, True,
                             "strategy 'ddp'", modules_run=True).to(ctx.device)
        parallelize.blocks(model, ctx)
        example = map_tensors(lambda t: t.to(ctx.device), example) if example is not None else None
        return apply_ddp(model, ctx.config, [ctx.device.index] if ctx.device.type == "cuda" else None,
                         example=example, device=ctx.device)

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return ctx.placement.rank, ctx.placement.world_size

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        set_ddp_sync(model, sync)

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        return forward_backward(model, inputs, targets, loss_fn, backward)

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return 1

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model


STRATEGY = DDP()
