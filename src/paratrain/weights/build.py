"""Building without storage: `empty_init`, and moving a partly built model without touching what has no data."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import nn

from ..parallel.tensor import local_part

M = TypeVar("M", bound=nn.Module)


def is_empty(t: torch.Tensor) -> bool:
    """No storage yet: a meta tensor, or a DTensor whose local piece is one."""
    return local_part(t).is_meta


def has_meta(module: nn.Module) -> bool:
    return any(is_empty(t) for t in (*module.parameters(), *module.buffers()))


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Build a model whose parameters are on the meta device and whose buffers are real (as Accelerate's
    `init_empty_weights` does): a buffer such as rotary frequencies is computed once, at build time, while
    parameters cost nothing until `run.prepare` gives each rank its share."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and not param.is_meta:
            kind = type(param)
            self._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def place(module: M, device: torch.device) -> M:
    """`module.to(device)` for the tensors that have data; tensors on the meta device stay there (they get this
    rank's storage once the model is split: `fill.materialize`)."""
    if not has_meta(module):
        return module.to(device)
    for sub in module.modules():
        for key, param in sub._parameters.items():
            if param is not None and not is_empty(param) and param.device != device:
                with torch.no_grad():
                    sub._parameters[key] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)
        for key, buf in sub._buffers.items():
            if buf is not None and not is_empty(buf) and buf.device != device:
                sub._buffers[key] = buf.to(device)
    return module


@contextlib.contextmanager
def all_meta(model: nn.Module) -> Iterator[bool]:
    """Inside, a model with meta tensors has all of them on meta (its real buffers swapped for meta twins), so a
    trace on meta inputs never meets a real tensor; yields whether the model is one."""
    if not has_meta(model):
        yield False
        return
    kept: list[tuple[nn.Module, str, torch.Tensor]] = []
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None and not is_empty(buf):
                kept.append((module, key, buf))
                module._buffers[key] = buf.to("meta")
    try:
        yield True
    finally:
        for module, key, buf in kept:
            module._buffers[key] = buf
