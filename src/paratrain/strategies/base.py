"""The one interface every strategy implements: a handful of functions, no inheritance chains."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..config import Config
from ..runtime import Placement

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class Context:
    """What a strategy needs to know about the job."""

    config: Config
    placement: Placement
    device: torch.device


class Strategy(Protocol):
    name: str
    needs_process_group: bool
    """False only for single-process strategies (single, dp, mp) running with world size 1."""

    def check(self, ctx: Context) -> None:
        """Reject a job this strategy cannot run, naming the fix."""

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        """Place and wrap the model; the result is what the user trains."""

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        """(replica index, replica count): which share of each global batch this rank loads."""

    def sync_context(self, model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        """Context for one micro-step; sync=False skips gradient communication (accumulation)."""

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn,
                         backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """One micro-step's forward and backward (calling `backward(loss)` where the loss exists);
        returns the mean loss over the whole global batch, on every rank."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the wrapper (for state dicts)."""

    # Optional attribute: `sharded_state = True` when ranks hold different parts of the model, so each
    # rank writes its own checkpoint file.
