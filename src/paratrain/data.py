"""Sharded, resumable data loading.

The global order of samples is a function of (seed, epoch) alone; each global batch of
`batch_size * replicas` samples is cut into one contiguous share per replica. So a script run with
1, 2 or 3 workers at the same global batch trains on the same batches, and a checkpoint only needs
the epoch and how many samples of it were consumed to resume exactly, even on a different world size:

    epoch order  : p0 p1 p2 p3 p4 p5 p6 p7 p8 p9 ...
    global batch : [p0 p1 p2 p3][p4 p5 p6 p7] ...      (batch_size 2 per worker, 2 workers)
    rank 0 / 1   :  p0 p1|p2 p3  p4 p5|p6 p7
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from .errors import ParatrainError


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


def split_evenly(items: list[int], parts: int) -> list[list[int]]:
    """Contiguous shares whose sizes differ by at most one, larger ones first."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out


def train_batches(
    order: list[int], consumed: int, batch_size: int, replica: int, replicas: int, drop_last: bool
) -> Iterator[tuple[list[int], int]]:
    """This replica's batches from position `consumed` on, each with the position after it."""
    global_batch = batch_size * replicas
    pos = consumed
    while pos < len(order):
        chunk = order[pos : pos + global_batch]
        end = pos + len(chunk)
        if len(chunk) < global_batch:
            if drop_last:
                return
            if len(chunk) < replicas:
                warnings.warn(
                    f"dropping the last {len(chunk)} sample(s) of the epoch: fewer than the {replicas} "
                    "replicas, so not every replica would get one",
                    stacklevel=2,
                )
                return
            yield split_evenly(chunk, replicas)[replica], end
        else:
            yield chunk[replica * batch_size : (replica + 1) * batch_size], end
        pos = end


class ShardedLoader:
    """A DataLoader's dataset, batch size and collation, sharded over replicas; `state_dict` is its position.

    Iterating runs the rest of the current epoch; when an epoch is finished the next iteration starts the
    next epoch (so `set_epoch` happens without the user calling it).
    """

    def __init__(self, loader: DataLoader, replica: int, replicas: int, seed: int, evaluation: bool = False) -> None:
        if loader.batch_size is None:
            raise ParatrainError("prepare_loader needs a DataLoader built with batch_size (not a batch_sampler)")
        n = len(loader.dataset)  # type: ignore[arg-type]
        if n < replicas:
            raise ParatrainError(
                f"the dataset has {n} samples but {replicas} data-parallel workers need at least one each; "
                f"use at most {n} workers or a larger dataset"
            )
        self.loader = loader
        self.replica, self.replicas = replica, replicas
        self.batch_size: int = loader.batch_size
        self.seed = seed
        self.shuffle = isinstance(loader.sampler, RandomSampler)
        self.drop_last = loader.drop_last
        self.evaluation = evaluation
        self.epoch = 0
        self.consumed = 0
        """Samples of the current epoch (global count, all replicas) already handed out."""
        self.timing: Any = None
        """A run's step breakdown (observe.Breakdown) that times the wait for each batch while profiling."""

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.replicas

    def __len__(self) -> int:
        n = len(self.loader.dataset)  # type: ignore[arg-type]
        if self.evaluation:
            share = len(split_evenly(list(range(n)), self.replicas)[self.replica])
            return -(-share // self.batch_size)
        full, tail = divmod(n, self.global_batch)
        return full + (1 if tail >= self.replicas and not self.drop_last else 0)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def _batches(self) -> Iterator[tuple[list[int], int]]:
        n = len(self.loader.dataset)  # type: ignore[arg-type]
        order = epoch_order(n, self.seed, self.epoch, self.shuffle and not self.evaluation)
        if self.evaluation:
            share = split_evenly(order, self.replicas)[self.replica]
            for i in range(0, len(share), self.batch_size):
                yield share[i : i + self.batch_size], n
            return
        yield from train_batches(order, self.consumed, self.batch_size, self.replica, self.replicas, self.drop_last)

    def __iter__(self) -> Iterator[Any]:
        plan = list(self._batches())
        if not plan:
            self._finish_epoch()
            return
        src = self.loader
        generator = torch.Generator().manual_seed(self.seed * 1009 + self.replica * 7919 + self.epoch)
        loader = DataLoader(
            src.dataset,
            batch_sampler=[indices for indices, _ in plan],
            num_workers=src.num_workers,
            collate_fn=src.collate_fn,
            pin_memory=src.pin_memory,
            timeout=src.timeout,
            worker_init_fn=src.worker_init_fn,
            multiprocessing_context=src.multiprocessing_context,
            generator=generator,
            prefetch_factor=src.prefetch_factor if src.num_workers > 0 else None,
        )
        batches = loader if self.timing is None else self.timing.batches(loader)
        for batch, (_, end) in zip(batches, plan):
            if not self.evaluation:
                self.consumed = end
            yield batch
        self._finish_epoch()

    def _finish_epoch(self) -> None:
        if not self.evaluation:
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The position: epoch and samples of it consumed, as global counts (valid for any world size)."""
        n = len(self.loader.dataset)  # type: ignore[arg-type]
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "size": n,
                "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position. The world size and per-worker batch may differ from the saving
        run: the not yet consumed samples of the epoch are re-divided among this run's replicas."""
        if state.get("seed", self.seed) != self.seed:
            raise ParatrainError(
                f"checkpoint's data order was made with seed {state['seed']} but this run uses seed "
                f"{self.seed}; resume with setup(seed={state['seed']}) to continue the same order"
            )
        n = len(self.loader.dataset)  # type: ignore[arg-type]
        if state.get("size", n) != n:
            raise ParatrainError(
                f"checkpoint's data position is for a dataset of {state['size']} samples but this one has {n}; "
                "resume with the same dataset (a different one cannot continue the same epoch order)"
            )
        if state.get("shuffle", int(self.shuffle)) != int(self.shuffle):
            raise ParatrainError(
                f"checkpoint's data order was made with shuffle={bool(state['shuffle'])} but this loader has "
                f"shuffle={self.shuffle}; build the DataLoader as the saving run did"
            )
        consumed = int(state["consumed"])
        if not 0 <= consumed <= n:
            raise ParatrainError(f"checkpoint's data position {consumed} is outside a dataset of {n} samples")
        self.epoch, self.consumed = int(state["epoch"]), consumed
