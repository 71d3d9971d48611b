"""Single-process model parallelism: stage i on device i, micro-batches pipelined in clock cycles.

The tutorials' `split_size` loop, generalised to K stages. Micro-batch i reaches stage j at clock
i + j; within one clock the stages work on different micro-batches, and because CUDA kernel launches
return at once, one Python thread keeps every device busy (torchgpipe draws the same picture):

    clock    0     1     2     3     4           (K = 3 stages, M = 3 micro-batches)
    stage 0  F0    F1    F2
    stage 1        F0    F1    F2
    stage 2              F0    F1    F2

The outputs are concatenated and the loss is taken on the whole batch, so the loss and gradients equal
the unsplit model's (uneven micro-batches included). One backward call then overlaps across devices
too: autograd runs each device's part of the graph on that device's own worker thread.

The model is split at the first forward, when a sample batch exists to measure layers with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .balance import choose_balance, describe
from .memory import ActivationMeter, StageMemory, format_report, param_bytes
from .microbatch import Search, divisors, merge, search, split
from .partition import Stage, equal_balance, layers_of, split_into_stages, too_few_layers
from .plan import Plan
from .streams import Copier
from .trial import no_trace, step_time


def clock_cycles(microbatches: int, stages: int) -> list[list[tuple[int, int]]]:
    """(micro-batch, stage) pairs runnable at each clock; see the module docstring."""
    return [[(clock - j, j) for j in range(stages) if 0 <= clock - j < microbatches]
            for clock in range(microbatches + stages - 1)]


class MPPipeline(nn.Module):
    """The user's model split over `devices`; trains like the model itself (`pipe(x)` -> output)."""

    def __init__(self, model: nn.Module, devices: Sequence[torch.device], microbatches: int | str = 1,
                 balance: Sequence[int] | str = "time") -> None:
        super().__init__()
        if isinstance(microbatches, int) and microbatches < 1:
            raise ValueError(f"microbatches must be >= 1 or 'auto', got {microbatches}")
        self.model = model
        self.devices = [torch.device(d) for d in devices]
        self.microbatches: int | str = microbatches
        self.requested_balance = balance
        self.stages: list[Stage] = []
        self.plan = Plan(strategy="mp", stages=len(self.devices), microbatches=microbatches)
        self._copier = Copier(self.devices)
        self._meters: list[ActivationMeter] | None = None
        self._first: dict[int, int] = {}
        self.agree: Callable[[list[float]], list[float]] | None = None
        """Makes processes that each hold a replica (ddp+mp) measure, and so split, identically."""

    @property
    def built(self) -> bool:
        return bool(self.stages)

    def build(self, sample: tuple[Any, ...]) -> None:
        """Split and place the model, measuring layers where they will run when balancing by time."""
        k = len(self.devices)
        layers = layers_of(self.model, sample)
        if len(layers) < k:
            raise too_few_layers(len(layers), k)
        if isinstance(self.requested_balance, str) and self.requested_balance in ("time", "memory"):
            self._place(split_into_stages(layers, equal_balance(len(layers), k)))  # measure on the devices
        balance, costs = choose_balance(self.requested_balance, layers, k, sample=sample, agree=self.agree)
        self._place(split_into_stages(layers, balance))
        self.plan.balance = balance
        self.plan.layer_costs = costs
        self.plan.note(describe(balance, costs, self.requested_balance))

    def _place(self, stages: list[Stage]) -> None:
        for stage, device in zip(stages, self.devices):
            stage.to(device)
        self.stages = stages
        self._stage_modules = nn.ModuleList(stages)  # registered, so .train()/.eval() reach traced pieces

    def forward(self, *inputs: Any) -> Any:
        if not self.built:
            self.build(inputs)
        if not isinstance(self.microbatches, int):
            raise RuntimeError("microbatches='auto' is resolved by the strategy before the first forward")
        k, m = len(self.stages), self.microbatches
        chunks = split(inputs, m) if m > 1 else [inputs]
        m = len(chunks)
        values: list[Any] = list(chunks)
        for pairs in clock_cycles(m, k):
            for i, j in pairs:
                x = self._copier.to(values[i], self.devices[j])
                if self._meters is None:
                    values[i] = self.stages[j](*x) if j == 0 else self.stages[j](x)
                    continue
                before = self._meters[j].current
                with self._meters[j].measure():
                    values[i] = self.stages[j](*x) if j == 0 else self.stages[j](x)
                self._first.setdefault(j, self._meters[j].current - before)
        return merge(values) if m > 1 else values[0]

    def measure_memory(self, step: Callable[[], Any]) -> Any:
        """Run `step` (a real forward and backward) watching what each stage saves for backward."""
        self._meters = [ActivationMeter(exclude=[stage]) for stage in self.stages]
        self._first = {}
        try:
            result = step()
        finally:
            meters, self._meters = self._meters, None
        m = self.microbatches if isinstance(self.microbatches, int) else 1
        self.plan.memory = [
            StageMemory(stages=[j], params_bytes=param_bytes(stage),
                        activation_per_microbatch_bytes=self._first.get(j, 0), in_flight_bound=m,
                        activation_bound_bytes=m * self._first.get(j, 0), peak_activation_bytes=meter.peak)
            for j, (stage, meter) in enumerate(zip(self.stages, meters))
        ]
        if self.plan.verbose:
            print(format_report(self.plan.memory, "mp (all forwards, then one backward)", m), flush=True)
        return result


def tune(pipe: MPPipeline, step: Callable[[], Any], batch: int, reduce_max: Callable[[float], float] | None = None,
         repeats: int = 3) -> Search:
    """Resolve microbatches='auto' by timing trial steps (`step` runs forward and backward)."""
    def measure(m: int) -> float:
        pipe.microbatches = m
        seconds = step_time(step, repeats, warmup=1, devices=pipe.devices)
        return reduce_max(seconds) if reduce_max else seconds

    with no_trace([pipe.model]):
        found = search(measure, divisors(batch), len(pipe.stages))
    pipe.microbatches = found.best
    pipe.plan.microbatches = found.best
    pipe.plan.search = found
    pipe.plan.note(f"microbatches auto -> {found.best} (measured {len(found.curve)} counts in "
                   f"{found.seconds:.2f}s: " + ", ".join(f"{m}: {t * 1e3:.1f}ms" for m, t in found.curve.items()) + ")")
    return found


__all__ = ["MPPipeline", "clock_cycles", "tune"]
