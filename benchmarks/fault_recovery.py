"""What a worker's death costs, against the checkpoint interval.

Runs examples/resumable.py under `paratrain run --nproc 2 --max-restarts 1`, SIGKILLs rank 1 right
after step K (before that step's checkpoint), and reads the per-rank ledgers the example writes:

    death ──detect+restart──▶ new process group ──build+load──▶ training resumed
    steps lost = K - step of the checkpoint resumed from

Each interval N (checkpoint every N steps) is measured with the same kill points, intervals in
alternating order (1 2 4 8, then 8 4 2 1, ...); medians are reported. It also measures the time a
step and a save take, so the trade-off can be read off: a failure costs restart + lost steps x step
time, and checkpointing costs save time / N per step.

    python benchmarks/fault_recovery.py                     # brief: one kill point per interval
    python benchmarks/fault_recovery.py --kills 21,22,23,24 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resumable.py"


def _records(folder: Path) -> list[dict[str, Any]]:
    out = []
    for file in sorted(folder.glob("rank-*.jsonl")):
        rank = int(file.stem.split("-")[1])
        out += [{**json.loads(line), "rank": rank} for line in file.read_text().splitlines()]
    return sorted(out, key=lambda r: r["t"])


def one_run(interval: int, kill: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fault-recovery-") as tmp:
        cmd = [sys.executable, "-m", "paratrain.cli", "run", "--nproc", "2", "--max-restarts", "1", str(EXAMPLE),
               "--checkpoint-dir", f"{tmp}/ckpt", "--ledger", f"{tmp}/ledger", "--every", str(interval),
               "--samples", str(args.samples), "--epochs", str(args.epochs), "--hidden", str(args.hidden),
               "--fault", f"kill:1@{kill}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        records = _records(Path(tmp) / "ledger")
    death = next(r for r in records if r.get("event") == "fault")
    after = [r for r in records if r["gen"] != death["gen"] and r["t"] > death["t"]]
    start = next(r for r in after if r.get("event") == "start")
    first_gen = [r for r in records if r["gen"] == death["gen"] and r["rank"] == 0 and "idx" in r]
    gaps = {b["step"]: b["t"] - a["t"] for a, b in zip(first_gen, first_gen[1:]) if b["step"] == a["step"] + 1}
    return {
        "interval": interval, "kill_step": kill, "resumed_step": start["step"],
        "steps_lost": kill - start["step"],
        "restart_s": start["gen"] / 1e9 - death["t"],
        "resume_s": start["t"] - start["gen"] / 1e9,
        "death_to_resumed_s": start["t"] - death["t"],
        "gaps_plain_s": [d for s, d in gaps.items() if (s - 1) % interval],  # steps after a step without a save
        "gaps_after_save_s": [d for s, d in gaps.items() if (s - 1) % interval == 0],
    }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per interval. A step's time is the median gap between two steps with no save between them
    (over all runs: with N=1 every step saves); a save's is the median gap after a save minus that."""
    step_s = statistics.median(d for r in runs for d in r["gaps_plain_s"])
    out = []
    for interval in sorted({r["interval"] for r in runs}):
        mine = [r for r in runs if r["interval"] == interval]
        med = {k: statistics.median(r[k] for r in mine)
               for k in ("steps_lost", "restart_s", "resume_s", "death_to_resumed_s")}
        med["step_s"] = step_s
        med["save_s"] = max(statistics.median(d for r in mine for d in r["gaps_after_save_s"]) - step_s, 0.0)
        kills = sorted({r["kill_step"] for r in mine})
        expected = statistics.mean(k - (k - 1) // interval * interval for k in kills)
        out.append({"interval": interval, "runs": len(mine), **med, "steps_lost_expected": expected,
                    "checkpoint_overhead_per_step_s": med["save_s"] / interval,
                    "failure_cost_s": med["death_to_resumed_s"] + med["steps_lost"] * med["step_s"]})
    return out


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["interval"] for s in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    restart = [s["restart_s"] for s in summary]
    resume = [s["resume_s"] for s in summary]
    labels = [str(x) for x in xs]
    left.bar(labels, restart, label="detect + restart (death → new process group)")
    left.bar(labels, resume, bottom=restart, label="build + load checkpoint")
    left.set_xlabel("checkpoint every N steps")
    left.set_ylabel("seconds from death to training resumed")
    left.legend(fontsize=8, loc="lower right")
    right.plot(labels, [s["steps_lost"] for s in summary], "o-", label="measured (median)")
    right.plot(labels, [s["steps_lost_expected"] for s in summary], "--", color="gray",
               label="K − last checkpoint before K")
    right.set_xlabel("checkpoint every N steps")
    right.set_ylabel("steps of work lost")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intervals", default="1,2,4,8")
    p.add_argument("--kills", default="24", help="steps after which rank 1 is killed (one run per kill point)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fault_recovery.json"))
    p.add_argument("--figure", default=str(ROOT / "docs" / "img" / "fault_recovery.png"))
    args = p.parse_args()

    intervals = [int(x) for x in args.intervals.split(",")]
    kills = [int(x) for x in args.kills.split(",")]
    runs = []
    for rep in range(args.repeats):
        order = intervals if rep % 2 == 0 else intervals[::-1]  # alternate, so drift hits every interval alike
        for kill in kills:
            for interval in order:
                result = one_run(interval, kill, args)
                runs.append(result)
                print(json.dumps({k: round(v, 3) for k, v in result.items() if isinstance(v, float | int)}),
                      flush=True)
    summary = summarize(runs)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    import torch

    report = {
        "what": "time from a worker's death to training resumed, and steps lost, against the checkpoint interval",
        "command": " ".join([Path(sys.executable).name, "benchmarks/fault_recovery.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit, "torch": torch.__version__,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                    "load_average_at_end": os.getloadavg()},
        "setup": {"workers": 2, "backend": "gloo", "samples": args.samples, "epochs": args.epochs,
                  "hidden": args.hidden, "kills": kills, "repeats": args.repeats},
        "summary": summary, "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(summary, Path(args.figure), f"2 CPU workers (gloo), SIGKILL of rank 1 after step {args.kills}; "
                                      f"{report['date']}, {commit[:8]}")
    for s in summary:
        print(f"every {s['interval']:>2} steps: death->resumed {s['death_to_resumed_s']:.2f} s "
              f"(restart {s['restart_s']:.2f} + load {s['resume_s']:.2f}), lost {s['steps_lost']:.0f} steps "
              f"x {s['step_s'] * 1e3:.1f} ms, save {s['save_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
