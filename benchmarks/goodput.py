"""Goodput under failures: replica groups against whole-job restarts, on the same training.

The `mini` GPT (benchmarks/goodput_train.py) trains for `--minutes` of wall time three ways, on 2 CPU workers:

  replica-groups   paratrain run --nproc 1 --replica-groups 2 --max-restarts K      a random group's worker SIGKILLed
  job-restart      paratrain run --nproc 2 --max-restarts K, checkpoint every 50    a random worker SIGKILLed
  no-failures      paratrain run --nproc 2                                          nothing killed

The clock starts at the run's first committed step (so the start of torch is not counted) and kills come every
`--every` seconds after it. From each run's ledger of committed steps:

    progress   the global step reached at the end, less the one it started at (steps trained twice count once)
    goodput    progress x failure-free step time / wall time. The failure-free step time is measured in the
               same run, away from failures: its wall time outside the disrupted windows (each from the last
               commit before a kill to the killed group's, the job's, first commit after it) over the steps it
               advanced there. Runs follow each other on a machine other jobs share, so each is held to its own
               step time; the no-failures run (goodput 1 by this definition) gives the plain job's step time,
               beside which the replica groups' own per-step cost shows
    lost       seconds per failure: wall time - progress x failure-free step time, over the kills
    recovery   per kill: seconds from the kill to the killed group (the job) committing a step again, and for
               replica groups the survivor's longest pause between two commits around it
    steps lost steps a restart went back over (job: to its last complete checkpoint), or dropped and redone
               (replica groups: the step whose reduction failed)

    python benchmarks/goodput.py                              # the protocol: 10 minutes, a failure a minute
    python benchmarks/goodput.py --minutes 4 --every 60       # three runs in about 14 minutes on 2 cores
    python benchmarks/goodput.py --summarize FILE             # a recording's figures again, from its ledgers

Results: benchmarks/results/goodput-DATE.json (docs/benchmarks.md quotes them), with each run's ledger (one
"step,seconds from its first step,pid,steps redone so far" per commit) so the figures can be recomputed, and the
load average before and after each run (other jobs on a shared machine move the step time between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _emit import commit, emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "benchmarks" / "goodput_train.py"
CHECKPOINT_EVERY = 50
WARM_MODULES = "torch,torch._dynamo,paratrain,torchft"
"""What a worker's template imports (PARATRAIN_WARM_WORKERS): a restart forks it instead of importing torch."""
START_TIMEOUT_S = 300.0
"""How long a run may take to commit its first step (two workers importing torch on a loaded machine)."""


def command(mode: str, ledger: Path, restarts: int, size: str) -> list[str]:
    """The `paratrain run` of one mode."""
    launch = [sys.executable, "-m", "paratrain.cli", "run", "--timeout", "120"]
    train = [str(TRAIN), "--ledger", str(ledger), "--size", size]
    if mode == "replica-groups":
        return [*launch, "--nproc", "1", "--replica-groups", "2", "--max-restarts", str(restarts), *train]
    if mode == "job-restart":
        return [*launch, "--nproc", "2", "--max-restarts", str(restarts), *train,
                "--checkpoint-dir", str(ledger / "ckpt"), "--save-every", str(CHECKPOINT_EVERY)]
    return [*launch, "--nproc", "2", *train]


def _steps(ledger: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for path in sorted(ledger.glob("steps-*.jsonl")):
        lines = [line for line in path.read_text().splitlines() if line.endswith("}")]  # a line cut by a kill
        out[path.stem.removeprefix("steps-")] = [json.loads(line) for line in lines]
    return out


def _pid(ledger: Path, name: str, rank: int) -> int:
    return int((ledger / f"pids-{name}-rank{rank}.txt").read_text().split()[-1])


def one_run(mode: str, minutes: float, every: float, seed: int, size: str, warm: bool) -> dict[str, Any]:
    """Launch, wait for the first committed step, kill on schedule for `minutes`, stop, and read the ledger."""
    wall = minutes * 60
    kills_due = [every * k for k in range(1, int(wall // every) + 1) if every * k < wall] if mode != "no-failures" \
        else []
    draw = random.Random(seed)
    before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix=f"goodput-{mode}-") as tmp:
        ledger = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("PARATRAIN_WARM_TEMPLATE", None)
        if warm:  # a restarted worker is a fork of a template that imported torch (docs/launchers.md)
            env["PARATRAIN_WARM_WORKERS"] = WARM_MODULES
        else:
            env.pop("PARATRAIN_WARM_WORKERS", None)
        log = open(ledger / "launcher.log", "w")
        proc = subprocess.Popen(command(mode, ledger, len(kills_due) + 1, size), stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, start_new_session=True)
        kills: list[dict[str, Any]] = []
        try:
            t0 = _first_step(ledger, proc)
            for due in kills_due:
                _sleep_until(t0 + due, proc)
                grouped = mode == "replica-groups"
                name, rank = (f"group{draw.randrange(2)}", 0) if grouped else ("job", draw.randrange(2))
                pid = _pid(ledger, name, rank)
                at = time.time()
                os.kill(pid, signal.SIGKILL)
                kills.append({"t": at, "target": f"{name} rank {rank}", "pid": pid, "after_s": at - t0})
            _sleep_until(t0 + wall, proc)
        finally:
            _stop(proc)
            log.close()
        tail = (ledger / "launcher.log").read_text()[-4000:]
        steps = _steps(ledger)
    load = {"before": before, "after": os.getloadavg()}
    return {**summarize(mode, steps, kills, t0, wall, tail), "load_average": load}


def _first_step(ledger: Path, proc: subprocess.Popen[bytes]) -> float:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended with code {proc.returncode} before its first step")
        firsts = [records[0]["t"] for records in _steps(ledger).values() if records]
        if firsts:
            return min(firsts)
        time.sleep(0.2)
    raise RuntimeError(f"no step committed within {START_TIMEOUT_S:.0f} s")


def _sleep_until(when: float, proc: subprocess.Popen[bytes]) -> None:
    while time.time() < when:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended early with code {proc.returncode}")
        time.sleep(min(0.2, max(0.0, when - time.time())))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The whole session: the launcher, each group's launcher and every worker."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def summarize(mode: str, steps: dict[str, list[dict[str, Any]]], kills: list[dict[str, Any]], t0: float,
              wall: float, tail: str) -> dict[str, Any]:
    """Progress, goodput, recoveries and steps lost, from the ledger (records after t0 + wall ignored)."""
    end = t0 + wall
    ledgers = {name: [r for r in records if r["t"] <= end] for name, records in steps.items()}
    merged = sorted((r for records in ledgers.values() for r in records), key=lambda r: r["t"])
    if not merged:
        raise RuntimeError(f"{mode}: no committed step in the ledger\n{tail}")
    recoveries = [_recovery(mode, ledgers, merged, kill, end) for kill in kills]
    windows = _merged(sorted((r["window"][0], r["window"][1]) for r in recoveries))
    start = merged[0]["step"]  # the position before the first committed step
    progress = _position(merged, end, start) - start
    disrupted_s = sum(b - a for a, b in windows)
    disrupted_steps = sum(_position(merged, b, start) - _position(merged, a, start) for a, b in windows)
    step_s = (wall - disrupted_s) / max(1, progress - disrupted_steps)
    one = next(iter(ledgers.values()))  # one group's (the job's) commits
    gaps = [b["t"] - a["t"] for a, b in zip(one, one[1:]) if b["step"] == a["step"] + 1]
    retrained = _retrained(ledgers["job"]) if mode == "job-restart" else 0
    redone = _redone(ledgers) if mode == "replica-groups" else 0
    resumed = [r["resumed_s"] for r in recoveries if r["resumed_s"] is not None]
    pauses = [r["survivor_pause_s"] for r in recoveries if r.get("survivor_pause_s") is not None]
    lost_s = wall - progress * step_s
    return {
        "mode": mode, "wall_s": wall, "progress_steps": progress, "failure_free_step_s": step_s,
        "goodput": progress * step_s / wall, "median_step_s": statistics.median(gaps) if gaps else None,
        "failures": len(kills), "seconds_lost_per_failure": lost_s / len(kills) if kills else 0.0,
        "recovery_s": statistics.mean(resumed) if resumed else None,
        "longest_survivor_pause_s": max(pauses) if pauses else None,
        "steps_lost": retrained + redone, "steps_lost_per_failure": (retrained + redone) / len(kills) if kills else 0.0,
        "recoveries": recoveries, "kills": kills,
        "ledger": {name: " ".join(f"{r['step']},{r['t'] - t0:.3f},{r['pid']},{r['redone']}" for r in records)
                   for name, records in ledgers.items()},
    }


def _merged(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping windows as one (a kill that came before the previous one was recovered)."""
    out: list[tuple[float, float]] = []
    for a, b in windows:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _position(merged: list[dict[str, Any]], at: float, start: int) -> int:
    """Global batches done at time `at`: the newest commit's (a job that rolled back to a checkpoint goes back)."""
    done = [r for r in merged if r["t"] <= at]
    return done[-1]["step"] + 1 if done else start


def _redone(ledgers: dict[str, list[dict[str, Any]]]) -> int:
    """Steps dropped and trained again (each process counts its own; a restarted one counts from 0)."""
    last: dict[int, int] = {}
    for records in ledgers.values():
        for record in records:
            last[record["pid"]] = record["redone"]
    return sum(last.values())


def _recovery(mode: str, ledgers: dict[str, list[dict[str, Any]]], merged: list[dict[str, Any]],
              kill: dict[str, Any], end: float) -> dict[str, Any]:
    """Seconds from the kill to the killed group (the job) committing again; the disrupted window, from the last
    commit before the kill to that one; and the survivor's longest pause between two commits in it."""
    at = kill["t"]
    victim = kill["target"].split()[0]
    records = ledgers.get(victim, [])
    before = {r["pid"] for r in records if r["t"] <= at}
    again = next((r["t"] for r in records if r["t"] > at and r["pid"] not in before), None)  # the new process's
    last = max((r["t"] for r in merged if r["t"] <= at), default=at)
    out: dict[str, Any] = {"after_s": kill["after_s"], "target": kill["target"],
                           "resumed_s": None if again is None else again - at, "window": [last, again or end]}
    if mode == "replica-groups":
        survivor = next(records for name, records in ledgers.items() if name != victim)
        times = [r["t"] for r in survivor if r["t"] <= (again or end)]
        times = [t for t in times if t >= max((t for t in times if t <= at), default=at)]
        out["survivor_pause_s"] = max((b - a for a, b in zip(times, times[1:])), default=None)
    return out


def _retrained(records: list[dict[str, Any]]) -> int:
    """Steps a restart went back over: from the step the job had reached to the checkpoint it resumed from."""
    lost = 0
    for before, after in zip(records, records[1:]):
        lost += max(0, before["step"] + 1 - after["step"])
    return lost


def resummarize(run: dict[str, Any]) -> dict[str, Any]:
    """A recorded run's figures again, from its ledger and kills (what `--summarize FILE` does to each run)."""
    start = run["kills"][0]["t"] - run["kills"][0]["after_s"] if run["kills"] else 0.0
    kills = [{**kill, "t": kill["t"] - start} for kill in run["kills"]]
    steps = {name: [dict(zip(("step", "t", "pid", "redone"), (int(a), float(b), int(c), int(d))))
                    for a, b, c, d in (entry.split(",") for entry in ledger.split())]
             for name, ledger in run["ledger"].items()}
    again = summarize(run["mode"], steps, kills, 0.0, run["wall_s"], "")
    again["kills"] = run["kills"]
    for old, new in zip(run["recoveries"], again["recoveries"]):
        new["window"] = old["window"]  # in the clock of the recording
    return {**run, **again}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="wall time of each run, from its first step")
    p.add_argument("--every", type=float, default=60.0, help="seconds between two kills")
    p.add_argument("--seed", type=int, default=0, help="which group (worker) each kill picks")
    p.add_argument("--modes", default="no-failures,replica-groups,job-restart")
    p.add_argument("--cold", action="store_true",
                   help="workers import torch at each start instead of forking from a warm template")
    p.add_argument("--size", default="mini", help="the GPT's size (paratrain.measure.gpt.SIZES; tiny: a smoke run)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"goodput-{date.today()}.json"))
    p.add_argument("--summarize", default=None, metavar="FILE",
                   help="recompute the figures of a recorded FILE from its ledgers (no run), in place")
    args = p.parse_args()
    if args.summarize:
        recorded = json.loads(Path(args.summarize).read_text())
        recorded["runs"] = [resummarize(run) for run in recorded["runs"]]
        Path(args.summarize).write_text(json.dumps(recorded, indent=1))
        return
    import torch

    runs = []
    for mode in args.modes.split(","):
        runs.append(one_run(mode, args.minutes, args.every, args.seed, args.size, not args.cold))
        print(json.dumps({k: v for k, v in runs[-1].items() if not isinstance(v, list | dict)}), file=sys.stderr,
              flush=True)
    result = {
        "benchmark": "goodput", "command": " ".join(["python", "benchmarks/goodput.py", *sys.argv[1:]]),
        "commit": commit(), "torch": torch.__version__,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_average_at_end": os.getloadavg()},
        "setup": {"model": f"paratrain.measure.gpt {args.size}, AdamW", "global_batch": 8,
                  "workers": 2, "minutes": args.minutes, "every_s": args.every, "seed": args.seed,
                  "checkpoint_every": CHECKPOINT_EVERY,
                  "workers_start": "cold: import torch" if args.cold else f"warm: forks of ({WARM_MODULES})"},
        "runs": runs,
    }
    sys.argv[1:] = [args.out]  # emit writes the file named here
    emit(result)


if __name__ == "__main__":
    main()
