"""`paratrain bench`: flags mapped onto a plan, the plan run, results.json, the table and plots written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ParatrainError

if TYPE_CHECKING:
    from .planned import Planner

DEFAULT_STRATEGIES = "single,dp,ddp,pp"
PRECISIONS = ("32", "bf16", "16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument("--workload", default="mlp",
                       help="toy, mlp (default), convnet, resnet50, gpt, gpt-moe (8 experts, top-2) or gpt-long "
                            "(1,024 tokens)")
    which.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                       help="your model: factory(batch_size) -> (model, inputs, targets[, loss_fn])")
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated, from single,dp,ddp,mp,pp,ddp+pp and N-D layouts such as "
                        f"tp,fsdp+tp,ddp+tp, or all (default {DEFAULT_STRATEGIES}; with --plan, every strategy the "
                        f"planner predicts); single always runs, as the baseline")
    p.add_argument("--plan", action="store_true",
                   help="time only the layouts `paratrain plan` ranks fastest (--top of them; the planner picks "
                        "degrees, micro-batches and schedule) and print predicted beside measured")
    p.add_argument("--top", type=int, default=3, help="with --plan: how many of the planner's best layouts to time")
    p.add_argument("--cluster", default="local",
                   help="with --plan: the cluster the planner predicts for: local (this machine, measured first) "
                        "or a spec file such as the cluster-local.json an earlier run wrote")
    p.add_argument("--workers", default=None, help="workers for ddp/pp/ddp+pp, e.g. 2 or 2,4 (default: GPUs, or 2)")
    p.add_argument("--microbatches", default="auto", help="auto (1,2,4,8 where they divide the batch) or e.g. 2,4,8")
    p.add_argument("--schedule", default=None,
                   help="pipeline schedule(s) for pp, e.g. 1f1b (default) or 1f1b,zero-bubble,interleaved-1f1b (the "
                        "last two with 2 stages per worker); with --plan, those the planner chooses among (default: "
                        "every schedule)")
    p.add_argument("--comm-hook", default="none",
                   help="DDP gradient communication to time side by side, e.g. none,auto,bf16: none (torch's "
                        "defaults), auto (exact settings measured), bf16, fp16 or powersgd (lossy: the final "
                        "loss column shows their effect)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: the workload's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default: the workload's)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: the workload's)")
    p.add_argument("--repeat", type=int, default=None, help="timed blocks per configuration, alternated")
    p.add_argument("--precision", default="32", choices=PRECISIONS)
    p.add_argument("--channels-last", action="store_true", help="channels-last memory format (image models)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile: paratrain with setup(compile=...), the hand-written loops with "
                        "torch.compile(model) as nanoGPT does (default backend inductor)")
    p.add_argument("--image-size", type=int, default=None, help="image side for convnet / resnet50")
    p.add_argument("--gpt-size", default=None, choices=("tiny", "mini", "gpt2", "moe", "long", "tiny-moe", "tiny-long"),
                   help="size of the gpt workloads: tiny (tests), mini (default on CPU), gpt2 (GPT-2 small, "
                        "default on GPUs); moe and tiny-moe (gpt-moe's), long and tiny-long (gpt-long's)")
    p.add_argument("--no-reference", action="store_true", help="skip the hand-written PyTorch references")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one job (one worker launch) may take")
    p.add_argument("--out", default="results/bench", help="directory for results.json, table.md and plots")


def _positive(value: int | None, default: int, flag: str, minimum: int = 1) -> int:
    value = default if value is None else value
    if value < minimum:
        raise ParatrainError(f"{flag} must be >= {minimum}, got {value}")
    return value


def _comm_hooks(text: str) -> tuple[str, ...]:
    from typing import get_args

    from ..config import CommHook

    known = ("none", *get_args(CommHook))
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip())) or ("none",)
    for name in names:
        if name not in known:
            from ..errors import unknown_name

            raise unknown_name("--comm-hook", name, known)
    return names


def _command(ns: argparse.Namespace, settings: Any, workers: list[int]) -> str:
    parts = ["paratrain bench", f"--model {ns.model}" if ns.model else f"--workload {ns.workload}"]
    parts += [f"--plan --top {ns.top} --cluster {ns.cluster}"] if ns.plan else []
    parts += [f"--strategies {ns.strategies}"] if ns.strategies else []
    parts += [f"--schedule {ns.schedule}"] if ns.schedule else []
    parts += [f"--workers {','.join(map(str, workers))}", f"--microbatches {ns.microbatches}",
              f"--batch-size {settings.batch}", f"--steps {settings.steps}", f"--warmup {settings.warmup}",
              f"--repeat {settings.repeat}"]
    parts += [f"--precision {settings.precision}"] if settings.precision != "32" else []
    parts += ["--channels-last"] if settings.channels_last else []
    parts += [f"--compile {settings.compile}"] if settings.compile else []
    parts += [f"--image-size {settings.image}"] if settings.image else []
    parts += [f"--gpt-size {settings.gpt_size}"] if settings.gpt_size else []
    parts += [f"--comm-hook {','.join(settings.comm_hooks)}"] if settings.comm_hooks != ("none",) else []
    parts += ["--no-reference"] if ns.no_reference else []
    return " ".join(parts + [f"--out {ns.out}"])


def main(ns: argparse.Namespace, planner: Planner | None = None) -> int:
    """`planner` ranks the layouts for --plan (paratrain/bench_plan.py's `make_plan`; bench does not import it)."""
    from ..measure import workloads
    from ..runtime import cuda_count
    from . import jobs as planning
    from . import mfu, planned, report, runner, schema

    gpus = cuda_count()
    if ns.plan and ns.microbatches != "auto":
        raise ParatrainError("--plan chooses the micro-batch count for each layout; drop --microbatches")
    if not ns.plan:  # --plan leaves both to the planner unless they are given
        ns.strategies, ns.schedule = ns.strategies or DEFAULT_STRATEGIES, ns.schedule or "1f1b"
    names = planning.parse_strategies(ns.strategies or DEFAULT_STRATEGIES)
    workers = planning.parse_counts(ns.workers, "--workers") if ns.workers else [gpus or 2]
    microbatches = planning.parse_microbatches(ns.microbatches)
    workload = workloads.get(ns.model or ns.workload, image=ns.image_size, gpu=gpus > 0, gpt_size=ns.gpt_size)
    settings = planning.Settings(
        workload=ns.model or ns.workload, image=ns.image_size, gpt_size=ns.gpt_size, gpus=gpus,
        batch=_positive(ns.batch_size, workload.batch, "--batch-size"),
        steps=_positive(ns.steps, workload.steps, "--steps"),
        warmup=_positive(ns.warmup, workload.warmup, "--warmup", minimum=0),
        repeat=_positive(ns.repeat, workload.repeat, "--repeat"),
        schedule=",".join(planning.schedules(ns.schedule or "1f1b")), precision=ns.precision,
        channels_last=ns.channels_last, comm_hooks=_comm_hooks(ns.comm_hook), compile=ns.compile,
    )
    plan = None
    if ns.plan:
        if planner is None:
            raise ParatrainError("bench --plan needs the planner; run it as `paratrain bench --plan`")
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        plan = planner(ns.model or ns.workload, settings, workers, names if ns.strategies else None,
                       planning.schedules(ns.schedule) if ns.schedule else None, ns.top, ns.cluster, out,
                       say=lambda text: print(text, flush=True))
        jobs = planned.jobs(plan, settings, references=not ns.no_reference)
    else:
        jobs = planning.build(names, workers, microbatches, settings, references=not ns.no_reference)
    model = workload.model()
    parameters = workloads.parameters(model)
    flops = mfu.count_step_flops(workload, settings.batch, model)
    del model
    machine = schema.machine()
    if gpus:
        peak = mfu.gpu_peak(machine["gpus"][0], settings.precision, flops.kind)
    elif flops.total:
        peak = mfu.cpu_peak(min(max(workers), machine["cores"] or 1), settings.precision)
    else:
        peak = mfu.Peak(flops_per_s=None, dtype=mfu.DTYPE_NAMES[settings.precision],
                        source="not measured: the step's FLOPs were not counted, so there is no MFU")
    results: dict[str, Any] = {
        "schema": schema.SCHEMA, "created": schema.now(), "command": _command(ns, settings, workers),
        "paratrain": {"version": _version(), "commit": schema.commit()},
        "machine": {**machine, "peak": peak.as_dict()},
        "workload": {"name": workload.name, "description": workload.description, "parameters": parameters,
                     "lr": workload.lr, "tokens_per_sample": workload.tokens, "flops_per_step": flops.total,
                     "flops_method": flops.method},
        "global_batch": settings.batch,
        "settings": {"steps": settings.steps, "warmup": settings.warmup, "repeat": settings.repeat,
                     "schedule": settings.schedule, "precision": settings.precision,
                     "channels_last": settings.channels_last, "gpt_size": settings.gpt_size,
                     "compile": settings.compile},
        "runs": [],
    }
    m = results["machine"]
    where = f"{gpus} GPU(s): {', '.join(m['gpus'])}" if gpus else f"CPU workers (one thread each), {m['cores']} cores"
    print(f"paratrain bench: {workload.name} ({workload.description}), "
          f"{parameters / 1e6:.1f} M parameters, global batch {settings.batch}; {where}", flush=True)
    counted = f"{flops.total / 1e9:.3g} GFLOP per step" if flops.total else flops.method
    rate = f"{peak.flops_per_s / 1e9:.4g} GFLOP/s per device" if peak.flops_per_s else "unknown"
    print(f"  model FLOPs: {counted}; peak: {rate} ({peak.source})", flush=True)
    print(f"  {len(jobs.jobs)} job(s); {results['command']}", flush=True)
    cols = report.columns(tokens=workload.tokens is not None, mfu=bool(flops.total and peak.flops_per_s))
    print(report.header(cols), flush=True)
    runs: list[schema.RunRecord] = []

    def finalise() -> list[schema.RunRecord]:
        return schema.finalise(runs, settings.batch, tokens_per_sample=workload.tokens,
                               flops_per_step=flops.total, peak_flops_per_s=peak.flops_per_s)

    def show(new: list[schema.RunRecord]) -> None:
        runs.extend(new)
        finalise()
        print("\n".join(report.row(r, cols) for r in new), flush=True)

    start_load = schema.load_average()
    runner.run_jobs(jobs, settings, ns.timeout, say=lambda text: print(text, flush=True), on_records=show)
    results["machine"]["load_average"] = {"start": start_load, "end": schema.load_average()}
    results["runs"] = finalise()
    if plan is not None:
        results["plan"] = planned.compare(plan, results["runs"])
    schema.validate(schema.as_json(results))
    for r in results["runs"]:
        if r.mfu is not None and r.mfu > 1:
            print(f"warning: {r.strategy} on {r.workers} worker(s) reached MFU {r.mfu:.2f} > 1: the peak "
                  f"({peak.source}) is below what the step achieved, so it understates this machine", flush=True)
    return _write(results, Path(ns.out))


def _write(results: dict[str, Any], out: Path) -> int:
    from . import plots, report, schema

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(schema.as_json(results), indent=1) + "\n")
    lines, best = report.comparisons(results["runs"]), report.summary(results["runs"])
    (out / "table.md").write_text(report.markdown(results["runs"]) + "\n\n" + "".join(f"- {c}\n" for c in best))
    written = plots.write_all(results, out)
    print("\n" + report.table(results["runs"]))
    if lines:
        print("\nparatrain / hand-written PyTorch (median of the paired step ratios, the two sides timed in turns step "
              "by step; a verdict only where the 95% interval excludes 1.0):")
        print("\n".join(f"  {c}" for c in lines))
    if best:
        print("\nbest of each strategy (speedup over one worker timed in the same rounds, with its 95% interval):")
        print("\n".join(f"  {c}" for c in best))
    if "plan" in results:
        from .planned import table

        print("\n" + table(results["plan"]))
    busy = _busy(results)
    if busy:
        print(f"\nnote: {busy}")
    print(f"\nwrote {out / 'results.json'}, {out / 'table.md'}" + "".join(f", {p}" for p in written))
    failed = [r for r in results["runs"] if r.status == "failed"]
    if failed:
        print(f"{len(failed)} configuration(s) failed; see their reasons above", flush=True)
    return 1 if failed else 0


def _busy(results: dict[str, Any]) -> str | None:
    """A warning when other work shared the machine: the 1-minute load average above half the cores before the
    jobs, or after them once this run's own workers are taken off."""
    load, cores = results["machine"].get("load_average") or {}, results["machine"].get("cores") or 1
    ours = max((r.workers for r in results["runs"]), default=1)
    start, end = load.get("start"), load.get("end")
    if start is None or end is None or max(start, end - ours) <= cores / 2:
        return None
    return (f"other work shared this machine (load average {start:.1f} before the jobs, {end:.1f} after, on {cores} "
            f"cores). The intervals hold this run's noise, not the load's: speedups are lower than on a quiet "
            f"machine, so compare runs made on a quiet one")


def _version() -> str:
    from .. import __version__

    return __version__
