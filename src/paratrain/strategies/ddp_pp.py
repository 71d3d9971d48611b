"""Strategy "ddp+pp": data-parallel replicas of a pipeline, laid out on a 2-D DeviceMesh.

Replicas lie along "dp" and pipeline ranks along "pp"; after each step that completes an accumulation
window, every stage averages its gradients over its "dp" group:

    world 4 = dp 2 x pp 2        pp rank 0   pp rank 1
              replica 0           rank 0  ->  rank 1      batches 0, 2, 4 ... (first half)
              replica 1           rank 2  ->  rank 3      (second half)
                                  \\_ dp group _/ \\_ dp group _/

DDP itself cannot wrap a stage here: torch's pipeline stages drive DDP's reducer by hand, which fails
its bucket rebuild after the first step once there is more than one micro-batch, and a zero-bubble
weight backward bypasses DDP's hooks altogether; so gradients are averaged after the schedule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ParatrainError
from ..parallel.batchnorm import for_replicas
from ..parallel.data_parallel import average_gradients
from ..parallel.microbatch import pipeline_bound
from ..parallel.options import check_pipeline
from ..parallel.pipeline.pipelining import PipelineModule, evaluate, global_loss
from .base import Backward, Context, LossFn

DEFAULT_PP_SIZE = 2


def dp_pp(ctx: Context) -> tuple[int, int]:
    """(replicas, pipeline ranks), validated against the world size."""
    world = ctx.placement.world_size
    pp = ctx.config.pp_size or DEFAULT_PP_SIZE
    if pp < 1 or world % pp:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise ParatrainError(
            f"ddp+pp lays workers out as dp x pp: world {world} is not a multiple of pp_size {pp} "
            f"(dp {max(world // pp, 1)} x pp {pp} = {max(world // pp, 1) * pp} != {world}); use pp_size in {fits}"
        )
    return world // pp, pp


class _Replicas(nn.Module):
    """One pipeline rank's stages, and the group of replicas that hold the same stages."""

    def __init__(self, pipe: PipelineModule, dp_group: Any, dp: int) -> None:
        super().__init__()
        self.pipe = pipe
        self.dp_group, self.dp = dp_group, dp
        self.sync = True
        """False inside an accumulation window: replicas average gradients only when the optimizer steps."""

    @property
    def plan(self) -> Any:
        return self.pipe.plan

    def forward(self, inputs: Any, targets: Any, loss_fn: LossFn, loss_scale: int = 1) -> torch.Tensor | None:
        return self.pipe(inputs, targets, loss_fn, loss_scale)  # type: ignore[no-any-return]


class DataPipeline:
    name = "ddp+pp"
    needs_process_group = True
    sharded_state = True
    microbatched = True
    scheduled = True
    comm_hooks = False

    def check(self, ctx: Context) -> None:
        dp, pp = dp_pp(ctx)
        if dp < 2:
            raise ParatrainError(
                f"ddp+pp needs at least 2 replicas of its {pp}-stage pipeline, so a world size >= {2 * pp} that is "
                f"a multiple of pp_size {pp}; got {ctx.placement.world_size}: use strategy='pp' for one pipeline, "
                "or launch more workers"
            )
        check_pipeline(ctx.config, pp, "strategy 'ddp+pp'")

    def bound(self, ctx: Context) -> float:
        dp, pp = dp_pp(ctx)
        return dp * pipeline_bound(pp, ctx.config.microbatches)

    def devices(self, ctx: Context) -> list[torch.device]:
        return [ctx.device]

    def wrap(self, model: nn.Module, ctx: Context, example: Any) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        cfg = ctx.config
        dp, pp = dp_pp(ctx)
        model = for_replicas(model, cfg.batchnorm, ctx.device, dp, False, "strategy 'ddp+pp'")
        mesh = init_device_mesh(ctx.device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
        pipe = PipelineModule(
            model, schedule=cfg.schedule, pp_rank=mesh.get_local_rank("pp"), pp=pp,
            per_worker=cfg.stages_per_worker, device=ctx.device, microbatches=cfg.microbatches,
            balance=cfg.balance, example=example, group=mesh.get_group("pp"), strategy=self.name,
            batchnorm=cfg.batchnorm, checkpointing=cfg.activation_checkpointing, compiling=cfg.compiling,
        )
        return _Replicas(pipe, mesh.get_group("dp"), dp)

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        dp, pp = dp_pp(ctx)
        return ctx.placement.rank // pp, dp

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        if isinstance(model, _Replicas):
            model.sync = sync

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        if not isinstance(model, _Replicas):
            raise ParatrainError("strategy 'ddp+pp': pass the model returned by run.prepare to forward_backward")
        local = model(inputs, targets, loss_fn, ctx.config.grad_accum)
        if model.sync:
            model.pipe.reduce_tied_gradients()
            average_gradients(model.pipe.parameters(), model.dp_group, model.dp)
        return global_loss(local, model.dp, ctx.device)

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.pipe.holds() if isinstance(model, _Replicas) else model


STRATEGY = DataPipeline()
