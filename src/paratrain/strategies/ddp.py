"""DistributedDataParallel: one process per device, gradients all-reduced in buckets during backward."""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ParatrainError, unknown_name
from ._common import plain_forward_backward, whole_batch
from .base import Context

_HOOKS = ("bf16", "fp16")


class _DDP(DistributedDataParallel):
    """DDP whose "expected to have finished reduction" error names the parameters that got no gradient."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as exc:
            if "finished reduction" not in str(exc):
                raise
            unused = [n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
            names = ", ".join(unused) if unused else "(none found by name; set TORCH_DISTRIBUTED_DEBUG=DETAIL)"
            raise ParatrainError(
                f"DDP: parameters did not take part in the previous backward: {names}. "
                "Use them in forward, freeze them (requires_grad=False), or pass "
                "setup(find_unused_parameters=True)"
            ) from exc


def register_comm_hook(model: DistributedDataParallel, name: str | None) -> None:
    if name is None:
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
    if name not in hooks:
        raise unknown_name("comm_hook", name, hooks)
    model.register_comm_hook(None, hooks[name])


def convert_sync_batchnorm(model: nn.Module, ctx: Context) -> nn.Module:
    if not ctx.config.sync_batchnorm:
        return model
    if ctx.device.type != "cuda":
        # torch's SyncBatchNorm runs on GPUs only; on CPU workers statistics stay per worker.
        warnings.warn("sync_batchnorm=True is ignored on CPU workers (torch supports SyncBatchNorm on CUDA only)",
                      stacklevel=3)
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def apply_ddp(model: nn.Module, ctx: Context, process_group: Any = None, device_ids: Any = "auto") -> nn.Module:
    """Wrap `model` (already on its device(s)) in DDP with the run's options."""
    cfg = ctx.config
    if device_ids == "auto":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    kwargs: dict[str, Any] = {
        "device_ids": device_ids,
        "process_group": process_group,
        "find_unused_parameters": cfg.find_unused_parameters,
        "static_graph": cfg.static_graph,
        "gradient_as_bucket_view": cfg.gradient_as_bucket_view,
    }
    if cfg.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = cfg.bucket_cap_mb
    wrapped = _DDP(model, **kwargs)
    register_comm_hook(wrapped, cfg.comm_hook)
    return wrapped


class DDP:
    name = "ddp"
    needs_process_group = True

    def check(self, ctx: Context) -> None:
        if ctx.config.comm_hook is not None and ctx.config.comm_hook not in _HOOKS:
            raise unknown_name("comm_hook", ctx.config.comm_hook, _HOOKS)
        if not dist.is_available():
            raise ParatrainError("this torch build has no torch.distributed; install a build with it")

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            raise ParatrainError("DDP needs at least one parameter with requires_grad=True")
        model = convert_sync_batchnorm(model, ctx).to(ctx.device)
        return apply_ddp(model, ctx)

    data_shard = staticmethod(whole_batch)

    @staticmethod
    def sync_context(model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        return _sync_toggle(model, sync)

    forward_backward = staticmethod(plain_forward_backward)

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model


class _sync_toggle(AbstractContextManager[Any]):
    """`no_sync()` for DDP models found anywhere in the wrapped module; a no-op when sync is wanted."""

    def __init__(self, model: nn.Module, sync: bool) -> None:
        self._ctxs = [] if sync else [m.no_sync() for m in model.modules() if isinstance(m, DistributedDataParallel)]

    def __enter__(self) -> None:
        for c in self._ctxs:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self._ctxs):
            c.__exit__(*exc)


STRATEGY = DDP()
