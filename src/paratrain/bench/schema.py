"""`results.json`: the contract other tools (and docs/benchmarks.md) read.

    {"schema": "paratrain-bench/3", "created": ISO time, "command": "...",
     "paratrain": {"version", "commit"},
     "machine": {"cpu", "cores", "cores_total", "gpus", "torch", "python", "platform",
                 "peak": {"flops_per_s", "dtype", "source", "per_worker"}},
     "workload": {"name", "description", "parameters", "lr", "tokens_per_sample", "flops_per_step",
                  "flops_method"},
     "global_batch": B,
     "settings": {"steps", "warmup", "repeat", "schedule", "precision", "channels_last", "gpt_size"},
     "runs": [{"strategy", "workers", "microbatches", "schedule", "step_times_s", "median_step_s", "spread_s",
               "samples_per_s", "tokens_per_s", "mfu", "speedup_vs_single", "scaling_efficiency", "bound",
               "peak_memory_mb", "reference", "vs_reference", "status", "reason", "options", "final_loss"}, ...],
     "plan": {...}}   # only from `bench --plan`: bench/planned.py's `compare` (predicted beside measured)

`no-comm` (beside ddp) is the ceiling of data parallelism here: every worker computing its share with
no communication. `microbatches` is null unless pipelined, `schedule` null unless `pp`-like; derived numbers are null
unless the run is `ok`; `reason` is null exactly when it is `ok`. `tokens_per_s` is null unless the workload
trains on tokens; `mfu` (model FLOPs utilisation, see `mfu.py`) is null when the step's FLOPs or the
devices' peak are unknown. Version 2 added `tokens_per_s`, `mfu`, `machine.peak`, the workload's
`tokens_per_sample`, `flops_per_step` and `flops_method`, and `settings.gpt_size`; version 3 added each run's
`options` and `final_loss`. Every older field is kept, and `from_json` reads versions 1 and 2 too.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..parallel.dims import is_grammar
from .jobs import BENCH_STRATEGIES, CEILING, N_D_STRATEGIES, REFERENCE, Spec

SCHEMA = "paratrain-bench/3"
OLDER = ("paratrain-bench/1", "paratrain-bench/2")
"""Versions `from_json` still reads (their missing fields are null)."""
STATUSES = ("ok", "not-applicable", "failed")
STRATEGIES = (*BENCH_STRATEGIES, *N_D_STRATEGIES, *REFERENCE.values(), CEILING)
PIPELINED = ("mp", "pp", "ddp+pp")
SCHEDULED = ("pp", "ddp+pp")
_REFERS_TO = {reference: strategy for strategy, reference in REFERENCE.items()}


def _pipeline_axis(strategy: str) -> bool:
    """An N-D layout of the grammar with a pipeline axis (`tp+pp`, `ddp+tp+pp`): pipelined and scheduled."""
    return strategy not in STRATEGIES and is_grammar(strategy) and "pp" in strategy.split("+")


def pipelined(strategy: str) -> bool:
    """Runs with a micro-batch count (a hand-written reference as the strategy it is written for)."""
    strategy = _REFERS_TO.get(strategy, strategy)
    return strategy in PIPELINED or _pipeline_axis(strategy)


def scheduled(strategy: str) -> bool:
    """Runs one of the pipeline schedules."""
    strategy = _REFERS_TO.get(strategy, strategy)
    return strategy in SCHEDULED or _pipeline_axis(strategy)


@dataclass(kw_only=True)
class RunRecord:
    """One measured (or not applicable, or failed) configuration: a row of results.json."""

    strategy: str
    workers: int
    microbatches: int | None = None
    schedule: str | None = None
    step_times_s: list[float] = field(default_factory=list)
    """Every timed step, the slowest rank's time each."""
    median_step_s: float | None = None
    spread_s: float | None = None
    """Interquartile range of step_times_s."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    """global batch x tokens per sample / median step time (token workloads only)."""
    mfu: float | None = None
    """Model FLOPs utilisation: FLOPs per step / median step time / (peak FLOP/s per device x workers)."""
    speedup_vs_single: float | None = None
    scaling_efficiency: float | None = None
    bound: float
    """The best speedup over single this layout allows (the strategy's own bound)."""
    peak_memory_mb: float | None = None
    reference: str | None = None
    """The hand-written PyTorch twin this run is compared with."""
    vs_reference: float | None = None
    status: str
    reason: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """More `paratrain.setup` options this run was given (e.g. {"comm_hook": "auto"}); {} for the defaults."""
    final_loss: float | None = None
    """paratrain's global-batch loss after the run's last step (every side trains the same steps from the same
    weights: a lossy option's effect is its difference from the exact run's); null for references."""

    @property
    def median(self) -> float:
        """The median step time of a measured run (reports and plots only look at `ok` runs)."""
        if self.median_step_s is None:
            raise ValueError(f"{self.strategy} on {self.workers} worker(s) has no measured steps ({self.status})")
        return self.median_step_s

    @property
    def speedup(self) -> float:
        if self.speedup_vs_single is None:
            raise ValueError(f"{self.strategy} on {self.workers} worker(s) has no speedup (no single run)")
        return self.speedup_vs_single

    @property
    def micro(self) -> int:
        """Micro-batches per step (1 for strategies that do not split batches)."""
        return self.microbatches or 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        """A record from results.json; fields an older version lacks take their defaults."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


RUN_KEYS = tuple(f.name for f in fields(RunRecord))
TOP_KEYS = ("schema", "created", "command", "paratrain", "machine", "workload", "global_batch", "settings", "runs")
WORKLOAD_KEYS = ("name", "description", "parameters", "tokens_per_sample", "flops_per_step", "flops_method")
PEAK_KEYS = ("flops_per_s", "dtype", "source", "per_worker")


def record(spec: Spec, status: str, reason: str | None, bound: float, step_times: list[float] | None = None,
           peak_mb: float | None = None) -> RunRecord:
    """A run before the derived numbers (medians, speedups) are filled in by `finalise`."""
    return RunRecord(strategy=spec.strategy, workers=spec.workers, microbatches=spec.microbatches,
                     schedule=spec.schedule, options=dict(spec.options),
                     step_times_s=[round(t, 6) for t in step_times or []],
                     bound=round(bound, 4), peak_memory_mb=peak_mb, reference=REFERENCE.get(spec.strategy),
                     status=status, reason=reason)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def finalise(runs: list[RunRecord], global_batch: int, *, tokens_per_sample: int | None = None,
             flops_per_step: int | None = None, peak_flops_per_s: float | None = None) -> list[RunRecord]:
    """Fill in medians, spread (interquartile range), samples/s, tokens/s, MFU, speedups and the ratio to
    the reference. MFU counts every worker of a run as one device at `peak_flops_per_s`."""
    for run in runs:
        if run.status == "ok":
            run.median_step_s = round(statistics.median(run.step_times_s), 6)
            run.spread_s = round(quantile(run.step_times_s, 0.75) - quantile(run.step_times_s, 0.25), 6)
            run.samples_per_s = round(global_batch / run.median_step_s, 3)
            if tokens_per_sample:
                run.tokens_per_s = round(global_batch * tokens_per_sample / run.median_step_s, 1)
            if flops_per_step and peak_flops_per_s:
                utilisation = flops_per_step / run.median_step_s / (peak_flops_per_s * run.workers)
                run.mfu = float(f"{utilisation:.4g}")  # significant digits: a toy model's MFU is tiny, not zero
    single = next((r for r in runs if r.strategy == "single" and r.status == "ok"), None)
    for run in runs:
        if run.status != "ok" or run.median_step_s is None:
            continue
        if single is not None and single.median_step_s is not None:
            speedup = single.median_step_s / run.median_step_s
            run.speedup_vs_single = round(speedup, 4)
            run.scaling_efficiency = round(speedup / run.workers, 4)
        ref = next((r for r in runs if r.strategy == run.reference and r.status == "ok" and r.workers == run.workers
                    and r.microbatches == run.microbatches and r.schedule == run.schedule), None)
        if ref is not None and ref.median_step_s is not None:
            run.vs_reference = round(run.median_step_s / ref.median_step_s, 4)
    return runs


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_name(i) for i in range(count)]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": usable, "cores_total": os.cpu_count(), "gpus": gpus, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def commit() -> str | None:
    """The source commit, with "+dirty" when the tree has changes (None outside a git checkout)."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def as_json(results: dict[str, Any]) -> dict[str, Any]:
    """The results document as results.json holds it (run records as plain dicts)."""
    return {**results, "runs": [r.as_dict() if isinstance(r, RunRecord) else r for r in results["runs"]]}


def from_json(data: dict[str, Any]) -> dict[str, Any]:
    """A results.json document (this version or an older one) with its runs as typed records again, for
    reports and plots."""
    if data.get("schema") not in (SCHEMA, *OLDER):
        raise ValueError(f"schema is {data.get('schema')!r}; this paratrain reads {', '.join((SCHEMA, *OLDER))}")
    return {**data, "runs": [RunRecord.from_dict(r) for r in data["runs"]]}


def validate(results: dict[str, Any]) -> None:
    """Raise ValueError naming every way `results` breaks the contract."""
    problems = [f"missing top-level key {k!r}" for k in TOP_KEYS if k not in results]
    if results.get("schema") != SCHEMA:
        problems.append(f"schema is {results.get('schema')!r}, expected {SCHEMA!r}")
    for key in ("cpu", "gpus", "torch", "peak"):
        if key not in results.get("machine", {}):
            problems.append(f"machine has no {key!r}")
    peak = results.get("machine", {}).get("peak") or {}
    problems += [f"machine.peak has no {k!r}" for k in PEAK_KEYS if k not in peak]
    workload = results.get("workload", {})
    problems += [f"workload has no {k!r}" for k in WORKLOAD_KEYS if k not in workload]
    if not isinstance(results.get("global_batch"), int) or results["global_batch"] < 1:
        problems.append("global_batch must be a positive integer")
    tokens = bool(workload.get("tokens_per_sample"))
    mfu = bool(workload.get("flops_per_step")) and bool(peak.get("flops_per_s"))
    for i, run in enumerate(results.get("runs", [])):
        problems += [f"runs[{i}]: {p}" for p in _run_problems(run, tokens, mfu)]
    if problems:
        raise ValueError("results.json breaks its schema:\n  " + "\n  ".join(problems))


def _run_problems(run: dict[str, Any], tokens: bool, mfu: bool) -> list[str]:
    out = [f"missing key {k!r}" for k in RUN_KEYS if k not in run]
    if out:
        return out
    if run["strategy"] not in STRATEGIES and not is_grammar(run["strategy"]):  # other N-D names of the grammar
        out.append(f"unknown strategy {run['strategy']!r}")
    if run["status"] not in STATUSES:
        out.append(f"status {run['status']!r} not in {STATUSES}")
    if not isinstance(run["workers"], int) or run["workers"] < 1:
        out.append("workers must be a positive integer")
    is_pipelined = pipelined(run["strategy"])
    if run["microbatches"] is not None and not is_pipelined:
        out.append("microbatches must be null unless the strategy is pipelined")
    if run["microbatches"] is None and is_pipelined and run["status"] == "ok":
        out.append("an ok pipelined run needs its microbatches")
    if run["schedule"] is not None and not scheduled(run["strategy"]):
        out.append("schedule must be null unless the strategy is pp-like")
    if run["status"] == "ok":
        if run["reason"] is not None:
            out.append("an ok run has a reason")
        if not run["step_times_s"] or min(run["step_times_s"]) <= 0:
            out.append("an ok run needs positive step_times_s")
        wanted = ("median_step_s", "samples_per_s", "bound", *(("tokens_per_s",) if tokens else ()),
                  *(("mfu",) if mfu else ()))
        for key in wanted:
            if not isinstance(run[key], (int, float)) or run[key] <= 0:
                out.append(f"{key} must be a positive number for an ok run")
    elif not run["reason"]:
        out.append(f"a {run['status']} run needs a reason")
    if not tokens and run["tokens_per_s"] is not None:
        out.append("tokens_per_s must be null when the workload has no tokens_per_sample")
    if not mfu and run["mfu"] is not None:
        out.append("mfu must be null when the step's FLOPs or the devices' peak are unknown")
    return out
