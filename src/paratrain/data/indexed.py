"""A stream made indexable, so the map-style machinery (order, plan, loader) orders and shards it unchanged.

Sample ids number the shards' rows one after another (shard j's row r is `offsets[j] + r`). An epoch's
global order is a function of (seed, epoch) and the shard list only:

    shards   0 1 2 3            permuted by Generator(seed * 100_003 + epoch)       -> 2 0 3 1
    rows     of each shard      permuted by Generator(blake2b(seed, epoch, shard))   -> 2.4 2.0 2.3 ... 0.1 ...
    order    the permuted shards' permuted rows, one after another (unshuffled: 0.0 0.1 ... 1.0 ...)

and the plan (data/plan.py) cuts it into global batches, each replica taking its contiguous share of every
one, as for map-style data. Each loading process (the main one, or each DataLoader worker) opens the shards
its batches touch and reads only its rows by position (data/formats.py); sources that can only be read in
order are read once through and held, one or two shards at a time. A checkpoint's position is a count of
samples, so resuming on any world size skips nothing by reading: the order is drawn and the plan starts
at the position.

The shard list is fingerprinted (name, bytes, samples): a file that disappears or changes size before an
epoch or while being opened, and a checkpoint saved over other shards, are refused naming the file.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import ParatrainError
from .formats import Rows
from .order import SEED_STRIDE
from .sources import Source, resolve

OPEN_SHARDS = 3
"""Shards each loading process keeps open: a global batch can straddle two, and a third spares reopening
one when consecutive batches alternate between them."""


@dataclass(frozen=True)
class Shard:
    name: str
    path: str | None
    size: int
    """Bytes of its file, -1 when it is no file."""
    rows: int

    def entry(self) -> list[Any]:
        return [self.name, self.size, self.rows]


def _size(path: str | None) -> int:
    return -1 if path is None else os.stat(path).st_size


def describe(source: Source, seed: int, device: torch.device | None) -> list[Shard]:
    """Every shard with its sample count: from metadata where the source has one, else by reading the shard
    once, those reads split over the ranks (one all-reduce) when a process group is up."""
    from .. import collectives

    n = len(source.names)
    counts = [source.length(j) for j in range(n)]
    unknown = [j for j, c in enumerate(counts) if c is None]
    if unknown:
        rank, world = 0, 1
        if device is not None and collectives.active():
            import torch.distributed as dist

            rank, world = dist.get_rank(), dist.get_world_size()
        found = torch.full((n,), -1, dtype=torch.int64)
        for j in unknown[rank::world]:
            found[j] = sum(1 for _ in source.read(j, seed))
        if world > 1:
            found = collectives.all_reduce(found, op="max", device=device).cpu()
        for j in unknown:
            counts[j] = int(found[j])
    return [Shard(source.names[j], source.paths[j], _size(source.paths[j]), int(counts[j])) for j in range(n)]  # type: ignore[arg-type]


class StreamView(Dataset):
    """The stream as a map-style dataset of `sum(rows)` samples, read by position."""

    def __init__(self, source: Source, shards: list[Shard], seed: int) -> None:
        self.source, self.shards, self.seed = source, shards, seed
        self.offsets = [0]
        for s in shards:
            self.offsets.append(self.offsets[-1] + s.rows)
        self._open: OrderedDict[int, Rows] = OrderedDict()

    def __len__(self) -> int:
        return self.offsets[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, row) of sample id `i`."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is outside a stream of {len(self)}")
        j = bisect.bisect_right(self.offsets, i) - 1
        return j, i - self.offsets[j]

    def __getitem__(self, i: int) -> Any:
        j, row = self.locate(int(i))
        return self._rows(j).take([row])[0]

    def __getitems__(self, ids: Sequence[int]) -> list[Any]:
        """A batch: each shard it touches opened once and asked for its rows together."""
        wanted: dict[int, list[tuple[int, int]]] = {}
        for k, i in enumerate(ids):
            j, row = self.locate(int(i))
            wanted.setdefault(j, []).append((k, row))
        out: list[Any] = [None] * len(ids)
        for j, items in wanted.items():
            for (k, _), sample in zip(items, self._rows(j).take([row for _, row in items])):
                out[k] = sample
        return out

    def _rows(self, j: int) -> Rows:
        rows = self._open.get(j)
        if rows is not None:
            self._open.move_to_end(j)
            return rows
        shard = self.shards[j]
        check_file(shard, "while reading it")
        rows = self.source.open(j, self.seed)
        if len(rows) != shard.rows:
            raise ParatrainError(
                f"shard {shard.name} now holds {len(rows)} samples but held {shard.rows} when the loader was "
                "prepared: it changed during the run, or reading it is not deterministic (a map or filter that draws "
                "random numbers, a shard_length that disagrees with read_shard); keep shards unchanged while a run "
                "reads them and make reading one a function of the shard alone"
            )
        self._open[j] = rows
        if len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)
        return rows

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()  # open files stay with the process that opened them
        return state


def check_file(shard: Shard, when: str) -> None:
    if shard.path is None:
        return
    try:
        size = os.stat(shard.path).st_size
    except FileNotFoundError:
        raise ParatrainError(
            f"shard file {shard.path} disappeared {when}; restore it (a run's shards must stay in place until it "
            "ends), or start a new run over the remaining files without loading this run's loader state"
        ) from None
    if size != shard.size:
        raise ParatrainError(
            f"shard file {shard.path} is {size} bytes {when} but was {shard.size} when the loader was prepared "
            "(truncated or rewritten); restore it, or start a new run over the changed files without loading this "
            "run's loader state"
        )


def _mix(*values: int) -> int:
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class StreamOrder(Sampler[int]):
    """The epoch order described above, drawn by the ShardedLoader (data/order.py) for (seed, epoch)."""

    def __init__(self, view: StreamView, shuffle: bool) -> None:
        self.view, self.shuffle = view, shuffle

    def draw(self, seed: int, epoch: int) -> list[int]:
        for shard in self.view.shards:
            check_file(shard, f"before epoch {epoch}")
        offsets, shards = self.view.offsets, self.view.shards
        if not self.shuffle:
            return list(range(len(self.view)))
        order: list[int] = []
        perm = torch.randperm(len(shards), generator=torch.Generator().manual_seed(seed * SEED_STRIDE + epoch))
        for j in perm.tolist():
            rows = torch.randperm(shards[j].rows, generator=torch.Generator().manual_seed(_mix(seed, epoch, j)))
            order.extend((rows + offsets[j]).tolist())
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self.draw(self.view.seed, 0))

    def __len__(self) -> int:
        return len(self.view)


def prepare(loader: DataLoader, seed: int, device: torch.device | None) -> tuple[DataLoader, StreamView] | None:
    """The user's DataLoader over a stream, rebuilt over its StreamView with every loading option kept, and
    the view; None for a map-style dataset (a stream paratrain cannot order is refused by `resolve`)."""
    found = resolve(loader.dataset)
    if found is None:
        return None
    source, shuffle = found
    view = StreamView(source, describe(source, seed, device), seed)
    extra = {k: getattr(loader, k) for k in ("pin_memory_device", "in_order") if hasattr(loader, k)}
    return DataLoader(
        view, batch_size=loader.batch_size, sampler=StreamOrder(view, shuffle), drop_last=loader.drop_last,
        collate_fn=loader.collate_fn, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        persistent_workers=loader.persistent_workers, **extra,
    ), view


def fingerprint(view: StreamView) -> list[list[Any]]:
    return [s.entry() for s in view.shards]


def check_same_shards(view: StreamView, device: torch.device) -> None:
    """Every rank must list the same shards with the same counts (a glob unsorted on one machine, a file
    copied to some nodes only): one all-reduce of a digest at prepare_loader."""
    from .. import collectives

    if not collectives.active():
        return
    digest = int.from_bytes(hashlib.blake2b(repr(fingerprint(view)).encode(), digest_size=7).digest(), "big")
    both = collectives.all_reduce(torch.tensor([digest, -digest], dtype=torch.int64), op="max", device=device)
    if int(both[0]) != -int(both[1]):
        raise ParatrainError(
            f"the ranks list different shards or counts for this stream (this rank: {len(view.shards)} shards, "
            f"{len(view)} samples, first {view.shards[0].name}); give every rank the same files in the same order "
            "(sort a glob) on a file system every node sees"
        )


def check_resume(view: StreamView, saved: list[list[Any]] | None) -> None:
    """Refuse a checkpoint whose loader read other shards, naming the first that differs."""
    if saved is None:
        return
    now = {s.name: s for s in view.shards}
    before = {str(e[0]): e for e in saved}
    fix = ("resume with the shards the saving run read, or start a new run over these without loading the loader's "
           "state (its position counts samples of the saving run's shards)")
    for name in before:
        if name not in now:
            raise ParatrainError(f"the checkpoint's loader read shard {name}, which this loader lacks; {fix}")
    for name in now:
        if name not in before:
            raise ParatrainError(f"shard {name} is new: the checkpoint's loader did not read it; {fix}")
    for s in view.shards:
        _, size, rows = before[s.name]
        if (int(size), int(rows)) != (s.size, s.rows):
            raise ParatrainError(
                f"shard {s.name} had {rows} samples ({size} bytes) when the checkpoint was saved and has {s.rows} "
                f"({s.size} bytes) now; {fix}"
            )
    if [str(e[0]) for e in saved] != [s.name for s in view.shards]:
        raise ParatrainError(f"the checkpoint's loader listed the same shards in another order; {fix}")
