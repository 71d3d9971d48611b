"""How much slower a step gets on one CPU worker when its batch is cut into M micro-batches, with no
pipeline at all: the part of a pipeline's gap to its bound that no schedule can recover.

A K-stage pipeline's bound K*M/(M+K-1) assumes a micro-batch costs 1/M of the batch. On CPU a matrix
product on fewer rows runs at a lower rate, so M micro-batches cost more than one batch. This times, in
one thread and alternating the counts A B A B, forward + backward + SGD of the `mlp` workload over the
whole batch cut into M pieces run one after another, and writes the ratio to the M=1 step.

Usage: OMP_NUM_THREADS=1 python benchmarks/microbatch_cost.py [OUT.json]
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from _emit import emit  # benchmarks/ is the script's folder, first on sys.path

from paratrain.measure import workloads

COUNTS = tuple(int(m) for m in os.environ.get("MICROBATCH_COST_COUNTS", "1,2,4,8,16").split(","))
REPEATS = int(os.environ.get("MICROBATCH_COST_REPEATS", "7"))  # bench_limits.sh --quick runs 4


def main() -> None:
    torch.set_num_threads(1)
    workload = workloads.get("mlp")
    torch.manual_seed(0)
    model = workload.model()
    x, y = workload.data(workload.batch)
    loss_fn = workload.loss()
    opt = torch.optim.SGD(model.parameters(), lr=workload.lr)

    def step(m: int) -> float:
        start = time.perf_counter()
        opt.zero_grad()
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (loss_fn(model(xs), ys) / m).backward()
        opt.step()
        return time.perf_counter() - start

    for m in COUNTS:  # warm-up
        step(m)
    times: dict[int, list[float]] = {m: [] for m in COUNTS}
    for _ in range(REPEATS):
        for m in COUNTS:
            times[m].append(step(m))
    median = {m: statistics.median(t) for m, t in times.items()}
    out = {"workload": workload.description,
           "batch": workload.batch, "median_step_s": median,
           "cost_vs_whole_batch": {m: round(median[m] / median[1], 4) for m in COUNTS}}
    emit(out)


if __name__ == "__main__":
    main()
