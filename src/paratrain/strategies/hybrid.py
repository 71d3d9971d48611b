"""Data parallelism over model parallelism: "ddp+pp" and "ddp+mp".

ddp+pp lays the workers out on a 2-D DeviceMesh, replicas along "dp" and pipeline ranks along "pp";
after each step (or accumulation window) every stage averages its gradients over its "dp" group:

    world 4 = dp 2 x pp 2        pp rank 0   pp rank 1
              replica 0           rank 0  ->  rank 1      batches 0, 2, 4 ... (first half)
              replica 1           rank 2  ->  rank 3      (second half)
                                  \\_ dp group _/ \\_ dp group _/

ddp+mp is the tutorials' `DDP(ToyMpModel(dev0, dev1))`: each process owns `devices_per_worker`
devices, the model's stages are placed on them (the `mp` pipeline), and DDP without device_ids
all-reduces across processes. On CUDA process r gets devices r*k ... r*k+k-1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from ..collectives import max_over_world, mean_over_world
from ..errors import ParatrainError
from ..parallel.mp_pipeline import MPPipeline
from ..parallel.pipelining import PipelineModule
from ..runtime import cuda_count
from . import register
from ._common import whole_batch
from .base import Context, LossFn
from .ddp import apply_ddp
from .mp import check_common, pipelined_step
from .pp import check_pipeline, pipeline_forward_backward, pipeline_unwrap


def dp_pp(ctx: Context) -> tuple[int, int]:
    """(replicas, pipeline ranks), validated against the world size."""
    world = ctx.placement.world_size
    pp = ctx.config.pp_size or 2
    if pp < 1 or world % pp:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise ParatrainError(
            f"ddp+pp lays workers out as dp x pp: world {world} is not a multiple of pp_size {pp} "
            f"(dp {max(world // pp, 1)} x pp {pp} = {max(world // pp, 1) * pp} != {world}); use pp_size in {fits}"
        )
    return world // pp, pp


class DataPipeline:
    name = "ddp+pp"
    needs_process_group = True
    sharded_state = True

    def check(self, ctx: Context) -> None:
        _, pp = dp_pp(ctx)
        check_pipeline(ctx, pp, "strategy 'ddp+pp'")

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        cfg = ctx.config
        dp, pp = dp_pp(ctx)
        mesh = init_device_mesh(ctx.device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
        return PipelineModule(
            model, schedule=cfg.schedule, pp_rank=mesh.get_local_rank("pp"), pp=pp,
            per_worker=cfg.stages_per_worker, device=ctx.device, microbatches=cfg.microbatches,
            balance=cfg.balance, group=mesh.get_group("pp"), dp=dp, dp_group=mesh.get_group("dp"),
            grad_accum=cfg.grad_accum, strategy=self.name,
        )

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        dp, pp = dp_pp(ctx)
        return ctx.placement.rank // pp, dp

    @staticmethod
    def sync_context(model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        return _gradient_sync(model, sync)
    forward_backward = staticmethod(pipeline_forward_backward)
    unwrap = staticmethod(pipeline_unwrap)


@contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Replicas average gradients after a step only when it completes an accumulation window."""
    if not isinstance(model, PipelineModule):
        yield
        return
    model.sync_grads = sync
    try:
        yield
    finally:
        model.sync_grads = True


class _ReplicatedPipeline(nn.Module):
    """An `MPPipeline` under DDP; DDP is made once the pipeline has been split and placed."""

    def __init__(self, pipe: MPPipeline, ctx: Context) -> None:
        super().__init__()
        self.pipe = pipe
        self._ctx = ctx
        self._ddp: list[nn.Module] = []  # a list, so the DDP wrapper is not a second registered parent

    @property
    def plan(self) -> Any:
        return self.pipe.plan

    def build(self, sample: Any) -> None:
        if not self.pipe.built:
            self.pipe.build(sample)
        if not self._ddp:
            self._ddp.append(apply_ddp(self.pipe, self._ctx, device_ids=None))

    def forward(self, *inputs: Any) -> Any:
        self.build(inputs)
        return self._ddp[0](*inputs)

    def quiet(self) -> AbstractContextManager[Any]:
        return self._ddp[0].no_sync() if self._ddp else nullcontext()  # type: ignore[operator]


def worker_devices(ctx: Context) -> list[torch.device]:
    k = ctx.config.devices_per_worker
    if ctx.device.type != "cuda":
        return [torch.device("cpu")] * k
    first = ctx.placement.local_rank * k
    return [torch.device("cuda", first + i) for i in range(k)]


class DataModelParallel:
    name = "ddp+mp"
    needs_process_group = True

    def check(self, ctx: Context) -> None:
        k, local = ctx.config.devices_per_worker, ctx.placement.local_world_size
        if k < 1:
            raise ParatrainError(f"devices_per_worker must be >= 1, got {k}")
        if ctx.device.type == "cuda" and local * k > cuda_count():
            raise ParatrainError(
                f"ddp+mp: {local} workers x devices_per_worker {k} = {local * k} GPUs needed on this machine but "
                f"{cuda_count()} are visible; use {max(cuda_count() // k, 1)} workers per machine or "
                f"devices_per_worker={max(cuda_count() // max(local, 1), 1)}"
            )
        check_common(ctx.config.microbatches, ctx.config.balance, k, "strategy 'ddp+mp'")

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        pipe = MPPipeline(model, worker_devices(ctx), ctx.config.microbatches, ctx.config.balance)
        pipe.plan.strategy = self.name
        pipe.plan.verbose = ctx.placement.rank == 0
        pipe.agree = lambda values: mean_over_world(values, ctx.device)
        return _ReplicatedPipeline(pipe, ctx)

    data_shard = staticmethod(whole_batch)

    @staticmethod
    def sync_context(model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        if sync or not isinstance(model, _ReplicatedPipeline):
            return nullcontext()
        return model.quiet()

    @staticmethod
    def forward_backward(model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn,
                         backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        if not isinstance(model, _ReplicatedPipeline):
            raise ParatrainError("strategy 'ddp+mp': pass the model returned by run.prepare to forward_backward")
        return pipelined_step(model, model.pipe, inputs, targets, loss_fn, backward, model.build,
                              quiet=model.quiet,
                              reduce_max=lambda v: max_over_world(v, model._ctx.device))

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        return model.pipe.model if isinstance(model, _ReplicatedPipeline) else model


register(DataPipeline())
register(DataModelParallel())
