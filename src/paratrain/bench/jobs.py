"""What to measure: the requested strategies turned into jobs (one worker launch each), validated first.

The bench holds no rules of its own about strategies: for each requested strategy and worker count it
builds the job's `Context` and asks the strategy itself whether it applies (`check`), which devices
it drives, how it shards the batch and what its best speedup is (`bound`). A configuration that
cannot run here (dp without GPUs, pp on one worker, a batch that does not split) becomes a
`not-applicable` record with the strategy's own reason, before any process starts.

A job holds a paratrain configuration and its hand-written reference (and, for pipelines, every
micro-batch count) and, beside them, one worker on the whole batch (the baseline of their speedups), so one
set of worker processes times them all in turns, step by step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import strategies
from ..config import make_config
from ..errors import ParatrainError, unknown_name
from ..parallel.pipeline.schedules import row
from ..runtime import Placement, check_nproc
from ..strategies.base import Context, Strategy

REFERENCE = {"ddp": "torch-ddp", "fsdp": "torch-fsdp", "mp": "torch-pipeline", "pp": "torch-pipelining",
             "tp": "torch-tp", "fsdp+tp": "torch-fsdp-tp", "tp+pp": "torch-tp-pp", "ddp+pp": "torch-ddp-pp",
             "fsdp+pp": "torch-fsdp-pp", "ep": "torch-ep", "cp": "torch-cp"}
"""The hand-written PyTorch each paratrain strategy is compared with, on the same workers."""
REFERENCE_SCHEDULES = ("gpipe", "1f1b")
"""Schedules the hand-written pipeline references (torch-pipelining, torch-tp-pp, torch-ddp-pp, torch-fsdp-pp) are
written for."""
CEILING = "no-comm"
"""Each worker trains a private copy on its share with no gradient exchange: the fastest any data-parallel
strategy can be on this machine (it exposes shared cores, memory bandwidth and SMT siblings). Runs beside
the strategy whose reference is torch-ddp."""
AUTO_MICROBATCHES = (1, 2, 4, 8)
COMPILED_REFERENCES = ("torch-ddp", CEILING)
"""The hand-written loops `--compile` compiles (one model per worker: `torch.compile(model)`)."""


def schedules(text: str) -> list[str]:
    """`--schedule 1f1b,zero-bubble`: the schedules to time, each checked by name."""
    from ..config import SCHEDULES

    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in SCHEDULES:  # the table's and "auto"
            raise unknown_name("schedule", name, SCHEDULES)
    return names or ["1f1b"]


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a worker needs to rebuild the workload and time it; travels to every worker."""

    workload: str
    image: int | None = None
    gpt_size: str | None = None
    """Size of the gpt workload (None: its default for the devices)."""
    batch: int
    steps: int
    warmup: int
    repeat: int
    schedule: str = "1f1b"
    precision: str = "32"
    channels_last: bool = False
    compile: str | None = None
    """torch.compile backend (`--compile`): paratrain's `setup(compile=...)`, the references' whole model."""
    gpus: int = 0
    comm_hooks: tuple[str, ...] = ("none",)
    """DDP communication settings to time side by side (`--comm-hook`): none (torch's), auto, or a lossy one."""
    timeout_s: float = 120.0
    """Seconds a collective may wait inside a worker before the configuration is reported failed."""
    stages_per_worker: int | None = None
    """Stages per pipeline worker for the multi-stage schedules (None: each schedule's default); `--plan` sets what
    the planner chose."""


@dataclass(frozen=True)
class Spec:
    """One measured configuration."""

    strategy: str
    workers: int
    microbatches: int | None = None
    schedule: str | None = None
    devices: tuple[str, ...] | None = None
    """Stage devices of a one-process pipeline (mp, torch-pipeline)."""
    bound: float = field(default=1.0, compare=False)
    """The best speedup over one worker the layout allows, as its strategy states it."""
    options: tuple[tuple[str, Any], ...] = ()
    """More `paratrain.setup` options of this configuration (e.g. comm_hook), beyond the defaults."""

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.options)
        return self.strategy + extra + (f" M={self.microbatches}" if self.microbatches is not None else "")


@dataclass(frozen=True)
class Job:
    nproc: int
    specs: tuple[Spec, ...]
    title: str
    baseline: bool = False
    """Also time one worker on the whole batch in the same rounds (rank 0; the others wait): the denominator of
    every speedup of this job's runs, paired step by step, so a slow minute of the machine cannot pass for one."""


@dataclass
class JobList:
    jobs: list[Job] = field(default_factory=list)
    skipped: list[tuple[Spec, str, str]] = field(default_factory=list)
    """(spec, status, reason) of configurations reported without running."""


def parse_strategies(text: str) -> list[str]:
    """The requested strategies in a fixed order, with `single` always first: every speedup is over it. `all`: every
    strategy the bench offers by name."""
    from ..parallel.dims import canonical, is_grammar

    presets, offered = strategies.names(), strategies.offered()
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        names = offered
    for i, name in enumerate(names):
        if name not in presets and is_grammar(name):
            names[i] = canonical(name)  # an N-D layout from the grammar (a preset's words in any order: the preset)
        elif name not in presets:
            raise unknown_name("strategy for bench", name, offered)
    if not names:
        raise ParatrainError(f"--strategies is empty; give some of {','.join(offered)}")
    chosen = sorted({"single", *(n for n in names if n in presets)}, key=presets.index)
    return chosen + list(dict.fromkeys(n for n in names if n not in presets))


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


def context(strategy: str, nproc: int, settings: Settings, **options: Any) -> Context:
    """The context `paratrain.setup` would build on rank 0 of a job of `nproc` workers here."""
    config = make_config({"strategy": strategy, "precision": settings.precision, **options})
    device = torch.device("cuda", 0) if settings.gpus else torch.device("cpu")
    return Context(config=config, placement=Placement(world_size=nproc, local_world_size=nproc), device=device,
                   gpus=settings.gpus)


def _schedule_bound(strategy: Strategy, ctx: Context) -> float:
    """The strategy's bound with the pipeline part replaced by what its schedule allows: the strategies
    state K*M/(M+K-1), which zero-bubble and interleaved schedules beat. For "auto", the best schedule it
    chooses among."""
    from ..parallel.microbatch import pipeline_bound
    from ..parallel.pipeline.schedules import auto_names
    from ..parallel.pipeline.simulate import schedule_speedup

    bound = strategy.bound(ctx)
    cfg = ctx.config
    if not isinstance(cfg.microbatches, int) or cfg.schedule is None:
        return bound
    pp = strategy.pipeline_ranks(ctx)
    names = auto_names(cfg.stages_per_worker) if cfg.schedule == "auto" else [cfg.schedule]
    best = max(schedule_speedup(name, pp, cfg.stages_per_worker, cfg.microbatches) for name in names)
    return bound * best / pipeline_bound(pp, cfg.microbatches)


class _Builder:
    def __init__(self, settings: Settings, microbatches: list[int] | None, references: bool) -> None:
        self.s = settings
        self.microbatches = microbatches
        self.references = references
        self.out = JobList()

    def skip(self, spec: Spec, reason: str) -> None:
        self.out.skipped.append((spec, "not-applicable", reason))

    def with_reference(self, spec: Spec) -> list[Spec]:
        ref = REFERENCE.get(spec.strategy)
        if ref is None or not self.references:
            return [spec]
        twin = Spec(ref, spec.workers, spec.microbatches, spec.schedule, spec.devices, spec.bound)
        if spec.schedule is not None and spec.schedule not in REFERENCE_SCHEDULES:
            self.skip(twin, f"the hand-written torch.distributed.pipelining reference covers schedules "
                            f"{', '.join(REFERENCE_SCHEDULES)}, not {spec.schedule!r}")
            return [spec]
        if self.s.compile and ref not in COMPILED_REFERENCES:
            self.skip(twin, f"--compile compiles the hand-written {' and '.join(COMPILED_REFERENCES)} loops "
                            f"(the whole model, as nanoGPT does); {ref} is not written compiled")
            return [spec]
        ceiling = [Spec(CEILING, spec.workers, bound=spec.workers)] if ref == "torch-ddp" else []
        return [spec, twin, *ceiling]

    def pipelined(self, strategy: Strategy, nproc: int, counts: list[int]) -> list[Spec]:
        """One spec per micro-batch count and requested schedule, or GPipe where the strategy says the schedule
        cannot run that count (1F1B needs at least as many micro-batches as stages). Interleaved and
        zero-bubble schedules run 2 stages per worker (the loop and V layouts)."""
        specs: list[Spec] = []
        requested = schedules(self.s.schedule) if strategy.scheduled else [None]
        for first in requested:
            for m in counts:
                for i, schedule in enumerate([first, "gpipe"] if first not in (None, "gpipe") else [first]):
                    per_worker = row(schedule).default_per_worker if schedule not in (None, "auto") else 1
                    if i == 0 and per_worker > 1 and self.s.stages_per_worker:
                        per_worker = self.s.stages_per_worker
                    extra = (("stages_per_worker", per_worker),) if per_worker > 1 else ()
                    options = {"microbatches": m, **({"schedule": schedule} if schedule else {}), **dict(extra)}
                    ctx = context(strategy.name, nproc, self.s, **options)
                    try:
                        strategy.check(ctx)
                    except ParatrainError as exc:
                        if i == 1 or first in (None, "gpipe"):
                            self.skip(Spec(strategy.name, nproc, m, schedule, options=extra), str(exc))
                        continue
                    workers = nproc * len(set(strategy.devices(ctx)))
                    spec = Spec(strategy.name, workers, m, schedule, _devices(strategy, ctx),
                                _schedule_bound(strategy, ctx), options=extra)
                    if spec not in specs:
                        specs.append(spec)
                    break
        return specs

    def add(self, name: str, workers: int) -> None:
        strategy = strategies.get(name)
        nproc = workers if strategy.needs_process_group else 1
        ctx = context(name, nproc, self.s, microbatches="auto")
        try:
            check_nproc(nproc, self.s.gpus, "--workers", "hide the GPUs (CUDA_VISIBLE_DEVICES=)")
            strategy.check(ctx)
        except ParatrainError as exc:
            self.skip(Spec(name, nproc), str(exc))
            return
        _, replicas = strategy.data_shard(ctx)
        if self.s.batch % replicas:
            self.skip(Spec(name, nproc), f"global batch {self.s.batch} cannot be split over {replicas} replicas "
                                         f"({self.s.batch} % {replicas} = {self.s.batch % replicas}); use "
                                         f"--batch-size {self.s.batch // replicas * replicas or replicas}")
            return
        devices = _devices(strategy, ctx)
        where = f"{nproc} worker(s)" if nproc > 1 else f"1 process on {', '.join(devices or ('1 device',))}"
        title = f"{name}{' vs ' + REFERENCE[name] if name in REFERENCE and self.references else ''}, {where}"
        if not strategy.microbatched:
            spec = Spec(name, nproc * len(set(strategy.devices(ctx))), devices=None, bound=strategy.bound(ctx))
            variants = [spec]
            for hook in self.s.comm_hooks if strategy.comm_hooks else ():
                if hook == "none":
                    continue
                variant = replace(spec, options=(("comm_hook", hook),))
                try:
                    strategy.check(context(name, nproc, self.s, comm_hook=hook))
                except ParatrainError as exc:
                    self.skip(variant, str(exc))
                    continue
                variants.append(variant)
            if strategy.comm_hooks and "none" not in self.s.comm_hooks:
                variants = variants[1:] or [spec]
            specs = [*self.with_reference(variants[0]), *variants[1:]]
            self.out.jobs.append(Job(nproc, tuple(specs), title, baseline=name != "single"))
            return
        per_replica = self.s.batch // replicas
        counts = list(AUTO_MICROBATCHES) if self.microbatches is None else self.microbatches
        good = [m for m in counts if per_replica % m == 0]
        for m in counts if self.microbatches is not None else []:
            if per_replica % m:
                self.skip(Spec(name, nproc, m), f"a batch of {per_replica} cannot be cut into {m} equal micro-batches "
                                                f"({per_replica} % {m} = {per_replica % m}); use a divisor of "
                                                f"{per_replica}")
        specs = [twin for spec in self.pipelined(strategy, nproc, good) for twin in self.with_reference(spec)]
        if specs:
            self.out.jobs.append(Job(nproc, tuple(specs), title, baseline=True))


def _devices(strategy: Strategy, ctx: Context) -> tuple[str, ...] | None:
    """Stage devices of a one-process pipeline (what the hand-written torch-pipeline places stages on)."""
    if strategy.needs_process_group or not strategy.microbatched:
        return None
    return tuple(str(d) for d in strategy.devices(ctx))


def build(names: list[str], workers: list[int], microbatches: list[int] | None, settings: Settings,
          references: bool = True) -> JobList:
    """One job per strategy and worker count, in the order given (`parse_strategies` puts single first);
    one-process strategies (single, dp, mp) once."""
    builder = _Builder(settings, microbatches, references)
    for name in names:
        for w in workers if strategies.get(name).needs_process_group else [1]:
            builder.add(name, w)
    return builder.out
