"""The micro-step, made visible: which micro-step this is, whether its backward synchronises gradients,
and the optimizer that steps only when an accumulation window is complete.

nanoGPT decides gradient sync in one line before each forward (`require_backward_grad_sync =
micro_step == accum - 1`); here that line is `Step.micro`:

    with step.micro(model):                      # sync on the last micro-step of a window only
        loss = strategy.forward_backward(...)    # forward and backward of one micro-step
                                                 # on exit: counted, and the next one armed

A loop that calls `model(x)` itself runs its forward before paratrain sees the micro-step, so the
sync flag for a micro-step is armed when the previous one ends (and by `prepare` for the first):
the strategy's flag is always already right when the user's forward runs. No hooks are installed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .parallel import randomness
from .parallel.step_state import StepState

if TYPE_CHECKING:
    from .agreement import Refusals


class Step:
    """Micro-step counter and accumulation window of one run; arms each strategy's gradient sync."""

    def __init__(self, accum: int, set_sync: Callable[[nn.Module, bool], None]) -> None:
        self.accum = accum
        self.count = 0
        """Micro-steps completed since the start (or since the checkpoint the run resumed from)."""
        self._set_sync = set_sync
        self._models: list[nn.Module] = []
        self._armed: dict[int, bool] = {}
        """The sync flag each model was last armed with: unchanged flags (no accumulation) cost nothing."""
        self.state = StepState()
        """What this run's micro-step in flight knows (dropout position, deferred BatchNorm, pending reductions)."""

    def sync_with(self, set_sync: Callable[[nn.Module, bool], None]) -> None:
        """Arm another strategy's gradient sync (`strategy="auto"` switches strategy before any model is armed)."""
        self._set_sync = set_sync

    @property
    def at_boundary(self) -> bool:
        """True when the micro-steps so far fill whole accumulation windows (the optimizer may step)."""
        return self.count % self.accum == 0

    @property
    def syncs(self) -> bool:
        """Whether the coming micro-step completes a window, and so must synchronise gradients."""
        return (self.count + 1) % self.accum == 0

    def _arm(self, model: nn.Module) -> None:
        sync = self.syncs
        if self._armed.get(id(model)) is not sync:
            self._set_sync(model, sync)
            self._armed[id(model)] = sync

    def track(self, model: nn.Module) -> None:
        """A prepared model: its gradient sync follows the window from its first micro-step on."""
        self._models.append(model)
        self._arm(model)
        randomness.at_micro_step(self.count, self.state)

    @contextmanager
    def micro(self, model: nn.Module | None = None) -> Iterator[None]:
        """One micro-step of `model` (of every prepared model when None): sync set for it, counted after."""
        models = [model] if model is not None else self._models
        for m in models:
            self._arm(m)
        try:
            yield
        finally:
            self.count += 1
            randomness.at_micro_step(self.count, self.state)  # dropout masks are drawn per micro-step
            for m in self._models:
                self._arm(m)

    def restore(self, count: int) -> None:
        """Continue counting from a checkpoint, re-arming the sync flags for the micro-step that follows."""
        self.count = count
        randomness.at_micro_step(count, self.state)
        for m in self._models:
            self._arm(m)


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer whose `step`/`zero_grad` act only at window ends, driving the fp16 GradScaler.

    An `Optimizer` subclass so LR schedulers accept it; it delegates everything else. Its first real step
    ends in an agreement (`refusals`): a refusal raised in it on one rank is raised on every rank.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, step: Step, scaler: torch.amp.GradScaler | None,
                 timed: Callable[[str], AbstractContextManager[Any]] | None = None,
                 refusals: Refusals | None = None, gate: Callable[[], bool] | None = None) -> None:
        # Deliberately no super().__init__: the wrapped optimizer owns param_groups and state.
        self.optimizer = optimizer
        self._step = step
        self.scaler = scaler
        self._timed = timed or _untimed
        """Times the real step as the "optimizer" phase while profiling (observe/breakdown.py)."""
        self._first_step: Refusals | None = refusals
        """Until the first real step: whom it agrees with."""
        self._gate = gate
        """Asked before each real step whether to take it (replica groups: the step's gradients were reduced
        between groups); False drops the window's gradients instead."""

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
        if not self._step.at_boundary or self._step.count == 0:
            return None
        refusals, self._first_step = self._first_step, None
        with refusals.phase("the first optimizer step") if refusals is not None else nullcontext():
            return self._step_now(closure)

    def _step_now(self, closure: Callable[[], float] | None) -> Any:
        if self._gate is not None and not self._gate():
            self.optimizer.zero_grad(set_to_none=True)
            return None
        with self._timed("optimizer"):
            if self.scaler is not None:
                result = self.scaler.step(self.optimizer, *(() if closure is None else (closure,)))
                self.scaler.update()
                return result
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._step.at_boundary:
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


def _untimed(phase: str) -> AbstractContextManager[Any]:
    return nullcontext()


def rebind(optimizer: torch.optim.Optimizer, before: dict[str, nn.Parameter], after: dict[str, nn.Parameter]) -> None:
    """Point an optimizer built on the user's model at the parameters the strategy put in their place.

    Sharding (FSDP2) swaps parameters for new DTensor ones, matched by name; a pipeline stage keeps only
    its own layers, the same objects (a tied weight perhaps under its other name). This keeps the user's
    "build the optimizer, then prepare" order.
    Runs once, inside `prepare`; parameters this rank does not hold are dropped from the optimizer.
    """
    kept = {id(p) for p in after.values()}  # a pipeline stage keeps the very objects, maybe under another name
    new_for = {id(p): p if id(p) in kept else after[name]
               for name, p in before.items() if id(p) in kept or name in after}
    if all(new_for.get(id(p)) is p for group in optimizer.param_groups for p in group["params"]):
        return
    for group in optimizer.param_groups:
        group["params"] = [new_for[id(p)] for p in group["params"] if id(p) in new_for]
    optimizer.state = defaultdict(dict, {new_for[id(p)]: s for p, s in optimizer.state.items() if id(p) in new_for})
