"""The one timing harness of every benchmark: steps timed on every rank, each step's time the slowest
rank's (a step ends when its slowest worker ends it), with the peak memory of the block."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..memstats import peak_bytes, reset_peak


def _multi() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _peak_mb(devices: list[torch.device]) -> float:
    """Peak memory during the last block: CUDA allocations, or the process's peak RSS on CPU."""
    cuda = [d for d in devices if d.type == "cuda"]
    return max(peak_bytes(d) for d in (cuda or devices[:1])) / 2**20


def _sync(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def time_steps(step: Callable[[], object], count: int, devices: list[torch.device],
               device: torch.device) -> tuple[list[float], float]:
    """Seconds of `count` calls of `step` (collective: every rank calls it) and the peak MB during them.
    `devices` are synchronised after each step; `device` carries the reduction."""
    if _multi():
        dist.barrier()
    for d in devices:
        reset_peak(d)
    local = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        _sync(devices)
        local.append(time.perf_counter() - start)
    stats = torch.tensor([*local, _peak_mb(devices)], dtype=torch.float64, device=device)
    if _multi():
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return [float(t) for t in stats[:-1]], float(stats[-1])


def best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Best seconds per call of `fn` over `repeats` calls after a warm-up, the device synchronised (a GPU's work
    counts, not only its launch): one process, no collective. The fastest, since a busy machine only ever slows
    a call down (the planner's probes and its profile's whole step and optimizer step)."""
    fn()
    _sync([device])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync([device])
        best = min(best, time.perf_counter() - start)
    return best
