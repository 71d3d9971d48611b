"""A Hugging Face `datasets.IterableDataset` (`load_dataset(..., streaming=True)`) as a paratrain source.

Its shards are the data files (or generator arguments) `dataset.num_shards` counts; shard j is read as
`dataset.shard(num_shards, j)`, which keeps every `.map`, `.filter` and `.shuffle` of the pipeline but
starts at the shard's first example, so it yields the same examples wherever it is read. What HF would
make depend on the layout is taken out:

    HF's own                                     under prepare_loader
    shard order shuffled by .shuffle(seed)       shards sorted by file name, then permuted by (seed, epoch)
    shards split over DataLoader workers / nodes  never: a shard is read whole, by whoever needs its rows
    shuffle buffer (sequential over the stream)   runs within each shard, its generator seeded from
                                                  setup(seed) and the shard's name: the same in every process
    set_epoch reshuffles                          the epoch's order is paratrain's (rows permuted within shards)

`datasets` is never imported here: a dataset of that type can only exist if its module is loaded.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Iterator
from typing import Any

from ..errors import ParatrainError
from .sources import Listed, Source


def is_hf_stream(dataset: Any) -> bool:
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.IterableDataset)


def _chain(ex_iterable: Any) -> Iterator[Any]:
    """The examples iterables of a pipeline, outermost first (a single path; several sources end it)."""
    while ex_iterable is not None:
        yield ex_iterable
        ex_iterable = getattr(ex_iterable, "ex_iterable", None)


def _buffered(ex_iterable: Any) -> bool:
    return any(type(e).__name__ == "BufferShuffledExamplesIterable" for e in _chain(ex_iterable))


def _names(dataset: Any) -> list[str]:
    """A name per shard: its data file where the builder lists files, else its generator argument."""
    n = dataset.num_shards
    base = list(_chain(dataset._ex_iterable))[-1]
    kwargs = getattr(base, "kwargs", None) or {}
    for key in ("original_files", "base_files", "files"):
        value = kwargs.get(key)
        if isinstance(value, list) and len(value) == n:
            return [str(v) for v in value]
    lists = [v for v in kwargs.values() if isinstance(v, list) and len(v) == n]
    if lists:
        return [repr(v) for v in lists[0]]
    return [f"shard {j} of {n}" for j in range(n)]


def source(dataset: Any) -> tuple[Source, bool]:
    """(source, shuffle): shuffled when the pipeline has a `.shuffle()`."""
    if getattr(dataset, "_distributed", None) is not None:
        raise ParatrainError(
            "this Hugging Face dataset was split by split_dataset_by_node, so each rank holds a part of the stream "
            "and paratrain would split it again; pass the dataset from before split_dataset_by_node (paratrain gives "
            "each rank its share of every global batch)"
        )
    formatting = getattr(dataset, "_formatting", None)
    kind = getattr(formatting, "format_type", None)
    if kind not in (None, "python", "torch", "numpy", "np"):
        raise ParatrainError(
            f"this Hugging Face dataset is formatted as {kind!r}, whose batches are tables, not examples; use "
            "with_format('torch'), with_format('numpy') or no format"
        )
    shuffle = _buffered(dataset._ex_iterable)
    return HFSource(dataset, canonical=shuffle), shuffle


class HFSource:
    def __init__(self, dataset: Any, canonical: bool) -> None:
        self.dataset = dataset
        self.count = int(dataset.num_shards)
        names = _names(dataset)
        order = list(range(self.count))
        if canonical and len(set(names)) == self.count:
            order.sort(key=names.__getitem__)  # .shuffle(seed) permuted the file list; undo it
        self.index = order
        """Our shard j is the dataset's shard index[j]."""
        self.names = [names[i] for i in order]
        self.paths: list[str | None] = [n if os.path.isfile(n) else None for n in self.names]

    def length(self, shard: int) -> int | None:
        return None  # only reading knows what a filter keeps

    def read(self, shard: int, seed: int = 0) -> Iterator[Any]:
        part = self.dataset.shard(num_shards=self.count, index=self.index[shard], contiguous=True)
        salt = zlib.crc32(self.names[shard].encode())
        for e in _chain(part._ex_iterable):
            if type(e).__name__ == "BufferShuffledExamplesIterable":
                import numpy as np

                e.generator = np.random.default_rng([seed % 2**63, salt])
            inner: Any = getattr(e, "ex_iterable", None)
            if type(inner).__name__ == "InterleavedShardsExamplesIterable":
                # .shuffle() interleaves up to 10 shards; of one shard that is a no-op, which over parquet waits
                # 5 s in threads' shutdown (datasets' workaround for apache/arrow#45214) each time a shard is read
                e.ex_iterable = inner.ex_iterable
        for batch in part.iter(batch_size=256):
            keys = list(batch)
            for i in range(len(batch[keys[0]]) if keys else 0):
                yield {k: batch[k][i] for k in keys}

    def open(self, shard: int, seed: int = 0) -> Listed:
        return Listed(list(self.read(shard, seed)))
