"""Which layouts to predict, without enumerating blindly.

For N devices: data parallelism (ddp, fsdp) over all N, with the fewest gradient-accumulation steps
that fit in memory; pipelines of P ranks (pp when P = N, otherwise N / P replicas that copy the stages,
ddp+pp, or shard each stage, fsdp+pp) for
each divisor P of N up to the number of layers, each schedule, stages per worker up to what the layers
allow; and `mp` inside one node. Where the model has a tensor-parallel plan, the same again on N / T
devices for each tensor degree T that divides N, fits in a node and splits the plan's dimensions: tp
alone, ddp+tp and fsdp+tp, tp+pp, ddp+tp+pp and fsdp+tp+pp. Three prunings keep 1,024 devices to seconds:

- a degree whose parameters, gradients and optimizer state alone exceed a device is predicted once,
  as the reason it does not fit, and no micro-batch count or schedule is tried for it;
- micro-batch counts are tried in growing powers of two (the schedule's minimum first) and the sweep
  stops once the step time has risen twice in a row while fitting (step time over M has one minimum:
  the bubble shrinks as 1/M while the per-micro-batch cost grows);
- data parallelism stops adding accumulation steps at the first count that fits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

from ..parallel.pipeline.schedules import NAMES, row
from .cluster import Cluster
from .costs import Profile, tensor_params
from .layout import STRATEGIES, Layout
from .memory import model_state
from .predict import Prediction, capacity, predict

PIPELINE_SCHEDULES = NAMES
MAX_STAGES_PER_WORKER = 4
ALL = STRATEGIES


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers(low: int, high: int) -> Iterator[int]:
    m = 1
    while m <= high:
        if m >= low:
            yield m
        m *= 2


def _state_too_big(profile: Profile, cluster: Cluster, layout: Layout, optimizer: str,
                   params_share: float) -> str | None:
    held = model_state(profile.param_bytes * params_share, profile.params * params_share, optimizer)
    needed = held.state + cluster.process_bytes + cluster.reserved
    available = capacity(cluster, layout)
    if available and needed > available:
        return (f"parameters, gradients and optimizer state alone need {needed / 2**30:.1f} GiB per worker, "
                f"{available / 2**30:.1f} GiB available")
    return None


def _tensor_share(profile: Profile, tp: int) -> float:
    return tensor_params(profile.layers, tp)[0] / profile.params if tp > 1 and profile.params else 1.0


def _data_parallel(profile: Profile, cluster: Cluster, n: int, batch: int, precision: str, optimizer: str,
                   strategy: str, tp: int = 1) -> list[Prediction]:
    dp = n // tp if strategy != "single" else 1
    base = Layout(strategy=strategy, dp=dp, tp=tp, precision=precision)
    if batch % dp:
        return [Prediction(base, fits=False, reason=f"global batch {batch} does not split over {dp} replicas")]
    share = _tensor_share(profile, tp) / (dp if base.sharded else 1)
    too_big = _state_too_big(profile, cluster, base, optimizer, share)
    if too_big:
        return [Prediction(base, fits=False, reason=too_big)]
    last = None
    for accum in _divisors(batch // dp):
        last = predict(profile, replace(base, grad_accum=accum), cluster, batch, optimizer)
        if last.fits:
            break
    return [last] if last else []


def _micro_counts(schedule: str, pp: int, per_worker: int, per_replica: int) -> Iterator[int]:
    rule = row(schedule)
    low = pp if rule.multi_stage else rule.min_microbatches(pp, per_worker)
    for m in _powers(low, per_replica):
        if per_replica % m == 0:
            yield m


def _pipeline_strategies(n: int, tp: int) -> Iterator[tuple[int, str]]:
    """(pipeline ranks, strategy) for n devices per tensor group: one pipeline, or replicas of it that copy
    (ddp) or shard (fsdp) its stages."""
    suffix = "+tp+pp" if tp > 1 else "+pp"
    for pp in _divisors(n):
        if pp == n:
            yield pp, suffix[1:]
        else:
            yield pp, "ddp" + suffix
            yield pp, "fsdp" + suffix


def _pipelines(profile: Profile, cluster: Cluster, n: int, batch: int, precision: str, optimizer: str,
               strategies: Sequence[str], schedules: Sequence[str], tp: int = 1) -> list[Prediction]:
    out: list[Prediction] = []
    layers = len(profile.layers)
    for pp, strategy in _pipeline_strategies(n // tp, tp):
        dp = n // tp // pp
        if pp < 2 or pp > layers or strategy not in strategies or batch % dp:
            continue
        probe = Layout(strategy=strategy, dp=dp, pp=pp, tp=tp, schedule="1f1b", microbatches=pp,
                       precision=precision)
        share = _tensor_share(profile, tp) / pp / (dp if probe.sharded else 1)
        too_big = _state_too_big(profile, cluster, probe, optimizer, share)
        if too_big:
            out.append(Prediction(probe, fits=False, reason=too_big))
            continue
        for schedule in schedules:
            for per_worker in range(1, MAX_STAGES_PER_WORKER + 1):
                if (per_worker > 1) != row(schedule).multi_stage or pp * per_worker > layers:
                    continue
                out += _sweep_microbatches(profile, cluster, batch, optimizer, Layout(
                    strategy=strategy, dp=dp, pp=pp, tp=tp, stages_per_worker=per_worker, schedule=schedule,
                    precision=precision))
    return out


def _sweep_microbatches(profile: Profile, cluster: Cluster, batch: int, optimizer: str,
                        base: Layout) -> list[Prediction]:
    found: list[Prediction] = []
    best, rises = float("inf"), 0
    for m in _micro_counts(base.schedule or "1f1b", base.pp, base.stages_per_worker, batch // base.dp):
        layout = replace(base, microbatches=m)
        result = predict(profile, layout, cluster, batch, optimizer)
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


def tensor_degrees(profile: Profile, cluster: Cluster, n: int) -> list[int]:
    """Tensor degrees worth trying on n devices: they divide n and the plan's split dimensions and fit in a node."""
    return [t for t in _divisors(n) if 2 <= t <= cluster.devices_per_node and profile.tp_width
            and profile.tp_width % t == 0]


def _tensor_parallel(profile: Profile, cluster: Cluster, n: int, batch: int, precision: str, optimizer: str,
                     wanted: set[str], schedules: Sequence[str]) -> list[Prediction]:
    found: list[Prediction] = []
    for tp in tensor_degrees(profile, cluster, n):
        alone = ["tp"] if n == tp else ["ddp+tp", "fsdp+tp"]
        for strategy in (s for s in alone if s in wanted):
            found += _data_parallel(profile, cluster, n, batch, precision, optimizer, strategy, tp)
        found += _pipelines(profile, cluster, n, batch, precision, optimizer, sorted(wanted), schedules, tp)
    return found


def layouts(profile: Profile, cluster: Cluster, batch: int, *, precision: str = "32", optimizer: str = "adam",
            devices: int | None = None, strategies: Iterable[str] = ALL,
            schedules: Sequence[str] = PIPELINE_SCHEDULES) -> list[Prediction]:
    """Predictions for every layout worth trying on `devices` devices (default: the whole cluster): those
    that fit, fastest first, then those that do not, each with its reason."""
    n = devices or cluster.devices
    wanted = set(strategies)
    found: list[Prediction] = []
    if n == 1 and "single" in wanted:
        found += _data_parallel(profile, cluster, 1, batch, precision, optimizer, "single")
    for strategy in ("ddp", "fsdp"):
        if n > 1 and strategy in wanted:
            found += _data_parallel(profile, cluster, n, batch, precision, optimizer, strategy)
    if n > 1:
        found += _pipelines(profile, cluster, n, batch, precision, optimizer, sorted(wanted), schedules)
    if "mp" in wanted and cluster.kind == "cuda":
        found += _model_parallel(profile, cluster, n, batch, precision, optimizer)
    found += _tensor_parallel(profile, cluster, n, batch, precision, optimizer, wanted, schedules)
    fitting = sorted((p for p in found if p.fits), key=lambda p: p.step_s)
    return fitting + [p for p in found if not p.fits]


def best_by_strategy(predictions: Iterable[Prediction]) -> dict[str, Prediction]:
    best: dict[str, Prediction] = {}
    for p in predictions:
        if p.fits and (p.layout.strategy not in best or p.step_s < best[p.layout.strategy].step_s):
            best[p.layout.strategy] = p
    return best


def scaling(profile: Profile, cluster: Cluster, batch: int, *, precision: str = "32", optimizer: str = "adam",
            strategies: Iterable[str] = ALL) -> dict[int, dict[str, Prediction]]:
    """The best layout of each strategy at 1, 2, 4, ... devices up to the cluster's size (for the plot)."""
    counts = [n for n in _powers(1, cluster.devices)
              if n <= cluster.devices_per_node or n % cluster.devices_per_node == 0]
    return {n: best_by_strategy(layouts(profile, cluster.resized(n), batch, precision=precision, optimizer=optimizer,
                                        devices=n, strategies=strategies)) for n in counts}
