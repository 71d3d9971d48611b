"""What the slow-rank watch costs a training step (observe/stragglers.py): its timing (two gradient hooks and a
few flag tests every step, a clock read per phase in one step of four) and its one small all-reduce per window
(at least a second).

2 CPU DDP workers (gloo, one thread each) hold two runs of the same MLP side by side, one with the watch on (the
default, `straggler_threshold=0.2`) and one with it off (`None`), and alternate single steps of the two, A B B A,
each step timed alone by the bench's harness (`measure.timing.time_steps`: a barrier first, the slowest rank's
time), so that the machine's drift falls on both sides alike (blocks of a second measured one after the other
differ by 20% and more on this shared 2-core machine). Reported per model size:

- end to end: each side's median step and the median of the paired ratios (each step on over the step off
  beside it) with a 95% bootstrap interval;
- a control: the same run with the watch off on both sides (A A), whose paired ratio is the harness's own
  bias and noise (the side built first, the order of a pair) to read the first against;
- its parts, each measured where it is small enough to see: the CPU time the watch adds to a step (rank 0's
  thread time, paired the same way: waiting for a busy core does not count), and the all-reduce, timed where
  it runs and spread over a window of max(20 steps, 1 s). The median of paired steps never holds a window's
  all-reduce (one step in hundreds), which is why it is measured apart. Their sum, as a share of the step, is
  the overhead a run pays (`overhead`; `overhead_less_control` takes off the CPU time the control's
  first side gained over its second with no watch at all).

The goal is at most 1% of a step.

    python benchmarks/straggler_overhead.py benchmarks/results/straggler-overhead-2026-11-29.json
    python benchmarks/straggler_overhead.py OUT --pairs 100          # a smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.observe import stragglers

sys.path.insert(0, str(Path(__file__).parent))
from _emit import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = ((16, 16), (512, 256))
"""(width, global batch): a tiny model, where a fixed cost per step shows most, and one of about 10 ms a step."""
PAIRS = (1500, 800)


def _side(width: int, batch: int, **options: Any) -> tuple[Any, Any, Any, Any]:
    run = paratrain.setup(progress=False, seed=0, **options)
    data = TensorDataset(torch.randn(batch * 64, width), torch.randn(batch * 64, width))
    loader = run.prepare_loader(DataLoader(data, batch_size=run.per_worker_batch(batch), shuffle=True))
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    return run, _forever(loader), model, opt


def _forever(loader: Any) -> Any:
    while True:
        yield from loader


def _one(side: tuple[Any, Any, Any, Any]) -> None:
    run, batches, model, opt = side
    x, y = next(batches)
    run.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()


def end_to_end(width: int, batch: int, pairs: int, threshold: float | None) -> dict[str, Any]:
    """In each DDP worker: both sides built and warmed up, then `pairs` steps of each, alternated A B B A. The
    first side has the watch at `threshold` (None: off, the control)."""
    from paratrain.measure.timing import time_steps

    on = _side(width, batch, strategy="ddp", straggler_threshold=threshold)
    off = _side(width, batch, strategy="ddp", straggler_threshold=None)
    for _ in range(30):
        _one(on)
        _one(off)
    watch = on[0]._stragglers
    gathers: list[float] = []
    gather = watch._gather

    def timed_gather(step: int) -> None:
        start = time.perf_counter()
        gather(step)
        gathers.append(time.perf_counter() - start)

    watch._gather = timed_gather  # type: ignore[method-assign]
    cpu = torch.device("cpu")
    times: dict[str, list[float]] = {"on": [], "off": [], "on_cpu": [], "off_cpu": []}
    for i in range(pairs):
        order = (("on", on), ("off", off))
        for name, side in order if i % 2 == 0 else order[::-1]:
            cpu_start = time.thread_time()
            times[name] += time_steps(lambda side=side: _one(side), 1, [cpu], cpu)[0]
            times[f"{name}_cpu"].append(time.thread_time() - cpu_start)
    result = {"windows_gathered": len(gathers), "gather_s": gathers, "watch_active": watch.active,
              "named": watch.named, **times}
    for side in (on, off):
        side[0].close()
    return result


def _interval(on: list[float], off: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median paired ratio (steps resampled in their pairs, fixed seed)."""
    rng = random.Random(0)
    ratios = [a / b for a, b in zip(on, off)]
    medians = sorted(statistics.median(rng.choice(ratios) for _ in ratios) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--pairs", type=int, default=0, help=f"DDP steps of each side (default: {PAIRS})")
    args = parser.parse_args()
    sys.argv = [sys.argv[0], *([args.out] if args.out else [])]  # _emit reads the output path from argv
    rows = []
    for (width, batch), pairs in zip(SIZES, PAIRS):
        got, control = (paratrain.launch(end_to_end, width, batch, args.pairs or pairs, threshold, nproc=2, timeout=900,
                                         accelerator="cpu", threads_per_worker=1, prefix_output=False)
                        for threshold in (0.2, None))
        control_ratio = statistics.median(a / b for a, b in zip(control["on"], control["off"]))
        control_cpu = statistics.median(a - b for a, b in zip(control["on_cpu"], control["off_cpu"]))
        on, off = got.pop("on"), got.pop("off")
        on_cpu, off_cpu = got.pop("on_cpu"), got.pop("off_cpu")
        added = statistics.median(a - b for a, b in zip(on_cpu, off_cpu))
        step = statistics.median(off)
        paired = statistics.median(a / b for a, b in zip(on, off))
        low, high = _interval(on, off)
        window_s = max(stragglers.MIN_WINDOW_S, 20 * step)
        gather = statistics.mean(got["gather_s"]) if got["gather_s"] else 0.0
        share = {"timing": added / step, "all_reduce": gather / window_s}
        row = {"width": width, "global_batch": batch, "pairs": len(on), **got,
               "on_median_s": statistics.median(on), "off_median_s": step, "median_paired_ratio": paired,
               "paired_ratio_ci95": [low, high], "cpu_added_s": added, "all_reduce_mean_s": gather,
               "control": {"median_paired_ratio": control_ratio, "paired_ratio_ci95": _interval(control["on"],
                                                                                                control["off"]),
                           "cpu_added_s": control_cpu},
               "window_s": window_s, "share_of_step": share, "overhead": sum(share.values()),
               "overhead_less_control": sum(share.values()) - control_cpu / step,
               **{name: [round(v, 7) for v in values] for name, values in  # 0.1 us: the file stays small
                  (("on_s", on), ("off_s", off), ("on_cpu_s", on_cpu), ("off_cpu_s", off_cpu))}}
        rows.append(row)
        print(f"width {width}, batch {batch}: DDP step {step * 1e3:.3f} ms off, {row['on_median_s'] * 1e3:.3f} ms on, "
              f"paired ratio {paired:.4f} (95% {low:.4f}-{high:.4f}; control A A {control_ratio:.4f}); CPU "
              f"+{added * 1e6:.1f} us a step (control {control_cpu * 1e6:+.1f}) "
              f"({share['timing'] * 100:.2f}%), all-reduce {gather * 1e3:.2f} ms a window of {window_s:.2f} s "
              f"({share['all_reduce'] * 100:.2f}%): overhead {row['overhead'] * 100:.2f}% "
              f"({row['overhead_less_control'] * 100:.2f}% less the control)", file=sys.stderr, flush=True)
    emit({"what": "slow-rank watch on vs off: 2 CPU DDP workers (gloo), MLP, SGD, single steps alternated A B B A; "
                  "its CPU time per step (rank 0's thread time, paired) and its all-reduce where it gathered",
          "commit": _commit(), "torch": torch.__version__,
          "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                      "load_average": os.getloadavg()}, "sizes": rows})


if __name__ == "__main__":
    main()
