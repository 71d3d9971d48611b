"""The one order every layout is applied in, gated by its degrees (torchtitan's):

    pipeline split  ->  per stage: tensor -> context -> expert -> activation checkpointing -> compile
                    ->  FSDP2 / HSDP, or replicas

Each step is one `apply_*` of its own module and runs only where its degree is above 1, so a new axis is one more
step here. Tensor parallelism goes first because it turns Linears into DTensor shards that everything after it
sees; context parallelism then replaces attention calls, expert parallelism swaps in each rank's experts;
activation checkpointing and compile wrap the blocks as they finally compute; the data-parallel wrapper comes last,
over whatever the steps left: FSDP2 over "dp_shard" (and "cp": context-parallel ranks hold one replica's weights),
HSDP over "dp_replicate" x "dp_shard", or replicas averaging after the backward.

A pipeline is split first: its stages are traced from the (tensor-parallel) model, so tensor parallelism is
applied to the whole model and the traced stages call the sharded layers; each stage becomes one FSDP2 unit over
the ranks holding it; activation checkpointing and compile then wrap each stage's layers (`stages`), which exist
only once the split is made.

The presets (`single`, `ddp`, `fsdp`, `pp`, `mp`, ...) have one axis and their own wrappers; they call `blocks`
or `stages` at the same point of the order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .._tree import map_tensors
from . import activation_checkpoint
from . import compile as compile_units
from .batchnorm import for_replicas
from .data_parallel.fsdp import apply_fsdp
from .data_parallel.replicas import Replicas, Stages
from .dims import ParallelDims

if TYPE_CHECKING:
    from ..strategies.base import Context


def blocks(model: nn.Module, ctx: Context) -> None:
    """Activation checkpointing, then compile, per block of a model each process runs whole."""
    activation_checkpoint.without_cache(model, ctx.config.activation_checkpointing, ctx.dims.cp > 1)
    _checkpoint_and_compile(activation_checkpoint.blocks(model), ctx)


def stages(wrapped: nn.Module, ctx: Context) -> nn.Module:
    """Activation checkpointing, then compile, per layer of the pipeline stages this process holds."""
    _checkpoint_and_compile(activation_checkpoint.stages(wrapped), ctx)
    return wrapped


def _checkpoint_and_compile(units: list[tuple[str, nn.Module]], ctx: Context) -> None:
    activation_checkpoint.apply(units, ctx.config.activation_checkpointing)
    compile_units.apply(units, ctx.config.compile, ctx.device)


def parallelize(model: nn.Module, dims: ParallelDims, ctx: Context, example: Any, name: str) -> nn.Module:
    """`model` in its final form for an N-D layout: every step of the order whose degree is above 1."""
    from ..weights.build import place

    cfg = ctx.config
    model = for_replicas(model, cfg.batchnorm, ctx.device, dims.dp, False, f"strategy {name!r}")
    model = place(model, ctx.device)  # a meta model stays meta: each rank's share is made real after
    mesh = dims.build_mesh(ctx.device.type)
    plan = _tensor(model, mesh, dims, ctx, example) if dims.tp > 1 else None
    if dims.pp > 1:  # the stages are split next; context and expert parallelism then live inside them
        own = set(_experts(model, dims, ctx).params) if dims.ep > 1 else set()
        return stages(_pipeline(model, mesh, dims, ctx, example, name, plan, own), ctx)
    if dims.cp > 1:
        from .context import apply_cp

        apply_cp(model, mesh["cp"].get_group(), dims.cp, mesh.get_local_rank("cp"))
    own = set(_experts(model, dims, ctx).params) if dims.ep > 1 else set()  # reduced there, not by the data axes
    blocks(model, ctx)
    if dims.dp_shard > 1:
        return apply_fsdp(model, _shard_mesh(dims, mesh), precision=cfg.precision, ignored=own)
    if dims.dp_replicate * dims.cp > 1:  # context-parallel ranks average as replicas do (parallel.context)
        group = mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp") if dims.cp > 1 else mesh["dp_replicate"]
        return Replicas(model, group.get_group(), dims.dp_replicate * dims.cp, skip=own)
    return model


def _tensor(model: nn.Module, mesh: Any, dims: ParallelDims, ctx: Context, example: Any) -> dict[str, Any]:
    from .tensor.apply import apply_tp
    from .tensor.plan import check_plan, describe, find_plan

    plan, source = find_plan(model, ctx.config.tp_plan)
    if dims.ep > 1:  # the experts are expert parallelism's: split whole over the ep ranks, not inside
        plan = _without_experts(model, plan)
    check_plan(model, plan, dims.tp)
    example = map_tensors(lambda t: t.to(ctx.device), example) if example is not None else None
    plan, settled = apply_tp(model, mesh["tp"], plan, example)
    if ctx.placement.rank == 0:
        print(f"paratrain: {describe(plan, source, dims.tp)}", flush=True)
        for note in settled:
            print(f"paratrain: tensor parallel: {note}", flush=True)
    return plan


def _without_experts(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    from .expert.find import find

    inside = tuple(e.path for e in find(model))
    return {name: style for name, style in plan.items()
            if not any(name == path or name.startswith(path + ".") for path in inside)}


def _pipeline(model: nn.Module, mesh: Any, dims: ParallelDims, ctx: Context, example: Any, name: str,
              plan: dict[str, Any] | None, experts: set[nn.Parameter]) -> Stages:
    """Expert and context parallelism inside the stages need stages of the model's own blocks (`pipeline.blocks`):
    a traced stage cannot run an expert dispatch or attention over the shares."""
    from .context import Share
    from .pipeline.pipelining import PipelineModule

    cfg = ctx.config
    share = Share(mesh["cp"].get_group(), dims.cp, mesh.get_local_rank("cp")) if dims.cp > 1 else None
    pipe = PipelineModule(
        model, schedule=cfg.schedule, pp_rank=mesh.get_local_rank("pp"), pp=dims.pp,
        per_worker=cfg.stages_per_worker, device=ctx.device, microbatches=cfg.microbatches,
        balance=cfg.balance, example=example, group=mesh.get_group("pp"), strategy=name,
        batchnorm=cfg.batchnorm, checkpointing=cfg.activation_checkpointing, compiling=cfg.compiling,
        tp_plan=plan, shard_mesh=_shard_mesh(dims, mesh), precision=cfg.precision, share=share,
        own_blocks=dims.cp > 1 or dims.ep > 1, unsharded=experts)
    pipe.experts = model.__dict__.get("_paratrain_experts")
    # HSDP's FSDP reduces over the replicas too; plain replicas of a pipeline (and its cp ranks) average here
    if dims.dp_shard > 1:
        return Stages(pipe, mesh["dp_replicate"].get_group(), 1)
    group = mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp") if dims.cp > 1 else mesh["dp_replicate"]
    return Stages(pipe, group.get_group(), dims.dp_replicate * dims.cp, skip=experts)


def _experts(model: nn.Module, dims: ParallelDims, ctx: Context) -> Any:
    from .expert.apply import Groups, apply_ep

    mesh, replicas = dims.build_expert_mesh(ctx.device.type)
    grads = apply_ep(model, Groups(mesh=mesh, rank=mesh.get_local_rank(), size=dims.ep,
                                   replicas=replicas.get_group(), replica_count=replicas.size(),
                                   data_parallel=dims.dp))
    model.__dict__["_paratrain_experts"] = grads  # the strategy's set_gradient_sync finds it there
    if ctx.placement.rank == 0:
        print(f"paratrain: expert parallel: {dims.ep} ranks per expert group, "
              f"{replicas.size()} holding the same experts", flush=True)
    return grads


def _shard_mesh(dims: ParallelDims, mesh: Any) -> Any:
    """FSDP's mesh: "dp_shard", or HSDP's "dp_replicate" x "dp_shard"; None without sharding."""
    if dims.dp_shard == 1:
        return None
    if dims.cp > 1:  # shards over the context-parallel ranks too: they hold one replica's weights (torchtitan)
        flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else flat
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
