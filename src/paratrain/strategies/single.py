"""One process, one device: the reference every other strategy is checked against."""

from __future__ import annotations

from torch import nn

from ..errors import ParatrainError
from ._common import identity_unwrap, no_context, plain_forward_backward
from .base import Context


class Single:
    name = "single"
    needs_process_group = False

    def check(self, ctx: Context) -> None:
        if ctx.placement.world_size > 1:
            raise ParatrainError(
                f"strategy 'single' runs in one process but {ctx.placement.world_size} were launched; "
                "use strategy='ddp' for several workers, or launch one process"
            )

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        return model.to(ctx.device)

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return 0, 1

    sync_context = staticmethod(no_context)
    forward_backward = staticmethod(plain_forward_backward)
    unwrap = staticmethod(identity_unwrap)


STRATEGY = Single()
