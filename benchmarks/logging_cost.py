"""What `run.log` and the step breakdown cost, and whether the breakdown points at the right rank.

1. Cost: 2 CPU DDP workers (one thread each, gloo) train an MLP; blocks of steps with no logging,
   with one bare `run.all_reduce` of the loss per step (the floor), with `run.log(step, loss=loss)`
   every step, and with `run.log` every step inside `paratrain.profile(run)` alternate A B C D A B C D;
   medians of the per-block mean step time are quoted, for a tiny model (where a fixed cost shows most)
   and a larger one.
2. Attribution: rank 1 burns a fixed extra amount of CPU in its forward on every step (real compute,
   not a sleep); the per-rank breakdown should show it as rank 1's compute, rank 0's exposed
   communication (waiting for rank 1 at the end of backward), and name rank 1.

    python benchmarks/logging_cost.py          # about a minute on a quiet 2-core machine
    python benchmarks/logging_cost.py --quick

Results: benchmarks/results/logging_cost.json. On a shared machine the numbers are noisy; compare
the modes within one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

sys.path.insert(0, str(Path(__file__).parent))
from _emit import commit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "all_reduce", "log", "log+profile")
"""`all_reduce`: one bare `run.all_reduce` of the loss per step, the floor under `run.log`'s one collective."""


def _setup(width: int, batch: int, folder: str) -> tuple[Any, Any, Any, Any]:
    run = paratrain.setup(strategy="ddp", log_dir=folder, progress=False, seed=0)
    data = TensorDataset(torch.randn(batch * 64, width), torch.randn(batch * 64, width))
    loader = run.prepare_loader(DataLoader(data, batch_size=run.per_worker_batch(batch), shuffle=True))
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    return run, loader, model, opt


def _batches(loader: Any) -> Any:
    while True:
        yield from loader


def cost(width: int, batch: int, steps: int, repeat: int, folder: str) -> dict[str, Any]:
    run, loader, model, opt = _setup(width, batch, folder)
    batches = _batches(loader)
    step = 0
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for block in range(repeat + 1):  # block 0 warms up
        for mode in MODES:
            profiling = paratrain.profile(run) if mode == "log+profile" else None
            if profiling is not None:
                profiling.__enter__()
            run.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                x, y = next(batches)
                loss = run.forward_backward(model, x, y, nn.functional.mse_loss)
                opt.step()
                opt.zero_grad()
                step += 1
                if mode == "all_reduce":
                    run.all_reduce(loss.detach()).item()
                elif mode != "none":
                    run.log(step, loss=loss)
            elapsed = (time.perf_counter() - start) / steps
            if profiling is not None:
                profiling.__exit__(None, None, None)
            if block:
                times[mode].append(elapsed)
    run.close()
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"width": width, "global_batch": batch, "steps_per_block": steps, "blocks": repeat,
            "median_step_s": med, "blocks_step_s": times,
            "overhead_vs_none": {m: med[m] / med["none"] - 1 for m in MODES if m != "none"}}


def attribution(burn_s: float, steps: int, folder: str) -> dict[str, Any]:
    run, loader, model, opt = _setup(256, 64, folder)
    batches = _batches(loader)
    with paratrain.profile(run) as prof:
        for _ in range(steps):
            x, y = next(batches)
            out = model(x)
            if run.rank == 1:
                until = time.perf_counter() + burn_s
                while time.perf_counter() < until:  # CPU work, as a slower core or a heavier shard would be
                    pass
            run.backward(nn.functional.mse_loss(out, y))
            opt.step()
            opt.zero_grad()
    run.close()
    return {"burn_s": burn_s, "steps": prof.steps, "slow": prof.slow, "table": str(prof),
            "per_rank_ms": [{k: round(v * 1e3, 3) for k, v in vars(t).items()} for t in prof.ranks]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    steps, repeat = (20, 3) if args.quick else (100, 7)
    folder = tempfile.mkdtemp(prefix="paratrain-logcost-")
    launch = dict(nproc=2, timeout=600, accelerator="cpu", threads_per_worker=1, prefix_output=False)
    results: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit(), "torch": torch.__version__,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": __import__("os").cpu_count()},
        "cost": [paratrain.launch(cost, w, b, steps, repeat, f"{folder}/{w}", **launch)
                 for w, b in ((16, 16), (512, 256))],
        "attribution": paratrain.launch(attribution, 0.02, 20 if args.quick else 50, f"{folder}/a", **launch),
    }
    out = ROOT / "benchmarks" / "results" / "logging_cost.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    for c in results["cost"]:
        med = c["median_step_s"]
        print(f"width {c['width']}, batch {c['global_batch']}: " + ", ".join(
            f"{m} {med[m] * 1e3:.3f} ms" for m in MODES) + "  (overhead: " + ", ".join(
            f"{m} {v * 100:+.1f}%" for m, v in c["overhead_vs_none"].items()) + ")")
    print(results["attribution"]["table"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
