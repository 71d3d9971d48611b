"""`paratrain plan --validate`: run every layout this machine can hold and compare with the prediction.

Each layout runs in fresh worker processes (`paratrain.launch`), so one layout's memory is never counted
in the next one's peak, through the public API a training script uses: `paratrain.setup(**the layout's
arguments)`, `run.prepare`, `run.forward_backward`, `optimizer.step()`. A step's time is the slowest
worker's; the reported time is the median over the timed steps, and the peak is the largest worker's
(CUDA: allocated bytes; CPU: resident set, which is what the local cluster spec's `process_bytes`
counts from). `measure_layout` is the one seam to the runner: it can be pointed at `paratrain bench`.

Layouts run in rounds (`Settings.round_size`), each opened by a run of `single`, so each layout's error is also
read against single as measured in its own round: a machine that drifts between minutes moves a layout and its
round's single together, and that drift divides out of `relative_step_error`.

Every measured comparison carries its 95% interval (`paratrain.measure.stats`: the timed steps of each side
resampled on its own, since they ran in different launches): a layout's step over its round's single, the error
against the prediction that follows from it, and the predicted fastest layout's step over the measured fastest
one's, which is within noise when its interval holds 1.0.

`validation.json` is a list of records, one per layout:

    {"layout": "pp 2 (1f1b, M=4)", "predicted_step_s", "measured_step_s", "measured_spread_s" (IQR of the timed
     steps), "predicted_peak_bytes", "measured_peak_bytes", "step_error", "memory_error", "round",
     "round_single_step_s", "relative_step_error", "measured_step_times_s" (every timed step of every pass),
     "measured_vs_single", "measured_vs_single_ci" ([low, high], 95%), "relative_step_error_ci",
     "status": "ok" | "failed" | "cannot-run", "reason"}
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ParatrainError
from ..measure import stats
from ..measure.timing import time_steps
from ..parallel.dims import dims_for
from ..parallel.pipeline.schedules import NAMES, row
from .cluster import Cluster
from .costs import Profile
from .layout import Layout
from .predict import predict

MICROBATCHES = (1, 2, 4, 8)


def local_layouts(precision: str = "32", cluster: Cluster | None = None, profile: Profile | None = None
                  ) -> list[Layout]:
    """What fits a 2-core machine: single, ddp 2, fsdp 2, pp 2 at M in {1, 2, 4, 8} for each schedule
    (interleaved and zero-bubble with 2 stages per worker), mp 2, ddp+pp 2 x 2, tp 2, and the N-D layouts of 4
    workers (more workers than cores: the planner must predict them slow): fsdp+tp, tp+pp, fsdp+pp and HSDP
    (ddp+fsdp, 2 replicas of 2 shards); and, for a `profile` they apply to (`search.expert_degrees`,
    `search.context_degrees`), ep 2 and fsdp+ep 2, cp 2.
    On GPUs one worker per GPU: single, and with n GPUs ddp, fsdp and tp over all n and pp n (1F1B, M=4, 8)."""
    if cluster is not None and cluster.kind == "cuda":
        return gpu_layouts(cluster.devices, precision)
    return _cpu_layouts(precision) + (_axis_layouts(profile, precision) if profile is not None else [])


def _axis_layouts(profile: Profile, precision: str) -> list[Layout]:
    from .search import context_degrees, expert_degrees

    out = []
    if 2 in expert_degrees(profile, 2):
        out += [Layout(strategy=s, dp=2, ep=2, precision=precision) for s in ("ep", "fsdp+ep")]
    if 2 in context_degrees(profile, 2):
        out.append(Layout(strategy="cp", cp=2, precision=precision))
    return out


def _cpu_layouts(precision: str) -> list[Layout]:
    out = [Layout(strategy="single", precision=precision), Layout(strategy="ddp", dp=2, precision=precision),
           Layout(strategy="fsdp", dp=2, precision=precision)]
    for schedule in NAMES:
        per_worker = row(schedule).default_per_worker
        out += [Layout(strategy="pp", pp=2, schedule=schedule, stages_per_worker=per_worker, microbatches=m,
                       precision=precision) for m in MICROBATCHES]
    out += [Layout(strategy="mp", pp=2, microbatches=m, precision=precision) for m in (1, 4)]
    out += [Layout(strategy="ddp+pp", dp=2, pp=2, schedule="1f1b", microbatches=m, precision=precision)
            for m in (2, 4)]
    out += [Layout(strategy="tp", tp=2, precision=precision),
            Layout(strategy="fsdp+tp", dp=2, tp=2, precision=precision),
            Layout(strategy="tp+pp", tp=2, pp=2, schedule="1f1b", microbatches=4, precision=precision),
            Layout(strategy="fsdp+pp", dp=2, pp=2, schedule="1f1b", microbatches=4, precision=precision),
            Layout(strategy="ddp+fsdp", dims=dims_for("ddp+fsdp", 4, dp_replicate=2), precision=precision)]
    return out


def gpu_layouts(gpus: int, precision: str = "32") -> list[Layout]:
    out = [Layout(strategy="single", precision=precision)]
    if gpus > 1:
        out += [Layout(strategy=s, dp=gpus, precision=precision) for s in ("ddp", "fsdp")]
        out += [Layout(strategy="tp", tp=gpus, precision=precision)]
        out += [Layout(strategy="pp", pp=gpus, schedule="1f1b", microbatches=m, precision=precision) for m in (4, 8)]
    return out


@dataclass(frozen=True, kw_only=True)
class Settings:
    workload: str
    gpt_size: str | None = None
    """A size of the GPT workloads (`measure/gpt.py`), as the profile was measured; None: the default."""
    gpu: bool = False
    """The workload as it runs on GPUs (`workloads.get(gpu=True)`: GPT-2 small, the tutorials' ResNet-50 images)."""
    batch: int
    optimizer: str = "adam"
    steps: int = 5
    warmup: int = 2
    repeat: int = 2
    timeout_s: float = 600.0
    round_size: int = 4
    """Layouts per round; each round first measures `single`, so a layout's error can also be read against the
    machine as it was in its own round (the development machine drifts by 10-25% between minutes)."""
    passes: int = 1
    """Times every layout is measured, each pass in fresh workers and in the order opposite to the pass before:
    a slow minute of the machine then falls on different neighbours in each pass, the reported time is the median
    of the passes', and their disagreement is reported as the measurement's own noise."""


@dataclass
class Measured:
    step_s: float
    peak_bytes: float
    spread_s: float = 0.0
    """Interquartile range of the timed steps."""
    times: list[float] = field(default_factory=list)
    """Every timed step (the slowest worker's time each): what the intervals resample."""


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if name == "momentum" else 0.0)


def worker(options: dict[str, Any], settings: Settings, accum: int) -> dict[str, Any]:
    """One layout in every worker: the user's loop through the public API, timed."""
    from torch.utils.data import DataLoader, TensorDataset

    import paratrain

    from ..measure import workloads

    workload = workloads.get(settings.workload, gpu=settings.gpu, gpt_size=settings.gpt_size)
    if options.get("tp_size", 1) > 1 and workload.tp_plan:
        options = {**options, "tp_plan": workload.tp_plan}  # the plan the profile measured
    run = paratrain.setup(**options, seed=0, timeout_s=settings.timeout_s)
    model = workload.model()
    optimizer = _optimizer(settings.optimizer, model.parameters())
    data = workload.data(settings.batch)
    loader = run.prepare_loader(DataLoader(TensorDataset(*data), batch_size=run.per_worker_batch(settings.batch)))
    inputs, targets = (t.clone().to(run.device) for t in next(iter(loader)))
    del data, loader  # only this worker's batch stays, as in a real loop
    model, optimizer = run.prepare(model, optimizer, example=inputs)
    loss_fn = workload.loss()

    def step() -> None:
        for _ in range(accum):
            run.forward_backward(model, inputs, targets, loss_fn)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(settings.warmup):
        step()
    times: list[float] = []
    peak = 0.0
    for _ in range(settings.repeat):  # the bench's harness: each step's time is the slowest worker's
        block, peak_mb = time_steps(step, settings.steps, [run.device], run.device)
        times += block
        peak = max(peak, peak_mb * 2**20)
    run.close()
    return {"step_times_s": times, "peak_bytes": peak}


def measure_layout(layout: Layout, cluster: Cluster, settings: Settings) -> Measured:
    """The seam to the runner: one layout measured on this machine."""
    from ..launcher.spawn import launch

    out = launch(worker, layout.setup_kwargs(cluster), settings, layout.grad_accum, nproc=layout.processes,
                 timeout=settings.timeout_s,
                 accelerator="cuda" if cluster.kind == "cuda" else "cpu", prefix_output=False)
    times = out["step_times_s"]
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return Measured(step_s=statistics.median(times), peak_bytes=out["peak_bytes"],
                    spread_s=quartiles[2] - quartiles[0], times=list(times))


def _error(predicted: float, measured: float | None) -> float | None:
    return None if not measured else predicted / measured - 1


def _measured_single(precision: str, cluster: Cluster, settings: Settings,
                     measure: Callable[[Layout, Cluster, Settings], Measured]) -> Measured | None:
    """`single` measured now, the yardstick of a round (None where it failed: the round's layouts then have no
    relative error)."""
    try:
        return measure(Layout(strategy="single", precision=precision), cluster, settings)
    except ParatrainError:
        return None


def run(profile: Profile, cluster: Cluster, settings: Settings, layouts: list[Layout],
        measure: Callable[[Layout, Cluster, Settings], Measured] = measure_layout,
        say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Predict and measure each layout; one record each (see the module docstring). Layouts run in rounds of
    `settings.round_size`, each opened by a run of `single`: `relative_step_error` compares the layout's speed
    against single, predicted and measured in its round, so the machine's drift between rounds cancels. With
    `settings.passes` > 1 every layout is measured once per pass, every other pass in reverse order."""
    if not cluster.measured_here:
        raise ParatrainError(f"--validate runs the layouts on this machine, but cluster {cluster.name!r} describes "
                             "other hardware; use --cluster local (or the cluster-local.json it wrote)")
    predicted_single = {x: predict(profile, Layout(strategy="single", precision=x), cluster, settings.batch,
                                   settings.optimizer).step_s for x in {layout.precision for layout in layouts}}
    predictions = [predict(profile, layout, cluster, settings.batch, settings.optimizer) for layout in layouts]
    records = [_record(layout, p) for layout, p in zip(layouts, predictions)]
    for i, (layout, p) in enumerate(zip(layouts, predictions)):
        if p.reason is not None and not p.reason.startswith("needs"):
            records[i].update(status="cannot-run", reason=p.reason)
            say(f"[{i + 1}/{len(layouts)}] {layout.label}: cannot run ({p.reason})")
    seen: list[list[tuple[Measured, Measured | None, int]]] = [[] for _ in layouts]
    per_round, rounds = max(1, settings.round_size), 0
    for pass_index in range(max(1, settings.passes)):
        order = list(range(len(layouts)))[:: -1 if pass_index % 2 else 1]
        todo = [i for i in order if records[i]["status"] == "ok"]
        measured_single: Measured | None = None
        for k, i in enumerate(todo):
            if k % per_round == 0:
                rounds += 1
                measured_single = _measured_single(layouts[i].precision, cluster, settings, measure)
                shown = f"{measured_single.step_s:.4f} s" if measured_single else "failed"
                say(f"round {rounds}: single measured {shown}")
            start = time.monotonic()
            where = f"[{i + 1}/{len(layouts)}{f', pass {pass_index + 1}' if settings.passes > 1 else ''}]"
            try:
                got = measure(layouts[i], cluster, settings)
            except ParatrainError as exc:
                lines = [line for line in str(exc).strip().splitlines() if line.strip()]
                records[i].update(status="failed", reason=lines[-1][-400:] if lines else str(exc))
                say(f"{where} {layouts[i].label}: failed ({records[i]['reason']})")
                continue
            seen[i].append((got, measured_single, rounds))
            p = predictions[i]
            say(f"{where} {layouts[i].label}: predicted {p.step_s:.4f} s, measured {got.step_s:.4f} s "
                f"(IQR {got.spread_s:.4f}; {_error(p.step_s, got.step_s) or 0.0:+.1%}); memory "
                f"{p.memory.total / 2**20:.0f} / {got.peak_bytes / 2**20:.0f} MiB  [{time.monotonic() - start:.0f} s]")
    for i, record in enumerate(records):
        if record["status"] == "ok" and seen[i]:
            _combine(record, predictions[i], seen[i], predicted_single[layouts[i].precision])
    return records


def _record(layout: Layout, p: Any) -> dict[str, Any]:
    return {"layout": layout.label, **{k: v for k, v in layout.as_dict().items() if k != "label"},
            "predicted_step_s": p.step_s or None, "measured_step_s": None,
            "predicted_peak_bytes": p.memory.total if p.step_s else None,
            "measured_peak_bytes": None, "step_error": None, "memory_error": None, "round": None,
            "round_single_step_s": None, "relative_step_error": None, "measured_spread_s": None,
            "measured_passes_s": [], "measured_step_times_s": [], "measured_vs_single": None,
            "measured_vs_single_ci": None, "relative_step_error_ci": None, "status": "ok", "reason": None}


def _combine(record: dict[str, Any], p: Any, seen: list[tuple[Measured, Measured | None, int]],
             single: float) -> None:
    """The record from its passes: the median step and spread, the largest peak, and the speed against each
    pass's round single (their median; `round_single_step_s` is the single that gives that speed), with the
    interval of that speed from every pass's steps and its singles'."""
    step = statistics.median(m.step_s for m, _, _ in seen)
    peak = max(m.peak_bytes for m, _, _ in seen)
    speeds = [m.step_s / s.step_s for m, s, _ in seen if s and s.step_s]
    speed = statistics.median(speeds) if speeds else None
    times = [t for m, _, _ in seen for t in m.times]
    single_times = [t for _, s, _ in seen if s for t in s.times]
    against = stats.ratio_of_medians(times, single_times, paired=False) if times and single_times else None
    relative = p.step_s / single if single else None
    error_ci = [round(relative / against.high - 1, 4), round(relative / against.low - 1, 4)] \
        if relative and against and against.low and against.high else None
    record.update(measured_step_s=step, measured_peak_bytes=peak,
                  measured_spread_s=statistics.median(m.spread_s for m, _, _ in seen),
                  measured_passes_s=[m.step_s for m, _, _ in seen], round=seen[0][2],
                  round_single_step_s=step / speed if speed else None,
                  step_error=_error(p.step_s, step), memory_error=_error(p.memory.total, peak),
                  relative_step_error=_error(relative, speed) if speed and relative else None,
                  measured_step_times_s=[round(t, 6) for t in times], measured_vs_single=speed,
                  measured_vs_single_ci=against.interval if against else None, relative_step_error_ci=error_ci)


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst absolute errors, and how far the predicted-fastest layout is from the fastest."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return {"layouts": 0}
    steps = [abs(r["step_error"]) for r in ok]
    mems = [abs(r["memory_error"]) for r in ok]
    predicted_best = min(ok, key=lambda r: r["predicted_step_s"])
    order = rank_correlation([r["predicted_step_s"] for r in ok], [r["measured_step_s"] for r in ok])
    measured_best = min(ok, key=lambda r: r["measured_step_s"])
    out = {"layouts": len(ok), "step_median_abs_error": statistics.median(steps), "step_worst_abs_error": max(steps),
           "memory_median_abs_error": statistics.median(mems), "memory_worst_abs_error": max(mems),
           "predicted_fastest": predicted_best["layout"], "measured_fastest": measured_best["layout"],
           "predicted_fastest_vs_measured_fastest":
               predicted_best["measured_step_s"] / measured_best["measured_step_s"] - 1,
           "step_rank_correlation": order}
    apart = _apart(predicted_best, measured_best)
    if apart is not None:  # the pick's steps over the fastest's: is the gap more than the machine's noise?
        out["predicted_fastest_vs_measured_fastest_ci"] = [round(x - 1, 4) for x in apart.interval or []] or None
    rounded = [r for r in ok if r.get("relative_step_error") is not None]
    if rounded:  # measured steps as fractions of their round's single: the machine's drift divided out
        relative = [abs(r["relative_step_error"]) for r in rounded]
        speed = {r["layout"]: r["measured_step_s"] / r["round_single_step_s"] for r in rounded}
        fastest = min(rounded, key=lambda r: speed[r["layout"]])
        picked = min(rounded, key=lambda r: r["predicted_step_s"])
        out.update(relative_step_median_abs_error=statistics.median(relative),
                   relative_step_worst_abs_error=max(relative),
                   relative_rank_correlation=rank_correlation([r["predicted_step_s"] for r in rounded],
                                                              [speed[r["layout"]] for r in rounded]),
                   relative_measured_fastest=fastest["layout"],
                   relative_predicted_fastest_vs_measured_fastest=(
                       speed[picked["layout"]] / speed[fastest["layout"]] - 1))
    repeated = [r["measured_passes_s"] for r in ok if len(r.get("measured_passes_s") or []) > 1]
    if len(repeated) > 1:  # the measurement against itself: how well any prediction could be shown to rank
        out.update(pass_median_disagreement=statistics.median(max(t) / min(t) - 1 for t in repeated),
                   pass_worst_disagreement=max(max(t) / min(t) - 1 for t in repeated),
                   pass_rank_correlation=rank_correlation([t[0] for t in repeated], [t[1] for t in repeated]))
    return out


def _apart(picked: dict[str, Any], fastest: dict[str, Any]) -> stats.Ratio | None:
    """The predicted fastest layout's measured steps over the measured fastest's (None: the same layout, or no
    steps kept)."""
    a, b = picked.get("measured_step_times_s"), fastest.get("measured_step_times_s")
    if picked is fastest or not a or not b:
        return None
    return stats.ratio_of_medians(a, b, paired=False)


def _vs_single(r: dict[str, Any]) -> str:
    """`0.612 0.581-0.650`: the measured step over its round's single, with its interval."""
    value, ci = r.get("measured_vs_single"), r.get("measured_vs_single_ci")
    if value is None:
        return "-"
    return f"{value:.3f}" + (f" {ci[0]:.3f}-{ci[1]:.3f}" if ci else "")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i : j + 1]:  # ties share their mean rank
            ranks[k] = (i + j) / 2
        i = j + 1
    return ranks


def rank_correlation(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rho: whether the layouts come in the same order predicted and measured (None: under 3)."""
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    spread = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / spread if spread else None


def table(records: list[dict[str, Any]], created: str) -> str:
    lines = [f"validation ({created}): predicted vs measured on this machine",
             f"  {'layout':<36} {'pred. s':>9} {'meas. s':>9} {'error':>7} {'pred. MiB':>10} {'meas. MiB':>10} "
             f"{'error':>7}  {'meas. / round single (95% CI)':>29}"]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"  {r['layout']:<36} {r['status']}: {r['reason']}")
            continue
        lines.append(f"  {r['layout']:<36} {r['predicted_step_s']:>9.4f} {r['measured_step_s']:>9.4f} "
                     f"{r['step_error']:>+7.1%} {r['predicted_peak_bytes'] / 2**20:>10.0f} "
                     f"{r['measured_peak_bytes'] / 2**20:>10.0f} {r['memory_error']:>+7.1%}  {_vs_single(r):>29}")
    s = summary(records)
    if s["layouts"]:
        lines.append(f"  step time: median |error| {s['step_median_abs_error']:.1%}, "
                     f"worst {s['step_worst_abs_error']:.1%} "
                     f"(targets 8% / 20%); memory: median {s['memory_median_abs_error']:.1%}, worst "
                     f"{s['memory_worst_abs_error']:.1%} (targets 5% / 10%)")
        if s["step_rank_correlation"] is not None:
            lines.append(f"  rank correlation of predicted and measured step times {s['step_rank_correlation']:.2f} "
                         "(target 0.9)")
        ci = s.get("predicted_fastest_vs_measured_fastest_ci")
        noise = f"; 95% CI {ci[0]:+.1%} to {ci[1]:+.1%}, " if ci else ""
        noise += "within noise" if ci and ci[0] <= 0 <= ci[1] else "beyond the noise" if ci else ""
        lines.append(f"  predicted fastest {s['predicted_fastest']!r} is "
                     f"{s['predicted_fastest_vs_measured_fastest']:+.1%} from the measured fastest "
                     f"{s['measured_fastest']!r} (target within 5%{noise})")
        if "relative_step_median_abs_error" in s:
            correlation = s["relative_rank_correlation"]
            lines.append(f"  against each round's single (the machine's drift divided out): median |error| "
                         f"{s['relative_step_median_abs_error']:.1%}, worst {s['relative_step_worst_abs_error']:.1%}"
                         + (f", rank correlation {correlation:.2f}" if correlation is not None else "")
                         + f"; predicted fastest {s['relative_predicted_fastest_vs_measured_fastest']:+.1%} from "
                         f"{s['relative_measured_fastest']!r}")
        if "pass_median_disagreement" in s:
            agreement = s["pass_rank_correlation"]
            lines.append(f"  the measurement against itself (pass 1 vs pass 2): median disagreement "
                         f"{s['pass_median_disagreement']:.1%}, worst {s['pass_worst_disagreement']:.1%}"
                         + (f", rank correlation {agreement:.2f}" if agreement is not None else ""))
    return "\n".join(lines)


def write(records: list[dict[str, Any]], path: Path) -> Path:
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path
