"""Does `paratrain bench --plan` find the full sweep's winner, in a third of its time?

Runs `paratrain bench --plan --top K` (the planner's K best layouts, `single` and the hand-written references)
and the full sweep `paratrain bench --strategies all --schedule <every schedule>` on the same workload and
global batch, one after the other, in the order given by --order (alternate it between runs: the machine
drifts), and writes their wall times, each one's fastest paratrain layout and the plan's predicted-beside-
measured summary. The winner of each run is its fastest `ok` paratrain run (references and the no-comm
ceiling are not layouts a user can pick).

    python benchmarks/bench_plan.py                        # mlp; writes benchmarks/results/bench-plan.json
    python benchmarks/bench_plan.py --workload gpt --top 3 --order sweep,plan
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

NOT_LAYOUTS = ("no-comm",)
SCHEDULES = "gpipe,1f1b,interleaved-1f1b,zero-bubble"


def _winner(results: dict[str, Any]) -> dict[str, Any] | None:
    ok = [r for r in results["runs"] if r["status"] == "ok" and not r["strategy"].startswith("torch-")
          and r["strategy"] not in NOT_LAYOUTS]
    best = min(ok, key=lambda r: r["median_step_s"]) if ok else None
    return None if best is None else {k: best[k] for k in ("strategy", "workers", "microbatches", "schedule",
                                                            "options", "median_step_s")}


def _key(run: dict[str, Any]) -> tuple[Any, ...]:
    return (run["strategy"], run["workers"], run["microbatches"], run["schedule"],
            run["options"].get("stages_per_worker", 1))


def _run(name: str, args: list[str], out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "paratrain.cli", "bench", *args, "--out", str(out)]
    print("$ " + " ".join(command[2:]), flush=True)
    start = time.monotonic()
    proc = subprocess.run(command, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout)
    if proc.returncode:
        print(proc.stdout[-3000:])
        raise SystemExit(f"{name} failed ({proc.returncode})")
    results = json.loads((out / "results.json").read_text())
    print(f"  {name}: {wall:.0f} s, winner {_winner(results)}", flush=True)
    return {"wall_s": wall, "command": results["command"], "winner": _winner(results), "results": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="mlp")
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--order", default="plan,sweep")
    p.add_argument("--scratch", default="results/bench-plan")
    p.add_argument("--out", default="benchmarks/results/bench-plan.json")
    ns = p.parse_args()
    common = ["--workload", ns.workload]
    args = {"plan": [*common, "--plan", "--top", str(ns.top)],
            "sweep": [*common, "--strategies", "all", "--schedule", SCHEDULES]}
    got = {name: _run(name, args[name], Path(ns.scratch) / name) for name in ns.order.split(",")}
    plan, sweep = got["plan"], got["sweep"]
    sweep_times = {_key(r): r["median_step_s"] for r in sweep["results"]["runs"] if r["status"] == "ok"}
    pick = plan["winner"]
    in_sweep = sweep_times.get(_key(pick)) if pick else None
    summary = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.node(),
        "cores": len(os.sched_getaffinity(0)), "workload": ns.workload, "top": ns.top,
        "order": ns.order, "plan_wall_s": plan["wall_s"], "sweep_wall_s": sweep["wall_s"],
        "time_ratio": plan["wall_s"] / sweep["wall_s"],
        "plan_winner": pick, "sweep_winner": sweep["winner"],
        "same_winner": bool(pick and sweep["winner"] and _key(pick) == _key(sweep["winner"])),
        "plan_winner_in_sweep_vs_sweep_winner": (in_sweep / sweep["winner"]["median_step_s"]
                                                 if in_sweep and sweep["winner"] else None),
        "sweep_configurations": sum(1 for r in sweep["results"]["runs"] if r["status"] == "ok"),
        "plan_configurations": sum(1 for r in plan["results"]["runs"] if r["status"] == "ok"),
        "plan": plan["results"]["plan"], "commands": {"plan": plan["command"], "sweep": sweep["command"]},
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("plan", "commands")}, indent=1))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
