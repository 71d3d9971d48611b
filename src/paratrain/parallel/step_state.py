"""What the micro-step in flight knows, in one object per run, and the one place that says which run is active.

Four parts of paratrain keep state between the calls of one micro-step: layout-independent dropout needs the
seed, the micro-step, the first global row of this worker's share and how often each layer ran (`randomness`);
BatchNorm over micro-batches collects each layer's sums until the step ends (`batchnorm`); the step's loss
is reduced over the ranks asynchronously, waited for when read or by the next reduction (`collectives`); and
the batch the run's loaders yielded last decides how much the next micro-step's loss counts (`data.loader`). That
state belongs to a run: `setup` makes a `StepState` for its run (`Run.step.state`) and activates it, and the
run's own calls activate it again, so two runs in one process (a training run and an evaluation run, or two
notebook cells) never share a micro-step.

Code deep inside a forward cannot be handed the object: a traced pipeline stage calls dropout and deferred
BatchNorm as functions written into its graph, and autograd's recomputation (activation checkpointing) may run
on another thread. So the active object is found through `active()`, a process-wide pointer (a context
variable would not reach autograd's threads); it is the only module-level variable of `parallel/` that changes.
Outside any run a default object serves (a model used before `setup`, or unit tests of one part).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DropoutPosition:
    """Where the current forward is, for dropout masks: seed, micro-step, rows of the global batch before this
    worker's share, and how often each layer has drawn at this (layer, step, rows)."""

    seed: int = 0
    step: int = 0
    rows_before: int = 0
    calls: dict[tuple[str, int, int], int] = field(default_factory=dict)


@dataclass
class StepState:
    """One run's micro-step state (see the module docstring)."""

    dropout: DropoutPosition = field(default_factory=DropoutPosition)
    batchnorm: dict[str, Any] = field(default_factory=dict)
    """Deferred BatchNorm sums of the current step, by layer (`batchnorm._Pending`)."""
    reductions: list[torch.Tensor] = field(default_factory=list)
    """Reductions started by `collectives.mean_later` whose result nobody has read yet."""
    random_calls: Any = None
    """The run's `random_calls.RandomCalls`: random functions a forward calls, drawn by the layout-independent rule."""
    eager_draws: tuple[Any, Any] | None = None
    """Set when the run compiles: dropout's draws wrapped to run eagerly inside compiled code (`randomness`)."""
    rows: Any = None
    """Which rows of the global batch a forward of this run sees (`expert.router_stats.Rows`), for statistics
    that must be the global batch's."""
    batches: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    """Numbers the batches the run's training loaders yield, so the latest one weighs the next micro-step's loss."""


_ACTIVE = StepState()
"""The active run's state: the one module-level variable of `parallel/` that changes, set only below."""


def active() -> StepState:
    """The state of the run whose calls are in flight (or the default one outside any run)."""
    return _ACTIVE


def activate(state: StepState) -> None:
    global _ACTIVE
    _ACTIVE = state


@contextmanager
def using(state: StepState) -> Iterator[None]:
    """`state` is active inside; whatever was active before is back afterwards."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, state
    try:
        yield
    finally:
        _ACTIVE = before
