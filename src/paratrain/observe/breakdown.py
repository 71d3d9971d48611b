"""Where a step's time goes on each rank: waiting for data, compute, communication not hidden by compute,
and the optimizer.

Timing is off unless asked for (`setup(profile=True)` or `with paratrain.profile(run):`). While off,
each point below costs one attribute test: no clock is read, nothing is synchronised, no hook is
installed. While on, the step's timeline is cut at points paratrain already owns:

    next(loader) ─data─▶ batch ───────compute───────▶ last gradient ─comm─▶ end of backward ─optimizer─▶
                 (loader's own      (user forward,    accumulated           (DDP waits for   (opt.step()
                  work and wait)     backward)                               its buckets)     at window end)

- data: time inside `next()` of a loader made by `run.prepare_loader` (collation, worker processes).
- compute: from the batch's arrival (or the previous timed point) to the end of the micro-step
  (`run.backward` / `run.forward_backward`), less the exposed communication in it. A pipeline's wait
  for its neighbouring stages (the bubble) is inside its schedule and so counts here.
- comm: communication not hidden by compute: from the moment this rank's last parameter gradient is
  accumulated (a post-accumulate-grad hook on each parameter, installed only while timing) to the end
  of the micro-step, which is where DDP waits for its last gradient buckets; plus the time inside
  paratrain's own collectives (`run.all_reduce`, `run.barrier`, `run.should_stop`).
- optimizer: `optimizer.step()` (and the GradScaler's update) at the end of an accumulation window.
- other: the rest of the wall time (the user's code between steps, `run.log` itself).

A rank that is slower than its peers spends more time in data, compute or optimizer ("busy" time),
while its peers spend the difference waiting for it in comm. So a rank is named slow when its busy
time is more than SLOW_RATIO times the median busy time of the other ranks and the excess is at
least SLOW_SHARE of its step. On CUDA every timed point synchronises the device (only while timing)
and the last-gradient point is a CUDA event, so the times are the device's, not the launch queue's.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PHASES = ("data", "compute", "comm", "optimizer")
"""The timed phases, in the order they are packed for the all-reduce (each rank adds its wall time)."""
SLOW_RATIO = 1.5
SLOW_SHARE = 0.1
_UNTIMED = contextlib.nullcontext()


class Breakdown:
    """One rank's phase timer: cumulative seconds per phase while enabled; readers keep their own snapshot."""

    def __init__(self, device: torch.device, enabled: bool = False) -> None:
        self.device = device
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._users = 0
        self._cuda = device.type == "cuda"
        self._mark = 0.0
        """The end of the last timed point: compute runs from here to the end of a micro-step."""
        self._grad_at: float | None = None
        self._grad_event: Any = None
        self._models: list[nn.Module] = []
        self._handles: list[Any] = []
        if enabled:
            self.enable()

    @property
    def enabled(self) -> bool:
        return self._users > 0

    # -- switching on and off -------------------------------------------------------------------
    def enable(self) -> None:
        """Start timing (nested users count); the first one installs the gradient hooks."""
        self._users += 1
        if self._users == 1:
            for model in self._models:
                self._hook(model)
            self._mark = self._now()

    def disable(self) -> None:
        self._users = max(0, self._users - 1)
        if self._users == 0:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()

    def track(self, model: nn.Module) -> None:
        """A prepared model whose parameters mark when this rank's gradients are all computed."""
        self._models.append(model)
        if self.enabled:
            self._hook(model)

    def _hook(self, model: nn.Module) -> None:
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, _: torch.Tensor) -> None:
        if self._cuda:
            if self._grad_event is None:
                self._grad_event = torch.cuda.Event(enable_timing=True)
            self._grad_event.record()
            self._grad_at = 0.0
        else:
            self._grad_at = time.perf_counter()

    # -- the timed points -----------------------------------------------------------------------
    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _add(self, phase: str, start: float, end: float) -> None:
        self.totals[phase] += max(0.0, end - start)
        self._mark = end

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Time a block as `name` ("optimizer", "comm"); a shared no-op context while timing is off."""
        return self._timed(name) if self.enabled else _UNTIMED

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._add(name, start, self._now())

    def micro_step(self) -> contextlib.AbstractContextManager[Any]:
        """Wraps one micro-step: compute since the last timed point, less the exposed communication at its end."""
        return self._micro() if self.enabled else _UNTIMED

    @contextlib.contextmanager
    def _micro(self) -> Iterator[None]:
        self._grad_at = None
        try:
            yield
        finally:
            exposed = 0.0
            if self._cuda and self._grad_at is not None:
                end_event = torch.cuda.Event(enable_timing=True)
                end_event.record()
                end = self._now()
                exposed = self._grad_event.elapsed_time(end_event) / 1e3
            else:
                end = self._now()
                if self._grad_at is not None:
                    exposed = end - self._grad_at
            exposed = min(max(0.0, exposed), max(0.0, end - self._mark))
            self._add("compute", self._mark, end - exposed)
            self._add("comm", end - exposed, end)

    def batches(self, source: Iterable[Any]) -> Iterator[Any]:
        """`source`'s batches, the wait for each timed as data while timing is on (a plain pass-through when off)."""
        it: Iterator[Any] | None = None
        while True:
            start = self._now() if self.enabled else None
            if it is None:
                it = iter(source)  # starting the loader's workers is part of waiting for data
            try:
                batch = next(it)
            except StopIteration:
                return
            if start is not None:
                self._add("data", start, self._now())
            yield batch

    def snapshot(self) -> list[float]:
        """Cumulative seconds per phase (in PHASES order) and this rank's clock, for a reader to difference."""
        return [self.totals[p] for p in PHASES] + [time.perf_counter()]


@dataclass(frozen=True)
class RankTimes:
    """One rank's seconds per step in each phase; `other` is the rest of its wall time."""

    data: float
    compute: float
    comm: float
    optimizer: float
    other: float

    @property
    def busy(self) -> float:
        """Time the rank spends on its own work; a rank waiting for a slower peer spends it in comm instead."""
        return self.data + self.compute + self.optimizer

    @property
    def wall(self) -> float:
        return self.busy + self.comm + self.other


def per_step(before: list[float], after: list[float], steps: int) -> list[float]:
    """Seconds per step in each phase and in total (wall) between two snapshots."""
    return [(b - a) / max(1, steps) for a, b in zip(before, after)]


def rank_times(values: list[float]) -> RankTimes:
    """From per_step's list: the four phases and the wall time, whose rest is `other`."""
    data, compute, comm, optimizer, wall = values
    return RankTimes(data, compute, comm, optimizer, other=max(0.0, wall - (data + compute + comm + optimizer)))


def slow_ranks(ranks: list[RankTimes]) -> list[int]:
    """Ranks whose busy time exceeds SLOW_RATIO x the median of the others', by at least SLOW_SHARE of their step."""
    if len(ranks) < 2:
        return []
    slow = []
    for r, times in enumerate(ranks):
        median = statistics.median(t.busy for i, t in enumerate(ranks) if i != r)
        if times.busy > SLOW_RATIO * median and times.busy - median >= SLOW_SHARE * times.wall:
            slow.append(r)
    return slow


_FIXES = {
    "data": "its loader (more DataLoader workers, data on local disk) or that host's load",
    "compute": "its device or host (another process on it, thermal throttling, a slower GPU)",
    "optimizer": "its device or host (another process on it)",
}


def describe(rank: int, ranks: list[RankTimes]) -> str:
    """Why `rank` is slow, in one sentence: its busy time against the others' and the phase it loses most in."""
    others = [t for i, t in enumerate(ranks) if i != rank]
    me = ranks[rank]
    excess = {p: getattr(me, p) - statistics.median(getattr(t, p) for t in others) for p in ("data", "compute",
                                                                                              "optimizer")}
    worst = max(excess, key=lambda p: excess[p])
    median = statistics.median(t.busy for t in others)
    return (f"rank {rank} is slow: busy {_ms(me.busy)} per step against a median of {_ms(median)} on the other "
            f"{len(others)} rank(s) (its {worst} takes {_ms(getattr(me, worst))}, {_ms(excess[worst])} more); "
            f"the others wait for it in communication. Look at {_FIXES[worst]}.")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
