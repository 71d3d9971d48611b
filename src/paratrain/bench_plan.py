"""The bridge between `paratrain plan` and `paratrain bench --plan`: the planner's ranking as bench choices.

Neither package imports the other (bench measures, the planner predicts); this module asks the planner exactly
what `paratrain plan` would be asked (the same cluster: `local`, measured now, or a spec file; the bench's global
batch and precision; plain SGD, which the bench's workers train with) and hands the K fastest layouts that fit
to the bench as `Choice`s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from .bench.jobs import Settings
from .bench.planned import Choice, Plan
from .errors import ParatrainError
from .planner.layout import Layout, axes, known
from .planner.predict import Prediction

OPTIMIZER = "sgd"
"""What the bench's workers train with (bench/worker.py), so what the planner predicts for."""


def plannable(names: Sequence[str] | None) -> tuple[str, ...] | None:
    """The strategies to plan over (None: every one the planner predicts); others are refused by name."""
    if names is None:
        return None
    unknown = [f"{n} ({why})" for n in names for why in [known(n)] if why]
    if unknown:
        raise ParatrainError(f"bench --plan: the planner predicts the presets and the grammar's names, not "
                             f"{', '.join(unknown)}; drop them from --strategies, or time them without --plan")
    return tuple(names)


def _choice(p: Prediction) -> Choice:
    layout: Layout = p.layout
    pipelined = layout.pipelined
    return Choice(label=layout.label, strategy=layout.strategy, processes=layout.processes, devices=layout.devices,
                  microbatches=layout.microbatches if pipelined else None, schedule=layout.schedule,
                  stages_per_worker=layout.stages_per_worker, grad_accum=layout.grad_accum,
                  predicted_step_s=p.step_s)


def _bench_runs(layout: Layout, say: Callable[[str], None]) -> bool:
    """The bench runs a name of the grammar (`ddp+pp` and `tp+pp` alike) at its default degrees for its worker
    count (`parallel.dims`); a layout with other degrees is left to `paratrain plan`, with a line saying so."""
    if not axes(layout.strategy):
        return True
    from .parallel.dims import dims_for

    try:
        dims = dims_for(layout.strategy, layout.devices)
    except ParatrainError:
        dims = None
    if dims == layout.dims:
        return True
    runs = dims.describe() if dims else "nothing: it needs degrees the bench does not set"
    say(f"bench --plan: {layout.label} is not timed (the bench runs {layout.strategy} on {layout.devices} workers as "
        f"{runs}); see it in paratrain plan")
    return False


def make_plan(workload: str, settings: Settings, workers: list[int], strategies: Sequence[str] | None,
              schedules: list[str] | None, top: int, cluster_name: str, out: Path | None,
              say: Callable[[str], None] = print) -> Plan:
    """The planner's ranking over the requested worker counts, cut to the `top` fastest that fit."""
    from .planner import command, search

    if top < 1:
        raise ParatrainError(f"--top must be >= 1, got {top}")
    wanted = plannable(strategies)
    request = command.PlanRequest(workload=workload, global_batch=settings.batch, cluster=cluster_name,
                                  precision=settings.precision, optimizer=OPTIMIZER)
    if settings.gpus and cluster_name == "local":
        raise ParatrainError("bench --plan on GPUs: --cluster local measures CPU workers; give a spec of these GPUs "
                             "(--cluster h100-nvlink, or a file: docs/plan.md, Cluster specs)")
    cluster = command.load_cluster(cluster_name, out, say)
    if (cluster.kind == "cuda") != bool(settings.gpus):
        where = f"{settings.gpus} GPU(s)" if settings.gpus else "CPU workers"
        raise ParatrainError(f"bench --plan: cluster {cluster.name!r} describes {cluster.kind} devices but the bench "
                             f"runs on {where} here; give a spec of this machine's devices as --cluster")
    too_many = [n for n in workers if n > cluster.devices]
    if too_many:
        raise ParatrainError(f"bench --plan: --workers {max(too_many)} is more than the {cluster.devices} device(s) of "
                             f"cluster {cluster.name!r}; use --workers {cluster.devices} or a larger --cluster spec")
    profile, batch = command.load_profile(request, cluster, say)
    found: list[Prediction] = []
    for n in workers:
        found += search.layouts(profile, cluster.resized(n), batch, precision=settings.precision, optimizer=OPTIMIZER,
                                devices=n, strategies=None if wanted is None else [s for s in wanted if s != "single"],
                                schedules=schedules or search.PIPELINE_SCHEDULES)
    single = search.layouts(profile, cluster.resized(1), batch, precision=settings.precision, optimizer=OPTIMIZER,
                            devices=1, strategies=("single",))
    fitting = sorted((p for p in found if p.fits and _bench_runs(p.layout, say)), key=lambda p: p.step_s)
    one = next((p for p in single if p.fits), None)
    return Plan(chosen=[_choice(p) for p in fitting[:top]], single=_choice(one) if one else None,
                candidates=len(fitting) + (one is not None), cluster=cluster.name)
