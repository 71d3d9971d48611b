"""Samples/s of a streamed dataset through `run.prepare_loader` beside the same stream through a plain DataLoader.

Data: jsonl and parquet shards of token records ({"id", "tokens": 128 ints, "text"}), written to a temporary
folder. For each format and DataLoader `num_workers` in 0, 2, 4, one epoch is read in turns (A B C A B C ...,
`--repeat` rounds, the order rotated) by

    A  plain     DataLoader(stream, batch_size=64, num_workers=W): torch's recipe, each worker reading every
                 W-th shard in order (the stream's own __iter__), no sharding, no global order
    B  prepared  run.prepare_loader(DataLoader(stream, ...)): the same stream in paratrain's global order,
                 read by position (unshuffled, so it reads what A reads)
    C  shuffled  B with shuffle=True: shards and rows permuted by (seed, epoch)

with the same collate_fn (tokens to a LongTensor), and the median of each side's samples/s (wall clock) and
samples per CPU-second (this process and its loader workers; steadier on a shared machine) is reported with
the ratio to A (goal: >= 0.95). Worker start-up is inside every pass, for every side, and so is
prepare_loader's own work (counting each shard's samples); `paratrain.setup` is not. Writes JSON (machine,
date, commit, every pass) to --out.

    python benchmarks/stream_throughput.py --out benchmarks/results/stream-throughput-2026-11-29.json
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

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 128


def write_shards(folder: Path, shards: int, per_shard: int) -> dict[str, list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    g = torch.Generator().manual_seed(0)
    out: dict[str, list[str]] = {"jsonl": [], "parquet": []}
    for j in range(shards):
        tokens = torch.randint(0, 50_000, (per_shard, TOKENS), generator=g).tolist()
        rows = [{"id": j * per_shard + i, "tokens": t, "text": f"document {j}-{i}"} for i, t in enumerate(tokens)]
        path = folder / f"part-{j:03d}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out["jsonl"].append(str(path))
        path = folder / f"part-{j:03d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1024)
        out["parquet"].append(str(path))
    return out


def collate(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"id": torch.tensor([b["id"] for b in batch]), "tokens": torch.tensor([b["tokens"] for b in batch])}


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the DataLoader workers, reaped at the epoch's end):
    unlike wall time, barely moved by other work on a shared machine."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def one_pass(side: str, fmt: str, files: list[str], workers: int, batch: int) -> tuple[float, float]:
    """Samples per second and samples per CPU-second of one epoch."""
    import paratrain
    from paratrain import data

    stream = getattr(data, fmt)(files, shuffle=side == "shuffled")
    loader = DataLoader(stream, batch_size=batch, num_workers=workers, collate_fn=collate)
    if side != "plain":
        run = paratrain.setup(strategy="single", seed=0, progress=False)
    start, cpu = time.perf_counter(), cpu_seconds()
    if side != "plain":  # prepare_loader's own work (counting each shard's samples) is timed
        loader = run.prepare_loader(loader)  # type: ignore[assignment]
    n = 0
    for b in loader:
        n += len(b["id"])
    del b
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    if side != "plain":
        run.close()
    return n / seconds, n / cpu


def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=ROOT, text=True,
                                capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import pyarrow

    return {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "torch": torch.__version__, "pyarrow": pyarrow.__version__, "commit": commit,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--per-shard", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", default="0,2,4")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    sides = ("plain", "prepared", "shuffled")
    passes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="stream-throughput-") as tmp:
        files = write_shards(Path(tmp), args.shards, args.per_shard)
        for side in sides:  # untimed: imports and first-use costs
            one_pass(side, "parquet", files["parquet"][:1], 0, args.batch)
        for fmt in ("jsonl", "parquet"):
            for workers in (int(w) for w in args.workers.split(",")):
                for rnd in range(args.repeat):
                    order = sides[rnd % 3 :] + sides[: rnd % 3]  # no side always first
                    for side in order:
                        rate, per_cpu = one_pass(side, fmt, files[fmt], workers, args.batch)
                        passes.append({"format": fmt, "workers": workers, "side": side, "round": rnd,
                                       "samples_s": rate, "samples_per_cpu_s": per_cpu})
    rows = []
    for fmt in ("jsonl", "parquet"):
        for workers in sorted({q["workers"] for q in passes}):
            mine = [q for q in passes if (q["format"], q["workers"]) == (fmt, workers)]
            med = {s: statistics.median(q["samples_s"] for q in mine if q["side"] == s) for s in sides}
            cpu = {s: statistics.median(q["samples_per_cpu_s"] for q in mine if q["side"] == s) for s in sides}
            rows.append({"format": fmt, "workers": workers, **{f"{s}_samples_s": round(med[s]) for s in sides},
                         "prepared_ratio": round(med["prepared"] / med["plain"], 3),
                         "shuffled_ratio": round(med["shuffled"] / med["plain"], 3),
                         **{f"{s}_samples_per_cpu_s": round(cpu[s]) for s in sides},
                         "prepared_cpu_ratio": round(cpu["prepared"] / cpu["plain"], 3),
                         "shuffled_cpu_ratio": round(cpu["shuffled"] / cpu["plain"], 3)})
    print("| format | workers | plain samples/s | prepared (ratio) | prepared, shuffled (ratio) | "
          "samples per CPU-s: plain | prepared (ratio) | shuffled (ratio) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['format']} | {r['workers']} | {r['plain_samples_s']} | {r['prepared_samples_s']} "
              f"({r['prepared_ratio']:.2f}) | {r['shuffled_samples_s']} ({r['shuffled_ratio']:.2f}) | "
              f"{r['plain_samples_per_cpu_s']} | {r['prepared_samples_per_cpu_s']} ({r['prepared_cpu_ratio']:.2f}) | "
              f"{r['shuffled_samples_per_cpu_s']} ({r['shuffled_cpu_ratio']:.2f}) |")
    result = {"machine": machine(), "settings": vars(args), "samples": args.shards * args.per_shard,
              "summary": rows, "passes": passes}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
