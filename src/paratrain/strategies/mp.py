"""Strategy "mp": one process drives several devices, one model stage on each, micro-batches pipelined.

The tutorials' `ModelParallelResNet50` and its `split_size` loop, without writing `seq1`/`seq2`: the
model is split and balanced automatically (see `parallel.mp_pipeline`). On a machine without CUDA every
stage sits on "cpu", so the same script runs (and is tested) anywhere; speed only matters on GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from ..collectives import all_reduce
from ..errors import ParatrainError
from ..parallel.balance import MODES
from ..parallel.microbatch import batch_size
from ..parallel.mp_pipeline import MPPipeline, tune
from ..runtime import cuda_count
from . import register
from ._common import no_context
from .base import Context, LossFn


def check_common(microbatches: Any, balance: Any, stages: int, where: str) -> None:
    if microbatches != "auto" and (not isinstance(microbatches, int) or microbatches < 1):
        raise ParatrainError(f"{where}: microbatches must be a positive int or 'auto', got {microbatches!r}")
    if isinstance(balance, str):
        if balance not in MODES:
            raise ParatrainError(f"{where}: balance must be a list of layer counts or one of {MODES}, got {balance!r}")
    elif len(balance) != stages:
        raise ParatrainError(
            f"{where}: balance {list(balance)} has {len(balance)} entries but there are {stages} stages; "
            f"give one layer count per stage, or balance='time'"
        )


def mp_devices(ctx: Context) -> list[torch.device]:
    requested = ctx.config.devices
    if ctx.device.type != "cuda":
        return [torch.device("cpu")] * (len(requested) if requested else 2)
    if not requested:
        return [torch.device("cuda", i) for i in range(cuda_count())]
    return [torch.device(d) for d in requested]


def _on(value: Any, like: Any) -> Any:
    device = like.device if isinstance(like, torch.Tensor) else None
    if device is None and isinstance(like, list | tuple) and like and isinstance(like[0], torch.Tensor):
        device = like[0].device
    if isinstance(value, torch.Tensor) and device is not None:
        return value.to(device, non_blocking=True)
    return value


def pipelined_step(model: nn.Module, pipe: MPPipeline, inputs: Any, targets: Any, loss_fn: LossFn,
                   backward: Callable[[torch.Tensor], None], build: Callable[[Any], None],
                   quiet: Callable[[], AbstractContextManager[Any]] = nullcontext,
                   reduce_max: Callable[[float], float] | None = None) -> torch.Tensor:
    """One step of a single-process pipeline (also under DDP): split on first use, resolve
    microbatches='auto' by trial steps, watch memory on the first real step."""
    build((inputs,))
    if pipe.microbatches == "auto":
        def trial() -> None:
            with quiet():
                out = model(inputs)
                loss_fn(out, _on(targets, out)).backward()

        tune(pipe, trial, batch_size(inputs), reduce_max)

    def real() -> torch.Tensor:
        out = model(inputs)
        loss = loss_fn(out, _on(targets, out))
        backward(loss)
        return loss

    loss = pipe.measure_memory(real) if pipe.plan.memory is None else real()
    return all_reduce(loss.detach().float(), op="mean")


class ModelParallel:
    name = "mp"
    needs_process_group = False

    def check(self, ctx: Context) -> None:
        cfg = ctx.config
        if ctx.placement.world_size > 1:
            raise ParatrainError(
                f"strategy 'mp' runs in one process that drives every stage's device, but "
                f"{ctx.placement.world_size} processes were launched; launch one process, or use "
                "strategy='ddp+mp' (each process its own devices) or 'pp' (one process per stage)"
            )
        if cfg.devices is not None and len(cfg.devices) < 1:
            raise ParatrainError("devices must list at least one device, e.g. devices=['cuda:0', 'cuda:1']")
        devices = mp_devices(ctx)
        bad = [str(d) for d in devices if d.type == "cuda" and (d.index or 0) >= cuda_count()]
        if bad:
            raise ParatrainError(f"devices {bad} do not exist: {cuda_count()} GPU(s) visible; use cuda:0..cuda:"
                                 f"{cuda_count() - 1}")
        check_common(cfg.microbatches, cfg.balance, len(devices), "strategy 'mp'")

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        return MPPipeline(model, mp_devices(ctx), ctx.config.microbatches, ctx.config.balance)

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return 0, 1

    sync_context = staticmethod(no_context)

    @staticmethod
    def forward_backward(model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn,
                         backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        pipe = model if isinstance(model, MPPipeline) else None
        if pipe is None:
            raise ParatrainError("strategy 'mp': pass the model returned by run.prepare to forward_backward")

        def build(sample: Any) -> None:
            if not pipe.built:
                pipe.build(sample)

        return pipelined_step(model, pipe, inputs, targets, loss_fn, backward, build)

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        return model.model if isinstance(model, MPPipeline) else model


STRATEGY = ModelParallel()
register(STRATEGY)
