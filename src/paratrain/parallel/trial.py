"""Trial runs that leave no trace, and their timing.

Profiling layers for a balance and timing micro-batch counts run real forward and backward passes
before the first step. Afterwards the model must be exactly as a single-process run would find it:
the same gradients, BatchNorm statistics and random-number state, or the strategies would no longer
match the reference run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from . import batchnorm, randomness


@contextmanager
def no_trace(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run trials inside; gradients, buffers and RNG state are put back on exit."""
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    for module in modules:
        params.update({id(p): p for p in module.parameters()})
        buffers.update({id(b): b for b in module.buffers()})
    grads = {key: p.grad for key, p in params.items()}
    saved = {key: b.detach().clone() for key, b in buffers.items()}
    devices = sorted({p.device.index for p in params.values() if p.device.type == "cuda"})
    for p in params.values():
        p.grad = None  # trial gradients go to fresh tensors, never into the saved ones
    calls = randomness.snapshot()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            randomness.restore(calls)
            batchnorm.discard()
            with torch.no_grad():
                for key, p in params.items():
                    p.grad = grads[key]
                for key, b in buffers.items():
                    b.copy_(saved[key])


def synchronize(devices: Iterable[torch.device]) -> None:
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)


def step_time(fn: Callable[[], object], repeats: int, warmup: int = 1,
              devices: Iterable[torch.device] = ()) -> float:
    """Fastest wall seconds of `fn` over `repeats` runs after `warmup` untimed ones (CUDA synchronised).

    The fastest, not the median: other processes and the allocator only ever add time, and choices
    (a balance, a micro-batch count) must not follow a noisy run.
    """
    devices = list(devices)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(devices)
        start = time.perf_counter()
        fn()
        synchronize(devices)
        times.append(time.perf_counter() - start)
    return min(times)
