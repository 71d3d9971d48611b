"""Runs a plan: one `paratrain.launch` per job (fresh worker processes, one thread each on CPU), and
turns what rank 0 returns into result records. A job whose workers crash or time out is reported as
`failed` with the worker's error; the next job still runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import ParatrainError
from ..launcher.spawn import launch
from ..observe.progress import Bar
from . import schema
from .jobs import JobList, Settings, Spec
from .schema import RunRecord
from .worker import run_job


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-600:] if lines else text[-600:]


def run_jobs(jobs: JobList, settings: Settings, job_timeout: float, say: Callable[[str], None] = print,
             on_records: Callable[[list[RunRecord]], None] | None = None,
             progress: bool | None = None) -> list[RunRecord]:
    """Measure every job in turn; `on_records` sees each job's records as soon as it finishes. A bar over the
    configurations with an ETA goes to stderr (`progress`: None shows it on a terminal)."""
    records = [schema.record(spec, status, reason, spec.bound) for spec, status, reason in jobs.skipped]
    if on_records and records:
        on_records(records)
    bar = Bar(progress, total=sum(len(job.specs) for job in jobs.jobs), unit="config", desc="bench")
    with bar.above():  # what is printed meanwhile (rows, the workers' lines) goes above the bar
        for i, job in enumerate(jobs.jobs, 1):
            beside = " and one worker (the speedups' baseline)" if job.baseline else ""
            say(f"[{i}/{len(jobs.jobs)}] {job.title}: {len(job.specs)} configuration(s){beside}, "
                f"{settings.warmup} warm-up + {settings.repeat * settings.steps} timed steps each, in turns step by "
                "step")
            start = time.monotonic()
            try:
                out = launch(run_job, job, settings, nproc=job.nproc, timeout=job_timeout, prefix_output=False)
                done = [_from_worker(item) for item in out]
            except ParatrainError as exc:  # WorkerFailed or the job's time limit
                reason = f"job failed: {_last_line(str(exc))}"
                done = [schema.record(spec, "failed", reason, spec.bound) for spec in job.specs]
            say(f"      ({time.monotonic() - start:.0f} s)")
            records += done
            if on_records:
                on_records(done)
            bar.advance(by=len(job.specs), postfix=job.title)
    return records


def _from_worker(item: dict[str, Any]) -> RunRecord:
    spec: Spec = item["spec"]
    status = "failed" if item["reason"] else "ok"
    done = schema.record(spec, status, item["reason"], spec.bound, item["step_times_s"], item["peak_memory_mb"],
                         single_times=item.get("single_step_times_s"))
    done.final_loss = item.get("final_loss")
    return done
