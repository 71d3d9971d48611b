"""Pieces shared by the data-parallel strategies."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..collectives import all_reduce
from .base import Context, LossFn


def whole_batch(ctx: Context) -> tuple[int, int]:
    return ctx.placement.rank, ctx.placement.world_size


def no_context(model: nn.Module, sync: bool) -> Any:
    return nullcontext()


def plain_forward_backward(model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Any) -> torch.Tensor:
    """Forward and backward on this rank's share; returns the mean loss over all data-parallel ranks."""
    loss = loss_fn(model(inputs), targets)
    backward(loss)
    return all_reduce(loss.detach().float(), op="mean")


def identity_unwrap(model: nn.Module) -> nn.Module:
    return model
