"""How communication overlaps compute in a data-parallel step: DDP's bucketed all-reduce during the backward
and FSDP's all-gathers and reduce-scatters with prefetch, each simulated in order as torch issues them.
(Pipeline schedules are simulated from torch's own action lists in `parallel.pipeline.simulate`.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Overlapped:
    """A compute phase with communication running beside it."""

    end: float
    """Seconds from the phase's start until both compute and communication are done."""
    compute: float
    comm: float
    """Seconds of communication in total."""

    @property
    def exposed(self) -> float:
        """Communication the compute did not hide."""
        return self.end - self.compute


def _charge(end: float, compute: float, comm: float, overlap: float) -> Overlapped:
    """With overlap < 1 the hidden part of the communication still costs its share of compute time."""
    hidden = comm - (end - compute)
    return Overlapped(end + (1 - overlap) * max(0.0, hidden), compute, comm)


DDP_FIRST_BUCKET = 1024**2
"""DDP's first bucket is small (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES) so communication starts early."""
DDP_BUCKET = 25 * 1024**2


def ddp_backward(backward: Sequence[float], grad_bytes: Sequence[float], all_reduce: Callable[[float], float],
                 overlap: float = 1.0, bucket: float = DDP_BUCKET, first: float = DDP_FIRST_BUCKET) -> Overlapped:
    """DDP's backward: gradients fill buckets in reverse layer order; a full bucket is all-reduced while the
    backward goes on, one bucket at a time, in order."""
    clock = comm_free = comm = 0.0
    filled, cap = 0.0, first
    ready: list[tuple[float, float]] = []
    for seconds, size in zip(reversed(backward), reversed(grad_bytes)):
        clock += seconds
        filled += size
        if filled >= cap:
            ready.append((clock, filled))
            filled, cap = 0.0, bucket
    if filled:
        ready.append((clock, filled))
    for at, size in ready:
        took = all_reduce(size)
        comm_free = max(comm_free, at) + took
        comm += took
    return _charge(max(clock, comm_free), clock, comm, overlap)


def fsdp_step(forward: Sequence[float], backward: Sequence[float], unit_bytes: Sequence[float],
              all_gather: Callable[[float], float], reduce_scatter: Callable[[float], float],
              overlap: float = 1.0, sync: bool = True) -> Overlapped:
    """FSDP2 over one unit per layer with parameters: each unit's parameters are all-gathered before its
    forward and again before its backward (they are freed after forward), the next unit's gather issued
    when a unit starts computing (prefetch), and its gradients reduce-scattered after its backward.
    Communication runs in issue order beside compute. With sync=False (inside an accumulation window)
    there is no reduce-scatter."""
    compute_free = comm_free = comm = 0.0
    gathered: dict[tuple[str, int], float] = {}

    def gather(key: tuple[str, int], size: float, issued: float) -> None:
        nonlocal comm_free, comm
        if size and key not in gathered:
            took = all_gather(size)
            comm_free = max(comm_free, issued) + took
            comm += took
            gathered[key] = comm_free

    n = len(forward)
    passes = [("F", i) for i in range(n)] + [("B", i) for i in reversed(range(n))]
    gather(passes[0], unit_bytes[passes[0][1]], 0.0)
    for at, (phase, i) in enumerate(passes):
        begin = max(compute_free, gathered.get((phase, i), 0.0))
        for later in passes[at + 1 :]:  # prefetch the next unit that has parameters
            if unit_bytes[later[1]]:
                gather(later, unit_bytes[later[1]], begin)
                break
        compute_free = begin + (forward[i] if phase == "F" else backward[i])
        if phase == "B" and unit_bytes[i] and sync:
            took = reduce_scatter(unit_bytes[i])
            comm_free = max(comm_free, compute_free) + took
            comm += took
    compute = sum(forward) + sum(backward)
    return _charge(max(compute_free, comm_free), compute, comm, overlap)
