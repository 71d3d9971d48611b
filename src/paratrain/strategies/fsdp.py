"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over data-parallel ranks.

Each child module that owns parameters becomes one FSDP unit (its parameters are all-gathered just
before it runs and freed after), then the root is sharded too. Gradients are reduce-scattered and
averaged, so training matches DDP and the single-process run at the same global batch.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Any

from torch import nn

from ..errors import ParatrainError
from . import register
from ._common import identity_unwrap, plain_forward_backward, whole_batch
from .base import Context


def apply_fsdp(model: nn.Module, mesh: Any = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    units = [m for m in model.children() if any(True for _ in m.parameters())]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class FSDP:
    name = "fsdp"
    needs_process_group = True
    sharded_state = True

    def check(self, ctx: Context) -> None:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            raise ParatrainError("strategy 'fsdp' needs torch >= 2.6 (torch.distributed.fsdp.fully_shard)") from None

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        return apply_fsdp(model.to(ctx.device))

    data_shard = staticmethod(whole_batch)

    @staticmethod
    def sync_context(model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        return _gradient_sync(model, sync)

    forward_backward = staticmethod(plain_forward_backward)
    unwrap = staticmethod(identity_unwrap)


@contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Any:
    setter = getattr(model, "set_requires_gradient_sync", None)
    if sync or setter is None:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)


STRATEGY = FSDP()
register(STRATEGY)
