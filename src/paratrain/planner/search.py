"""Which layouts to predict, without enumerating blindly.

The names come from the grammar's axes (`parallel.dims`) and the presets, built from degrees, never read off a
list. For N devices, every shape of the model axes that applies to this model: none; a tensor degree T where the
model has a tensor-parallel plan (T divides N and the plan's split dimensions, fits in a node); a context degree C
where its attention can be shared out (the forward takes `position_ids`, the sequence divides into 2C chunks); T
and C together; an expert degree E where it has experts (E divides N and every layer's experts). Each shape with the
data-parallel ranks left as replicas (`ddp`; experts carved from them: `ep`) or shards (`fsdp`), or, 4 or more of
them, as HSDP's replicas of shard groups (`ddp+fsdp`, where the printed `setup` arguments rebuild the split), or the
name of the model axes alone when none are left, with the fewest gradient-accumulation steps that fit in memory. Then
pipelines of P ranks beside each shape of the model axes (pp when P = N / (T C), otherwise replicas that copy the
stages, ddp+pp, or shard each stage, fsdp+pp) for each divisor P up to the number of layers, each schedule, stages
per worker up to what the layers allow; and `mp` inside one node. What the runtime refuses is not proposed: degrees
`dims_for` refuses, the combinations the N-D strategy does not build (`axes.refused`: ep with cp), and what this
model cannot do (cp or ep inside pipeline stages of a model without its own blocks: `axes.problem`).

Three prunings keep 1,024 devices to seconds:

- a degree whose parameters, gradients and optimizer state alone exceed a device is predicted once,
  as the reason it does not fit, and no micro-batch count or schedule is tried for it;
- micro-batch counts are tried in growing powers of two (the schedule's minimum first) and the sweep
  stops once the step time has risen twice in a row while fitting (step time over M has one minimum:
  the bubble shrinks as 1/M while the per-micro-batch cost grows);
- data parallelism stops adding accumulation steps at the first count that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from ..errors import ParatrainError
from ..parallel.dims import canonical, dims_for, is_grammar
from ..parallel.pipeline.schedules import NAMES, row
from . import axes
from .cluster import Cluster
from .costs import Profile
from .layout import Layout
from .memory import model_state
from .predict import Prediction, capacity, predict

PIPELINE_SCHEDULES = NAMES
MAX_STAGES_PER_WORKER = 4
DATA_WORDS = ("ddp", "fsdp")
"""How the data-parallel ranks left beside the model axes hold the model: replicas, or shards."""
Wanted = Callable[[str], bool]


def wanted(strategies: Iterable[str] | None) -> Wanted:
    """Whether a strategy name is among `strategies` (None: every name), in any order of its words."""
    if strategies is None:
        return lambda name: True

    def normal(name: str) -> str:
        try:
            return canonical(name) if is_grammar(name) else name
        except ParatrainError:
            return name

    names = {normal(s) for s in strategies}
    return lambda name: normal(name) in names


def name_of(model_axes: Sequence[str], data: str | None) -> str:
    """The grammar's name for model axes beside a data-parallel word (None: no data-parallel ranks left); experts
    carved from replicas are plain `ep`, the grammar's default."""
    words = list(model_axes) + ([data] if data and not (data == "ddp" and "ep" in model_axes) else [])
    return canonical("+".join(words)) if words else "single"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers(low: int, high: int) -> Iterator[int]:
    m = 1
    while m <= high:
        if m >= low:
            yield m
        m *= 2


def _state_too_big(profile: Profile, cluster: Cluster, layout: Layout, optimizer: str) -> str | None:
    """Parameters, gradients and optimizer state alone beyond a device (pipelines: an even share per stage)."""
    params, size, own_params, own_bytes = axes.held(profile.layers, layout.dims)
    shards = axes.averaged_over(layout.dims) if layout.sharded else 1
    parts = layout.pp if layout.pipelined else 1
    held = model_state(size / shards / parts, params / shards / parts, optimizer)
    held.add(model_state(own_bytes / parts, own_params / parts, optimizer))
    needed = held.state + cluster.process_bytes + cluster.reserved
    available = capacity(cluster, layout)
    if available and needed > available:
        return (f"parameters, gradients and optimizer state alone need {needed / 2**30:.1f} GiB per worker, "
                f"{available / 2**30:.1f} GiB available")
    return None


def _layout(strategy: str, **kwargs: Any) -> Layout | None:
    """The layout, or None where the runtime's degrees refuse it (`dims_for`) or the N-D strategy does not build it
    (`axes.refused`)."""
    try:
        layout = Layout(strategy=strategy, **kwargs)
    except ParatrainError:
        return None
    return None if axes.refused(layout.dims) else layout


def _data_parallel(profile: Profile, cluster: Cluster, batch: int, optimizer: str, base: Layout,
                   loss: str = "any") -> list[Prediction]:
    dp = base.dp
    if batch % dp:
        return [Prediction(base, fits=False, reason=f"global batch {batch} does not split over {dp} replicas")]
    too_big = _state_too_big(profile, cluster, base, optimizer)
    if too_big:
        return [Prediction(base, fits=False, reason=too_big)]
    last = None
    for accum in _divisors(batch // dp):
        last = predict(profile, replace(base, grad_accum=accum), cluster, batch, optimizer, loss=loss)
        if last.fits:
            break
    return [last] if last else []


def tensor_degrees(profile: Profile, cluster: Cluster, n: int) -> list[int]:
    """Tensor degrees worth trying on n devices: they divide n and the plan's split dimensions and fit in a node."""
    return [t for t in _divisors(n) if 2 <= t <= cluster.devices_per_node and profile.tp_width
            and profile.tp_width % t == 0]


def context_degrees(profile: Profile, n: int) -> list[int]:
    """Context degrees worth trying on n devices: the model's attention can be shared out over C ranks (it calls
    `F.scaled_dot_product_attention`, its forward takes `position_ids`), C divides n and the sequence divides into
    2C chunks."""
    if not profile.attention or not profile.position_ids or profile.context_refused or not profile.sequence:
        return []
    return [c for c in _divisors(n) if c >= 2 and profile.sequence % (2 * c) == 0]


def expert_degrees(profile: Profile, n: int) -> list[int]:
    """Expert degrees worth trying: they divide the data-parallel ranks (all n) and every layer's experts."""
    return [e for e in _divisors(n) if e >= 2 and profile.experts and profile.experts % e == 0]


def model_shapes(profile: Profile, cluster: Cluster, n: int) -> Iterator[dict[str, int]]:
    """Degrees of the model axes beside data parallelism (ep: carved from it), each axis where it applies."""
    yield {}
    for tp in tensor_degrees(profile, cluster, n):
        yield {"tp": tp}
    for cp in context_degrees(profile, n):
        yield {"cp": cp}
        for tp in tensor_degrees(profile, cluster, n // cp):
            yield {"tp": tp, "cp": cp}
    for ep in expert_degrees(profile, n):
        yield {"ep": ep}


def _without_pipeline(profile: Profile, cluster: Cluster, n: int, batch: int, precision: str, optimizer: str,
                      want: Wanted, loss: str = "any") -> list[Prediction]:
    """Every model shape, with the data-parallel ranks left as replicas or shards (or none left), or, where there
    are at least 4, as HSDP's replicas of shard groups (`hybrid`)."""
    found: list[Prediction] = []
    for shape in model_shapes(profile, cluster, n):
        rest = n // (shape.get("tp", 1) * shape.get("cp", 1))
        model = [axis for axis in ("tp", "cp", "ep") if axis in shape]
        for data in [None] if rest == 1 else DATA_WORDS:
            strategy = name_of(model, data)
            if strategy == "single" or not want(strategy):
                continue
            layout = _layout(strategy, dp=rest, precision=precision, **shape)
            if layout is not None:
                found += _data_parallel(profile, cluster, batch, optimizer, layout, loss)
        for layout in hybrid(model, shape, rest, n, precision, want):
            if renders(layout, cluster):
                found += _data_parallel(profile, cluster, batch, optimizer, layout, loss)
    return found


def hybrid(model: Sequence[str], shape: dict[str, int], rest: int, n: int, precision: str,
           want: Wanted) -> Iterator[Layout]:
    """HSDP beside the model axes of `shape`: the `rest` data-parallel ranks as R replicas (dp_replicate) of shard
    groups of rest / R ranks (dp_shard), for each R with at least 2 of each, as `dims_for` builds them (experts
    carved from the shard groups)."""
    strategy = canonical("+".join(["ddp", "fsdp", *model]))
    if not want(strategy):
        return
    for replicas in _divisors(rest):
        if replicas < 2 or rest // replicas < 2:
            continue
        try:
            dims = dims_for(strategy, n, tp_size=shape.get("tp"), cp_size=shape.get("cp"), ep_size=shape.get("ep"),
                            dp_replicate=replicas)
        except ParatrainError:
            continue
        if not axes.refused(dims):
            yield Layout(strategy=strategy, dims=dims, precision=precision)


def renders(layout: Layout, cluster: Cluster) -> bool:
    """Whether the `setup` arguments the layout prints build its own degrees (`dims_for`): a layout whose call would
    run other degrees is not proposed (HSDP with other than the runtime's default replicas, while the arguments do not
    carry `dp_replicate`)."""
    if not layout.grammar:
        return True
    kwargs = layout.setup_kwargs(cluster)
    try:
        built = dims_for(layout.strategy, layout.devices, tp_size=kwargs.get("tp_size"),
                         pp_size=kwargs.get("pp_size"), ep_size=kwargs.get("ep_size"), cp_size=kwargs.get("cp_size"),
                         dp_replicate=kwargs.get("dp_replicate"))
    except ParatrainError:
        return False
    return built == layout.dims


def _micro_counts(schedule: str, pp: int, per_worker: int, per_replica: int) -> Iterator[int]:
    rule = row(schedule)
    low = pp if rule.multi_stage else rule.min_microbatches(pp, per_worker)
    for m in _powers(low, per_replica):
        if per_replica % m == 0:
            yield m


def _pipeline_strategies(n: int, model: Sequence[str]) -> Iterator[tuple[int, str]]:
    """(pipeline ranks, strategy) for n devices per group of the other model axes: one pipeline, or replicas of it
    that copy (ddp) or shard (fsdp) its stages."""
    axes_named = (*model, "pp")
    for pp in _divisors(n):
        for data in [None] if pp == n else DATA_WORDS:
            yield pp, name_of(axes_named, data)


def _pipelines(profile: Profile, cluster: Cluster, n: int, batch: int, precision: str, optimizer: str,
               want: Wanted, schedules: Sequence[str], shape: dict[str, int] | None = None,
               loss: str = "any") -> list[Prediction]:
    """Pipelines beside the model axes of `shape` (tp, cp, ep): expert and context parallelism live inside the
    stages only where the stages are the model's own blocks (`axes.problem` says which)."""
    out: list[Prediction] = []
    shape = shape or {}
    layers = len(profile.layers)
    tp, cp = shape.get("tp", 1), shape.get("cp", 1)
    model = [axis for axis in ("tp", "cp", "ep") if axis in shape]
    for pp, strategy in _pipeline_strategies(n // (tp * cp), model):
        dp = n // (tp * cp) // pp
        if pp < 2 or pp > layers or not want(strategy) or batch % dp:
            continue
        probe = _layout(strategy, dp=dp, pp=pp, schedule="1f1b", microbatches=pp, precision=precision, **shape)
        if probe is None or axes.problem(profile, probe.dims):
            continue
        too_big = _state_too_big(profile, cluster, probe, optimizer)
        if too_big:
            out.append(Prediction(probe, fits=False, reason=too_big))
            continue
        for schedule in schedules:
            for per_worker in range(1, MAX_STAGES_PER_WORKER + 1):
                if (per_worker > 1) != row(schedule).multi_stage or pp * per_worker > layers:
                    continue
                out += _sweep_microbatches(profile, cluster, batch, optimizer, replace(
                    probe, stages_per_worker=per_worker, schedule=schedule, microbatches=1), loss)
    return out


def _sweep_microbatches(profile: Profile, cluster: Cluster, batch: int, optimizer: str,
                        base: Layout, loss: str = "any") -> list[Prediction]:
    found: list[Prediction] = []
    best, rises = float("inf"), 0
    for m in _micro_counts(base.schedule or "1f1b", base.pp, base.stages_per_worker, batch // base.dp):
        layout = replace(base, microbatches=m)
        result = predict(profile, layout, cluster, batch, optimizer, loss=loss)
        if result.reason and not result.fits and "GiB" not in result.reason:
            continue  # a count this schedule refuses
        found.append(result)
        if result.fits:
            rises = rises + 1 if result.step_s > best else 0
            best = min(best, result.step_s)
            if rises >= 2:
                break
    fitting = [p for p in found if p.fits]
    return sorted(fitting, key=lambda p: p.step_s)[:3] if fitting else found[-1:]


def _model_parallel(profile: Profile, cluster: Cluster, n: int, batch: int, precision: str,
                    optimizer: str) -> list[Prediction]:
    if n < 2 or n > cluster.devices_per_node or n > len(profile.layers):
        return []
    base = Layout(strategy="mp", pp=n, precision=precision)
    return _sweep_microbatches(profile, cluster, batch, optimizer, base)


def layouts(profile: Profile, cluster: Cluster, batch: int, *, precision: str = "32", optimizer: str = "adam",
            devices: int | None = None, strategies: Iterable[str] | None = None,
            schedules: Sequence[str] = PIPELINE_SCHEDULES, loss: str = "any") -> list[Prediction]:
    """Predictions for every layout worth trying on `devices` devices (default: the whole cluster), among
    `strategies` (None: every one): those that fit, fastest first, then those that do not, each with its reason.
    `loss` is `setup(loss=...)`, which decides whether context ranks gather the outputs (`axes.gathers_outputs`)."""
    n = devices or cluster.devices
    want = wanted(strategies)
    found: list[Prediction] = []
    if n == 1 and want("single"):
        found += _data_parallel(profile, cluster, batch, optimizer, Layout(strategy="single", precision=precision),
                                loss)
    if n > 1:
        found += _without_pipeline(profile, cluster, n, batch, precision, optimizer, want, loss)
        for shape in model_shapes(profile, cluster, n):
            found += _pipelines(profile, cluster, n, batch, precision, optimizer, want, schedules, shape, loss)
    if want("mp") and cluster.kind == "cuda":
        found += _model_parallel(profile, cluster, n, batch, precision, optimizer)
    fitting = sorted((p for p in found if p.fits), key=lambda p: p.step_s)
    return fitting + [p for p in found if not p.fits]


def best_by_strategy(predictions: Iterable[Prediction]) -> dict[str, Prediction]:
    best: dict[str, Prediction] = {}
    for p in predictions:
        if p.fits and (p.layout.strategy not in best or p.step_s < best[p.layout.strategy].step_s):
            best[p.layout.strategy] = p
    return best


def scaling(profile: Profile, cluster: Cluster, batch: int, *, precision: str = "32", optimizer: str = "adam",
            strategies: Iterable[str] | None = None) -> dict[int, dict[str, Prediction]]:
    """The best layout of each strategy at 1, 2, 4, ... devices up to the cluster's size (for the plot)."""
    counts = [n for n in _powers(1, cluster.devices)
              if n <= cluster.devices_per_node or n % cluster.devices_per_node == 0]
    return {n: best_by_strategy(layouts(profile, cluster.resized(n), batch, precision=precision, optimizer=optimizer,
                                        devices=n, strategies=strategies)) for n in counts}
