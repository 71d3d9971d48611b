"""What to measure: the requested strategies turned into jobs (one worker launch each), validated first.

A job holds a paratrain configuration and its hand-written reference (and, for pipelines, every
micro-batch count), so one set of worker processes times them in turns, A B A B. A configuration
that cannot run here (dp without GPUs, pp on one worker, a batch that does not split) becomes a
`not-applicable` record with the reason and the arithmetic, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ParatrainError, unknown_name

STRATEGIES = ("single", "dp", "ddp", "mp", "pp", "ddp+pp")
REFERENCE = {"ddp": "torch-ddp", "mp": "torch-pipeline", "pp": "torch-pipelining"}
"""The hand-written PyTorch each paratrain strategy is compared with, on the same workers."""
CEILING = "no-comm"
"""Each worker trains a private copy on its share with no gradient exchange: the fastest any data-parallel
strategy can be on this machine (it exposes shared cores, memory bandwidth and SMT siblings)."""
PIPELINED = ("mp", "pp", "ddp+pp", "torch-pipeline", "torch-pipelining")
AUTO_MICROBATCHES = (1, 2, 4, 8)
REFERENCE_SCHEDULES = ("gpipe", "1f1b")
PP_SIZE_HYBRID = 2
"""Stages per replica in `ddp+pp` (paratrain's default pp_size for the hybrid)."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a worker needs to rebuild the workload and time it; travels to every worker."""

    workload: str
    image: int | None = None
    batch: int
    steps: int
    warmup: int
    repeat: int
    schedule: str = "1f1b"
    precision: str = "32"
    channels_last: bool = False
    gpus: int = 0
    timeout_s: float = 120.0
    """Seconds a collective may wait inside a worker before the configuration is reported failed."""


@dataclass(frozen=True)
class Spec:
    """One measured configuration."""

    strategy: str
    workers: int
    microbatches: int | None = None
    schedule: str | None = None
    devices: tuple[str, ...] | None = None
    """Stage devices of a one-process pipeline (mp, torch-pipeline)."""

    @property
    def label(self) -> str:
        return self.strategy + (f" M={self.microbatches}" if self.microbatches is not None else "")


@dataclass(frozen=True)
class Job:
    nproc: int
    specs: tuple[Spec, ...]
    title: str


@dataclass
class Plan:
    jobs: list[Job] = field(default_factory=list)
    skipped: list[tuple[Spec, str, str]] = field(default_factory=list)
    """(spec, status, reason) of configurations reported without running."""


def parse_strategies(text: str) -> list[str]:
    """The requested strategies in a fixed order, with `single` always first: every speedup is over it."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in STRATEGIES:
            raise unknown_name("strategy for bench", name, STRATEGIES)
    if not names:
        raise ParatrainError(f"--strategies is empty; give some of {','.join(STRATEGIES)}")
    return sorted({"single", *names}, key=STRATEGIES.index)


def parse_counts(text: str, flag: str) -> list[int]:
    try:
        counts = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ParatrainError(f"{flag} {text!r}: expected whole numbers separated by commas, e.g. 1,2,4") from None
    if not counts or min(counts) < 1:
        raise ParatrainError(f"{flag} {text!r}: every value must be >= 1")
    return sorted(set(counts))


def parse_microbatches(text: str) -> list[int] | None:
    """None means auto: the powers of two in AUTO_MICROBATCHES that divide the batch."""
    return None if text == "auto" else parse_counts(text, "--microbatches")


def _split(batch: int, requested: list[int] | None) -> tuple[list[int], list[tuple[int, str]]]:
    if requested is None:
        return [m for m in AUTO_MICROBATCHES if batch % m == 0], []
    good = [m for m in requested if batch % m == 0]
    bad = [(m, f"a batch of {batch} cannot be cut into {m} equal micro-batches ({batch} % {m} = {batch % m}); "
                f"use a divisor of {batch}") for m in requested if batch % m]
    return good, bad


def mp_devices(gpus: int) -> tuple[str, ...]:
    """The tutorials' two stages: on two GPUs when there are, both on the one GPU, or both on the CPU."""
    if gpus >= 2:
        return ("cuda:0", "cuda:1")
    return ("cuda:0", "cuda:0") if gpus == 1 else ("cpu", "cpu")


class _Builder:
    def __init__(self, settings: Settings, microbatches: list[int] | None, available: set[str],
                 references: bool) -> None:
        self.s = settings
        self.microbatches = microbatches
        self.available = available
        self.references = references
        self.plan = Plan()

    def skip(self, spec: Spec, reason: str, status: str = "not-applicable") -> None:
        self.plan.skipped.append((spec, status, reason))

    def job(self, nproc: int, specs: list[Spec], title: str) -> None:
        runnable = []
        for spec in specs:
            if spec.strategy in STRATEGIES and spec.strategy not in self.available:
                self.skip(spec, f"strategy {spec.strategy!r} is not available in this paratrain installation "
                                f"(available: {', '.join(sorted(self.available))})", "failed")
            else:
                runnable.append(spec)
        if runnable:
            self.plan.jobs.append(Job(nproc, tuple(runnable), title))

    def with_reference(self, spec: Spec) -> list[Spec]:
        ref = REFERENCE.get(spec.strategy)
        if ref is None or not self.references:
            return [spec]
        twin = Spec(ref, spec.workers, spec.microbatches, spec.schedule, spec.devices)
        if ref == "torch-pipelining" and spec.schedule not in REFERENCE_SCHEDULES:
            self.skip(twin, f"the hand-written torch.distributed.pipelining reference covers schedules "
                            f"{', '.join(REFERENCE_SCHEDULES)}, not {spec.schedule!r}")
            return [spec]
        return [spec, twin]

    def schedule(self, strategy: str, stages: int, microbatches: int) -> str | None:
        """1F1B needs at least as many micro-batches as stages; with fewer it is GPipe, so GPipe runs."""
        if strategy == "mp":
            return None
        return "gpipe" if self.s.schedule == "1f1b" and microbatches < stages else self.s.schedule

    def gpu_limit(self, spec: Spec, nproc: int) -> bool:
        if self.s.gpus and nproc > self.s.gpus:
            self.skip(spec, f"{nproc} workers need {nproc} GPUs (one worker per GPU) but {self.s.gpus} are "
                            f"visible; use --workers {self.s.gpus}")
            return False
        return True

    def pipelines(self, strategy: str, workers: int, nproc: int, batch: int, devices: tuple[str, ...] | None,
                  title: str) -> None:
        stages = PP_SIZE_HYBRID if strategy == "ddp+pp" else workers
        counts, bad = _split(batch, self.microbatches)
        for m, reason in bad:
            self.skip(Spec(strategy, workers, m, self.schedule(strategy, stages, m), devices), reason)
        specs = [s for m in counts
                 for s in self.with_reference(Spec(strategy, workers, m, self.schedule(strategy, stages, m), devices))]
        if specs:
            self.job(nproc, specs, title)

    def add(self, strategy: str, workers: list[int]) -> None:
        s = self.s
        if strategy == "single":
            self.job(1, [Spec("single", 1)], "single, 1 worker")
        elif strategy == "dp":
            if not s.gpus:
                self.skip(Spec("dp", 1), "torch.nn.DataParallel needs CUDA GPUs and none are visible; on CPU "
                                         "workers ddp is the data-parallel strategy")
            else:
                self.job(1, [Spec("dp", s.gpus)], f"dp, 1 process driving {s.gpus} GPU(s)")
        elif strategy == "mp":
            devices = mp_devices(s.gpus)
            self.pipelines("mp", len(set(devices)), 1, s.batch, devices,
                           f"mp vs torch-pipeline, 2 stages on {', '.join(devices)} in one process")
        for w in workers if strategy in ("ddp", "pp", "ddp+pp") else []:
            self.add_multi(strategy, w)

    def add_multi(self, strategy: str, w: int) -> None:
        s = self.s
        if strategy == "ddp":
            spec = Spec("ddp", w)
            if s.batch % w:
                self.skip(spec, f"global batch {s.batch} cannot be split over {w} workers ({s.batch} % {w} = "
                                f"{s.batch % w}); use --batch-size {s.batch // w * w or w}")
            elif self.gpu_limit(spec, w):
                ceiling = [Spec(CEILING, w)] if self.references else []
                self.job(w, self.with_reference(spec) + ceiling, f"ddp vs torch-ddp, {w} workers")
        elif strategy == "pp":
            if w < 2:
                self.skip(Spec("pp", w), "pp needs at least 2 workers (one per stage); use --workers 2")
            elif self.gpu_limit(Spec("pp", w), w):
                self.pipelines("pp", w, w, s.batch, None, f"pp vs torch-pipelining, {w} stages on {w} workers")
        elif strategy == "ddp+pp":
            replicas = w // PP_SIZE_HYBRID
            if w < 2 * PP_SIZE_HYBRID or w % PP_SIZE_HYBRID:
                self.skip(Spec("ddp+pp", w), f"ddp+pp lays out replicas x {PP_SIZE_HYBRID} stages, so it needs an "
                                             f"even number of workers >= {2 * PP_SIZE_HYBRID}; got {w}")
            elif s.batch % replicas:
                self.skip(Spec("ddp+pp", w), f"global batch {s.batch} cannot be split over {replicas} replicas "
                                             f"({w} workers / {PP_SIZE_HYBRID} stages); use a multiple of {replicas}")
            elif self.gpu_limit(Spec("ddp+pp", w), w):
                self.pipelines("ddp+pp", w, w, s.batch // replicas, None,
                               f"ddp+pp, {replicas} replicas x {PP_SIZE_HYBRID} stages")


def build(strategies: list[str], workers: list[int], microbatches: list[int] | None, settings: Settings,
          available: set[str], references: bool = True) -> Plan:
    """One job per strategy and worker count, in the order given (`parse_strategies` puts single first)."""
    builder = _Builder(settings, microbatches, available, references)
    for strategy in strategies:
        builder.add(strategy, workers)
    return builder.plan


def describe(spec: Spec) -> dict[str, Any]:
    return {"strategy": spec.strategy, "workers": spec.workers, "microbatches": spec.microbatches,
            "schedule": spec.schedule}
