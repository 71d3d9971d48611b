"""Does `setup(strategy="auto")` choose, on this machine, a layout within 5% of the fastest one measured?

For each workload: two workers start with strategy="auto" three times (the choice rests on timings), with
auto_pipelines=True (the bench's loop steps with `run.forward_backward`, which pipelines run), prepare the
workload's model with an example batch, and say what they chose; then `paratrain bench` times every
two-worker layout it runs (every strategy, schedule and micro-batch count: the full sweep, alternated
A B A B), and each choice's median step time is set against the fastest. A choice the sweep does not run at
its exact options is timed beside `ddp` in a second bench call and placed by its ratio to `ddp` (the sweep
measured `ddp` too).

    python benchmarks/auto_choice.py                  # mlp and gpt; writes benchmarks/results/auto-choice.json
    python benchmarks/auto_choice.py --workloads mlp
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCHEDULES = "gpipe,1f1b,interleaved-1f1b,zero-bubble"
WORKERS = 2
NOT_CHOICES = ("no-comm", "single", "dp", "mp", "ddp+mp")
"""What the bench runs that a world of two processes, one device each, cannot switch to."""
CHOSEN = ("strategy", "microbatches", "schedule", "stages_per_worker", "tp_size", "pp_size")


def choose(workload: str, out: Path) -> None:
    """Worker side: what strategy="auto" picks for this workload on this world."""
    import torch

    import paratrain
    from paratrain.measure import workloads

    run = paratrain.setup(strategy="auto", auto_pipelines=True, seed=0)
    job = workloads.get(workload)
    model = job.model()
    inputs, _ = job.data(job.batch // run.world_size)  # one worker's share under the provisional ddp
    started = time.perf_counter()
    run.prepare(model, torch.optim.SGD(model.parameters(), lr=job.lr), example=inputs)
    if run.is_main:
        chosen = {k: getattr(run.config, k) for k in CHOSEN}
        out.write_text(json.dumps({"setup": chosen, "prepare_s": time.perf_counter() - started}))
    run.close()


def _bench(args: list[str], out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "paratrain.cli", "bench", *args, "--no-reference", "--out", str(out)]
    print("$ " + " ".join(command[2:]), flush=True)
    proc = subprocess.run(command, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout)
    if proc.returncode:
        raise SystemExit(f"bench failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return json.loads((out / "results.json").read_text())  # type: ignore[no-any-return]


def _key(strategy: str, microbatches: Any, schedule: Any, stages: int) -> tuple[Any, ...]:
    pipelined = "pp" in strategy.split("+")
    return (strategy, microbatches if pipelined else None, schedule if pipelined else None,
            stages if pipelined else 1)


def _times(results: dict[str, Any]) -> dict[tuple[Any, ...], float]:
    """Two-worker paratrain layouts the bench ran, by their options."""
    return {_key(r["strategy"], r["microbatches"], r["schedule"], r["options"].get("stages_per_worker", 1)):
            r["median_step_s"] for r in results["runs"]
            if r["status"] == "ok" and r["workers"] == WORKERS and r["strategy"] not in NOT_CHOICES
            and not r["strategy"].startswith("torch-")}


def _choose(workload: str, scratch: Path, n: int) -> dict[str, Any]:
    """One `strategy="auto"` start: its options, its line, how long `prepare` took."""
    picked = scratch / f"{workload}-choice-{n}.json"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "paratrain.cli", "run", "--nproc", str(WORKERS), __file__,
                           "--choose", workload, "--choice-out", str(picked)],
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"strategy=auto failed:\n{proc.stdout[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if "strategy auto ->" in x)
    print(line, flush=True)
    choice: dict[str, Any] = json.loads(picked.read_text())
    choice.update(line=line.split("] ", 1)[-1], launch_s=time.monotonic() - start)
    setup = choice["setup"]
    choice["key"] = _key(setup["strategy"], setup["microbatches"], setup["schedule"], setup["stages_per_worker"])
    return choice


def measure(workload: str, scratch: Path, starts: int) -> dict[str, Any]:
    scratch.mkdir(parents=True, exist_ok=True)
    choices = [_choose(workload, scratch, n) for n in range(starts)]
    sweep = _bench(["--workload", workload, "--workers", str(WORKERS), "--strategies", "all", "--schedule",
                    SCHEDULES, "--microbatches", "1,2,4,8"], scratch / f"{workload}-sweep")
    times = _times(sweep)
    best_key = min(times, key=lambda k: times[k])
    for n, choice in enumerate(choices):
        key = choice["key"]
        if key in times:
            choice.update(step_s=times[key], measured="in the sweep")
        else:  # timed beside ddp, placed by its ratio to ddp
            extra = ["--strategies", f"{key[0]},ddp"]
            if key[1] is not None:
                extra += ["--microbatches", str(key[1]), "--schedule", str(key[2])]
            pair = _times(_bench(["--workload", workload, "--workers", str(WORKERS), *extra],
                                 scratch / f"{workload}-pair-{n}"))
            ddp = _key("ddp", None, None, 1)
            choice.update(step_s=pair[key] / pair[ddp] * times[ddp], measured="beside ddp, scaled by the sweep's ddp")
        choice.update(vs_fastest=choice["step_s"] / times[best_key], key=list(key))
    return {"workload": workload, "starts": choices, "fastest_key": list(best_key), "fastest_step_s": times[best_key],
            "worst_vs_fastest": max(c["vs_fastest"] for c in choices), "layouts_measured": len(times),
            "measured": [{"key": list(k), "median_step_s": v} for k, v in sorted(times.items(), key=lambda kv: kv[1])]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="mlp,gpt")
    p.add_argument("--starts", type=int, default=3, help="strategy=auto starts per workload (its choice is timed)")
    p.add_argument("--scratch", default="results/auto-choice")
    p.add_argument("--out", default="benchmarks/results/auto-choice.json")
    p.add_argument("--choose", default=None, help=argparse.SUPPRESS)
    p.add_argument("--choice-out", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.choose:
        choose(ns.choose, Path(ns.choice_out))
        return
    found = [measure(w, Path(ns.scratch), ns.starts) for w in ns.workloads.split(",")]
    summary = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.node(),
               "cores": len(os.sched_getaffinity(0)), "workers": WORKERS, "workloads": found}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(summary, indent=1) + "\n")
    for w in found:
        picks = "; ".join(f"{c['key']} {c['step_s']:.4f} s ({c['vs_fastest']:.3f}x)" for c in w["starts"])
        print(f"{w['workload']}: fastest {w['fastest_key']} {w['fastest_step_s']:.4f} s; auto chose {picks}")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
