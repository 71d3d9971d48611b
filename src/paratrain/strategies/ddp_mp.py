"""Strategy "ddp+mp": the tutorials' `DDP(ToyMpModel(dev0, dev1))`.

Each process owns `devices_per_worker` devices; the model's stages are placed on them (the `mp`
pipeline, balanced identically in every process), and DDP without device_ids all-reduces across
processes. On CUDA process r gets devices r*k ... r*k+k-1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..collectives import max_over_world, mean_later
from ..config import Config
from ..errors import ParatrainError
from ..parallel.data_parallel import evaluate, set_ddp_sync
from ..parallel.dims import ParallelDims
from ..parallel.microbatch import pipeline_bound
from ..parallel.options import check_balance_entries
from ..parallel.pipeline.mp_pipeline import MPPipeline, train_step
from ..runtime import worker_devices
from .base import Backward, Context, LossFn


class DataModelParallel:
    name = "ddp+mp"
    needs_process_group = True
    sharded_state = False
    microbatched = True
    scheduled = False
    comm_hooks = False
    axes: tuple[str, ...] = ()
    in_process = "stages"

    def degrees(self, config: Config, world: int) -> ParallelDims:
        """Every worker a replica (of a model split over its process's devices); `check` refuses a world this
        layout cannot run."""
        return ParallelDims(dp_replicate=world)

    def check(self, ctx: Context) -> None:
        k, local = ctx.config.devices_per_worker, ctx.placement.local_world_size
        if ctx.device.type == "cuda" and local * k > ctx.gpus:
            raise ParatrainError(
                f"ddp+mp: {local} workers x devices_per_worker {k} = {local * k} GPUs needed on this machine but "
                f"{ctx.gpus} are visible; use {max(ctx.gpus // k, 1)} workers per machine or "
                f"devices_per_worker={max(ctx.gpus // max(local, 1), 1)}"
            )
        check_balance_entries(ctx.config.balance, k, "strategy 'ddp+mp'")

    def bound(self, ctx: Context) -> float:
        stages = len(set(self.devices(ctx)))
        return ctx.placement.world_size * pipeline_bound(stages, ctx.config.microbatches)

    def devices(self, ctx: Context) -> list[torch.device]:
        return worker_devices(ctx.config.devices_per_worker, ctx.device)

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return ctx.placement.rank, ctx.placement.world_size

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        set_ddp_sync(model, sync)

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        if not isinstance(model, DistributedDataParallel) or not isinstance(model.module, MPPipeline):
            raise ParatrainError("strategy 'ddp+mp': pass the model returned by run.prepare to forward_backward")
        loss = train_step(model, model.module, inputs, targets, loss_fn, backward, no_sync=model.no_sync,
                          reduce_max=lambda v: max_over_world(v, ctx.device))
        return mean_later(loss)

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return 1

    def unwrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, DistributedDataParallel) and isinstance(model.module, MPPipeline):
            return model.module.model
        return model


STRATEGY = DataModelParallel()
