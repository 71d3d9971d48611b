"""`results.json`: the contract other tools (and docs/benchmarks.md) read.

    {"schema": "paratrain-bench/4", "created": ISO time, "command": "...",
     "paratrain": {"version", "commit"},
     "machine": {"cpu", "cores", "cores_total", "gpus", "torch", "python", "platform",
                 "peak": {"flops_per_s", "dtype", "source", "per_worker"}, "load_average": {"start", "end"}},
     "workload": {"name", "description", "parameters", "lr", "tokens_per_sample", "flops_per_step",
                  "flops_method"},
     "global_batch": B,
     "settings": {"steps", "warmup", "repeat", "schedule", "precision", "channels_last", "gpt_size"},
     "runs": [{"strategy", "workers", "microbatches", "schedule", "step_times_s", "median_step_s", "spread_s",
               "samples_per_s", "tokens_per_s", "mfu", "speedup_vs_single", "speedup_ci", "scaling_efficiency",
               "bound", "peak_memory_mb", "reference", "vs_reference", "ratio_ci", "status", "reason", "options",
               "final_loss", "single_step_times_s"}, ...],
     "plan": {...}}   # only from `bench --plan`: bench/planned.py's `compare` (predicted beside measured)

`no-comm` (beside ddp) is the ceiling of data parallelism here: every worker computing its share with
no communication. `microbatches` is null unless pipelined, `schedule` null unless `pp`-like; derived numbers are null
unless the run is `ok`; `reason` is null exactly when it is `ok`. `tokens_per_s` is null unless the workload
trains on tokens; `mfu` (model FLOPs utilisation, see `mfu.py`) is null when the step's FLOPs or the
devices' peak are unknown. Version 2 added `tokens_per_s`, `mfu`, `machine.peak`, the workload's
`tokens_per_sample`, `flops_per_step` and `flops_method`, and `settings.gpt_size`; version 3 added each run's
`options` and `final_loss`; version 4 the intervals `speedup_ci` and `ratio_ci` ([low, high], 95%, `stats.py`),
`single_step_times_s` and the machine's `load_average` before and after the jobs, and made `speedup_vs_single`
and `vs_reference` medians of paired step ratios (each step beside the one-worker baseline's, or the reference's,
of its round) where they were ratios of medians.
Every older field is kept, and `from_json` reads versions 1 to 3 too.
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

from .. import strategies
from ..errors import ParatrainError
from ..measure import stats
from ..strategies.base import Strategy
from .jobs import CEILING, REFERENCE, Spec

SCHEMA = "paratrain-bench/4"
OLDER = ("paratrain-bench/1", "paratrain-bench/2", "paratrain-bench/3")
"""Versions `from_json` still reads (their missing fields are null)."""
STATUSES = ("ok", "not-applicable", "failed")
_REFERS_TO = {reference: strategy for strategy, reference in REFERENCE.items()}


def known(name: str) -> bool:
    """A strategy of the registry (a preset or a name of the grammar), a hand-written reference, or the ceiling."""
    return name in _REFERS_TO or name == CEILING or _strategy(name) is not None


def _strategy(name: str) -> Strategy | None:
    """The strategy a run measured (a hand-written reference as the strategy it is written for)."""
    name = _REFERS_TO.get(name, name)
    try:
        return strategies.get(name)
    except ParatrainError:
        return None


def pipelined(strategy: str) -> bool:
    """Runs with a micro-batch count: the registry's strategy says so (`Strategy.microbatched`)."""
    found = _strategy(strategy)
    return found is not None and found.microbatched


def scheduled(strategy: str) -> bool:
    """Runs one of the pipeline schedules (`Strategy.scheduled`)."""
    found = _strategy(strategy)
    return found is not None and found.scheduled


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
    """Over one worker on the whole batch: the median of the paired ratios of the one-worker baseline's steps
    (`single_step_times_s`) to this run's; without them (older files), single's median over this run's."""
    speedup_ci: list[float] | None = None
    """95% interval of the speedup, [low, high] (null without one: single itself, too few steps)."""
    scaling_efficiency: float | None = None
    bound: float
    """The best speedup over single this layout allows (the strategy's own bound)."""
    peak_memory_mb: float | None = None
    reference: str | None = None
    """The hand-written PyTorch twin this run is compared with."""
    vs_reference: float | None = None
    """This run's steps over its reference's: the median of the paired ratios (the two timed in one round)."""
    ratio_ci: list[float] | None = None
    """95% interval of vs_reference, [low, high]."""
    status: str
    reason: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """More `paratrain.setup` options this run was given (e.g. {"comm_hook": "auto"}); {} for the defaults."""
    final_loss: float | None = None
    """paratrain's global-batch loss after the run's last step (every side trains the same steps from the same
    weights: a lossy option's effect is its difference from the exact run's); null for references."""
    single_step_times_s: list[float] = field(default_factory=list)
    """The one-worker baseline's steps, timed in the same rounds as step_times_s (its i-th beside their i-th):
    the denominator of this run's speedup. Empty for single itself."""

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

    def interval(self, which: str) -> stats.Ratio | None:
        """`speedup` or `ratio` (vs_reference) as a Ratio with its interval, None where it was not measured."""
        value, ci = (self.speedup_vs_single, self.speedup_ci) if which == "speedup" else \
            (self.vs_reference, self.ratio_ci)
        if value is None:
            return None
        low, high = ci if ci else (None, None)
        return stats.Ratio(value, low, high, paired=True, samples=len(self.step_times_s))

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
           peak_mb: float | None = None, single_times: list[float] | None = None) -> RunRecord:
    """A run before the derived numbers (medians, speedups) are filled in by `finalise`."""
    return RunRecord(strategy=spec.strategy, workers=spec.workers, microbatches=spec.microbatches,
                     schedule=spec.schedule, options=dict(spec.options),
                     step_times_s=[round(t, 6) for t in step_times or []],
                     single_step_times_s=[round(t, 6) for t in single_times or []],
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
    the reference, each ratio with its interval. MFU counts every worker of a run as one device at
    `peak_flops_per_s`."""
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
        speedup = _speedup(run, single)
        if speedup is not None:
            run.speedup_vs_single, run.speedup_ci = round(speedup.value, 4), speedup.interval
            run.scaling_efficiency = round(speedup.value / run.workers, 4)
        ref = next((r for r in runs if r.strategy == run.reference and r.status == "ok" and r.workers == run.workers
                    and r.microbatches == run.microbatches and r.schedule == run.schedule), None)
        if ref is not None:
            ratio = _compare(run.step_times_s, ref.step_times_s)
            run.vs_reference, run.ratio_ci = round(ratio.value, 4), ratio.interval
    return runs


def _compare(a: list[float], b: list[float]) -> stats.Ratio:
    """a over b: paired step by step where they were timed in the same rounds (as many steps), else by medians."""
    return stats.paired_ratio(a, b) if len(a) == len(b) else stats.ratio_of_medians(a, b, paired=False)


def _speedup(run: RunRecord, single: RunRecord | None) -> stats.Ratio | None:
    """Over the one-worker baseline timed beside the run; failing that, over single's own run (timed apart)."""
    if run is single:
        return stats.Ratio(1.0, None, None, paired=True, samples=len(run.step_times_s))
    if run.single_step_times_s:
        return _compare(run.single_step_times_s, run.step_times_s)
    if single is not None:
        return stats.ratio_of_medians(single.step_times_s, run.step_times_s, paired=False)
    return None


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


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the platform has none): how much other work shared it."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


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
    if not known(run["strategy"]):
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
        for key, ci in (("speedup_vs_single", "speedup_ci"), ("vs_reference", "ratio_ci")):
            out += _interval_problems(run, key, ci)
    elif not run["reason"]:
        out.append(f"a {run['status']} run needs a reason")
    if not tokens and run["tokens_per_s"] is not None:
        out.append("tokens_per_s must be null when the workload has no tokens_per_sample")
    if not mfu and run["mfu"] is not None:
        out.append("mfu must be null when the step's FLOPs or the devices' peak are unknown")
    return out


def _interval_problems(run: dict[str, Any], key: str, ci: str) -> list[str]:
    """An interval is [low, high] with 0 < low <= high, and only beside the ratio it bounds."""
    interval = run[ci]
    if interval is None:
        return []
    if run[key] is None:
        return [f"{ci} without {key}"]
    if (not isinstance(interval, list) or len(interval) != 2 or not all(isinstance(x, (int, float)) for x in interval)
            or not 0 < interval[0] <= interval[1]):
        return [f"{ci} must be [low, high] with 0 < low <= high, got {interval!r}"]
    return []
