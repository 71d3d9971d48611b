"""Choosing the micro-batch count by measurement, for both pipeline engines (one process or many).

The engines differ in how one trial step runs; the search over counts, the rule that trials leave no
trace, and what is recorded on the plan are the same, so they live here once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from .microbatch import Search, search
from .plan import Plan
from .trial import no_trace


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
