"""Data-parallel wrapping: DDP, the switch for its gradient synchronisation, and the plain micro-step.

Strategies compose these functions (torchtitan's `apply_ddp` manner; FSDP2 lives in `parallel.data_parallel.fsdp`);
none of them knows about strategy names. `set_ddp_sync` is what `no_sync()` does, written as a
persistent flag so a micro-step can be armed before the user's own forward runs (see `paratrain.step`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ...config import Config
from ...errors import ParatrainError
from ..tensor import local_part


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

    @property
    def plan(self) -> Any:
        """The wrapped pipeline's plan (ddp+mp), so `model.plan` reads the same under DDP."""
        return getattr(self.module, "plan", None)


def _register_comm_hook(model: DistributedDataParallel, name: str | None, process_group: Any) -> None:
    """The lossy hooks, each only when asked for by name: bf16/fp16 compression, PowerSGD (rank 2, with error
    feedback, exact all-reduce for the first 10 steps as its authors advise)."""
    if name is None:
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=process_group, matrix_approximation_rank=2,
                                            start_powerSGD_iter=10, use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return
    hooks = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
    model.register_comm_hook(process_group, hooks[name])


def apply_ddp(model: nn.Module, cfg: Config, device_ids: list[int] | None, process_group: Any = None,
              example: Any = None, device: torch.device | None = None) -> nn.Module:
    """Wrap `model` (already on its device(s)) in DDP with the run's options; comm_hook="auto" measures the
    exact settings on `example` (see `ddp_tuning`) and records its choice as `model.ddp_tuning`."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ParatrainError("DDP needs at least one parameter with requires_grad=True")
    if cfg.comm_hook == "auto":
        from ..options import example_needed
        from . import ddp_tuning

        if example is None:
            raise example_needed("comm_hook='auto'", "it times DDP's exact settings on trial steps")
        where = device or next(model.parameters()).device
        wrapped, choice = ddp_tuning.choose(model, cfg, example, where,
                                            lambda m, c: apply_ddp(m, c, device_ids, process_group))
        wrapped.ddp_tuning = choice  # type: ignore[assignment]
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"paratrain: {choice.describe()}", flush=True)
        return wrapped
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
    _register_comm_hook(wrapped, cfg.comm_hook, process_group)
    return wrapped


def set_ddp_sync(model: nn.Module, sync: bool) -> None:
    """Whether the next backward of every DDP module in `model` all-reduces (False: accumulate locally)."""
    for m in model.modules():
        if isinstance(m, DistributedDataParallel):
            m.require_backward_grad_sync = sync


def average_gradients(params: Iterable[nn.Parameter], group: Any, size: int,
                      buffers: dict[torch.dtype, torch.Tensor]) -> None:
    """Mean gradients over a process group, one all-reduce per dtype over one flat buffer (Megatron's
    contiguous buffer, DDP's `gradient_as_bucket_view`). Plain gradients become views of that buffer, kept in
    `buffers`: while they still are at the next call (zeroed in place, or accumulated into) the buffer is reduced
    where it lies, with no copy; a DTensor's local shard is copied back into it."""
    by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, torch.Tensor]]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append((p, p.grad))
    for dtype, owned in by_dtype.items():
        grads = [local_part(grad) for _, grad in owned]
        kept = buffers.get(dtype)
        reused = kept is not None and _views_of(kept, grads)
        flat = kept if kept is not None and reused else torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= size
        if reused:
            continue
        offset = 0
        for (p, grad), g in zip(owned, grads):
            piece = flat[offset : offset + g.numel()].view_as(g)
            if g is grad:
                p.grad = piece
            else:
                g.copy_(piece)
            offset += g.numel()
        buffers[dtype] = flat


def _views_of(flat: torch.Tensor, grads: list[torch.Tensor]) -> bool:
    """Whether `grads` are, in order, the contiguous pieces of `flat` that fill it."""
    storage, offset = flat.untyped_storage().data_ptr(), flat.storage_offset()
    for g in grads:
        if (g.untyped_storage().data_ptr() != storage or g.storage_offset() != offset
                or not g.is_contiguous()):
            return False
        offset += g.numel()
    return bool(offset == flat.storage_offset() + flat.numel())


def evaluate(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any, device: torch.device) -> Any:
    """The outputs of a forward pass, or given `loss_fn` the mean loss over every rank's rows (ranks may
    hold different numbers, as an evaluation loader gives them), on every rank."""
    from ..._inputs import call
    from ...collectives import all_reduce
    from ..microbatch import batch_size

    out = call(model, inputs)
    if loss_fn is None:
        return out
    rows = float(batch_size(inputs))
    loss = float(loss_fn(out, targets))
    total = all_reduce(torch.tensor([loss * rows, rows], dtype=torch.float64), op="sum", device=device)
    return (total[0] / total[1]).float()


def forward_backward(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any, backward: Any) -> torch.Tensor:
    """The plain micro-step (forward, loss, backward) on this rank's share; returns the mean loss over all
    ranks, each holding an equal share of the global batch (reduced asynchronously: see `mean_later`)."""
    from ..._inputs import call
    from ...collectives import mean_later

    loss = loss_fn(call(model, inputs), targets)  # a dict's fields by name where the forward names them
    backward(loss)
    return mean_later(loss)
