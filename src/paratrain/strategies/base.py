"""The one interface every strategy implements: a handful of methods, no inheritance chains."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..config import Config
from ..parallel.dims import ParallelDims
from ..runtime import Placement

LossFn = Callable[[Any, Any], torch.Tensor]
Backward = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Context:
    """What a strategy needs to know about the job."""

    config: Config
    placement: Placement
    device: torch.device
    gpus: int = 0
    """CUDA GPUs visible to this process (read once, so checks are pure functions of the context)."""

    @functools.cached_property
    def dims(self) -> ParallelDims:
        """The layout's degrees, built and validated once per context by the strategy itself (`Strategy.degrees`;
        `setup` checks them before any process group starts): every part that needs a degree asks here instead of
        reading the strategy's name again."""
        from . import get

        return get(self.config.strategy).degrees(self.config, self.placement.world_size)


class Strategy(Protocol):
    """Every member is required. The strategy files therefore share this shape, and data-parallel ones
    share one-line bodies (shard by rank, call `parallel.data_parallel`); each file stays readable on its
    own, so that repetition is deliberate and not factored into base classes."""

    name: str
    needs_process_group: bool
    """False only for single-process strategies (single, dp, mp) running with world size 1."""
    sharded_state: bool
    """Ranks hold different parts of the model, so each rank writes its own checkpoint files."""
    microbatched: bool
    """Each (per-replica) batch is split into micro-batches that flow through model stages."""
    scheduled: bool
    """A pipeline schedule (`schedule=`) orders the micro-batches' work across processes."""
    comm_hooks: bool
    """Takes a DDP communication hook (`comm_hook=`) for its gradient all-reduce."""
    axes: tuple[str, ...]
    """The grammar's axes the layout is built of (`ddp`, `fsdp`, `tp`, `cp`, `ep`, `pp`); none for the presets of
    one process and `ddp+mp`."""
    in_process: str | None
    """What this process's several devices are: "stages" of the model (`mp`, `ddp+mp`), "replicas" of it (`dp`,
    torch's DataParallel), or None (one device per process). `parallel.parallelize` builds by it."""

    def degrees(self, config: Config, world: int) -> ParallelDims:
        """This layout's degrees on `world` workers (a preset's fixed shape, or the grammar's from the config's
        sizes, refused with every factor where they do not fit): what `Context.dims` holds."""

    def check(self, ctx: Context) -> None:
        """Reject a job this strategy cannot run (here: this world size, these devices), naming the fix."""

    def bound(self, ctx: Context) -> float:
        """The best speedup over one worker this layout allows (workers; K*M/(M+K-1) for pipelines)."""

    def devices(self, ctx: Context) -> list[torch.device]:
        """The devices this process computes on (one, or a pipeline's stage devices, or every GPU for dp)."""

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        """(replica index, replica count): which share of each global batch this rank loads."""

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        """Whether the next micro-step's backward synchronises gradients (False inside accumulation)."""

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        """One micro-step's forward and backward (calling `backward(loss)` where the loss exists);
        returns the mean loss over the whole global batch, on every rank."""

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        """A forward-only pass (the caller sets eval mode and no_grad): the outputs, or given `loss_fn` the
        mean loss over the rows of every rank, on every rank. Pipelines return outputs on the last stage."""

    def pipeline_ranks(self, ctx: Context) -> int:
        """Processes one pipeline of this layout spans: 1 where no pipeline crosses processes (mp's stages share
        one), every worker for pp, the pipeline degree of an N-D layout (its tensor ranks are not stages)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the wrapper (for state dicts)."""
