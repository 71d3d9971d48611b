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
  accumulated to the end of the micro-step, which is where DDP waits for its last gradient buckets; plus
  the time inside paratrain's own collectives (`run.all_reduce`, `run.barrier`, `run.should_stop`).
  The last gradient is marked by a post-accumulate-grad hook on each model's first and last trainable
  parameter (the input side's, registered first or last in nearly every model, gets its gradient at the
  very end of backward), installed while profiling. Only two: once torch has called a Python hook on a
  parameter it keeps calling into Python for it in every backward, removed or not (about 1.5 us a
  parameter), and a hook on every parameter would cost a model of hundreds of them a millisecond a step
  for the rest of the run.
- optimizer: `optimizer.step()` (and the GradScaler's update) at the end of an accumulation window.
- other: the rest of the wall time (the user's code between steps, `run.log` itself).

Besides the phases, `totals["backward"]` counts from the start of `run.backward`'s backward to the end of
its micro-step, and `totals["exposed"]` the micro-steps' part of comm: the slow-rank watch splits a step
there (`split`), needing no hook at all. Before `run.backward` a data-parallel rank runs no collective, so
its forward is its own work; a wait for a peer falls after it, or in paratrain's collectives.

A rank that is slower than its peers spends more time in data, compute or optimizer ("busy" time),
while its peers spend the difference waiting for it in comm. So a rank is named slow when its busy
time is more than SLOW_RATIO times the median busy time of the other ranks and the excess is at
least SLOW_SHARE of its step (one interval's verdict; stragglers.py names a rank that stays slower).

On CUDA every timed point records an event on the current stream instead of reading the host clock,
and the spans between events become seconds only when a reader takes a snapshot (one synchronisation
for all of them): the times are the device's, not the launch queue's, and timing never stops the CPU
from running ahead of the GPU (a synchronisation at every point would expose the loader's work that
the GPU otherwise hides). So timing stays cheap enough to leave on for the slow-rank watch.

Readers count: the slow-rank watch (stragglers.py) keeps timing on for the run, and times only some
steps (`sample`); `profiling` says whether a reader that reports every phase (`run.log`'s fields,
`paratrain.profile`) is among them: then every step is timed, and the last-gradient hooks are installed.
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
_MAX_PENDING = 512
"""CUDA spans kept as events before they are read anyway (a run that times without ever taking a snapshot)."""


class Breakdown:
    """One rank's phase timer: cumulative seconds per phase while enabled; readers keep their own snapshot."""

    def __init__(self, device: torch.device, enabled: bool = False) -> None:
        self.device = device
        self.totals = dict.fromkeys((*PHASES, "backward", "exposed"), 0.0)
        self._users = 0
        self._watchers = 0
        self._skipping = False
        """The watch's sampling skips the coming step: its timed points are no-ops (see `sample`)."""
        self.live = False
        """Whether the timed points time now: enabled, and the step not skipped. (An attribute, not a property: it
        is read at every point.)"""
        self._cuda = device.type == "cuda"
        self._mark: Any = 0.0
        """The end of the last timed point (a clock reading, or a CUDA event): compute runs from here to the end
        of a micro-step."""
        self._grad_at: Any = None
        """When this micro-step's last gradient so far was accumulated (the same kind of point as `_mark`)."""
        self._backward_at: Any = None
        """When this micro-step's first backward started."""
        self._pending: list[tuple[str, Any, Any, Any]] = []
        """CUDA: spans (phase, start, end, last gradient) whose events are read at the next snapshot."""
        self._models: list[nn.Module] = []
        self._handles: list[Any] = []
        self._hooked: list[int] = []
        """id() of the parameter of each handle."""
        if enabled:
            self.enable()

    @property
    def enabled(self) -> bool:
        return self._users > 0

    @property
    def profiling(self) -> bool:
        """Timing for a reader that reports every phase (`run.log`'s fields), not only for the slow-rank watch."""
        return self._users > self._watchers

    # -- switching on and off -------------------------------------------------------------------
    def enable(self, *, watch: bool = False) -> None:
        """Start timing (nested users count; `watch`: for the slow-rank watch, which reports no phases); the first
        profiler installs the gradient hooks."""
        self._users += 1
        self._watchers += watch
        if not watch and self._users - self._watchers == 1:
            for model in self._models:
                self._hook(model)
        if self._users == 1 or (not watch and self._skipping):  # a profiler times every step, from now
            self._skipping = False
            self._mark = self._now()
        self.live = True

    def sample(self, timed: bool) -> None:
        """The watch's sampling, at a step's end: time the coming step, or skip it (each of its points then costs
        one attribute test). Skipping is ignored while a profiler reads: it needs every step."""
        skipping = self.enabled and not timed and not self.profiling
        if self._skipping and not skipping and self.enabled:
            self._mark = self._now()  # compute counts from here, not from the last step timed
        self._skipping = skipping
        self.live = self.enabled and not skipping

    def disable(self, *, watch: bool = False) -> None:
        if self._users == 0:
            return
        self._users -= 1
        self._watchers = max(0, self._watchers - watch)
        self.live = self.enabled and not self._skipping
        if not self.profiling:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._hooked.clear()

    def track(self, model: nn.Module) -> None:
        """A prepared model whose parameters mark when this rank's gradients are all computed."""
        self._models.append(model)
        if self.profiling:
            self._hook(model)

    def _hook(self, model: nn.Module) -> None:
        """The last-gradient mark on `model`'s first and last trainable parameters (see the module docstring)."""
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params[:1] + params[1:][-1:]:
            self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
            self._hooked.append(id(p))

    def _grad_ready(self, _: torch.Tensor) -> None:
        if not self.live:
            return
        if self._cuda:  # one event per micro-step, moved to each later gradient (spans keep earlier ones)
            if self._grad_at is None:
                self._grad_at = torch.cuda.Event(enable_timing=True)
            self._grad_at.record()
        else:
            self._grad_at = time.perf_counter()

    # -- the timed points -----------------------------------------------------------------------
    def _now(self) -> Any:
        """A point in time: the host clock, or on CUDA an event recorded on the current stream (no waiting)."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _add(self, phase: str, start: Any, end: Any, grad: Any = None) -> None:
        """`phase` from `start` to `end`; given `grad` (the last gradient's point), the part after it is exposed
        communication. On CUDA the span waits, as events, for the next snapshot."""
        self._mark = end
        if self._cuda:
            self._pending.append((phase, start, end, grad))
            if len(self._pending) >= _MAX_PENDING:
                self._settle()
            return
        total = end - start  # the host clock, counted now (inline: this runs a few times every step)
        if total <= 0.0:
            return
        exposed = 0.0 if grad is None else min(max(0.0, end - grad), total)
        self.totals[phase] += total - exposed
        if exposed:
            self.totals["comm"] += exposed
            self.totals["exposed"] += exposed

    def _count(self, phase: str, start: Any, end: Any, grad: Any) -> None:
        """A CUDA span, its events complete: `phase` up to the last gradient, exposed communication after it."""
        total = max(0.0, float(start.elapsed_time(end)) / 1e3)
        before = total if grad is None else min(max(0.0, float(start.elapsed_time(grad)) / 1e3), total)
        self.totals[phase] += before
        self.totals["comm"] += total - before
        self.totals["exposed"] += total - before

    def _settle(self) -> None:
        """CUDA: read every pending span's events (one synchronisation of the device for all of them)."""
        if not self._pending:
            return
        torch.cuda.synchronize(self.device)
        pending, self._pending = self._pending, []
        for span in pending:
            self._count(*span)

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Time a block as `name` ("optimizer", "comm"); a shared no-op context while timing is off."""
        return _Phase(self, name) if self.live else _UNTIMED

    def backward_starts(self) -> None:
        """`run.backward` is about to run the backward of this micro-step's loss (the first one counts)."""
        if self.live and self._backward_at is None:
            self._backward_at = self._now()

    def micro_step(self) -> contextlib.AbstractContextManager[Any]:
        """Wraps one micro-step: compute since the last timed point, less the exposed communication at its end."""
        return _Micro(self) if self.live else _UNTIMED

    def batches(self, source: Iterable[Any]) -> Iterator[Any]:
        """`source`'s batches, the wait for each timed as data while timing is on (a plain pass-through when off)."""
        it: Iterator[Any] | None = None
        while True:
            start = self._now() if self.live else None
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
        self._settle()
        return [self.totals[p] for p in PHASES] + [time.perf_counter()]

    def split(self) -> list[float]:
        """For the slow-rank watch: cumulative seconds of data, forward (the micro-steps up to `run.backward`),
        synced (their backward, and paratrain's collectives: where a rank waits for its peers) and optimizer,
        and this rank's clock."""
        data, compute, comm, optimizer, clock = self.snapshot()
        backward, exposed = self.totals["backward"], self.totals["exposed"]
        return [data, compute + exposed - backward, backward + comm - exposed, optimizer, clock]


class _Phase:
    """A block timed as one phase. (Classes, not generator contexts: they run every step while the slow-rank
    watch is on, and cost a third as much.)"""

    __slots__ = ("timing", "name", "start")

    def __init__(self, timing: Breakdown, name: str) -> None:
        self.timing, self.name = timing, name

    def __enter__(self) -> None:
        self.start = self.timing._now()

    def __exit__(self, *exc: object) -> None:
        self.timing._add(self.name, self.start, self.timing._now())


class _Micro:
    """One micro-step: compute from the last timed point, exposed communication after its last gradient."""

    __slots__ = ("timing",)

    def __init__(self, timing: Breakdown) -> None:
        self.timing = timing

    def __enter__(self) -> None:
        self.timing._grad_at = self.timing._backward_at = None

    def __exit__(self, *exc: object) -> None:
        timing = self.timing
        end = timing._now()
        timing._add("compute", timing._mark, end, timing._grad_at)
        if timing._backward_at is not None:
            timing._add("backward", timing._backward_at, end)


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
