"""Layouts on one DeviceMesh: the grammar's `+`-joined sets of ddp, fsdp, tp, cp, ep and pp, and the presets that
are one of its axes on every worker (`ddp`, `fsdp`, `pp`; `ddp+pp` is the grammar's too).

The model is put in its final form by `parallel.parallelize`, the one build path of every layout; this file is
what the layout does at each step of training: which micro-steps synchronise, how a pipeline's step and loss are
run, which jobs are refused.

    "fsdp+tp", world 4:    tp group {0, 1}  tp group {2, 3}      rows of the global batch
                           dp_shard group {0, 2}, {1, 3}          ranks 0, 1: first half; 2, 3: second half
    "tp+pp", world 4:      stage 0 on ranks {0, 1} (tp group), stage 1 on {2, 3};  pp groups {0, 2}, {1, 3}

Replicas that are the layout's one axis (`ddp`) are torch's DistributedDataParallel; beside another axis they
average when a window ends (`parallel.data_parallel.replicas`); with `fsdp` beside `pp` each stage is one FSDP2 unit
over the ranks holding it (`parallel.pipeline.sharded`), and torch's PipelineStage drives its gradient reduction.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import Config
from ..errors import ParatrainError
from ..parallel.context import own_tokens, share_of
from ..parallel.data_parallel import evaluate, forward_backward, set_ddp_sync
from ..parallel.data_parallel.fsdp import set_fsdp_sync
from ..parallel.data_parallel.replicas import Replicas, Stages
from ..parallel.dims import ParallelDims, canonical, dims_for, parse
from ..parallel.microbatch import pipeline_bound
from ..parallel.options import check_pipeline
from ..parallel.pipeline import schedules
from ..parallel.pipeline.pipelining import PipelineModule
from .base import Backward, Context, LossFn

PRESETS = {"ddp": "dp_replicate", "fsdp": "dp_shard", "pp": "pp"}
"""The presets that are one axis of the grammar on every worker, and the mesh dimension that axis is."""


class NDStrategy:
    needs_process_group = True
    in_process = None

    def __init__(self, name: str) -> None:
        self.name = canonical(name)
        self.axes = parse(name)
        self.microbatched = self.scheduled = "pp" in self.axes
        self.comm_hooks = self.axes == ("ddp",)  # replicas as the one axis are torch's DDP, which takes hooks
        self.sharded_state = self.axes != ("ddp",)

    def degrees(self, config: Config, world: int) -> ParallelDims:
        if self.name in PRESETS:  # every worker on the one axis (`check` refuses a world the layout cannot run)
            return ParallelDims(**{PRESETS[self.name]: world})
        return dims_for(self.name, world, tp_size=config.tp_size, pp_size=config.pp_size,
                        dp_replicate=config.dp_replicate, ep_size=config.ep_size, cp_size=config.cp_size)

    def check(self, ctx: Context) -> None:
        dims, cfg = ctx.dims, ctx.config
        if not dist.is_available():
            raise ParatrainError("this torch build has no torch.distributed; install a build with it")
        if "fsdp" in self.axes:
            try:
                from torch.distributed.fsdp import fully_shard  # noqa: F401
            except ImportError:
                raise ParatrainError(f"strategy {self.name!r} needs torch >= 2.6 "
                                     "(torch.distributed.fsdp.fully_shard)") from None
        if self.comm_hooks and cfg.comm_hook == "powersgd" and ctx.device.type != "cuda":
            raise ParatrainError(
                "comm_hook='powersgd' issues its collectives from completion callbacks, which gloo (CPU workers) "
                "can run in a different order on each rank once the gradients span several buckets (a collective "
                "mismatch); on CPU workers use comm_hook='bf16' (lossy) or 'auto' (exact), or run powersgd on GPUs")
        if self.name == "pp":
            _check_one_pipeline(ctx)
        why = dims.refused()
        if why:
            raise ParatrainError(f"strategy {self.name!r}: {why}")
        if dims.pp > 1:
            check_pipeline(cfg, dims.pp, f"strategy {self.name!r}")

    def bound(self, ctx: Context) -> float:
        dims, cfg = ctx.dims, ctx.config
        if dims.pp == 1:
            return float(ctx.placement.world_size)
        unset = cfg.microbatches is None and cfg.schedule != "auto"  # at least the fewest the schedule runs
        fewest = schedules.row(cfg.schedule).min_microbatches(dims.pp, cfg.stages_per_worker) if unset else None
        return dims.dp * dims.tp * dims.cp * pipeline_bound(dims.pp, fewest if fewest is not None else cfg.microbatches)

    def devices(self, ctx: Context) -> list[torch.device]:
        return [ctx.device]

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return ctx.dims.data_shard(ctx.placement.rank)

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        experts = _experts_of(model)
        if experts is not None:
            experts.sync = sync
        if isinstance(model, Stages):
            model.sync = model.pipe.sync = sync  # the pipeline sums tied gradients when the window ends
        elif isinstance(model, (PipelineModule, Replicas)):
            model.sync = sync
        elif isinstance(model, DistributedDataParallel):
            set_ddp_sync(model, sync)
        else:
            set_fsdp_sync(model, sync)

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        if "pp" not in self.axes:
            share = share_of(self.unwrap(model)) if ctx.config.loss == "token_mean" else None
            if share is None:
                return forward_backward(model, inputs, targets, loss_fn, backward)
            with own_tokens(share, loss_fn) as own_loss:  # each cp rank its own tokens' loss: no logits gathered
                return forward_backward(model, inputs, targets, own_loss, backward)
        from ..parallel.pipeline.pipelining import global_loss

        if not isinstance(model, (Stages, PipelineModule)):
            raise ParatrainError(f"strategy {self.name!r}: pass the model returned by run.prepare to forward_backward")
        pipe = model.pipe if isinstance(model, Stages) else model
        experts = _experts_of(model)
        sync = model.sync
        if experts is not None:  # reduced once per schedule, after its last micro-batch, not after each backward
            experts.sync = False
        local = model(inputs, targets, loss_fn, ctx.config.grad_accum)
        if sync:  # averaged first: the tied sums then write into the averaged buffers in place
            if isinstance(model, Stages):
                model.average()
            pipe.reduce_tied_gradients()
            if experts is not None:
                experts.reduce()
        dims = ctx.dims
        return global_loss(local, dims.dp * dims.tp * dims.cp, ctx.device)  # every tp and cp rank of a last stage

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        if "pp" in self.axes:
            from ..parallel.pipeline import pipelining

            return pipelining.evaluate(model, inputs, targets, loss_fn, ctx.device)
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return ctx.dims.pp

    def unwrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, Stages):
            return model.pipe.holds()
        if isinstance(model, PipelineModule):
            return model.holds()
        return model.module if isinstance(model, (Replicas, DistributedDataParallel)) else model


def _check_one_pipeline(ctx: Context) -> None:
    """`pp`: every worker one pipeline rank."""
    world, pp = ctx.placement.world_size, ctx.config.pp_size
    if world < 2:
        raise ParatrainError(
            f"strategy 'pp' needs at least 2 workers, one per pipeline stage, but {world} was launched; "
            "launch 2 or more (paratrain run --nproc 2 ...), or use strategy='mp' to pipeline in one process")
    if pp is not None and pp != world:
        raise ParatrainError(
            f"strategy 'pp' makes every worker a pipeline rank: pp_size {pp} != world size {world}; "
            f"use pp_size={world} (or leave it unset), or strategy='ddp+pp' for dp x pp workers")


def _experts_of(model: nn.Module) -> Any:
    """The expert gradients' reducer of a prepared model (`parallel.expert.apply.ExpertGrads`), or None."""
    if isinstance(model, Stages):
        return model.pipe.experts
    if isinstance(model, PipelineModule):
        return model.experts
    inner = model.module if isinstance(model, (Replicas, DistributedDataParallel)) else model
    return inner.__dict__.get("_paratrain_experts")
