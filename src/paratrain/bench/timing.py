"""The one timing harness of every benchmark: steps timed on every rank, each step's time the slowest
rank's (a step ends when its slowest worker ends it), with the peak memory of the block."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def _multi() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # "5" resets the peak resident set size (VmHWM) of this process (Linux)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_mb(devices: list[torch.device]) -> float:
    """Peak memory during the last block: CUDA allocations, or the process's peak RSS on CPU."""
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        return max(torch.cuda.max_memory_allocated(d) for d in cuda) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
        _reset_peak(d)
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
