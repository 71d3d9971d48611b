"""Where an epoch's global order comes from: the DataLoader's own sampler, read once at `prepare_loader`.

Every rank must draw the same global order, and a resumed run must draw it again, so the order is a
function of (seed, epoch) only, whatever asked for it:

    shuffle=False / SequentialSampler     0 1 2 ... n-1
    shuffle=True  / RandomSampler         randperm(n) from Generator(seed * 100_003 + epoch)
    DistributedSampler(shuffle, seed)     the permutation torch's sampler draws (randperm from seed + epoch)
                                          before it pads and strides it over ranks
    any other sampler or batch_sampler    its own index stream, drawn with torch's, Python's and NumPy's
                                          RNGs and its `generator` seeded from (seed, epoch), then restored
    a stream (data/indexed.py)            its shards permuted by (seed, epoch), rows within each shard by
                                          (seed, epoch, shard)

Sharding itself (which replica loads what) belongs to paratrain, never to the sampler: a sampler that
shards by rank is refused or, for `DistributedSampler`, replaced.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from ..errors import ParatrainError

SEED_STRIDE = 100_003
"""Epoch e of seed s is drawn from generator seed s * SEED_STRIDE + e (distinct for any e < SEED_STRIDE)."""


@dataclass(frozen=True)
class Epoch:
    """One epoch's global order, and the end positions of its batches when the sampler makes the batches."""

    order: list[Any]
    ends: list[int] | None = None


@dataclass(frozen=True)
class Order:
    """How a loader's epochs are drawn, and what a checkpoint must match to continue one."""

    name: str
    """What asked for the order ("sequential", "shuffle", "DistributedSampler", a sampler's class name)."""
    seed: int
    seed_option: str
    """The option that sets `seed`, for error messages ("setup(seed=...)" or "DistributedSampler(seed=...)")."""
    shuffle: bool
    drop_last: bool
    """The sampler asked to drop the short last batch (DistributedSampler(drop_last=True))."""
    draw: Callable[[int], Epoch]
    drawn: bool = False
    """The order is a user sampler's stream: it is checked to be the same on every rank."""


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + epoch)
    return torch.randperm(n, generator=generator).tolist()


def read_order(loader: DataLoader, seed: int, replicas: int) -> Order:
    """The order `loader` asks for, or a ParatrainError naming what to change."""
    from .indexed import StreamOrder  # here: indexed draws with this module's SEED_STRIDE

    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):  # ShardedLoader has made every stream it can order indexable
        raise ParatrainError(
            f"prepare_loader cannot order or shard an IterableDataset ({type(dataset).__name__}): its stream "
            "has no index to split by rank, so results would depend on the number of workers; use a map-style "
            "Dataset (with __getitem__ and __len__), one of the streams docs/usage.md \"Streamed data\" lists, or "
            "shard the stream yourself and pass the plain DataLoader to the loop (not to prepare_loader)"
        )
    if isinstance(loader.sampler, StreamOrder) and loader.batch_size is not None:
        stream = loader.sampler
        return Order("stream", seed, "setup(seed=...)", stream.shuffle, False,
                     lambda epoch: Epoch(stream.draw(seed, epoch)))
    n = len(dataset)  # type: ignore[arg-type]
    if loader.batch_size is None and loader.batch_sampler is None:
        raise ParatrainError(
            "prepare_loader needs batches, but this DataLoader was built with batch_size=None (one sample per "
            "item); give it a batch_size (per worker) or a batch_sampler"
        )
    if loader.batch_size is None:
        sampler: Any = loader.batch_sampler
        _refuse_sharding(sampler, "batch_sampler")
        _note_generator(sampler, loader)
        return Order(f"batch_sampler:{type(sampler).__name__}", seed, "setup(seed=...)", True, False,
                     lambda epoch: _batches(sampler, seed, epoch), drawn=True)
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        return Order("sequential", seed, "setup(seed=...)", False, False,
                     lambda e: Epoch(epoch_order(n, seed, e, False)))
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == n:
        _note_generator(sampler, loader)
        return Order("shuffle", seed, "setup(seed=...)", True, False, lambda e: Epoch(epoch_order(n, seed, e, True)))
    if type(sampler) is DistributedSampler:
        return _distributed(sampler, n, replicas, loader.batch_size)
    _refuse_sharding(sampler, "sampler")
    _note_generator(sampler, loader)
    return Order(type(sampler).__name__, seed, "setup(seed=...)", True, False,
                 lambda epoch: Epoch(_draw(sampler, seed, epoch)), drawn=True)


def _distributed(sampler: DistributedSampler, n: int, replicas: int, batch_size: int) -> Order:
    """torch's own order for this sampler; its num_replicas must be the run's replicas, its rank is replaced."""
    if len(sampler.dataset) != n:  # type: ignore[arg-type]
        raise ParatrainError(
            f"the DistributedSampler was built on a dataset of {len(sampler.dataset)} samples but the DataLoader's "  # type: ignore[arg-type]
            f"has {n}; build both on the same dataset"
        )
    if sampler.num_replicas != replicas:
        k = sampler.num_replicas
        raise ParatrainError(
            f"DistributedSampler(num_replicas={k}) but this run has {replicas} data-parallel replica(s): the global "
            f"batch would be {batch_size} x {replicas} = {batch_size * replicas}, not the {batch_size} x {k} = "
            f"{batch_size * k} the sampler implies; build it with num_replicas={replicas}, rank=run.rank % "
            f"{replicas} (paratrain replaces the rank with its own replica index), or use DataLoader(shuffle=True)"
        )
    _note_once(
        "paratrain shards the DistributedSampler's order itself: each global batch is split over the "
        f"{replicas} replica(s) in contiguous shares, with no padding duplicates (a short last batch is split "
        "unevenly and each rank's loss is weighted by its rows); its shuffle, seed and drop_last are kept"
    )
    seed, shuffle = int(sampler.seed), bool(sampler.shuffle)

    def draw(epoch: int) -> Epoch:
        if not shuffle:
            return Epoch(list(range(n)))
        return Epoch(torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist())

    return Order("DistributedSampler", seed, "DistributedSampler(seed=...)", shuffle, bool(sampler.drop_last), draw)


def _refuse_sharding(sampler: Any, option: str) -> None:
    """A sampler that picks a rank's share itself would be sharded twice."""
    inner = getattr(sampler, "sampler", None)
    for s in (sampler, inner):
        if isinstance(s, DistributedSampler):
            raise ParatrainError(
                f"the DataLoader's {option} {type(sampler).__name__} shards by rank itself "
                f"({type(s).__name__}); paratrain would shard its share again. Pass a {option} that orders the "
                "whole dataset (paratrain splits each global batch over the replicas), or torch's own "
                "DistributedSampler as sampler="
            )


def _draw(sampler: Any, seed: int, epoch: int) -> list[Any]:
    with _seeded(sampler, seed * SEED_STRIDE + epoch, epoch):
        return [_index(i) for i in sampler]


def _batches(batch_sampler: Any, seed: int, epoch: int) -> Epoch:
    with _seeded(batch_sampler, seed * SEED_STRIDE + epoch, epoch):
        batches = [[_index(i) for i in b] for b in batch_sampler]
    order, ends = [], []
    for b in batches:
        order += b
        ends.append(len(order))
    return Epoch(order, ends)


def _index(i: Any) -> Any:
    """A plain value for a 0-d tensor index (SubsetRandomSampler over a tensor yields those)."""
    return i.item() if isinstance(i, torch.Tensor) else i


@contextlib.contextmanager
def _seeded(sampler: Any, seed: int, epoch: int) -> Iterator[None]:
    """Every RNG a sampler may draw from seeded with `seed`, and put back as it was afterwards."""
    parts: list[Any] = [s for s in (sampler, getattr(sampler, "sampler", None)) if s is not None]
    owners = [s for s in parts if isinstance(getattr(s, "generator", None), torch.Generator)]
    saved = [s.generator for s in owners]
    py_state = random.getstate()
    np = numpy_or_none()
    np_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        if np is not None:
            np.random.seed(seed % 2**32)
        for s in owners:
            s.generator = torch.Generator().manual_seed(seed)
        for s in parts:
            if callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)
        try:
            yield
        finally:
            for s, g in zip(owners, saved):
                s.generator = g
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_state)


def numpy_or_none() -> Any:
    """NumPy where it is installed: its global generator is part of what a sampler may draw from."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _note_generator(sampler: Any, loader: DataLoader) -> None:
    if loader.generator is not None or any(
        isinstance(getattr(s, "generator", None), torch.Generator) for s in (sampler, getattr(sampler, "sampler", None))
    ):
        _note_once(
            "the DataLoader's or sampler's generator= does not choose the order under paratrain: every rank must "
            "draw the same order, so it is drawn from a generator seeded by setup(seed=...) and the epoch instead "
            "(sampler generators are swapped for the draw and put back)"
        )


_SAID: set[str] = set()


def _note_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, stacklevel=6)  # the line calling prepare_loader
