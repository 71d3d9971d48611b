"""Strategy "pp": one process per pipeline rank, built on torch.distributed.pipelining.

Every worker is given the whole `nn.Sequential` (or traceable model) and the same batches; `prepare`
keeps the worker's stage(s), and `run.forward_backward` runs one scheduled step (gpipe, 1f1b,
interleaved-1f1b, zero-bubble). Ranks hold different layers, so checkpoints are written per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ParatrainError
from ..parallel.pipelining import PipelineModule, check_layout
from . import register
from ._common import no_context
from .base import Context, LossFn
from .mp import check_common


def check_pipeline(ctx: Context, pp: int, where: str) -> None:
    cfg = ctx.config
    check_layout(cfg.schedule, pp, cfg.stages_per_worker, cfg.microbatches)
    check_common(cfg.microbatches, cfg.balance, pp * cfg.stages_per_worker, where)
    if cfg.precision == "16":
        raise ParatrainError(
            f"{where}: precision='16' needs a GradScaler on the loss, which the pipeline schedule computes "
            "and differentiates itself; use precision='bf16' (no scaler needed) or '32'"
        )


def count_micro_step(backward: Callable[[torch.Tensor], None]) -> None:
    """The schedule already ran backward. Passing a zero leaf through the run's `backward` lets the run
    count the micro-step (accumulation windows, when the optimizer steps) as for every other strategy."""
    backward(torch.zeros((), requires_grad=True))


def pipeline_forward_backward(model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn,
                              backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
    if not isinstance(model, PipelineModule):
        raise ParatrainError("pass the model returned by run.prepare to run.forward_backward")
    loss = model(inputs, targets, loss_fn)
    count_micro_step(backward)
    return loss  # type: ignore[no-any-return]


def pipeline_unwrap(model: nn.Module) -> nn.Module:
    return model.holds() if isinstance(model, PipelineModule) else model


class Pipeline:
    name = "pp"
    needs_process_group = True
    sharded_state = True

    def check(self, ctx: Context) -> None:
        world, pp = ctx.placement.world_size, ctx.config.pp_size
        if pp is not None and pp != world:
            raise ParatrainError(
                f"strategy 'pp' makes every worker a pipeline rank: pp_size {pp} != world size {world}; "
                f"use pp_size={world} (or leave it unset), or strategy='ddp+pp' for dp x pp workers"
            )
        check_pipeline(ctx, world, "strategy 'pp'")

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        cfg = ctx.config
        return PipelineModule(
            model, schedule=cfg.schedule, pp_rank=ctx.placement.rank, pp=ctx.placement.world_size,
            per_worker=cfg.stages_per_worker, device=ctx.device, microbatches=cfg.microbatches,
            balance=cfg.balance, grad_accum=cfg.grad_accum, strategy=self.name,
        )

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return 0, 1  # every stage of the one pipeline sees the same batches

    sync_context = staticmethod(no_context)
    forward_backward = staticmethod(pipeline_forward_backward)
    unwrap = staticmethod(pipeline_unwrap)


STRATEGY = Pipeline()
register(STRATEGY)
