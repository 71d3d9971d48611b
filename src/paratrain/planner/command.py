"""`paratrain plan`: the request the flags fill in, and the steps it runs.

    cluster (preset, file, or this machine measured)  ->  model profile (measured, or analytic)
      ->  layouts searched and predicted  ->  table, plan.json, scaling plot  ->  [--validate]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import ParatrainError, unknown_name
from ..parallel.dims import AXES
from ..strategies import TABLE
from . import cluster as clusters
from . import report, search, transformer, validate
from .cluster import Cluster
from .costs import Profile
from .layout import known, presets

OPTIMIZERS = ("adam", "momentum", "sgd")
Say = Callable[[str], None]


@dataclass(kw_only=True)
class PlanRequest:
    workload: str = "mlp"
    """A bench workload (measured here), an analytic GPT preset (gpt-5b, ...), or `module:factory`."""
    global_batch: int | None = None
    """Samples per optimizer step (default: the workload's batch)."""
    cluster: str = "local"
    """A preset (local, h100-nvlink, h100-ib) or a YAML/JSON spec file."""
    devices: int | None = None
    """Plan for this many of the cluster's devices (default: all)."""
    precision: str = "32"
    optimizer: str = "adam"
    top: int = 10
    out: str | None = None
    validate: bool = False
    strategies: tuple[str, ...] | None = None
    """The strategies to consider (None: every one the planner predicts): presets, or any name of the grammar."""
    gpt_size: str | None = None
    """A size of the GPT workloads (`measure/gpt.py` SIZES, e.g. `tiny-moe`); None: the workload's default."""
    steps: int = 5
    warmup: int = 2
    repeat: int = 2
    passes: int = 1
    timeout_s: float = 600.0
    layouts: list[str] = field(default_factory=list)
    """--validate only these layouts (labels as the table prints them); empty: all of `validate.local_layouts`."""
    command: str = "paratrain plan"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def load_cluster(name: str, out: Path | None, say: Say = print) -> Cluster:
    if name != clusters.LOCAL:
        return clusters.load(name)
    import torch

    from . import calibrate, calibrate_gpu

    found = calibrate_gpu.measure(say=say) if torch.cuda.is_available() else calibrate.measure(say=say)
    if out is not None:
        say(f"  wrote {clusters.write(found, out / 'cluster-local.json')} (pass it as --cluster next time)")
    return found


def micro_sizes(batch: int, limit: int = 8) -> list[int]:
    """The per-device batch sizes layouts run at: the batch halved, and halved again, down to 1."""
    sizes: list[int] = []
    b = batch
    while b >= 1 and len(sizes) < limit:
        sizes.append(b)
        if b % 2:
            break
        b //= 2
    return sorted(sizes)


def load_profile(request: PlanRequest, cluster: Cluster, say: Say = print) -> tuple[Profile, int]:
    """The model's profile and the global batch."""
    if request.workload in transformer.PRESETS:
        gpt = transformer.get(request.workload)
        if request.global_batch is None:
            raise ParatrainError(f"--workload {request.workload} is analytic; give --global-batch (sequences per step, "
                                 "e.g. 512)")
        return transformer.profile(gpt, request.precision, request.optimizer), request.global_batch
    import torch

    from ..measure import workloads
    from .profile import measure

    on_gpu = cluster.kind == "cuda" and cluster.measured_here  # measured where it will train
    workload = workloads.get(request.workload, gpu=on_gpu, gpt_size=request.gpt_size)
    batch = request.global_batch or workload.batch
    sizes = micro_sizes(batch) if cluster.measured_here else micro_sizes(batch)[:1]
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    say(f"paratrain plan: profiling {workload.name} layer by layer at micro-batch sizes {sizes} "
        f"({'on ' + str(device) if on_gpu else 'one thread'})")
    torch.manual_seed(0)

    def data(b: int) -> tuple[Any, Any]:
        return tuple(t.to(device) for t in workload.data(b))  # type: ignore[return-value]

    profile = measure(workload.model().to(device), data, workload.loss(), sizes, name=workload.name,
                      precision=request.precision, optimizer=request.optimizer, tp_plan=workload.tp_plan,
                      device=device)
    profile.tokens_per_sample = workload.tokens or 1
    return profile, batch


def main(request: PlanRequest, say: Say = print) -> int:
    if request.optimizer not in OPTIMIZERS:
        raise ParatrainError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {request.optimizer!r}")
    for name in request.strategies or ():
        why = known(name)
        if why is not None and ("+" in name or name in TABLE):
            raise ParatrainError(f"--strategies: {why}")
        if why is not None:
            raise unknown_name("strategy", name, {*presets(), *AXES})
    if request.top < 1:
        raise ParatrainError(f"--top must be >= 1, got {request.top}")
    out = Path(request.out) if request.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    cluster = load_cluster(request.cluster, out, say)
    if request.devices is not None:
        if not 1 <= request.devices <= cluster.devices:
            raise ParatrainError(f"--devices {request.devices}: cluster {cluster.name!r} has {cluster.devices} "
                                 f"devices; use 1..{cluster.devices}")
        cluster = cluster.resized(request.devices)
    profile, batch = load_profile(request, cluster, say)
    predictions = search.layouts(profile, cluster, batch, precision=request.precision, optimizer=request.optimizer,
                                 strategies=request.strategies)
    if cluster.devices > 1 and search.wanted(request.strategies)("single"):  # one device is always a candidate too
        single = search.layouts(profile, cluster, batch, precision=request.precision, optimizer=request.optimizer,
                                devices=1, strategies=("single",))
        predictions = sorted((p for p in predictions + single if p.fits), key=lambda p: p.step_s) + [
            p for p in predictions + single if not p.fits]
    created = now()
    say(f"\nparatrain plan ({created}): {profile.name} ({profile.params / 1e6:,.1f} M parameters, {profile.source}), "
        f"global batch {batch}, precision {request.precision}, {request.optimizer}; cluster {cluster.name}: "
        f"{cluster.nodes} x {cluster.devices_per_node} {cluster.kind} device(s)")
    say(report.table(predictions, profile, request.top))
    best = next((p for p in predictions if p.fits), None)
    if best is not None:
        say(f"\nbest: {best.layout.label}: {report.breakdown(best)}")
        say(report.how_to_run(best, cluster))
    else:
        say("\nno layout fits: see the reasons above (a larger cluster, a smaller batch or model)")
    if out is not None:
        scaling = search.scaling(profile, cluster, batch, precision=request.precision, optimizer=request.optimizer,
                                 strategies=request.strategies)
        doc = report.document(predictions, profile, cluster, batch, request.precision, request.optimizer,
                              request.command, created, scaling)
        written = [report.write_json(doc, out / "plan.json")]
        plot = report.scaling_plot(scaling, profile, f"{profile.name}, global batch {batch}, {cluster.name}",
                                   out / "plan_scaling.png")
        written += [plot] if plot else []
        say("wrote " + ", ".join(str(p) for p in written))
    if request.validate:
        return _validate(request, profile, cluster, batch, out, say)
    return 0


def _validate(request: PlanRequest, profile: Profile, cluster: Cluster, batch: int, out: Path | None,
              say: Say) -> int:
    if request.workload in transformer.PRESETS:
        raise ParatrainError(f"--validate runs the model, but {request.workload} is analytic; validate a workload "
                             "that can be built here (toy, mlp, convnet, resnet50 or --model module:factory)")
    layouts = validate.local_layouts(request.precision, cluster, profile)
    if request.layouts:
        chosen = [layout for layout in layouts if layout.label in request.layouts]
        unknown = sorted(set(request.layouts) - {layout.label for layout in chosen})
        if unknown:
            raise ParatrainError(f"--layouts {unknown} are not validation layouts; choose from "
                                 f"{[layout.label for layout in layouts]}")
        layouts = chosen
    settings = validate.Settings(workload=request.workload, gpt_size=request.gpt_size, gpu=cluster.kind == "cuda",
                                 batch=batch,
                                 optimizer=request.optimizer, steps=request.steps, warmup=request.warmup,
                                 repeat=request.repeat, passes=request.passes, timeout_s=request.timeout_s)
    say(f"\nvalidating {len(layouts)} layout(s) on this machine ({settings.warmup} warm-up + {settings.repeat} x "
        f"{settings.steps} timed steps each, fresh workers per layout, {settings.passes} pass(es))")
    records = validate.run(profile, cluster, settings, layouts, say=say)
    say("\n" + validate.table(records, now()))
    if out is not None:
        say(f"wrote {validate.write(records, out / 'validation.json')}")
    return 1 if any(r["status"] == "failed" for r in records) else 0
