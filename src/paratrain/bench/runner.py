"""Runs a plan: one `paratrain.launch` per job (fresh worker processes, one thread each on CPU), and
turns what rank 0 returns into result records. A job whose workers crash or time out is reported as
`failed` with the worker's error; the next job still runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import ParatrainError
from ..launcher.spawn import launch
from . import schema
from .plan import Plan, Settings, Spec
from .worker import run_job

Record = dict[str, Any]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-600:] if lines else text[-600:]


def run_plan(plan: Plan, settings: Settings, job_timeout: float, say: Callable[[str], None] = print,
             on_records: Callable[[list[Record]], None] | None = None) -> list[Record]:
    """Measure every job in turn; `on_records` sees each job's records as soon as it finishes."""
    records: list[Record] = [schema.record(spec, status, reason) for spec, status, reason in plan.skipped]
    if on_records and records:
        on_records(records)
    for i, job in enumerate(plan.jobs, 1):
        say(f"[{i}/{len(plan.jobs)}] {job.title}: {len(job.specs)} configuration(s), "
            f"{settings.warmup} warm-up + {settings.repeat} x {settings.steps} timed steps each")
        start = time.monotonic()
        try:
            out = launch(run_job, job, settings, nproc=job.nproc, timeout=job_timeout, prefix_output=False)
            done = [_from_worker(item) for item in out]
        except ParatrainError as exc:  # WorkerFailed or the job's time limit
            reason = f"job failed: {_last_line(str(exc))}"
            done = [schema.record(spec, "failed", reason) for spec in job.specs]
        say(f"      ({time.monotonic() - start:.0f} s)")
        records += done
        if on_records:
            on_records(done)
    return records


def _from_worker(item: dict[str, Any]) -> Record:
    spec: Spec = item["spec"]
    if item["reason"]:
        return schema.record(spec, "failed", item["reason"], item["step_times_s"], item["peak_memory_mb"])
    return schema.record(spec, "ok", None, item["step_times_s"], item["peak_memory_mb"])
