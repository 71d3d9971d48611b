"""What runs in every worker process of one job: build each configuration, warm it up, then time them
in rounds of one step each, so a slow spell of the machine hits paratrain and its reference alike and the
i-th steps of any two sides, taken in the same round seconds apart, make a pair (`stats.paired_ratio`). The order turns
every round (A B, B A, B A, A B: rotated every other round, reversed every other one), so no configuration
always runs first or right after another. One worker on the whole batch (`references.one_worker`) runs in the
same rounds: the baseline every speedup of the job is paired with.

A step ends when the slowest worker ends it, so each step's time is the maximum over ranks. A
configuration that raises is dropped after all ranks agree on it (with its reason); the others go on.
"""

from __future__ import annotations

import functools
import statistics
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import paratrain

from .. import runtime
from ..measure import workloads
from ..measure.timing import time_steps
from ..measure.workloads import Batch, Workload
from . import jobs, references
from .jobs import Job, Settings, Spec

BASELINE = Spec("single", 1)
"""The one worker every job times beside its runs (`references.one_worker`)."""


@dataclass
class _Side:
    spec: Spec
    step: Callable[[], Any] | None = None
    reason: str | None = None
    times: list[float] = field(default_factory=list)
    peak_mb: float = 0.0
    loss: Any = None
    """What the latest step returned: the global-batch loss on paratrain's side (None for references)."""
    alone: bool = False
    """Only rank 0 computes (the one-worker baseline): its error is held until every rank has left the block's
    collectives, then raised, so the other ranks are not left waiting in them."""
    error: Exception | None = None

    def timed_step(self) -> None:
        assert self.step is not None
        if not self.alone:
            self.loss = self.step()
            return
        try:
            self.loss = self.step() if self.error is None else None
        except Exception as exc:
            self.error = exc

    def final_loss(self) -> float | None:
        """The loss of the last step: every side trains the same steps from the same weights, so a lossy
        option's effect shows against the exact side's."""
        return round(float(self.loss), 7) if isinstance(self.loss, torch.Tensor) else None


def paratrain_side(spec: Spec, workload: Workload, data: Batch, settings: Settings) -> Callable[[], torch.Tensor]:
    """The user's loop through the public API only: setup, prepare, prepare_loader, forward_backward, step."""
    options: dict[str, Any] = {"strategy": spec.strategy, "seed": references.SEED,
                               "precision": settings.precision, "timeout_s": settings.timeout_s}
    if spec.microbatches is not None:
        options["microbatches"] = spec.microbatches
        if spec.schedule is not None:
            options["schedule"] = spec.schedule
    if spec.devices is not None:
        options["devices"] = list(spec.devices)
    options.update(spec.options)
    if settings.compile:
        options["compile"] = True if settings.compile == "inductor" else settings.compile
    if workload.tp_plan and jobs.context(spec.strategy, spec.workers, settings, **dict(spec.options)).dims.tp > 1:
        options["tp_plan"] = workload.tp_plan
    run = paratrain.setup(**options)
    model = workload.model()
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    loader = run.prepare_loader(DataLoader(TensorDataset(*data), batch_size=run.per_worker_batch(settings.batch)))
    inputs, targets = (t.to(run.device) for t in next(iter(loader)))
    if settings.channels_last and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=workload.lr), example=inputs)
    model.train()
    loss_fn = workload.loss()

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = run.forward_backward(model, inputs, targets, loss_fn)
        optimizer.step()
        return loss

    return step


def _device(settings: Settings, rank: int) -> torch.device:
    return torch.device("cuda", rank) if settings.gpus else torch.device("cpu")


def _init_group(job: Job, settings: Settings) -> None:
    """A job of several workers starts its process group first, so the references have it whichever side
    runs first; `paratrain.setup` finds it initialised and uses it."""
    if job.nproc == 1:
        return
    placement = runtime.read_placement()
    device = runtime.pick_device("cuda" if settings.gpus else "cpu", placement.local_rank)
    runtime.init_process_group(placement, runtime.pick_backend(None, device), None, settings.timeout_s, device)


def _multi() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _agree(side: _Side) -> None:
    """All ranks learn whether any rank failed this configuration, and why (the first reason)."""
    if not _multi():
        return
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, side.reason)
    failed = [(r, text) for r, text in enumerate(reasons) if text]
    if failed:
        rank, text = failed[0]
        side.reason = text if rank == 0 else f"rank {rank}: {text}"
        side.step = None


def _reason(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return " ".join(line.strip() for line in lines)[-600:]


def _block(side: _Side, count: int, device: torch.device) -> list[float]:
    """`count` steps of one side, timed by the bench's one harness."""
    assert side.step is not None
    devices = [torch.device(d) for d in side.spec.devices] if side.spec.devices else [device]
    times, peak_mb = time_steps(side.timed_step, count, devices, device)
    if side.error is not None:
        raise side.error
    side.peak_mb = max(side.peak_mb, peak_mb)
    return times


def _build(spec: Spec, workload: Workload, data: Batch, settings: Settings,
           device: torch.device) -> Callable[[], Any]:
    reference = references.BUILDERS.get(spec.strategy)
    if reference is not None:
        return reference(spec, workload, data, settings, device)
    return paratrain_side(spec, workload, data, settings)


def _guarded(side: _Side, action: Callable[[], Any]) -> Any:
    """Run one build or block; a failure is printed with its traceback (any rank) and agreed on."""
    try:
        result = action()
    except Exception as exc:
        side.reason, side.step, result = _reason(exc), None, None
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"      {_label(side)} failed on rank {rank}:\n{traceback.format_exc()}", flush=True)
    _agree(side)
    return result


def turn(sides: list[_Side], k: int) -> list[_Side]:
    """Round k's order: rotated by one every other round, reversed every other round (for two sides A B, B A,
    B A, A B), so each side leads, and follows each other side, equally often."""
    shift = (k // 2) % len(sides)
    order = sides[shift:] + sides[:shift]
    return order[::-1] if k % 2 else order


def run_job(job: Job, settings: Settings) -> list[dict[str, Any]]:
    """Entry point in each worker (via `paratrain.launch`); rank 0's return value is the job's result."""
    _init_group(job, settings)
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = _device(settings, rank)
    say: Callable[[str], None] = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)
    workload = workloads.get(settings.workload, image=settings.image, gpu=settings.gpus > 0,
                             gpt_size=settings.gpt_size)
    data = workload.data(settings.batch)
    sides = [_Side(spec) for spec in job.specs]
    for side in sides:
        side.step = _guarded(side, functools.partial(_build, side.spec, workload, data, settings, device))
    baseline = _Side(BASELINE, alone=True) if job.baseline else None
    if baseline is not None:
        baseline.step = _guarded(baseline, functools.partial(references.one_worker, workload, data, settings, device))
    timed = sides + ([baseline] if baseline is not None else [])
    for side in timed:
        if side.step is not None and settings.warmup:
            _guarded(side, functools.partial(_block, side, settings.warmup, device))
    for k in range(settings.repeat * settings.steps):
        for side in turn(timed, k):
            if side.step is not None:
                side.times += _guarded(side, functools.partial(_block, side, 1, device)) or []
        if (k + 1) % settings.steps == 0:  # a repeat's worth of rounds: each side's median over them
            for side in timed:
                if side.step is not None:
                    median = statistics.median(side.times[-settings.steps:])
                    say(f"      repeat {(k + 1) // settings.steps}/{settings.repeat}  {_label(side):<22} "
                        f"{median:8.4f} s/step")
    paired = baseline.times if baseline is not None and baseline.reason is None else []
    return [{"spec": side.spec, "step_times_s": side.times, "peak_memory_mb": round(side.peak_mb, 1),
             "reason": side.reason, "final_loss": side.final_loss(), "single_step_times_s": paired}
            for side in sides]


def _label(side: _Side) -> str:
    return "one worker (baseline)" if side.spec is BASELINE else side.spec.label
