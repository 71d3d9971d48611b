"""Slow ranks named while training, with no code in the loop: the straggler watch.

A rank that is merely slower than its peers (a throttled GPU, a busy host, a loader starved of CPU)
slows every step of every rank, and nothing fails. The watch keeps the step breakdown (breakdown.py)
on for the run, timing one optimizer step in SAMPLE_EVERY (a straggler is slow in every step, so a
sample finds it, at a quarter of the cost), and once a window of optimizer steps gathers every rank's
seconds per timed step in one small all-reduce (six floats per rank):

    next(loader) ─data─▶ batch ──forward──▶ run.backward ──backward──▶ end of micro-step ─optimizer─▶
                                            (own backward, and DDP's wait for its slowest peer's buckets)

Before `run.backward` a data-parallel rank runs no collective, so data, forward and optimizer are its own
work; a rank that waits for a slower peer does it in its backward or in paratrain's collectives
(`run.all_reduce`, ...): together, "synced". Rank 0 judges each window:

    rank r is slow when, against the median of its peers (the ranks doing the same work as r),
        excess = own(r) - median(own)                own = data + forward + optimizer
        excess > threshold x median(own)             (setup(straggler_threshold=0.2): 20% more)
        excess >= FLOOR_S                            (a millisecond a step: less is not worth a word)
        median(synced) - synced(r) >= excess / 2     (its peers wait for it)

A rank waiting for a slower peer is the victim, not the culprit: the last condition keeps it (and a
rank whose extra work nobody waits for) from being named. (A rank s times slower in compute shows s
times the forward; its peers' backward is longer than its own by that forward's excess.) A rank slow in
IN_A_ROW windows running is named once: rank 0 prints which rank, its host (from the heartbeat every
rank publishes, faults/watch.py), how much slower and in which phase, and appends the event to
metrics.jsonl. The timing needs no autograd hook: `run.backward` marks where backward starts.

Peers are the ranks at the same position in another data-parallel replica: every rank of DDP or FSDP;
the same pipeline stage of each replica of ddp+pp. A single replica (a pipeline alone, tensor
parallelism alone) has no peers, and the watch stops at its first window.

Windows: every rank counts optimizer steps (ends of accumulation windows) and gathers after `window`
of them, and after at least MIN_WINDOW_S of wall time, so that one collective per window costs well
under 1% of a run of short steps; the next window's length in steps is computed from the gathered
numbers, which are the same on every rank (each float has one non-zero term in the sum, so the sum is
exact). The first window (start-up: loader workers, DDP's first buckets) is not judged. Inside
`run.join` ranks stop stepping together, so the watch neither counts nor gathers there and starts a
new window after it.

Not seen: under FSDP and tensor parallelism a rank waits for a slower peer inside its forward too (their
collectives are there), so waiting cannot be told from working and nobody is named; the stages of a
pipeline other than the last run their backward inside the schedule, unmarked, and are not judged.
"""

from __future__ import annotations

import math
import socket
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .breakdown import Breakdown

if TYPE_CHECKING:
    from ..step import Step

OWN = ("data", "forward", "optimizer")
"""A rank's own work; the rest of a step is synced (its backward and collectives, waits included) or other."""
PHASE = {"data": "data", "forward": "compute", "optimizer": "optimizer"}
"""The phase each part of own work is reported as (the breakdown's names)."""
FLOOR_S = 1e-3
IN_A_ROW = 3
"""Windows running in which a rank must be slow: a busy moment on a shared host passes, a straggler stays."""
SAMPLE_EVERY = 4
"""One optimizer step in this many is timed (the first of each group; every one while a profiler reads)."""
MIN_WINDOW_S = 1.0
_SLOT = 6
"""Floats per rank in the gather: data, forward, synced, optimizer, wall (seconds per step), replica index."""
_WORDS = {"data": "waiting for data", "compute": "forward/backward", "optimizer": "the optimizer step"}
_FIXES = {
    "data": "its loader (more DataLoader workers, data on local disk) or that host's load",
    "compute": "its device or host (another process on it, thermal throttling, a slower GPU)",
    "optimizer": "its device or host (another process on it)",
}


@dataclass(frozen=True)
class RankWindow:
    """One rank's seconds per timed step in a window (wall: per step)."""

    data: float
    forward: float
    synced: float
    """Its backward and paratrain's collectives: its own backward, and every wait for a slower peer."""
    optimizer: float
    wall: float

    @property
    def own(self) -> float:
        return self.data + self.forward + self.optimizer


@dataclass(frozen=True)
class Slow:
    """One rank's excess over the median of its peers, in seconds per step."""

    rank: int
    own_s: float
    peers_s: float
    """The median of its peers' own work."""
    waited_s: float
    """How much longer its peers wait in collectives than it does (median)."""
    excess_s: Mapping[str, float]
    """Per phase of own work (data, compute, optimizer): this rank's time less its peers' median."""

    @property
    def ratio(self) -> float:
        return self.own_s / self.peers_s if self.peers_s > 0 else math.inf

    @property
    def phase(self) -> str:
        """The phase it loses most in."""
        return max(self.excess_s, key=lambda p: self.excess_s[p])


def peer_groups(replicas: list[int]) -> list[list[int]]:
    """Ranks doing the same work, from each rank's data-parallel replica index: the k-th rank of every replica
    (in rank order) together. Groups of one are left out: nothing to compare."""
    positions: dict[int, int] = {}
    groups: dict[int, list[int]] = {}
    for r, replica in enumerate(replicas):
        position = positions.get(replica, 0)
        positions[replica] = position + 1
        groups.setdefault(position, []).append(r)
    return [g for g in groups.values() if len(g) > 1]


def slow_in_window(ranks: list[RankWindow], groups: list[list[int]], threshold: float,
                   floor_s: float = FLOOR_S) -> dict[int, Slow]:
    """The ranks that are slow in one window (the rule in the module docstring), each against its own group."""
    found = {}
    for group in groups:
        for r in group:
            me, peers = ranks[r], [ranks[i] for i in group if i != r]
            median = statistics.median(t.own for t in peers)
            excess = me.own - median
            waited = statistics.median(t.synced for t in peers) - me.synced
            if excess > threshold * median and excess >= floor_s and waited >= excess / 2:
                found[r] = Slow(r, me.own, median, waited, {
                    PHASE[p]: getattr(me, p) - statistics.median(getattr(t, p) for t in peers) for p in OWN})
    return found


def merge(windows: list[Slow]) -> Slow:
    """One rank's verdicts over several windows, averaged (equal windows of wall time weigh alike)."""
    n = len(windows)
    return Slow(windows[0].rank, sum(w.own_s for w in windows) / n, sum(w.peers_s for w in windows) / n,
                sum(w.waited_s for w in windows) / n,
                {p: sum(w.excess_s[p] for w in windows) / n for p in windows[0].excess_s})


def describe(slow: Slow, host: str, steps: tuple[int, int], peers: int) -> str:
    """The warning: which rank, where, how much slower, in which phase, and what to look at."""
    phase = slow.phase
    return (f"rank {slow.rank} (host {host}) is slower than its peers: over steps {steps[0]}-{steps[1]} its own work "
            f"takes {_ms(slow.own_s)} a step against a median of {_ms(slow.peers_s)} on the other {peers} "
            f"({_times(slow.ratio)}), most of the difference in {_WORDS[phase]} (+{_ms(slow.excess_s[phase])}); "
            f"the others wait for it ({_ms(slow.waited_s)} a step more than it waits for them). "
            f"Look at {_FIXES[phase]}. (setup(straggler_threshold=...) tunes this check, None turns it off.)")


def record(slow: Slow, host: str, steps: tuple[int, int]) -> dict[str, Any]:
    """The event's line in metrics.jsonl."""
    return {"step": steps[1], "event": "slow_rank", "rank": slow.rank, "host": host, "phase": slow.phase,
            "ratio": round(slow.ratio, 4), "own_s": slow.own_s, "peers_own_s": slow.peers_s,
            "peers_wait_s": slow.waited_s, "excess_s": dict(slow.excess_s), "steps": list(steps)}


class StragglerWatch:
    """One rank's side of the watch: times the run, gathers once a window, and on rank 0 names slow ranks."""

    def __init__(self, *, rank: int, world_size: int, threshold: float | None, window: int, timing: Breakdown,
                 all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                 guard: Callable[[str], Any], layout: Callable[[], tuple[int, int]],
                 beats: Callable[[], Mapping[int, Any]], report: Callable[[dict[str, Any], str], None]) -> None:
        self.rank, self.world_size = rank, world_size
        self.threshold = threshold
        self.min_steps = window
        self.timing = timing
        self._sum, self._guard, self._layout = all_reduce_sum, guard, layout
        self._beats, self._report = beats, report
        """Every rank's heartbeat (its host), and rank 0's sink for the warning and its record."""
        self.active = threshold is not None and world_size > 1
        self._window = window
        """Optimizer steps in the current window (the first: `window`; then as long as MIN_WINDOW_S needs)."""
        self._steps = 0
        self._timed = 0
        """Steps of this window that were timed (sampled, or all of them while a profiler reads)."""
        self.windows = 0
        """Windows gathered so far (the first is not judged)."""
        self._paused = False
        self._streak: dict[int, list[Slow]] = {}
        """Rank 0: the ranks slow in every window since a given one, with their verdicts."""
        self._first_step: dict[int, int] = {}
        self.named: list[int] = []
        """Rank 0: the ranks warned about (each once)."""
        self._since: list[float] = []
        if self.active:
            timing.enable(watch=True)
            self._since = timing.split()

    def after_micro_step(self, step: Step, *, joining: bool) -> None:
        """Called after every micro-step on every rank; at a window's end (an optimizer step), the gather."""
        if not self.active or not step.at_boundary:
            return
        if joining:  # ranks no longer step together: nothing counted, and a new window after the join
            self._paused = True
            return
        if self._paused:
            self._restart()
            return
        self._steps += 1
        self._timed += self.timing.live
        if self._steps >= self._window:
            self._gather(step.count // step.accum)
        timed = self._steps % SAMPLE_EVERY == 0  # a window's first step is always timed
        if timed != self.timing.live:
            self.timing.sample(timed)

    def stop(self) -> None:
        """Timing off for good (no peers to compare, or the run is closing)."""
        if self.active:
            self.active = False
            self.timing.disable(watch=True)

    def _restart(self) -> None:
        self._paused = False
        self._steps = self._timed = 0
        self.timing.sample(True)
        self._since = self.timing.split()
        self._streak.clear()

    def _gather(self, step: int) -> None:
        replica, replicas = self._layout()
        if replicas < 2:  # the same answer on every rank: no collective is skipped by one rank only
            self.stop()
            return
        now = self.timing.split()
        phases = [(b - a) / max(1, self._timed) for a, b in zip(self._since[:-1], now[:-1])]
        wall = (now[-1] - self._since[-1]) / self._steps
        flat = torch.zeros(self.world_size * _SLOT, dtype=torch.float64)
        flat[self.rank * _SLOT:(self.rank + 1) * _SLOT] = torch.tensor([*phases, wall, float(replica)],
                                                                        dtype=torch.float64)
        with self._guard("straggler check"):
            summed = self._sum(flat).tolist()
        slots = [summed[r * _SLOT:(r + 1) * _SLOT] for r in range(self.world_size)]
        ranks = [RankWindow(*s[:5]) for s in slots]
        steps, self._since, self._steps, self._timed = self._steps, now, 0, 0
        self.windows += 1
        slowest = max(t.wall for t in ranks)
        self._window = max(self.min_steps, math.ceil(MIN_WINDOW_S / slowest) if slowest > 0 else self.min_steps)
        if self.rank == 0 and self.windows > 1:
            assert self.threshold is not None
            groups = peer_groups([int(s[5]) for s in slots])
            self._judge(slow_in_window(ranks, groups, self.threshold), groups, (step - steps + 1, step))

    def _judge(self, found: dict[int, Slow], groups: list[list[int]], steps: tuple[int, int]) -> None:
        """Rank 0, after a window (its first and last step): name each rank slow in IN_A_ROW windows running."""
        for r in list(self._streak):
            if r not in found:
                del self._streak[r]
        for r, slow in found.items():
            if r not in self._streak:
                self._first_step[r] = steps[0]
            self._streak.setdefault(r, []).append(slow)
            if len(self._streak[r]) >= IN_A_ROW and r not in self.named:
                self.named.append(r)
                merged = merge(self._streak[r])
                span = (self._first_step[r], steps[1])
                host = self._host(r)
                peers = next(len(g) - 1 for g in groups if r in g)
                self._report(record(merged, host, span), describe(merged, host, span, peers))

    def _host(self, rank: int) -> str:
        if rank == self.rank:
            return socket.gethostname()
        try:
            beat = self._beats().get(rank)
        except Exception:  # the heartbeat store is gone: the rank is still named, its host is not
            beat = None
        return str(getattr(beat, "host", None) or "unknown")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.0f}x"

