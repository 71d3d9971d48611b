"""Soak: long runs killed again and again end exactly where uninterrupted runs end.

For each of ddp, fsdp and pp (2 workers), examples/resumable.py trains under
`paratrain run --nproc 2 --max-restarts 1000` while this script SIGKILLs a random worker every 30-90 s
(scaled by --pace), and the example itself dies inside `run.save` at a few steps (its kill-in-save
fault). The ddp run stops part-way and is finished under fsdp: a resume under another layout. Each run
is then compared with the same training uninterrupted:

    weights   bit-identical for ddp, fsdp, pp; within 1e-5 for ddp -> fsdp (another reduction order)
    samples   every sample of every epoch trained on once (the example's per-rank ledgers, the last
              generation that trained each step)

    python benchmarks/soak.py                      # 10 minutes in all, results/soak.json
    python benchmarks/soak.py --minutes 2 --pace 0.2
It is a benchmark, not a test: it takes minutes and its kill points are random (the seed is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resumable.py"
SAMPLES, GLOBAL_BATCH = 960, 12
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _command(folder: Path, strategy: str, epochs: int, *extra: str, restarts: int = 0) -> list[str]:
    return [str(Path(sys.executable).parent / "paratrain"), "run", "--nproc", "2", "--max-restarts", str(restarts),
            str(EXAMPLE), "--checkpoint-dir", str(folder / "ckpt"), "--strategy", strategy, "--epochs", str(epochs),
            "--samples", str(SAMPLES), "--global-batch", str(GLOBAL_BATCH), "--every", "20", "--dropout", "0",
            *(["--microbatches", "2"] if "pp" in strategy else []), *extra]


def _workers(marker: str) -> list[int]:
    """Worker processes of one run: they run the example with this run's checkpoint folder; the agent
    (`paratrain run`) is left alone."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        text = [c.decode(errors="replace") for c in cmd]
        if marker in text and b"\0RANK=" in b"\0" + environ and "run" not in text[:3]:
            found.append(int(entry))
    return found


def _final(folder: Path, out: str) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob(f"{out}*"))
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(torch.load(file, weights_only=False)["model"])
    return weights


def _effective(ledger: Path) -> dict[int, list[list[int]]]:
    """step -> the sample indices each rank trained on in the last generation that trained the step."""
    records = [json.loads(line) for f in sorted(ledger.glob("rank-*.jsonl")) for line in f.read_text().splitlines()]
    steps = [r for r in records if "idx" in r]
    last: dict[int, int] = {}
    for r in steps:
        last[r["step"]] = max(last.get(r["step"], 0), r["gen"])
    out: dict[int, list[list[int]]] = defaultdict(list)
    for r in steps:
        if r["gen"] == last[r["step"]]:
            out[r["step"]].append(r["idx"])
    return out


def _exactly_once(effective: dict[int, list[list[int]]], epochs: int, replicas: int) -> bool:
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for step, records in effective.items():
        shares = sorted({tuple(share) for share in records})  # a pipeline's ranks record the same rows
        if len(shares) != replicas:
            return False
        per_epoch[(step - 1) // STEPS_PER_EPOCH] += [i for share in shares for i in share]
    return sorted(per_epoch) == list(range(epochs)) and all(sorted(v) == list(range(SAMPLES))
                                                          for v in per_epoch.values())


def _soak(folder: Path, strategy: str, epochs: int, seconds: float, pace: float, rng: random.Random,
          faults: str) -> dict[str, Any]:
    """Run under kills until the run ends; returns what happened."""
    ledger = folder / "ledger"
    proc = subprocess.Popen(_command(folder, strategy, epochs, "--ledger", str(ledger), "--fault", faults,
                                     "--out", str(folder / "soak.pt"), restarts=1000),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    start, kills = time.monotonic(), []
    next_kill = start + rng.uniform(30, 90) * pace
    while proc.poll() is None:
        time.sleep(0.2)
        if time.monotonic() >= next_kill and time.monotonic() - start < seconds:
            workers = _workers(str(folder / "ckpt"))
            if workers:
                victim = rng.choice(workers)
                try:
                    os.kill(victim, signal.SIGKILL)
                    kills.append(round(time.monotonic() - start, 1))
                except ProcessLookupError:
                    pass
            next_kill = time.monotonic() + rng.uniform(30, 90) * pace
    out = proc.stdout.read() if proc.stdout else ""
    in_save = sum(1 for f in ledger.glob("fault-*-kill-in-save"))
    return {"rc": proc.returncode, "seconds": round(time.monotonic() - start, 1), "kills": kills,
            "kills_in_save": in_save, "restarts": out.count("paratrain: resumed from"), "tail": out[-1500:]}


def _reference(folder: Path, strategy: str, epochs: int) -> float:
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    subprocess.run(_command(folder, strategy, epochs, "--out", str(folder / "whole.pt")), env=_env(), check=True,
                   capture_output=True, text=True)
    return time.monotonic() - t0


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="time under kills, all runs together")
    p.add_argument("--pace", type=float, default=1.0, help="scales the 30-90 s between kills")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--only", default=None, help="one of ddp, fsdp, pp: that run alone (its share of --minutes is all)")
    p.add_argument("--epochs", type=int, default=None, help="instead of the epochs the calibration fits in the time")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    print(f"soak: seed {seed}", flush=True)  # recorded even if the run is stopped
    plan = [(s, then) for s, then in (("ddp", "fsdp"), ("fsdp", None), ("pp", None)) if args.only in (None, s)]
    slot = args.minutes * 60 / len(plan)
    results = []
    with tempfile.TemporaryDirectory(prefix="paratrain-soak-") as tmp:
        short, long = (_reference(Path(tmp) / f"calibrate-{n}", "ddp", n) for n in (2, 6))
        per_epoch = max(1e-3, (long - short) / 4)
        startup = max(1.0, short - 2 * per_epoch)
        for strategy, then in plan:
            folder = Path(tmp) / strategy
            # as many epochs as fill the slot, less what the expected restarts cost (a start-up each)
            epochs = args.epochs or max(3, int((slot - slot / 60 / args.pace * startup) / per_epoch))
            first = epochs * 2 // 3 if then else epochs
            saves = (first * STEPS_PER_EPOCH) // 20
            faults = ",".join(f"kill-in-save:{rng.choice([0, 1])}@{20 * rng.randint(1, saves)}" for _ in range(2))
            soak = _soak(folder, strategy, first, slot * first / epochs, args.pace, rng, faults)
            row: dict[str, Any] = {"strategy": strategy, "epochs": epochs, **soak}
            if then:  # finish the run under another layout
                done = subprocess.run(_command(folder, then, epochs, "--ledger", str(folder / "ledger"), "--out",
                                               str(folder / "soak.pt")), env=_env(), capture_output=True, text=True)
                row["resumed_under"] = then
                row["rc_resumed"] = done.returncode
            reference_seconds = _reference(folder / "reference", strategy, epochs)
            row["reference_seconds"] = round(reference_seconds, 1)
            diff = _max_diff(_final(folder, "soak.pt"), _final(folder / "reference", "whole.pt"))
            row["max_weight_diff"] = diff
            row["weights_ok"] = diff == 0.0 if not then else diff < 1e-5
            replicas = 1 if strategy == "pp" else 2
            row["every_sample_once"] = _exactly_once(_effective(folder / "ledger"), epochs, replicas)
            row.pop("tail") if row["rc"] == 0 else None
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(), "seed": seed,
              "minutes": args.minutes, "pace": args.pace, "only": args.only, "runs": results,
              "ok": all(r["rc"] == 0 and r["weights_ok"] and r["every_sample_once"] for r in results)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"soak: {'ok' if report['ok'] else 'FAILED'}; {sum(len(r['kills']) for r in results)} kills, "
          f"{sum(r['kills_in_save'] for r in results)} inside run.save; {args.out}")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
