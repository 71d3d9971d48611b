"""torch.nn.DataParallel: one process driving every visible GPU (kept for the tutorials; ddp is faster)."""

from __future__ import annotations

from torch import nn

from ..errors import ParatrainError
from ..runtime import cuda_count
from ._common import no_context, plain_forward_backward
from .base import Context


class DataParallel:
    name = "dp"
    needs_process_group = False

    def check(self, ctx: Context) -> None:
        if cuda_count() == 0 or ctx.device.type != "cuda":
            raise ParatrainError(
                "strategy 'dp' (torch.nn.DataParallel) needs CUDA GPUs and none are visible; on CPU use "
                "strategy='ddp' and start one worker per core: paratrain run --nproc N script.py"
            )
        if ctx.placement.world_size > 1:
            raise ParatrainError(
                "strategy 'dp' runs in a single process that drives all GPUs, but "
                f"{ctx.placement.world_size} processes were launched; launch one process, or use strategy='ddp'"
            )

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        return nn.DataParallel(model.to(ctx.device))

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return 0, 1

    sync_context = staticmethod(no_context)
    forward_backward = staticmethod(plain_forward_backward)

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model


STRATEGY = DataParallel()
