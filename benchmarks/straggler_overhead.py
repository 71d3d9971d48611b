"""What the slow-rank check costs a training step (observe/stragglers.py): its own work on every rank (a few flag
tests every step, a clock read per phase in one step of four) and one small all-reduce per window (at least a
second).

1. End to end. 2 CPU DDP workers (gloo, one thread each) hold two runs of the same MLP side by side, one with
   the check on (the default, `straggler_threshold=0.2`) and one with it off (`None`), and alternate single
   steps of the two, A B B A, each step timed alone by the bench's harness (`measure.timing.time_steps`: a
   barrier first, the slowest rank's time), so that the machine's drift falls on both sides alike (blocks of a
   second measured one after the other differ by 20% and more on this shared 2-core machine). Reported: each
   side's median step and the median of the paired ratios (each step on over the step off beside it) with a
   95% bootstrap interval; and a control, the same run with the check off on both sides (A A), whose ratio is
   the harness's own bias and noise to read the first against.
2. Its parts, each measured where it is small enough to see. The work every rank does: in one process, two
   runs of the same loop, one with the check driven as on rank 0 of two (`StragglerWatch` given a world of two
   whose all-reduce is answered in place: a peer exactly as fast), blocks of steps alternated A B A B, the
   median of the paired block differences (two coupled processes blur a few microseconds: their steps wait
   for each other); on the tiny model only, since no part of this work depends on the model (no hook, no
   tensor). The all-reduce: timed where the DDP run above gathers, and spread over its window of max(20
   steps, 1 s). Their sum, as a share of the DDP step, is the overhead a run pays. The median of paired steps
   in 1. never holds a window's all-reduce (one step in hundreds), which is why it is measured apart.

The goal is at most 1% of a step.

    python benchmarks/straggler_overhead.py benchmarks/results/straggler-overhead-2026-11-29.json
    python benchmarks/straggler_overhead.py OUT --pairs 100          # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.measure import stats
from paratrain.observe import stragglers

sys.path.insert(0, str(Path(__file__).parent))
from _emit import commit, emit  # noqa: E402

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
    first side has the check at `threshold` (None: off, the control)."""
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
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(pairs):
        order = (("on", on), ("off", off))
        for name, side in order if i % 2 == 0 else order[::-1]:
            times[name] += time_steps(lambda side=side: _one(side), 1, [cpu], cpu)[0]
    result = {"windows_gathered": len(gathers), "gather_s": gathers, "watch_active": watch.active,
              "named": watch.named, **times}
    for side in (on, off):
        side[0].close()
    return result


def own_work(width: int, batch: int, blocks: int = 40, steps: int = 100) -> dict[str, Any]:
    """Seconds per step the check's own work adds, in one process: the same loop on two runs, one with a watch
    driven as rank 0 of two (its all-reduce answered in place, as by a peer exactly as fast)."""
    torch.set_num_threads(1)
    on, off = _side(width, batch, strategy="single"), _side(width, batch, strategy="single")
    run = on[0]

    def peer(flat: torch.Tensor) -> torch.Tensor:  # rank 1: the same times, in the second replica
        return torch.cat([flat[:6], flat[:5], torch.ones(1, dtype=flat.dtype)])

    run._stragglers = stragglers.StragglerWatch(
        rank=0, world_size=2, threshold=0.2, window=20, timing=run.timing, all_reduce_sum=peer,
        guard=lambda name: contextlib.nullcontext(), layout=lambda: (0, 2), beats=dict, report=lambda r, t: None)
    diffs, fastest = [], {"on": float("inf"), "off": float("inf")}
    for block in range(blocks + 1):
        took = {}
        for name, side in (("on", on), ("off", off)) if block % 2 else (("off", off), ("on", on)):
            start = time.perf_counter()
            for _ in range(steps):
                _one(side)
            took[name] = (time.perf_counter() - start) / steps
        if block:  # block 0 warms up
            diffs.append(took["on"] - took["off"])
            fastest = {k: min(fastest[k], took[k]) for k in fastest}
    windows = run._stragglers.windows
    for side in (on, off):
        side[0].close()
    return {"added_s": statistics.median(diffs), "fastest_on_s": fastest["on"], "fastest_off_s": fastest["off"],
            "blocks": blocks, "steps_per_block": steps, "windows": windows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--pairs", type=int, default=0, help=f"DDP steps of each side (default: {PAIRS})")
    args = parser.parse_args()
    sys.argv = [sys.argv[0], *([args.out] if args.out else [])]  # _emit reads the output path from argv
    rows = []
    work = own_work(*SIZES[0])
    for (width, batch), pairs in zip(SIZES, PAIRS):
        got, control = (paratrain.launch(end_to_end, width, batch, args.pairs or pairs, threshold, nproc=2,
                                         timeout=900, accelerator="cpu", threads_per_worker=1, prefix_output=False)
                        for threshold in (0.2, None))
        on, off = got.pop("on"), got.pop("off")
        step = statistics.median(off)
        ratio, control_pair = stats.paired_ratio(on, off), stats.paired_ratio(control["on"], control["off"])
        paired, control_ratio = ratio.value, control_pair.value
        window_s = max(stragglers.MIN_WINDOW_S, 20 * step)
        gather = statistics.mean(got["gather_s"]) if got["gather_s"] else 0.0
        share = {"own_work": work["added_s"] / step, "all_reduce": gather / window_s}
        row = {"width": width, "global_batch": batch, "pairs": len(on), **got,
               "on_median_s": statistics.median(on), "off_median_s": step, "median_paired_ratio": paired,
               "paired_ratio_ci95": ratio.interval,
               "control": {"median_paired_ratio": control_ratio,
                           "paired_ratio_ci95": control_pair.interval},
               "all_reduce_mean_s": gather, "window_s": window_s,
               "share_of_step": share, "overhead": sum(share.values()),
               **{name: [round(v, 7) for v in values] for name, values in  # 0.1 us: the file stays small
                  (("on_s", on), ("off_s", off))}}
        rows.append(row)
        print(f"width {width}, batch {batch}: DDP step {step * 1e3:.3f} ms off, {row['on_median_s'] * 1e3:.3f} ms on, "
              f"paired ratio {ratio.text()} (control A A {control_ratio:.4f}); own work "
              f"{work['added_s'] * 1e6:+.1f} us a step ({share['own_work'] * 100:.2f}%), all-reduce "
              f"{gather * 1e3:.2f} ms a window of {window_s:.2f} s ({share['all_reduce'] * 100:.2f}%): overhead "
              f"{row['overhead'] * 100:.2f}%", file=sys.stderr, flush=True)
    emit({"what": "slow-rank check on vs off: 2 CPU DDP workers (gloo), MLP, SGD, single steps alternated A B B A, "
                  "with an A A control; its own work per step in one process; its all-reduce where it gathered",
          "own_work_one_process": {"width": SIZES[0][0], "global_batch": SIZES[0][1], **work},
          "commit": commit(), "torch": torch.__version__,
          "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                      "load_average": os.getloadavg()}, "sizes": rows})


if __name__ == "__main__":
    main()
