"""Choosing the micro-batch count (and, for scheduled pipelines, the schedule) by measurement, for both
pipeline engines (one process or many).

The engines differ in how one trial step runs; the search over counts, the rule that trials leave no
trace, and what is recorded on the plan are the same, so they live here once.

schedule="auto" searches the micro-batch count with the first schedule (`microbatch.search`), then
walks each other schedule from that count towards fewer or more micro-batches while it improves
(zero-bubble schedules tend to prefer fewer, larger micro-batches than 1F1B): a few trial steps per
schedule instead of every (schedule, count) pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from torch import nn

from ...errors import ParatrainError
from ..microbatch import Search, search
from ..plan import Plan
from ..trial import no_trace


def tune_microbatches(plan: Plan, measure: Callable[[int], float], candidates: list[int], stages: int,
                      modules: Iterable[nn.Module]) -> int:
    """The best count among `candidates` by `measure(m)` (seconds per trial step, agreed by all ranks)."""
    with no_trace(modules):
        found: Search = search(measure, candidates, stages)
    plan.microbatches = found.best
    plan.search = found
    plan.note(f"microbatches auto -> {found.best} (measured {len(found.curve)} of {len(candidates)} counts in "
              f"{found.seconds:.2f}s: " + ", ".join(f"{m}: {t * 1e3:.1f}ms" for m, t in found.curve.items()) + ")")
    return found.best


def _walk(measure: Callable[[int], float], candidates: Sequence[int], start: int, curve: dict[int, float],
          limit: int = 3) -> None:
    """Measure `start` (or the candidate nearest it), then step to fewer micro-batches while that is faster,
    else to more; at most `limit` trials."""
    cands = sorted(candidates)
    if not cands:
        return
    i = min(range(len(cands)), key=lambda k: abs(cands[k] - start))
    curve[cands[i]] = measure(cands[i])
    for direction in (-1, 1):
        j = i
        while 0 <= j + direction < len(cands) and len(curve) < limit:
            nxt = cands[j + direction]
            curve[nxt] = measure(nxt)
            if curve[nxt] >= curve[cands[j]]:
                break
            j += direction
        if j != i:
            return  # improved in this direction: the other one is uphill


def tune_schedule(plan: Plan, schedules: list[str], measure: Callable[[str, int], float],
                  candidates: Callable[[str], list[int]], stages: int, modules: Iterable[nn.Module]) -> tuple[str, int]:
    """The fastest (schedule, micro-batch count) by `measure(schedule, m)` (seconds per trial step, agreed by all
    ranks); with one schedule this is the micro-batch search alone."""
    if len(schedules) == 1:
        best = tune_microbatches(plan, lambda m: measure(schedules[0], m), candidates(schedules[0]), stages, modules)
        plan.schedule = schedules[0]
        return schedules[0], best
    start = time.perf_counter()
    curves: dict[str, dict[int, float]] = {}
    with no_trace(modules):
        first = [s for s in schedules if candidates(s)]
        if not first:
            raise ParatrainError(f"no schedule of {schedules} runs a micro-batch count that fits this batch; pass "
                                 "schedule= and microbatches= by hand")
        found = search(lambda m: measure(first[0], m), candidates(first[0]), stages)
        curves[first[0]] = dict(found.curve)
        for name in first[1:]:
            curves[name] = {}
            _walk(lambda m, name=name: measure(name, m), candidates(name), found.best, curves[name])  # type: ignore[misc]
    schedule, best = min(((s, m) for s, c in curves.items() for m in c), key=lambda sm: curves[sm[0]][sm[1]])
    plan.schedule, plan.microbatches, plan.search = schedule, best, found
    plan.schedule_curve = {f"{s} M={m}": t for s, c in curves.items() for m, t in c.items()}
    trials = sum(len(c) for c in curves.values())
    plan.note(f"schedule auto -> {schedule}, microbatches {best} (measured {trials} (schedule, count) pairs in "
              f"{time.perf_counter() - start:.2f}s: " + ", ".join(f"{k}: {t * 1e3:.1f}ms"
                                                                  for k, t in plan.schedule_curve.items()) + ")")
    return schedule, best
