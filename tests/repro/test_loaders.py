"""Finding 7: what a tutorial-style DataLoader asks for (its sampler) is honoured or refused, never
dropped (tier 2: one process, strategy "single")."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

import paratrain

from .expect import check_refusal
from .loop import FAST

ROWS = 20


def _epochs(sampler: Sampler[int] | DistributedSampler[int], epochs: int = 2) -> list[list[int]]:
    """The sample order of each epoch as the prepared loader yields it, calling the tutorials'
    `loader.sampler.set_epoch(epoch)` where the sampler has it; or the refusal's check."""
    run = paratrain.setup(strategy="single", seed=0, **FAST)
    try:
        loader = run.prepare_loader(DataLoader(TensorDataset(torch.arange(ROWS)), batch_size=4, sampler=sampler))
        orders = []
        for epoch in range(epochs):
            if isinstance(sampler, DistributedSampler):
                loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            orders.append([i for (batch,) in loader for i in batch.tolist()])
        return orders
    finally:
        run.close()


def test_distributed_sampler_is_honoured_or_refused() -> None:
    """Finding 7 (fixed; was: prepare_loader drops a DistributedSampler and its shuffling silently, and
    loader.sampler.set_epoch raises AttributeError)."""
    data = TensorDataset(torch.arange(ROWS))
    sampler: DistributedSampler[int] = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    try:
        first, second = _epochs(sampler)
    except paratrain.ParatrainError as exc:
        check_refusal(exc, ["DistributedSampler"])
        return
    assert sorted(first) == sorted(second) == list(range(ROWS)), "each epoch sees every sample once"
    assert first != list(range(ROWS)), "shuffle=True was ignored"
    assert first != second, "set_epoch did not reshuffle"


class Reversed(Sampler[int]):
    """A custom order (e.g. curriculum): the last sample first."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(ROWS - 1, -1, -1))

    def __len__(self) -> int:
        return ROWS


def test_custom_sampler_is_honoured_or_refused() -> None:
    """Finding 7 (fixed; was: prepare_loader drops a custom sampler silently and serves the samples in dataset
    order)."""
    try:
        orders = _epochs(Reversed())
    except paratrain.ParatrainError as exc:
        check_refusal(exc, ["sampler"])
        return
    assert orders == [list(range(ROWS - 1, -1, -1))] * 2
