"""The one build path of every layout, presets included: a `ParallelDims` (and, for the one-process presets, the
process's devices) applied in one visible order (torchtitan's):

    dropout placement -> router statistics -> batchnorm for the replicas
    -> split into stages (over processes: `pp`; over this process's devices: `mp`, `ddp+mp`)
    -> per stage: tensor -> context -> expert -> activation checkpointing -> compile
    -> FSDP2 / HSDP, or replicas (DDP's buckets, DataParallel's devices, or an average after the backward)
    -> random-call watching -> autocast

Each step is one `apply_*` of its own module and runs only where its degree is above 1 (or the strategy's facts
ask for it: `Strategy.in_process`), so a new axis is one more step here and nothing branches on strategy names.
Tensor parallelism goes first inside the model because it turns Linears into DTensor shards that everything after
it sees; context parallelism then replaces attention calls, expert parallelism swaps in each rank's experts;
activation checkpointing and compile wrap the blocks as they finally compute; the data-parallel wrapper comes last,
over whatever the steps left: FSDP2 over "dp_shard" (and "cp": context-parallel ranks hold one replica's weights),
HSDP over "dp_replicate" x "dp_shard", or replicas: torch's DDP where the replicas are the layout's one axis (its
buckets overlap the backward), an average after the backward (`Replicas`) beside any other axis.

A pipeline over processes is split first: its stages are traced from the (tensor-parallel) model, or made of the
model's own blocks where expert or context parallelism lives inside them (`pipeline.blocks`), so tensor
parallelism is applied to the whole model and the stages call the sharded layers; each stage becomes one FSDP2 unit
over the ranks holding it; activation checkpointing and compile then wrap each stage's layers, which exist only
once the split is made.

`Run.prepare` is: make this rank's share real (meta builds), `parallelize`, track the step.
"""

from __future__ import annotations

from collections.abc import Callable
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
    from ..strategies.base import Context, Strategy
    from .random_calls import RandomCalls


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


def parallelize(model: nn.Module, strategy: Strategy, ctx: Context, example: Any, calls: RandomCalls | None = None,
                say: Callable[[str], None] = print) -> nn.Module:
    """`model` in its final form for `strategy` on this rank: every step of the order its layout asks for. `calls`
    (the run's random-call record) is watched on the built model; `example` is what a split traces and measures."""
    from ..precision import apply_autocast
    from .expert.router_stats import install as watch_router_statistics
    from .random_calls import watch as watch_random_calls
    from .randomness import apply_layout_dropout

    cfg = ctx.config
    apply_layout_dropout(model)  # before any split: a module's masks are placed by its path in the whole model
    watch_router_statistics(model)
    built = _layout(_batchnorm(model, strategy, ctx), strategy, ctx, example)
    if calls is not None:
        built = watch_random_calls(built, calls, cfg.compiling, say)
    return apply_autocast(built, cfg.precision, ctx.device.type)


def _batchnorm(model: nn.Module, strategy: Strategy, ctx: Context) -> nn.Module:
    """Global-batch statistics where the replicas span every rank (the default group), as `for_replicas` rules."""
    dims = ctx.dims
    return for_replicas(model, ctx.config.batchnorm, ctx.device, dims.dp, dims.dp == dims.world,
                        f"strategy {strategy.name!r}", modules_run=not strategy.microbatched)


def _layout(model: nn.Module, strategy: Strategy, ctx: Context, example: Any) -> nn.Module:
    """Split -> per stage: tp -> cp -> ep -> checkpointing -> compile -> the data-parallel wrapper."""
    from ..weights.build import place

    cfg, dims = ctx.config, ctx.dims
    if strategy.in_process == "stages":  # this process's devices hold the stages; replicas are other processes
        pipe = stages(_device_stages(model, strategy, ctx, example), ctx)
        return _ddp(pipe, ctx, None, one_device=False) if strategy.needs_process_group else pipe
    model = place(model, ctx.device)  # a meta model stays meta: each rank's share is made real after
    if strategy.in_process == "replicas":  # this process's devices are the replicas (torch's DataParallel)
        blocks(model, ctx)
        return nn.DataParallel(model)
    mesh: Any = dims.build_mesh(ctx.device.type) if _meshed(dims) else None  # one axis: the default group serves
    plan = _tensor(model, mesh, dims, ctx, example) if dims.tp > 1 else None
    if dims.pp > 1:  # the stages are split next; context and expert parallelism then live inside them
        own = set(_experts(model, dims, ctx).params) if dims.ep > 1 else set()
        return stages(_pipeline(model, mesh, dims, ctx, example, strategy.name, plan, own), ctx)
    if dims.cp > 1:
        from .context import apply_cp

        apply_cp(model, mesh["cp"].get_group(), dims.cp, mesh.get_local_rank("cp"))
    own = set(_experts(model, dims, ctx).params) if dims.ep > 1 else set()  # reduced there, not by the data axes
    blocks(model, ctx)
    if dims.dp_shard > 1 or "fsdp" in strategy.axes:  # a named axis wraps on one worker too (its state's form)
        return apply_fsdp(model, _shard_mesh(dims, mesh), precision=cfg.precision, ignored=own)
    if mesh is None and "ddp" in strategy.axes:  # the replicas are the one axis: DDP's buckets overlap the backward
        return _ddp(model, ctx, example, one_device=True)
    if dims.dp_replicate * dims.cp > 1:  # context-parallel ranks average as replicas do (parallel.context)
        group = mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp") if dims.cp > 1 else mesh["dp_replicate"]
        return Replicas(model, group.get_group(), dims.dp_replicate * dims.cp, skip=own)
    return model


def _meshed(dims: ParallelDims) -> bool:
    """Whether the layout needs a DeviceMesh: more than one axis, or an axis that names its groups (tp, cp, ep)."""
    return dims.tp * dims.cp * dims.ep > 1 or sum(size > 1 for size in dims.sizes().values()) > 1


def _ddp(model: nn.Module, ctx: Context, example: Any, *, one_device: bool) -> nn.Module:
    """torch's DistributedDataParallel with the run's options (`comm_hook="auto"` measures on `example`); a model
    over several devices of its process takes no device_ids."""
    from .data_parallel import apply_ddp

    if not one_device:
        return apply_ddp(model, ctx.config, device_ids=None)
    example = map_tensors(lambda t: t.to(ctx.device), example) if example is not None else None
    return apply_ddp(model, ctx.config, [ctx.device.index] if ctx.device.type == "cuda" else None, example=example,
                     device=ctx.device)


def _device_stages(model: nn.Module, strategy: Strategy, ctx: Context, example: Any) -> nn.Module:
    """The model split over this process's devices (`mp`): replicas in other processes (`ddp+mp`) measure, and so
    split, identically."""
    from ..collectives import mean_over_world
    from .pipeline.mp_pipeline import MPPipeline

    cfg = ctx.config
    agree = (lambda values: mean_over_world(values, ctx.device)) if ctx.dims.dp_replicate > 1 else None
    return MPPipeline(model, strategy.devices(ctx), cfg.microbatches, cfg.balance, example, strategy=strategy.name,
                      verbose=ctx.placement.rank == 0, agree=agree, batchnorm=cfg.batchnorm)


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
              plan: dict[str, Any] | None, experts: set[nn.Parameter]) -> nn.Module:
    """Expert and context parallelism inside the stages need stages of the model's own blocks (`pipeline.blocks`):
    a traced stage cannot run an expert dispatch or attention over the shares."""
    from .context import Share
    from .pipeline.pipelining import PipelineModule

    cfg = ctx.config
    share = Share(mesh["cp"].get_group(), dims.cp, mesh.get_local_rank("cp")) if dims.cp > 1 else None
    pp_rank = mesh.get_local_rank("pp") if mesh is not None else ctx.placement.rank
    pipe = PipelineModule(
        model, schedule=cfg.schedule, pp_rank=pp_rank, pp=dims.pp,
        per_worker=cfg.stages_per_worker, device=ctx.device, microbatches=cfg.microbatches,
        balance=cfg.balance, example=example, group=mesh.get_group("pp") if mesh is not None else None, strategy=name,
        batchnorm=cfg.batchnorm, checkpointing=cfg.activation_checkpointing, compiling=cfg.compiling,
        tp_plan=plan, shard_mesh=_shard_mesh(dims, mesh), precision=cfg.precision, share=share,
        own_blocks=dims.cp > 1 or dims.ep > 1, unsharded=experts)
    pipe.experts = model.__dict__.get("_paratrain_experts")
    if mesh is None:  # the pipeline is the layout's one axis: no replicas to average
        return pipe
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
    if dims.dp_shard == 1 or mesh is None:  # no shards, or FSDP's default mesh over every rank
        return None
    if dims.cp > 1:  # shards over the context-parallel ranks too: they hold one replica's weights (torchtitan)
        flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else flat
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
