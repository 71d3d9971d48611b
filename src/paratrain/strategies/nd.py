"""N-D strategies from the grammar: any `+`-joined set of ddp, fsdp, tp and pp on one DeviceMesh (`parallel.dims`).
The preset `ddp+pp` is one of them: replicas of a pipeline, the pipeline axis outermost.

The model goes through an ordered list of `apply_*` steps gated by the degrees, torchtitan's order: tensor
parallelism first (it changes the Linears into DTensor shards), then the data-parallel wrapper over the rest of
the mesh: FSDP2 over "dp_shard" (HSDP over "dp_replicate" x "dp_shard" when both are named), or replicas that
average their gradients over "dp_replicate" after the backward (DDP's reducer does not take DTensor shards).

    "fsdp+tp", world 4:    tp group {0, 1}  tp group {2, 3}      rows of the global batch
                           dp_shard group {0, 2}, {1, 3}          ranks 0, 1: first half; 2, 3: second half

With `pp` in the name the model is split into pipeline stages after tensor parallelism (torchtitan's order: split,
then shard each stage): the traced stages call the sharded layers themselves (`parallel.tensor.traced`), each
"pp" group of the mesh runs one schedule, and replicas ("dp_replicate") average their stages' gradients when a
window ends (`ddp+pp`: DDP itself cannot wrap a stage, since torch's pipeline stages drive DDP's reducer by hand,
which fails its bucket rebuild after the first step with several micro-batches, and a zero-bubble weight backward
bypasses its hooks). With `fsdp` beside `pp`, each stage becomes one FSDP2 unit over the ranks holding it
(`parallel.pipeline.sharded`); torch's PipelineStage drives its gradient reduction.

    "tp+pp", world 4:      stage 0 on ranks {0, 1} (tp group), stage 1 on {2, 3};  pp groups {0, 2}, {1, 3}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._tree import map_tensors, tensors_in
from ..errors import ParatrainError
from ..parallel.batchnorm import for_replicas
from ..parallel.data_parallel import average_gradients, evaluate, forward_backward
from ..parallel.data_parallel.fsdp import apply_fsdp, set_fsdp_sync
from ..parallel.dims import ParallelDims, canonical, parse
from ..parallel.microbatch import pipeline_bound
from ..parallel.options import check_pipeline
from ..weights.build import place
from .base import Backward, Context, LossFn

if TYPE_CHECKING:
    from ..parallel.pipeline.pipelining import PipelineModule


class _Replicas(nn.Module):
    """A (tensor-parallel) model whose gradients are averaged over its data-parallel replicas after each
    backward that ends an accumulation window."""

    def __init__(self, module: nn.Module, group: Any, size: int, skip: set[nn.Parameter] | None = None) -> None:
        super().__init__()
        self.module, self.group, self.size = module, group, size
        self.flat_grads: dict[torch.dtype, torch.Tensor] = {}  # see average_gradients
        self.sync = True
        self.skip = {id(p) for p in skip or ()}
        """Parameters whose gradients are reduced elsewhere (experts: `parallel.expert`)."""

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
        average_gradients((p for p in self.module.parameters() if id(p) not in self.skip), self.group, self.size,
                          self.flat_grads)


class _Stages(nn.Module):
    """One pipeline rank's (tensor-parallel) stages, and the replicas that hold the same stages."""

    def __init__(self, pipe: PipelineModule, group: Any, size: int) -> None:
        super().__init__()
        self.pipe, self.group, self.size = pipe, group, size
        self.flat_grads: dict[torch.dtype, torch.Tensor] = {}  # see average_gradients
        self.sync = True

    @property
    def plan(self) -> Any:
        return self.pipe.plan

    def forward(self, inputs: Any, targets: Any = None, loss_fn: LossFn | None = None, loss_scale: int = 1) -> Any:
        return self.pipe(inputs, targets, loss_fn, loss_scale)

    def average(self) -> None:
        if self.size > 1:
            average_gradients(self.pipe.parameters(), self.group, self.size, self.flat_grads)


class NDStrategy:
    needs_process_group = True
    sharded_state = True
    comm_hooks = False

    def __init__(self, name: str) -> None:
        self.name = canonical(name)
        self.axes = parse(name)
        self.microbatched = self.scheduled = "pp" in self.axes

    def dims(self, ctx: Context) -> ParallelDims:
        return ctx.dims  # built once per context, not parsed again at every micro-step

    def check(self, ctx: Context) -> None:
        dims = self.dims(ctx)
        if dims.ep > 1 and (dims.pp > 1 or dims.tp > 1 or dims.cp > 1):
            raise ParatrainError(
                f"strategy {self.name!r}: expert parallelism runs beside data parallelism (ep, ddp+ep, fsdp+ep, "
                "ddp+fsdp+ep); with tp, cp or pp it is not built: drop 'ep', or drop the model axes")
        if dims.cp > 1 and (dims.pp > 1 or dims.dp_replicate > 1 and dims.dp_shard > 1):
            raise ParatrainError(
                f"strategy {self.name!r}: context parallelism runs beside tensor parallelism and one data-parallel "
                "axis (cp, tp+cp, ddp+cp, fsdp+cp); with pp or hybrid sharding it is not built: drop 'cp', or drop "
                "the other axes")
        if dims.pp > 1:
            check_pipeline(ctx.config, dims.pp, f"strategy {self.name!r}")

    def bound(self, ctx: Context) -> float:
        dims = self.dims(ctx)
        if dims.pp > 1:
            return dims.dp * dims.tp * pipeline_bound(dims.pp, ctx.config.microbatches)
        return float(ctx.placement.world_size)

    def devices(self, ctx: Context) -> list[torch.device]:
        return [ctx.device]

    def wrap(self, model: nn.Module, ctx: Context, example: Any) -> nn.Module:
        from ..parallel.tensor.apply import apply_tp
        from ..parallel.tensor.plan import check_plan, describe, find_plan

        dims = self.dims(ctx)
        cfg = ctx.config
        model = for_replicas(model, cfg.batchnorm, ctx.device, dims.dp, False, f"strategy {self.name!r}")
        model = place(model, ctx.device)  # a meta model stays meta: each rank's share is made real after
        mesh = dims.build_mesh(ctx.device.type)
        if dims.tp > 1:
            plan, source = find_plan(model, cfg.tp_plan)
            check_plan(model, plan, dims.tp)
            example = map_tensors(lambda t: t.to(ctx.device), example) if example is not None else None
            plan, settled = apply_tp(model, mesh["tp"], plan, example)
            if ctx.placement.rank == 0:
                print(f"paratrain: {describe(plan, source, dims.tp)}", flush=True)
                for note in settled:
                    print(f"paratrain: tensor parallel: {note}", flush=True)
        experts = self._experts(model, dims, ctx) if dims.ep > 1 else None
        if dims.cp > 1:
            from ..parallel.context import apply_cp

            apply_cp(model, mesh["cp"].get_group(), dims.cp, mesh.get_local_rank("cp"))
        if dims.pp > 1:
            from ..parallel.pipeline.pipelining import PipelineModule

            pipe = PipelineModule(
                model, schedule=cfg.schedule, pp_rank=mesh.get_local_rank("pp"), pp=dims.pp,
                per_worker=cfg.stages_per_worker, device=ctx.device, microbatches=cfg.microbatches,
                balance=cfg.balance, example=example, group=mesh.get_group("pp"), strategy=self.name,
                batchnorm=cfg.batchnorm, checkpointing=cfg.activation_checkpointing, compiling=cfg.compiling,
                tp_plan=plan if dims.tp > 1 else None, shard_mesh=self._shard_mesh(dims, mesh),
                precision=cfg.precision)
            # HSDP's FSDP reduces over the replicas too; plain replicas of a pipeline average here
            return _Stages(pipe, mesh["dp_replicate"].get_group(), dims.dp_replicate if dims.dp_shard == 1 else 1)
        own = set(experts.params) if experts is not None else set()  # reduced by `experts`, not the data axes
        if dims.dp_shard > 1:
            return apply_fsdp(model, self._shard_mesh(dims, mesh), precision=cfg.precision, ignored=own)
        if dims.dp_replicate * dims.cp > 1:  # context-parallel ranks average as replicas do (parallel.context)
            group = mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp") if dims.cp > 1 else mesh["dp_replicate"]
            return _Replicas(model, group.get_group(), dims.dp_replicate * dims.cp, skip=own)
        return model

    @staticmethod
    def _experts(model: nn.Module, dims: ParallelDims, ctx: Context) -> Any:
        from ..parallel.expert.apply import Groups, apply_ep

        mesh, replicas = dims.build_expert_mesh(ctx.device.type)
        grads = apply_ep(model, Groups(mesh=mesh, rank=mesh.get_local_rank(), size=dims.ep,
                                       replicas=replicas.get_group(), replica_count=replicas.size(),
                                       data_parallel=dims.dp))
        model.__dict__["_paratrain_experts"] = grads  # set_gradient_sync finds it there
        if ctx.placement.rank == 0:
            print(f"paratrain: expert parallel: {dims.ep} ranks per expert group, "
                  f"{replicas.size()} holding the same experts", flush=True)
        return grads

    @staticmethod
    def _shard_mesh(dims: ParallelDims, mesh: Any) -> Any:
        """FSDP's mesh: "dp_shard", or HSDP's "dp_replicate" x "dp_shard"; None without sharding."""
        if dims.dp_shard == 1:
            return None
        if dims.cp > 1:  # shards over the context-parallel ranks too: they hold one replica's weights (torchtitan)
            return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return self.dims(ctx).data_shard(ctx.placement.rank)

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        experts = self.unwrap(model).__dict__.get("_paratrain_experts")
        if experts is not None:
            experts.sync = sync
        if isinstance(model, _Stages):
            model.sync = model.pipe.sync = sync  # the pipeline sums tied gradients when the window ends
        elif isinstance(model, _Replicas):
            model.sync = sync
        else:
            set_fsdp_sync(model, sync)

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        if "pp" not in self.axes:
            return forward_backward(model, inputs, targets, loss_fn, backward)
        from ..parallel.pipeline.pipelining import global_loss

        if not isinstance(model, _Stages):
            raise ParatrainError(f"strategy {self.name!r}: pass the model returned by run.prepare to forward_backward")
        local = model(inputs, targets, loss_fn, ctx.config.grad_accum)
        if model.sync:  # averaged first: the tied sums then write into the averaged buffers in place
            model.average()
            model.pipe.reduce_tied_gradients()
        dims = self.dims(ctx)
        return global_loss(local, dims.dp * dims.tp, ctx.device)  # every tensor rank of a last stage holds it

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        if "pp" in self.axes:
            from ..parallel.pipeline import pipelining

            return pipelining.evaluate(model, inputs, targets, loss_fn, ctx.device)
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return self.dims(ctx).pp

    def unwrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, _Stages):
            return model.pipe.holds()
        return model.module if isinstance(model, _Replicas) else model
