"""Strategy "pp": one process per pipeline rank, built on torch.distributed.pipelining.

Every worker is given the whole model and the same batches; `prepare` keeps the worker's stage(s),
and `run.forward_backward` runs one scheduled step (gpipe, 1f1b, interleaved-1f1b, zero-bubble).
Ranks hold different layers, so checkpoints are written per rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Config
from ..errors import ParatrainError
from ..parallel import parallelize
from ..parallel.dims import ParallelDims
from ..parallel.microbatch import pipeline_bound
from ..parallel.options import check_pipeline
from ..parallel.pipeline import schedules
from ..parallel.pipeline.pipelining import PipelineModule, evaluate, global_loss
from .base import Backward, Context, LossFn


class Pipeline:
    name = "pp"
    needs_process_group = True
    sharded_state = True
    microbatched = True
    scheduled = True
    comm_hooks = False

    def degrees(self, config: Config, world: int) -> ParallelDims:
        """Every worker a pipeline rank; `check` refuses a world this layout cannot run."""
        return ParallelDims(pp=world)

    def check(self, ctx: Context) -> None:
        world, pp = ctx.placement.world_size, ctx.config.pp_size
        if world < 2:
            raise ParatrainError(
                f"strategy 'pp' needs at least 2 workers, one per pipeline stage, but {world} was launched; "
                "launch 2 or more (paratrain run --nproc 2 ...), or use strategy='mp' to pipeline in one process"
            )
        if pp is not None and pp != world:
            raise ParatrainError(
                f"strategy 'pp' makes every worker a pipeline rank: pp_size {pp} != world size {world}; "
                f"use pp_size={world} (or leave it unset), or strategy='ddp+pp' for dp x pp workers"
            )
        check_pipeline(ctx.config, world, "strategy 'pp'")

    def bound(self, ctx: Context) -> float:
        cfg, world = ctx.config, ctx.placement.world_size
        unset = cfg.microbatches is None and cfg.schedule != "auto"  # at least the fewest the schedule runs
        fewest = schedules.row(cfg.schedule).min_microbatches(world, cfg.stages_per_worker) if unset else None
        count = fewest if fewest is not None else cfg.microbatches
        return pipeline_bound(world, count)

    def devices(self, ctx: Context) -> list[torch.device]:
        return [ctx.device]

    def wrap(self, model: nn.Module, ctx: Context, example: Any) -> nn.Module:
        cfg = ctx.config
        return parallelize.stages(PipelineModule(
            model, schedule=cfg.schedule, pp_rank=ctx.placement.rank, pp=ctx.placement.world_size,
            per_worker=cfg.stages_per_worker, device=ctx.device, microbatches=cfg.microbatches,
            balance=cfg.balance, example=example, strategy=self.name, batchnorm=cfg.batchnorm,
            checkpointing=cfg.activation_checkpointing, compiling=cfg.compiling,
        ), ctx)

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return 0, 1  # every stage of the one pipeline sees the same batches

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        if isinstance(model, PipelineModule):
            model.sync = sync  # tied parameters' gradients are summed over their stages when the window ends

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        if not isinstance(model, PipelineModule):
            raise ParatrainError("strategy 'pp': pass the model returned by run.prepare to forward_backward")
        local = model(inputs, targets, loss_fn, ctx.config.grad_accum)
        if model.sync:
            model.reduce_tied_gradients()
        return global_loss(local, 1, ctx.device)

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return ctx.placement.world_size

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.holds() if isinstance(model, PipelineModule) else model


STRATEGY = Pipeline()
