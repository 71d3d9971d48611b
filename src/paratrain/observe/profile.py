"""`with paratrain.profile(run) as p:` times the steps inside the block on every rank, then gathers the
per-rank breakdown (one all-reduce, on leaving the block) so that `print(p)` on rank 0 shows where the
time went and which rank, if any, holds the others up. `run.log` inside the block carries the same
fields per logged interval; `setup(profile=True)` times the whole run instead."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .breakdown import PHASES, RankTimes, describe, per_step, rank_times, slow_ranks
from .sinks import notice

if TYPE_CHECKING:
    from ..api import Run


@dataclass
class Profile:
    """Seconds per optimizer step in each phase, for every rank; filled when the `with` block ends."""

    steps: int = 0
    """Optimizer steps (accumulation windows) run inside the block; the times are per step (totals if 0)."""
    ranks: list[RankTimes] = field(default_factory=list)
    slow: list[int] = field(default_factory=list)
    """Ranks much slower than the others (see breakdown.slow_ranks)."""

    def __str__(self) -> str:
        unit = "ms per step" if self.steps else "ms in total"
        head = f"{'rank':>4} " + " ".join(f"{p:>9}" for p in (*PHASES, "other")) + f"   ({unit}, {self.steps} steps)"
        rows = [head]
        for r, t in enumerate(self.ranks):
            cells = " ".join(f"{getattr(t, p) * 1e3:9.2f}" for p in (*PHASES, "other"))
            rows.append(f"{r:>4} {cells}" + ("   <- slow" if r in self.slow else ""))
        rows += [describe(r, self.ranks) for r in self.slow]
        return "\n".join(rows)


@contextlib.contextmanager
def profile(run: Run) -> Iterator[Profile]:
    """Time data, compute, exposed communication and optimizer on every rank inside the block. Collective:
    every rank enters it, and leaving it all-reduces a few floats per rank (not done if the block raised)."""
    result = Profile()
    micro = run.step.count
    timing = run.timing
    timing.enable()
    before = timing.snapshot()
    try:
        yield result
    finally:
        after = timing.snapshot()
        timing.disable()
    result.steps = (run.step.count - micro) // run.config.grad_accum
    mine = per_step(before, after, result.steps)
    slot = len(mine)
    flat = torch.zeros(run.world_size * slot, dtype=torch.float64)
    flat[run.rank * slot:(run.rank + 1) * slot] = torch.tensor(mine, dtype=torch.float64)
    gathered = run.all_reduce(flat.to(run.device), "sum").tolist()
    result.ranks = [rank_times(gathered[r * slot:(r + 1) * slot]) for r in range(run.world_size)]
    result.slow = slow_ranks(result.ranks)
    if run.is_main:
        for r in result.slow:
            notice(describe(r, result.ranks))
