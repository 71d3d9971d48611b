"""The one place where paratrain replaces a module instance's `forward`.

Six features need a module to run differently without changing its class or the user's code: autocast around
the model (`precision`), layout-independent dropout masks (`parallel.randomness`), deferred BatchNorm
statistics over micro-batches (`parallel.batchnorm`) and the activation meter around pipeline stages
(`parallel.pipeline.memory`); tensor-parallel layers that compute on their local pieces (`parallel.tensor.styles`:
Conv1D, fused and expert weights), and the random calls of a training forward (`parallel.random_calls`); and two
single forwards watch what runs: the planner's tensor-parallel profile (`planner.tensor_profile`) and the
tensor-parallel check, which keeps the first block of each kind's inputs and output (`parallel.tensor.check`);
and a model built on the meta device runs those forwards with each module's tensors made real for its call
(`weights.streamed`).
Forward hooks cannot do it (they cannot replace the computation, and the micro-step must not depend on hooks), and
wrapper modules would change the user's parameter names, which checkpoints and tensor-parallel plans key on. So
the instance's `forward` is replaced here, and every replacement is recorded on the module with the reason. Whoever
needs the model's own forwards (the tracer), or must know what was changed (a second run in the same process, a
tensor-parallel plan), asks `replaced` instead of guessing from `module.__dict__`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

_RECORD = "_paratrain_forwards"
"""Instance attribute: the (reason, previous instance forward or None) of each replacement, oldest first."""


def replace(module: nn.Module, forward: Callable[..., Any], reason: str) -> None:
    """Run `forward` instead of the module's current forward (which it may call), recording why."""
    record: list[tuple[str, Any]] = module.__dict__.setdefault(_RECORD, [])
    record.append((reason, module.__dict__.get("forward")))
    module.forward = forward  # type: ignore[method-assign]


def restore(module: nn.Module) -> None:
    """Undo the latest replacement."""
    record = module.__dict__.get(_RECORD) or []
    if not record:
        return
    _, previous = record.pop()
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous  # type: ignore[method-assign]


def replaced(module: nn.Module) -> list[str]:
    """Why this module's forward is not its class's, latest last (empty: it is)."""
    return [reason for reason, _ in module.__dict__.get(_RECORD) or []]


def strip(module: nn.Module) -> None:
    """Every replacement dropped: a deep copy of a module runs its class's forward (a copied replacement may still
    call the original module's)."""
    module.__dict__.pop("forward", None)
    module.__dict__.pop(_RECORD, None)


@contextmanager
def own_forwards(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, these modules run their class's forward (all replacements set aside); restored on exit."""
    aside = {m: m.__dict__.pop("forward") for m in modules if "forward" in m.__dict__}
    try:
        yield
    finally:
        for m, forward in aside.items():
            m.forward = forward  # type: ignore[method-assign]
