"""What one step's gradient exchange costs on its own: a gloo all-reduce of the `mlp-wide` workload's
34 MB of float32 gradients (one flat tensor, and in DDP's 25 MiB buckets) between 2 one-thread CPU workers
doing nothing else, against the workload's compute per worker. It is the floor of DDP's cost on this
machine when nothing overlaps: both cores are busy computing during backward, so the exchange cannot hide.

Usage: OMP_NUM_THREADS=1 python benchmarks/allreduce_cost.py [OUT.json]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _emit import emit  # benchmarks/ is the script's folder, first on sys.path

import paratrain
from paratrain.measure import workloads

REPEATS = 15


def _time() -> dict[str, Any]:
    paratrain.setup(strategy="ddp")
    numel = workloads.parameters(workloads.get("mlp-wide").model())
    flat = torch.randn(numel)
    buckets = list(torch.randn(numel).split(25 * 2**20 // 4))

    def timed(fn: Any) -> float:
        samples = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    one = timed(lambda: dist.all_reduce(flat))
    bucketed = timed(lambda: [w.wait() for w in [dist.all_reduce(b, async_op=True) for b in buckets]])
    return {"bytes": numel * 4, "one_tensor_s": one, "buckets_s": bucketed, "gb_per_s": numel * 4 / one / 1e9}


def main() -> None:
    res = paratrain.launch(_time, nproc=2, timeout=120)
    emit(res)


if __name__ == "__main__":
    main()
