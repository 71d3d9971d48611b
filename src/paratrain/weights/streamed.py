"""Running a meta model's forward while a layout splits it, a module at a time.

The tensor-parallel check runs the example batch through the model it is about to shard. Inside `sourced` (all of
`run.prepare` for a meta model), each such forward is wrapped in `streamed`: every module with tensors still on
the meta device runs with them made real for its own call and meta again after, so no rank holds more than its
share plus one module's tensors. The replacements last one forward (`_forwards`, innermost last), not the run.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _forwards
from .build import is_empty
from .fill import materialize, piece, settle
from .sources import Source

REASON = "a meta model's forward while it is split (weights.streamed)"


@dataclass
class _Sourced:
    model: nn.Module
    source: Source
    device: torch.device
    names: dict[int, str]


_current: list[_Sourced] = []


@contextlib.contextmanager
def sourced(model: nn.Module, source: Source, device: torch.device) -> Iterator[None]:
    """While `model` (built on meta) is split: where its values come from, for `streamed` and `real_copy`."""
    _current.append(_Sourced(model, source, device, {id(m): name for name, m in model.named_modules()}))
    try:
        yield
    finally:
        _current.pop()


def _real(source: Source, name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    value = piece(source, name, t).to(device=device, dtype=t.dtype)
    if hasattr(t, "to_local"):
        from torch.distributed.tensor import DTensor

        value = DTensor.from_local(value, t.device_mesh, t.placements,  # type: ignore[attr-defined]
                                   shape=t.shape, stride=t.stride())
    return nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value


def _own_empty(module: nn.Module) -> bool:
    return any(t is not None and is_empty(t) for t in (*module._parameters.values(), *module._buffers.values()))


def _made_real(module: nn.Module, prefix: str, at: _Sourced, inner: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        kept: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for key, t in table.items():
                if t is not None and is_empty(t):
                    kept.append((table, key, t))
                    table[key] = _real(at.source, f"{prefix}.{key}" if prefix else key, t, at.device)
        try:
            return inner(*args, **kwargs)
        finally:
            for table, key, t in kept:
                table[key] = t

    return forward


@contextlib.contextmanager
def streamed(model: nn.Module) -> Iterator[None]:
    """One forward of `model` with its meta tensors made real a module at a time (nothing outside `sourced`)."""
    at = next((s for s in reversed(_current) if s.model is model), None)
    if at is None:
        yield
        return
    wrapped = [m for m in model.modules() if _own_empty(m) and id(m) in at.names]
    for m in wrapped:
        _forwards.replace(m, _made_real(m, at.names[id(m)], at, m.forward), REASON)
    try:
        yield
    finally:
        for m in reversed(wrapped):
            _forwards.restore(m)


def real_copy(module: nn.Module) -> nn.Module | None:
    """A copy of `module` (part of the model being split) with all its tensors real; None where none is meta."""
    at = next((s for s in reversed(_current) if id(module) in s.names), None)
    if at is None or not any(is_empty(t) for t in (*module.parameters(), *module.buffers())):
        return None
    twin = copy.deepcopy(module)
    for sub in twin.modules():
        _forwards.strip(sub)
    materialize(twin, at.source, at.device, at.names[id(module)])
    return twin


def real_layer(model: nn.Module, source: Source, device: torch.device) -> Callable[[nn.Module], nn.Module]:
    """For timing a meta model a layer at a time (`strategy="auto"`): a copy of one of its layers (a submodule, or a
    traced segment holding the model's own names) with storage on `device` and its initial values."""
    names = {id(m): name for name, m in model.named_modules()}

    def real(layer: nn.Module) -> nn.Module:
        twin = copy.deepcopy(layer)
        for sub in twin.modules():
            _forwards.strip(sub)
        settle(twin, materialize(twin, source, device, names.get(id(layer), "")))
        return twin

    return real
