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

The model is split and placed when the pipeline is constructed (inside `run.prepare`), measuring its
layers on the example batch when balancing by time or memory, so the optimizer is pointed at the
final parameters once and for all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from .. import batchnorm, randomness
from ..batchnorm import check_microbatches
from ..microbatch import batch_size, divisors, merge, split
from ..options import example_needed
from ..plan import Plan
from ..trial import step_time
from .balance import choose_balance, describe
from .memory import StageMemory, format_report, param_bytes, watch_stages
from .partition import Stage, equal_balance, layers_of, split_into_stages, too_few_layers
from .streams import Copier
from .tied import check_one_device
from .tuning import tune_microbatches

LossFn = Callable[[Any, Any], torch.Tensor]


def clock_cycles(microbatches: int, stages: int) -> list[list[tuple[int, int]]]:
    """(micro-batch, stage) pairs runnable at each clock; see the module docstring."""
    return [[(clock - j, j) for j in range(stages) if 0 <= clock - j < microbatches]
            for clock in range(microbatches + stages - 1)]


class MPPipeline(nn.Module):
    """The user's model split over `devices`; trains like the model itself (`pipe(x)` -> output)."""

    def __init__(self, model: nn.Module, devices: Sequence[torch.device], microbatches: int | str | None = 1,
                 balance: Sequence[int] | Sequence[str] | str = "time", example: Any = None, *, strategy: str = "mp",
                 verbose: bool = True, agree: Callable[[list[float]], list[float]] | None = None,
                 batchnorm: str = "exact") -> None:
        """`agree` makes processes that each hold a replica (ddp+mp) measure, and so split, identically.
        `microbatches` None (unset) is one: the tutorials' plain model parallelism."""
        super().__init__()
        microbatches = 1 if microbatches is None else microbatches
        self.model = model
        self.devices = [torch.device(d) for d in devices]
        self.microbatches: int | str = microbatches
        self.plan = Plan(strategy=strategy, stages=len(self.devices), microbatches=microbatches, verbose=verbose)
        self._copier = Copier(self.devices)
        self.stages: list[Stage] = []
        self.deferred_batchnorm = check_microbatches(model, batchnorm, microbatches, f"strategy {strategy!r}")
        self._build(balance, example, agree)

    def _build(self, requested: Sequence[int] | Sequence[str] | str, sample: Any,
               agree: Callable[[list[float]], list[float]] | None) -> None:
        """Split and place the model, measuring layers where they will run when balancing by time."""
        k = len(self.devices)
        measured = isinstance(requested, str) and requested in ("time", "memory")
        if sample is None and (measured or not isinstance(self.model, nn.Sequential)):
            why = (f"balance={requested!r} measures the layers" if measured
                   else f"{type(self.model).__name__} is not an nn.Sequential and is traced to be split")
            raise example_needed(f"strategy {self.plan.strategy!r}", why)
        layers = layers_of(self.model, sample, defer_batchnorm=self.deferred_batchnorm)
        if len(layers) < k:
            raise too_few_layers(len(layers), k)
        if measured:
            self._place(split_into_stages(layers, equal_balance(len(layers), k)))  # measure on the devices
        balance, costs = choose_balance(requested, layers, k, sample=sample, agree=agree)
        self._place(split_into_stages(layers, balance))
        check_one_device(self.model, self.stages, self.devices)
        self.plan.balance = balance
        self.plan.layer_costs = costs
        self.plan.note(describe(balance, costs, requested, [name for name, _ in layers]))

    def _place(self, stages: list[Stage]) -> None:
        for stage, device in zip(stages, self.devices):
            stage.to(device)
        self.stages = stages
        self._stage_modules = nn.ModuleList(stages)  # registered, so .train()/.eval() reach traced pieces

    def forward(self, inputs: Any) -> Any:
        k = len(self.stages)
        m = self.microbatches if isinstance(self.microbatches, int) else 1  # "auto" before it is resolved
        m = min(m, batch_size(inputs))  # a short batch: no empty micro-batches
        chunks = split(inputs, m) if m > 1 else [inputs]
        m = len(chunks)
        starts = [0]
        for chunk in chunks[:-1]:
            starts.append(starts[-1] + batch_size(chunk))
        values: list[Any] = list(chunks)
        for pairs in clock_cycles(m, k):
            for i, j in pairs:
                x = self._copier.to(values[i], self.devices[j])
                self.stages[j].micro_rows = batch_size(chunks[i])  # an activation may hold them off dim 0
                with randomness.rows_offset(starts[i]):  # dropout masks follow the rows, not the split
                    values[i] = self.stages[j](x)
        return merge(values) if m > 1 else values[0]

    def measure_memory(self, step: Callable[[], Any]) -> Any:
        """Run `step` (a real forward and backward) watching what each stage saves for backward."""
        with watch_stages(self.stages, range(len(self.stages))) as (meter, first):
            result = step()
        m = self.microbatches if isinstance(self.microbatches, int) else 1
        self.plan.memory = [
            StageMemory(stages=[j], params_bytes=param_bytes(stage),
                        activation_per_microbatch_bytes=first.get(j, 0), in_flight_bound=m,
                        activation_bound_bytes=m * first.get(j, 0), peak_activation_bytes=meter.owned_peak.get(j, 0))
            for j, stage in enumerate(self.stages)
        ]
        if self.plan.verbose:
            print(format_report(self.plan.memory, "mp (all forwards, then one backward)", m), flush=True)
        return result


def _on(value: Any, like: Any) -> Any:
    device = like.device if isinstance(like, torch.Tensor) else None
    if device is None and isinstance(like, list | tuple) and like and isinstance(like[0], torch.Tensor):
        device = like[0].device
    if isinstance(value, torch.Tensor) and device is not None:
        return value.to(device, non_blocking=True)
    return value


def train_step(module: nn.Module, pipe: MPPipeline, inputs: Any, targets: Any, loss_fn: LossFn,
               backward: Callable[[torch.Tensor], None],
               no_sync: Callable[[], AbstractContextManager[Any]] = nullcontext,
               reduce_max: Callable[[float], float] | None = None) -> torch.Tensor:
    """One micro-step through `module` (the pipeline, or DDP around it); returns this process's loss.

    The first step resolves microbatches="auto" by trial steps (without gradient sync, leaving no
    trace) and watches memory."""
    if pipe.microbatches == "auto":
        def trial() -> None:
            with no_sync():
                out = module(inputs)
                loss_fn(out, _on(targets, out)).backward()

        def measure(m: int) -> float:
            pipe.microbatches = m
            seconds = step_time(trial, repeats=3, warmup=1, devices=pipe.devices)
            return reduce_max(seconds) if reduce_max else seconds

        pipe.microbatches = tune_microbatches(pipe.plan, measure, divisors(batch_size(inputs)), len(pipe.stages),
                                              [pipe.model])

    def real() -> torch.Tensor:
        out = module(inputs)
        loss = loss_fn(out, _on(targets, out))
        backward(loss)
        return loss

    loss = pipe.measure_memory(real) if pipe.plan.memory is None else real()
    batchnorm.commit()  # running statistics move once per step, from all micro-batches
    return loss  # type: ignore[no-any-return]


__all__ = ["MPPipeline", "clock_cycles", "train_step"]
