"""Strategy "mp": one process drives several devices, one model stage on each, micro-batches pipelined.

The tutorials' `ModelParallelResNet50` and its `split_size` loop, without writing `seq1`/`seq2`: the
model is split and balanced automatically (see `parallel.pipeline.mp_pipeline`). On a machine without CUDA every
stage sits on "cpu", so the same script runs (and is tested) anywhere; speed only matters on GPUs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Config
from ..errors import ParatrainError
from ..parallel.data_parallel import evaluate
from ..parallel.dims import ParallelDims
from ..parallel.microbatch import pipeline_bound
from ..parallel.options import check_balance_entries
from ..parallel.pipeline.mp_pipeline import MPPipeline, train_step
from ..runtime import mp_devices
from .base import Backward, Context, LossFn


class ModelParallel:
    name = "mp"
    needs_process_group = False
    sharded_state = False
    microbatched = True
    scheduled = False
    comm_hooks = False
    axes: tuple[str, ...] = ()
    in_process = "stages"

    def degrees(self, config: Config, world: int) -> ParallelDims:
        """One process (its stages' devices are not ranks); `check` refuses a world this layout cannot run."""
        return ParallelDims()

    def check(self, ctx: Context) -> None:
        if ctx.placement.world_size > 1:
            raise ParatrainError(
                f"strategy 'mp' runs in one process that drives every stage's device, but "
                f"{ctx.placement.world_size} processes were launched; launch one process, or use "
                "strategy='ddp+mp' (each process its own devices) or 'pp' (one process per stage)"
            )
        devices = self.devices(ctx)
        bad = [str(d) for d in devices if d.type == "cuda" and (d.index or 0) >= ctx.gpus]
        if bad:
            raise ParatrainError(f"devices {bad} do not exist: {ctx.gpus} GPU(s) visible; use cuda:0..cuda:"
                                 f"{ctx.gpus - 1}")
        check_balance_entries(ctx.config.balance, len(devices), "strategy 'mp'")

    def bound(self, ctx: Context) -> float:
        """Stages on one device take turns, so K counts distinct devices (two stages on one CPU: K = 1)."""
        return pipeline_bound(len(set(self.devices(ctx))), ctx.config.microbatches)

    def devices(self, ctx: Context) -> list[torch.device]:
        return mp_devices(ctx.config.devices, ctx.device, ctx.gpus)

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return 0, 1

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        pass  # one process holds every gradient

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        if not isinstance(model, MPPipeline):
            raise ParatrainError("strategy 'mp': pass the model returned by run.prepare to forward_backward")
        return train_step(model, model, inputs, targets, loss_fn, backward).detach().float()

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return 1

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.model if isinstance(model, MPPipeline) else model


STRATEGY = ModelParallel()
