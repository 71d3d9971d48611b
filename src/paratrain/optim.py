"""The optimizer as the user sees it after `prepare`: same object API, but `step`/`zero_grad` honour
gradient accumulation and the fp16 GradScaler, so the training loop stays the plain PyTorch one."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


class Steps:
    """Counts micro-steps; an optimizer step happens every `accum` of them."""

    def __init__(self, accum: int) -> None:
        self.accum = accum
        self.micro = 0

    @property
    def at_boundary(self) -> bool:
        """True when the micro-steps so far fill whole accumulation windows."""
        return self.micro % self.accum == 0

    @property
    def next_syncs(self) -> bool:
        """Whether the coming backward completes a window (and so must synchronise gradients)."""
        return (self.micro + 1) % self.accum == 0


class PreparedOptimizer(torch.optim.Optimizer):
    """Delegates to the user's optimizer; an `Optimizer` subclass so LR schedulers accept it."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: Steps, scaler: torch.amp.GradScaler | None) -> None:
        # Deliberately no super().__init__: the wrapped optimizer owns param_groups and state.
        self.optimizer = optimizer
        self._steps = steps
        self.scaler = scaler

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        if not self._steps.at_boundary or self._steps.micro == 0:
            return None
        if self.scaler is not None:
            result = self.scaler.step(self.optimizer, *(() if closure is None else (closure,)))
            self.scaler.update()
            return result
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._steps.at_boundary:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"Prepared({self.optimizer!r})"

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def rebind(optimizer: torch.optim.Optimizer, before: dict[str, torch.nn.Parameter],
           after: dict[str, torch.nn.Parameter]) -> None:
    """Point an optimizer built on the user's model at the parameters the strategy put in their place.

    Sharding (FSDP2) swaps parameters for new DTensor ones, and a pipeline stage keeps only its own
    layers; matching by parameter name keeps the user's "build the optimizer, then prepare" order.
    Parameters this rank no longer holds are dropped from the optimizer.
    """
    new_for = {id(p): after[name] for name, p in before.items() if name in after}
    if all(new_for.get(id(p)) is p for group in optimizer.param_groups for p in group["params"]):
        return
    for group in optimizer.param_groups:
        group["params"] = [new_for[id(p)] for p in group["params"] if id(p) in new_for]
    optimizer.state = defaultdict(dict, {new_for[id(p)]: s for p, s in optimizer.state.items() if id(p) in new_for})
