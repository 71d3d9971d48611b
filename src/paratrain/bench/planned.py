"""`paratrain bench --plan`: measure only the layouts a planner ranks best, and show predicted beside measured.

A full sweep times every strategy x micro-batch count x schedule; the planner already predicts them all from a
layer profile and this machine's measured costs, so the bench can time the K it ranks fastest (with `single`
and the hand-written references, as in any sweep) and say how far each prediction was from its measurement.
The bench does not import the planner: it is handed the ranking as `Choice`s (paratrain/bench_plan.py asks the
planner, with the bench's global batch, precision and optimizer).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .. import strategies
from .jobs import JobList, Settings, Spec, build

Key = tuple[str, int, int | None, str | None, int]


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One predicted layout, in the bench's terms."""

    label: str
    strategy: str
    processes: int
    devices: int
    microbatches: int | None = None
    schedule: str | None = None
    stages_per_worker: int = 1
    grad_accum: int = 1
    predicted_step_s: float

    def as_dict(self) -> dict[str, Any]:
        return {"layout": self.label, "strategy": self.strategy, "devices": self.devices,
                "microbatches": self.microbatches, "schedule": self.schedule,
                "stages_per_worker": self.stages_per_worker, "grad_accum": self.grad_accum}


@dataclass(frozen=True)
class Plan:
    chosen: list[Choice]
    """The K fastest layouts that fit, fastest first (single not among them: it always runs)."""
    single: Choice | None
    candidates: int
    """How many layouts fit, of which `chosen` are the best."""
    cluster: str


Planner = Callable[..., Plan]
"""What `bench --plan` calls: (workload, settings, workers, strategies, schedules, top, cluster, out, say) -> Plan."""


def jobs(plan: Plan, settings: Settings, references: bool) -> JobList:
    """`single`, then one job per chosen layout, built as the sweep builds them (same checks and references)."""
    out = build(["single"], [1], None, settings, references)
    for choice in plan.chosen:
        if choice.grad_accum > 1:
            out.skipped.append((Spec(choice.strategy, choice.processes), "not-applicable",
                                f"{choice.label}: the bench times one optimizer step per batch; this layout needs "
                                f"{choice.grad_accum} accumulation steps to fit"))
            continue
        one = replace(settings, schedule=choice.schedule or settings.schedule,
                      stages_per_worker=choice.stages_per_worker if choice.schedule else None)
        pipelined = strategies.get(choice.strategy).microbatched
        part = build([choice.strategy], [choice.processes], [choice.microbatches or 1] if pipelined else None, one,
                     references)
        out.jobs += part.jobs
        out.skipped += part.skipped
    return out


def _choice_key(choice: Choice) -> Key:
    return (choice.strategy, choice.devices, choice.microbatches, choice.schedule, choice.stages_per_worker)


def _run_key(run: Any) -> Key:
    return (run.strategy, run.workers, run.microbatches, run.schedule,
            int(run.options.get("stages_per_worker", 1)))


def compare(plan: Plan, runs: list[Any]) -> dict[str, Any]:
    """Each planned layout's prediction beside its measured median, and the two winners: the planner's pick among
    what ran and the measured fastest of those (the same layout when the plan is right)."""
    measured = {_run_key(r): r for r in runs if r.status == "ok" and r.options.keys() <= {"stages_per_worker"}}
    rows = []
    for choice in ([plan.single] if plan.single else []) + plan.chosen:
        run = measured.get(_choice_key(choice))
        got = run.median_step_s if run is not None else None
        rows.append({**choice.as_dict(), "predicted_step_s": choice.predicted_step_s, "measured_step_s": got,
                     "step_error": choice.predicted_step_s / got - 1 if got else None,
                     "status": "ok" if got else "not measured"})
    ok = [r for r in rows if r["measured_step_s"]]
    picked = min(ok, key=lambda r: r["predicted_step_s"]) if ok else None
    fastest = min(ok, key=lambda r: r["measured_step_s"]) if ok else None
    errors = [abs(r["step_error"]) for r in ok]
    return {
        "cluster": plan.cluster, "top": len(plan.chosen), "fitting_layouts": plan.candidates, "layouts": rows,
        "predicted_fastest": picked["layout"] if picked else None,
        "measured_fastest": fastest["layout"] if fastest else None,
        "pick_vs_fastest": picked["measured_step_s"] / fastest["measured_step_s"] if picked and fastest else None,
        "step_median_abs_error": statistics.median(errors) if errors else None,
        "step_worst_abs_error": max(errors) if errors else None,
    }


def table(summary: dict[str, Any]) -> str:
    lines = [f"predicted beside measured (the planner's {summary['top']} best of {summary['fitting_layouts']} layouts "
             f"that fit, cluster {summary['cluster']}; single always runs):",
             f"  {'layout':40s} {'predicted s':>12s} {'measured s':>11s} {'error':>8s}"]
    for r in summary["layouts"]:
        got = f"{r['measured_step_s']:11.4f}" if r["measured_step_s"] else f"{'-':>11s}"
        err = f"{r['step_error']:+8.1%}" if r["step_error"] is not None else f"{r['status']:>8s}"
        lines.append(f"  {r['layout']:40s} {r['predicted_step_s']:12.4f} {got} {err}")
    if summary["measured_fastest"]:
        same = summary["predicted_fastest"] == summary["measured_fastest"]
        lines.append(f"measured fastest: {summary['measured_fastest']}; the planner's pick: "
                     f"{summary['predicted_fastest']}" + (" (the same)" if same else
                                                           f" ({summary['pick_vs_fastest']:.3f}x its step time)"))
    return "\n".join(lines)
