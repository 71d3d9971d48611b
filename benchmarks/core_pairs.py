"""Do two CPU cores here really compute twice as much as one? A one-thread matrix product, alone on a core
and then on two cores at once, for a few pairs; prints GFLOP/s and the pair that scales best.

Two vCPUs of a virtual machine are often the two hyperthreads of one physical core, which share one
set of vector units: then no strategy can make 2 workers 2x faster than 1 (see `no-comm` in
docs/benchmarks.md). Linux only (taskset).

    python benchmarks/core_pairs.py            # prints e.g. "best pair: 0,8 (1.97x)"
"""

from __future__ import annotations

import os
import subprocess
import sys

PRODUCT = """
import time, torch
torch.set_num_threads(1)
a, w = torch.randn(256, 1024), torch.randn(1024, 1024)
for _ in range(5):
    a @ w
start = time.perf_counter()
for _ in range(150):
    a @ w
print(2 * 256 * 1024 * 1024 * 150 / (time.perf_counter() - start) / 1e9)
"""


def rate(cpus: list[int]) -> list[float]:
    procs = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", PRODUCT], stdout=subprocess.PIPE,
                              text=True) for c in cpus]
    return [float(p.communicate(timeout=120)[0]) for p in procs]


def main() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    first = cpus[0]
    alone = rate([first])[0]
    print(f"cpu {first} alone: {alone:.1f} GFLOP/s")
    candidates = [c for c in cpus[1:] if c in (cpus[1], cpus[len(cpus) // 2], cpus[-1])]
    best = (0.0, "")
    for other in dict.fromkeys(candidates):
        both = rate([first, other])
        scale = sum(both) / alone
        print(f"cpus {first},{other} together: {both[0]:.1f} + {both[1]:.1f} GFLOP/s = {scale:.2f}x one core")
        best = max(best, (scale, f"{first},{other}"))
    print(f"best pair: {best[1]} ({best[0]:.2f}x)")


if __name__ == "__main__":
    main()
