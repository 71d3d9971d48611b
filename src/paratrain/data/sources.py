"""What a stream is made of, whatever the user handed over: a list of named shards, each readable from its
start, with a number of samples.

    Source          shards (names, files)   length(j)            read(j, seed)             open(j, seed)
    FileSource      the user's files        metadata or a scan   the format's reader       by position
    ProtocolSource  dataset.shards          dataset.shard_length dataset.read_shard(shard) the shard held in memory
    HFSource        the HF dataset's files  counted by reading   HF's pipeline, one shard  the shard held in memory
    PackedSource    the inner source's      counted by reading   documents packed          the shard held in memory

A shard is always read from its beginning, by itself, so what it yields depends only on the shard (and the
seed, for a shuffle buffer inside it), never on which rank, worker or epoch reads it: that is what makes
the global order built on top (data/indexed.py) the same under any world size.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch.utils.data import IterableDataset

from ..errors import ParatrainError
from .formats import Format, Rows, transformed


class Source(Protocol):
    @property
    def names(self) -> list[str]:
        """One per shard, unique: what error messages and checkpoints name."""
        ...

    @property
    def paths(self) -> list[str | None]:
        """The shard's file, where it is one (checked for size between epochs), else None."""
        ...

    def length(self, shard: int) -> int | None:
        """Samples in the shard when known without reading it (metadata, a scan), else None."""
        ...

    def read(self, shard: int, seed: int) -> Iterator[Any]:
        """The shard's samples from its beginning, in its own order."""
        ...

    def open(self, shard: int, seed: int) -> Rows:
        """The shard's samples by position."""
        ...


class Listed:
    """A shard read once through and held in memory: positions for sources that can only be read in order."""

    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def take(self, positions: Sequence[int]) -> list[Any]:
        return [self.samples[p] for p in positions]


@dataclass
class FileSource:
    """Shard files in one format (formats.py), with an optional per-sample transform."""

    format: Format
    files: list[str]
    transform: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if not self.files:
            raise ParatrainError(f"paratrain.data.{self.format.name}: no shard files given; pass a list of paths")
        self.files = [os.fspath(f) for f in self.files]
        if len(set(self.files)) != len(self.files):
            twice = sorted({f for f in self.files if self.files.count(f) > 1})
            raise ParatrainError(f"shard files listed more than once: {twice}; list each file once")
        missing = [f for f in self.files if not os.path.isfile(f)]
        if missing:
            raise ParatrainError(f"shard file(s) not found: {missing[:3]}; pass existing {self.format.name} files")

    @property
    def names(self) -> list[str]:
        return list(self.files)

    @property
    def paths(self) -> list[str | None]:
        return list(self.files)

    def length(self, shard: int) -> int | None:
        return self.format.count(self.files[shard])

    def read(self, shard: int, seed: int = 0) -> Iterator[Any]:
        rows = self.format.read(self.files[shard])
        return rows if self.transform is None else map(self.transform, rows)

    def open(self, shard: int, seed: int = 0) -> Rows:
        return transformed(self.format.open(self.files[shard]), self.transform)


class ProtocolSource:
    """A torch IterableDataset that names its shards and reads one (docs/usage.md, "Streamed data")."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.shards = list(dataset.shards)
        if not self.shards:
            raise ParatrainError(f"{type(dataset).__name__}.shards is empty; list the shards of the stream")
        self.names = [os.fspath(s) if isinstance(s, str | os.PathLike) else repr(s) for s in self.shards]
        if len(set(self.names)) != len(self.names):
            raise ParatrainError(f"{type(dataset).__name__}.shards names a shard twice; list each shard once")
        self.paths: list[str | None] = [n if os.path.isfile(n) else None for n in self.names]

    def length(self, shard: int) -> int | None:
        counter = getattr(self.dataset, "shard_length", None)
        return None if counter is None else int(counter(self.shards[shard]))

    def read(self, shard: int, seed: int = 0) -> Iterator[Any]:
        return iter(self.dataset.read_shard(self.shards[shard]))

    def open(self, shard: int, seed: int = 0) -> Rows:
        return Listed(list(self.read(shard, seed)))


def resolve(dataset: Any) -> tuple[Source, bool] | None:
    """(source, shuffle) for a stream paratrain can order, None for a map-style dataset; a ParatrainError
    naming the three ways to make a stream orderable for any other IterableDataset."""
    from . import hf
    from .stream import Stream

    if isinstance(dataset, Stream):
        return dataset.source, dataset.shuffle
    if hf.is_hf_stream(dataset):
        return hf.source(dataset)
    if not isinstance(dataset, IterableDataset):
        return None
    name = type(dataset).__name__
    has = {"shards": getattr(dataset, "shards", None) is not None,
           "read_shard": callable(getattr(dataset, "read_shard", None))}
    if has["shards"] and not has["read_shard"]:
        raise ParatrainError(
            f"{name} lists its shards but has no read_shard(shard) method: paratrain reads each shard itself, "
            "from its start, to put its samples in the global order; add read_shard(shard) yielding the shard's "
            "samples (and shard_length(shard) if its metadata knows the count)"
        )
    if not has["shards"]:
        raise ParatrainError(
            f"prepare_loader cannot order or shard the IterableDataset {name}: a stream without a shard list has no "
            "index to split by rank, so results would depend on the number of workers; use a map-style Dataset "
            "(with __getitem__ and __len__), paratrain.data.jsonl/parquet/arrow/webdataset(files) for shard files, a "
            "Hugging Face "
            "datasets.IterableDataset (load_dataset(..., streaming=True)), or give the dataset `shards` (a list) "
            "and `read_shard(shard)` (and `shard_length(shard)` where metadata knows it) — docs/usage.md, "
            "\"Streamed data\". Or shard the stream yourself and pass the plain DataLoader to the loop (not to "
            "prepare_loader)"
        )
    return ProtocolSource(dataset), bool(getattr(dataset, "shuffle", False))
