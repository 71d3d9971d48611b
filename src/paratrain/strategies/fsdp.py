"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over data-parallel ranks.

Units follow the model's blocks (see `parallel.data_parallel.fsdp`): each block of a `ModuleList`/`Sequential` is
gathered just before it runs and freed after; embeddings, final norm, head and tied weights stay in
the root unit. Gradients are reduce-scattered and averaged, so training matches DDP and the
single-process run at the same global batch. With precision="bf16" the parameters are gathered and
computed in bfloat16 (FSDP2's MixedPrecisionPolicy) under autocast, and reduced and updated in
float32 (numerics in docs/usage.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Config
from ..errors import ParatrainError
from ..parallel import parallelize
from ..parallel.batchnorm import for_replicas
from ..parallel.data_parallel import evaluate, forward_backward
from ..parallel.data_parallel.fsdp import apply_fsdp, set_fsdp_sync
from ..parallel.dims import ParallelDims
from ..weights.build import place
from .base import Backward, Context, LossFn


class FSDP:
    name = "fsdp"
    needs_process_group = True
    sharded_state = True
    microbatched = False
    scheduled = False
    comm_hooks = False

    def degrees(self, config: Config, world: int) -> ParallelDims:
        """Every worker a shard; `check` refuses a world this layout cannot run."""
        return ParallelDims(dp_shard=world)

    def check(self, ctx: Context) -> None:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            raise ParatrainError("strategy 'fsdp' needs torch >= 2.6 (torch.distributed.fsdp.fully_shard)") from None

    def bound(self, ctx: Context) -> float:
        return float(ctx.placement.world_size)

    def devices(self, ctx: Context) -> list[torch.device]:
        return [ctx.device]

    def wrap(self, model: nn.Module, ctx: Context, example: Any) -> nn.Module:
        model = for_replicas(model, ctx.config.batchnorm, ctx.device, ctx.placement.world_size, True,
                             "strategy 'fsdp'", modules_run=True)
        parallelize.blocks(model, ctx)
        return apply_fsdp(place(model, ctx.device), precision=ctx.config.precision)

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return ctx.placement.rank, ctx.placement.world_size

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        set_fsdp_sync(model, sync)

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        return forward_backward(model, inputs, targets, loss_fn, backward)

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return 1

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model


STRATEGY = FSDP()
