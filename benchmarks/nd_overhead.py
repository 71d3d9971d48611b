"""paratrain's N-D layouts against the same layouts written by hand (torchtitan's order), step by step.

`paratrain bench` alternates the two sides in blocks of steps; on this 2-core machine, with 2 or 4 workers, the
medians of two such runs of the same code move by 5-10%, more than the 2% the comparison is about. Here both
sides are built in the same workers (the bench's own builders: `worker.paratrain_side` and
`references.BUILDERS`), and every step alternates A B B A, each step timed alone by the bench's harness
(`measure.timing.time_steps`: a barrier first, the slowest rank's time), so the machine's drift falls on both
sides within a second. Reported per layout: each side's median step, the ratio of the medians, and
the median of the paired ratios (each paratrain step over the reference step beside it), each with its 95%
bootstrap interval and the verdict `paratrain bench` prints (`paratrain.measure.stats`).

    python benchmarks/nd_overhead.py benchmarks/results/nd-overhead.json            # the gpt workload, mini
    python benchmarks/nd_overhead.py OUT --steps 10 --size tiny                        # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

import paratrain
from paratrain.measure import stats

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _emit import emit  # noqa: E402

LAYOUTS = (("fsdp", 2), ("tp", 2), ("fsdp+tp", 4), ("tp+pp", 4), ("ddp+pp", 4), ("fsdp+pp", 4))
"""(strategy, workers): the layouts of the N-D issue's benchmark, at the fewest workers each runs on."""


def _pair(strategy: str, workers: int, size: str, steps: int, microbatches: int) -> dict[str, Any]:
    """In each worker: both sides built, warmed up, then `steps` alternated steps each (the slowest rank's times)."""
    import torch.distributed as dist

    from paratrain.bench import jobs, references, worker
    from paratrain.measure import workloads
    from paratrain.measure.timing import time_steps

    settings = jobs.Settings(workload="gpt", gpt_size=size, batch=8, steps=1, warmup=0, repeat=1, schedule="1f1b")
    worker._init_group(jobs.Job(workers, (), strategy), settings)
    w = workloads.get("gpt", gpt_size=size)
    pipelined = "pp" in strategy.split("+")
    ref = jobs.REFERENCE[strategy]
    m, schedule = (microbatches, "1f1b") if pipelined else (None, None)
    ours = worker.paratrain_side(jobs.Spec(strategy, workers, m, schedule), w, w.data(8), settings)
    theirs = references.BUILDERS[ref](jobs.Spec(ref, workers, m, schedule), w, w.data(8), settings,
                                      torch.device("cpu"))
    for _ in range(3):
        ours()
        theirs()
    times: dict[str, list[float]] = {"paratrain": [], "hand-written": []}
    cpu = torch.device("cpu")
    for i in range(steps):
        order = (("paratrain", ours), ("hand-written", theirs))
        for name, step in order if i % 2 == 0 else order[::-1]:
            times[name] += time_steps(step, 1, [cpu], cpu)[0]
    dist.barrier()
    return {"reference": ref, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--size", default="mini")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(f"{s}:{w}" for s, w in LAYOUTS))
    args = parser.parse_args()
    sys.argv = [sys.argv[0], *([args.out] if args.out else [])]  # _emit reads the output path from argv
    rows = []
    for item in args.layouts.split(","):
        strategy, workers = item.rsplit(":", 1)
        got = paratrain.launch(_pair, strategy, int(workers), args.size, args.steps, args.microbatches,
                               nproc=int(workers), timeout=900, accelerator="cpu")
        ours, theirs = got["times"]["paratrain"], got["times"]["hand-written"]
        of_medians = stats.ratio_of_medians(ours, theirs, paired=True)  # the steps resampled in their pairs
        paired = stats.paired_ratio(ours, theirs)
        row = {"strategy": strategy, "workers": int(workers), "reference": got["reference"],
               "paratrain_median_s": statistics.median(ours), "reference_median_s": statistics.median(theirs),
               "ratio_of_medians": of_medians.value, "median_paired_ratio": paired.value,
               "ratio_ci95": of_medians.interval, "paired_ci95": paired.interval, "verdict": stats.verdict(paired),
               "steps": len(ours), "paratrain_s": ours, "reference_s": theirs}
        rows.append(row)
        print(f"{strategy:>8} x{workers}: paratrain {row['paratrain_median_s']:.4f} s, {row['reference']} "
              f"{row['reference_median_s']:.4f} s, ratio of medians {of_medians.text()}; paired: {row['verdict']}",
              file=sys.stderr, flush=True)
    emit({"workload": f"gpt {args.size}, global batch 8, SGD", "microbatches": args.microbatches,
          "schedule": "1f1b", "torch": torch.__version__, "cores": os.cpu_count(), "layouts": rows})


if __name__ == "__main__":
    main()
