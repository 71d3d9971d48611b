"""Shard files a user already has, as a stream `prepare_loader` can order: one function per format.

    loader = run.prepare_loader(DataLoader(paratrain.data.jsonl("data/*.jsonl", shuffle=True),
                                           batch_size=run.per_worker_batch(256), num_workers=2))

A `Stream` is a torch IterableDataset, so the same object also works without paratrain: a plain
DataLoader reads its shards in order, each DataLoader worker taking every W-th shard (torch's usual
recipe, and the baseline benchmarks/stream_throughput.py measures against). Under `prepare_loader` it is
read by position instead (data/indexed.py), in paratrain's global order.

`shuffle` belongs to the stream because torch refuses `DataLoader(iterable, shuffle=True)`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from ..errors import ParatrainError
from .formats import Arrow, Jsonl, Parquet, WebDataset
from .sources import FileSource, Source

Files = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


class Stream(IterableDataset):
    """A sharded stream: `source` names the shards and reads them; `shuffle` asks for the shuffled order."""

    def __init__(self, source: Source, shuffle: bool = False) -> None:
        self.source = source
        self.shuffle = shuffle

    @property
    def shards(self) -> list[str]:
        return list(self.source.names)

    def __iter__(self) -> Iterator[Any]:
        shards = range(len(self.source.names))
        info = get_worker_info()
        if info is not None:
            shards = shards[info.id :: info.num_workers]
        for j in shards:
            yield from self.source.read(j, 0)

    def __repr__(self) -> str:
        return f"Stream({len(self.source.names)} shards, shuffle={self.shuffle})"


def files_of(files: Files) -> list[str]:
    """A list of paths, or one path or glob pattern (expanded and sorted)."""
    if isinstance(files, str | os.PathLike):
        text = os.fspath(files)
        found = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
        if not found:
            raise ParatrainError(f"no shard files match {text!r}; check the pattern")
        return found
    return [os.fspath(f) for f in files]


def jsonl(files: Files, *, shuffle: bool = False, transform: Callable[[Any], Any] | None = None) -> Stream:
    """JSON lines shards: each non-blank line one sample (a dict), passed through `transform` if given."""
    return Stream(FileSource(Jsonl(), files_of(files), transform), shuffle)


def parquet(files: Files, *, columns: Sequence[str] | None = None, shuffle: bool = False,
            transform: Callable[[Any], Any] | None = None) -> Stream:
    """Parquet shards: each row one sample (a dict of `columns`, all by default)."""
    return Stream(FileSource(Parquet(tuple(columns) if columns else None), files_of(files), transform), shuffle)


def arrow(files: Files, *, shuffle: bool = False, transform: Callable[[Any], Any] | None = None) -> Stream:
    """Arrow IPC shards (file or stream format, e.g. the .arrow files `datasets` writes), memory-mapped."""
    return Stream(FileSource(Arrow(), files_of(files), transform), shuffle)


def webdataset(files: Files, *, shuffle: bool = False, decode: bool = True,
               transform: Callable[[Any], Any] | None = None) -> Stream:
    """WebDataset tar shards: the files sharing a key are one sample {"__key__": key, ext: value}; with
    `decode` .json, .txt and .cls fields are decoded, the others stay bytes (decode images in `transform`)."""
    return Stream(FileSource(WebDataset(decode), files_of(files), transform), shuffle)
