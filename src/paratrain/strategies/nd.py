"""N-D strategies from the grammar: any `+`-joined set of ddp, fsdp and tp on one DeviceMesh (`parallel.dims`).

The model goes through an ordered list of `apply_*` steps gated by the degrees, torchtitan's order: tensor
parallelism first (it changes the Linears into DTensor shards), then the data-parallel wrapper over the rest of
the mesh: FSDP2 over "dp_shard" (HSDP over "dp_replicate" x "dp_shard" when both are named), or replicas that
average their gradients over "dp_replicate" after the backward (DDP's reducer does not take DTensor shards).

    "fsdp+tp", world 4:    tp group {0, 1}  tp group {2, 3}      rows of the global batch
                           dp_shard group {0, 2}, {1, 3}          ranks 0, 1: first half; 2, 3: second half

Pipelines (`pp` in the name) are refused here until stages can hold tensor-parallel blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._tree import map_tensors, tensors_in
from ..errors import ParatrainError
from ..parallel.batchnorm import for_replicas
from ..parallel.data_parallel import average_in_place, evaluate, forward_backward
from ..parallel.data_parallel.fsdp import apply_fsdp, set_fsdp_sync
from ..parallel.dims import ParallelDims, canonical, dims_for, parse
from .base import Backward, Context, LossFn


class _Replicas(nn.Module):
    """A (tensor-parallel) model whose gradients are averaged over its data-parallel replicas after each
    backward that ends an accumulation window."""

    def __init__(self, module: nn.Module, group: Any, size: int) -> None:
        super().__init__()
        self.module, self.group, self.size = module, group, size
        self.sync = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        if self.sync and torch.is_grad_enabled():
            # As DDP does: a hook on the output queues the average for the end of this backward pass, so the
            # user's own `loss.backward()` averages too.
            first = next((t for t in tensors_in(out) if t.requires_grad), None)
            if first is not None:
                first.register_hook(self._queue)
        return out

    def _queue(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self.average)  # type: ignore[attr-defined]
        return grad

    def average(self) -> None:
        # a DTensor's gradient is averaged through its local shard, which shares its storage
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        average_in_place([g.to_local() if hasattr(g, "to_local") else g for g in grads], self.group, self.size)


class NDStrategy:
    needs_process_group = True
    sharded_state = True
    microbatched = False
    scheduled = False
    comm_hooks = False

    def __init__(self, name: str) -> None:
        self.name = canonical(name)
        self.axes = parse(name)

    def dims(self, ctx: Context) -> ParallelDims:
        cfg = ctx.config
        return dims_for(self.name, ctx.placement.world_size, tp_size=cfg.tp_size, pp_size=cfg.pp_size,
                        dp_replicate=cfg.dp_replicate)

    def check(self, ctx: Context) -> None:
        if "pp" in self.axes:
            raise ParatrainError(
                f"strategy {self.name!r}: pipeline stages holding tensor-parallel or sharded blocks are not built "
                "yet; use 'ddp+pp' or 'pp' for pipelines, or 'fsdp+tp' / 'ddp+tp' without one")
        self.dims(ctx)

    def bound(self, ctx: Context) -> float:
        return float(ctx.placement.world_size)

    def devices(self, ctx: Context) -> list[torch.device]:
        return [ctx.device]

    def wrap(self, model: nn.Module, ctx: Context, example: Any) -> nn.Module:
        from ..parallel.tensor.apply import apply_tp
        from ..parallel.tensor.plan import check_plan, describe, find_plan

        dims = self.dims(ctx)
        cfg = ctx.config
        model = for_replicas(model, cfg.batchnorm, ctx.device, dims.dp, False, f"strategy {self.name!r}")
        model = model.to(ctx.device)
        mesh = dims.build_mesh(ctx.device.type)
        if dims.tp > 1:
            plan, source = find_plan(model, cfg.tp_plan)
            check_plan(model, plan, dims.tp)
            example = map_tensors(lambda t: t.to(ctx.device), example) if example is not None else None
            model = apply_tp(model, mesh["tp"], plan, example)
            if ctx.placement.rank == 0:
                print(f"paratrain: {describe(plan, source, dims.tp)}", flush=True)
        if dims.dp_shard > 1:
            dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
            return apply_fsdp(model, dp_mesh, precision=cfg.precision)
        if dims.dp_replicate > 1:
            return _Replicas(model, mesh["dp_replicate"].get_group(), dims.dp_replicate)
        return model

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return self.dims(ctx).data_shard(ctx.placement.rank)

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        if isinstance(model, _Replicas):
            model.sync = sync
        else:
            set_fsdp_sync(model, sync)

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        return forward_backward(model, inputs, targets, loss_fn, backward)

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, _Replicas) else model
