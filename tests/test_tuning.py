"""Choosing the schedule and micro-batch count by measurement (parallel/pipeline/tuning.py), on synthetic step
times with a known best: the pick, and how few (schedule, count) pairs it measures against a sweep."""

from __future__ import annotations

import pytest
from torch import nn

from paratrain.errors import ParatrainError
from paratrain.parallel.pipeline.tuning import tune_schedule
from paratrain.parallel.plan import Plan

COUNTS = [1, 2, 4, 8, 16, 32, 64, 128]


def _times(schedule: str, m: int) -> float:
    """A 2-stage pipeline: bubble (M+K-1)/M times a per-micro-batch cost; zero-bubble hides most of the
    bubble but pays more per micro-batch, so it is best at fewer micro-batches than 1f1b."""
    bubble = {"1f1b": 1.0, "zero-bubble": 0.2, "gpipe": 1.1}[schedule]
    per_micro = {"1f1b": 0.002, "zero-bubble": 0.004, "gpipe": 0.002}[schedule]
    return (m + bubble) / m + per_micro * m


@pytest.mark.parametrize("schedules", [["1f1b", "zero-bubble", "gpipe"], ["1f1b"]])
def test_picks_the_fastest_pair_measuring_a_third_of_the_sweep(schedules: list[str]) -> None:
    measured: list[tuple[str, int]] = []

    def measure(schedule: str, m: int) -> float:
        measured.append((schedule, m))
        return _times(schedule, m)

    plan = Plan(strategy="pp", stages=2, microbatches="auto", verbose=False)
    got = tune_schedule(plan, schedules, measure, lambda s: [m for m in COUNTS if s != "1f1b" or m >= 2],
                        2, [nn.Linear(1, 1)])
    best = min(((s, m) for s in schedules for m in COUNTS if s != "1f1b" or m >= 2), key=lambda sm: _times(*sm))
    assert _times(*got) <= 1.05 * _times(*best)
    assert (plan.schedule, plan.microbatches) == got
    sweep = sum(len([m for m in COUNTS if s != "1f1b" or m >= 2]) for s in schedules)
    assert len(set(measured)) <= sweep / 3 + 1


def test_no_schedule_fits_names_the_fix() -> None:
    plan = Plan(strategy="pp", stages=2, microbatches="auto", verbose=False)
    with pytest.raises(ParatrainError, match="schedule= and microbatches="):
        tune_schedule(plan, ["1f1b", "gpipe"], lambda s, m: 1.0, lambda s: [], 2, [nn.Linear(1, 1)])
