"""The prepared loader: the user's DataLoader, iterated as this replica's share of each global batch.

The batches are read by one inner DataLoader that keeps every loading option of the user's (workers,
collate_fn, pinned memory, persistent workers, prefetching, timeout, worker_init_fn, in_order); only
which indices form a batch is paratrain's. The loader's position (epoch, samples consumed) is global,
so a checkpoint resumes on any world size. A stream (a sharded IterableDataset) is first made indexable
(data/indexed.py) and then takes the same path.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..errors import ParatrainError
from ..parallel import randomness, step_state
from . import indexed
from .order import Epoch, numpy_or_none, read_order
from .plan import ONE, Batch, Layout, Weight, batch_ends, check_epoch, evaluation_batches, replica_batches


class StepShares(Protocol):
    """Replica groups (faults/replica_groups): who takes which rows is decided per step, by who is alive."""

    def begin(self) -> tuple[int, int]:
        """This step's quorum, begun once per step: this worker's share of the global batch as (share, shares)."""
        ...


class ShardedLoader:
    """A DataLoader sharded over data-parallel replicas; `state_dict` is its position.

    Iterating runs the rest of the current epoch; when an epoch is finished the next iteration starts the
    next epoch (so `set_epoch` happens without the user calling it; calling it works too).
    """

    def __init__(self, loader: DataLoader, replica: int, replicas: int, seed: int, evaluation: bool = False, *,
                 grad_accum: int = 1, equal_shares: bool = False, device: torch.device | None = None) -> None:
        streamed = indexed.prepare(loader, seed, device)  # a stream, made indexable; None for map-style data
        self.view: indexed.StreamView | None = None
        """The stream's StreamView, whose shard list a checkpoint records."""
        if streamed is not None:
            loader, self.view = streamed
        self.loader = loader
        self.order = read_order(loader, seed, replicas)
        self.layout = Layout(replica, replicas, 1 if evaluation else grad_accum, equal_shares)
        self.replica, self.replicas = replica, replicas
        self.batch_size: int | None = loader.batch_size
        """Per worker (None when a batch_sampler makes the global batches)."""
        self.seed = self.order.seed
        self.shuffle = self.order.shuffle
        self.drop_last = bool(loader.drop_last or self.order.drop_last)
        self.evaluation = evaluation
        self.epoch = 0
        self.consumed = 0
        """Samples of the current epoch's order (global count, all replicas) already handed out."""
        self.timing: Any = None
        """A run's step breakdown (observe.Breakdown) that times the wait for each batch while profiling."""
        self.step_state: Any = None
        """The run's micro-step state (parallel.step_state) its batches set the rows of; None: the active run's."""
        self.sampler = EpochSampler(self)
        """What tutorials call `loader.sampler`: `set_epoch` moves this loader's order."""
        self._drawn: tuple[int, Epoch] | None = None
        self._inner: DataLoader | None = None
        self._batches = _Batches()
        self._followed = self._sampler_epoch()
        self._stamp, self._weight, self._unclaimed, self._ahead = 0, ONE, 0, False
        self.replica_steps: StepShares | None = None
        """Set for replica groups: each step's shares come from it, and the position moves on `step_done(True)`."""
        self._pending_end: int | None = None
        if self.view is not None and device is not None:
            indexed.check_same_shards(self.view, device)
        first = self._draw()
        if self.order.drawn and device is not None:  # first: a refusal below must not leave other ranks waiting
            _check_same_on_every_rank(first, self.order.name, device)
        if len(first.order) < replicas:
            raise ParatrainError(
                f"the dataset has {len(first.order)} samples but {replicas} data-parallel workers need at least one "
                f"each; use at most {len(first.order)} workers or a larger dataset"
            )
        self._plan()  # refuses, now, an epoch that cannot be shared exactly
        if self.order.drawn and self.order.draw(0) != first:
            raise ParatrainError(
                f"the sampler {self.order.name} gives a different order each time it is drawn from the same "
                "seed (it keeps a random state of its own), so ranks would disagree and a resumed run would not "
                "continue the same epoch; draw from torch's global RNG, `random`, NumPy's global RNG or the "
                "sampler's `generator` attribute (paratrain seeds them per epoch), or shard the data yourself "
                "and pass the plain DataLoader to the loop"
            )

    def relayout(self, replica: int, replicas: int, equal_shares: bool) -> None:
        """Share the same global batch over another replica count: `strategy="auto"` chooses the layout in
        `prepare`, after a script may have prepared its loaders for the provisional one."""
        if self._inner is not None or self.consumed or self.epoch:
            raise ParatrainError(
                "strategy='auto' chose its layout after this loader was iterated; call run.prepare(model, "
                "optimizer, example=batch) before the first batch, or name the strategy"
            )
        if self.batch_size is not None:
            total = self.batch_size * self.replicas
            if total % replicas:
                raise ParatrainError(
                    f"the global batch {total} cannot be split over the {replicas} data-parallel replica(s) of the "
                    f"layout strategy='auto' chose; use a global batch that is a multiple of {replicas}"
                )
            self.batch_size = total // replicas
        self.order = read_order(self.loader, self.seed, replicas)
        self.layout = Layout(replica, replicas, self.layout.grad_accum, equal_shares)
        self.replica, self.replicas = replica, replicas
        self._drawn = None
        self._plan()

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def global_batch(self) -> int | None:
        return None if self.batch_size is None else self.batch_size * self.replicas

    def __len__(self) -> int:
        """Batches this replica loads in the current epoch, counted from its start."""
        self._follow_sampler()
        return len(self._plan(from_start=True))

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; the current epoch (e.g. one resumed mid-way) is left as it is."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    # -- the plan -------------------------------------------------------------------------------
    def _draw(self) -> Epoch:
        if self._drawn is None or self._drawn[0] != self.epoch:
            self._drawn = (self.epoch, self.order.draw(self.epoch))
        return self._drawn[1]

    def _plan(self, from_start: bool = False, layout: Layout | None = None, limit: int | None = None) -> list[Batch]:
        layout = layout or self.layout
        epoch = self._draw()
        consumed = 0 if from_start else self.consumed
        if self.evaluation:
            return [Batch(b, len(epoch.order)) for b in
                    evaluation_batches(epoch.order, epoch.ends, layout, self.batch_size)]
        start, ends = 0, epoch.ends
        if ends is None:
            assert self.global_batch is not None
            start = consumed % self.global_batch  # 0 unless resumed with another global batch
            ends = batch_ends(len(epoch.order), self.global_batch, self.drop_last, layout.grad_accum, start)
        elif consumed and consumed not in ends:
            raise ParatrainError(
                f"the checkpoint's position {consumed} is not at a batch boundary of this batch_sampler's epoch "
                f"{self.epoch}; resume with the batch_sampler the saving run used"
            )
        check_epoch(ends, layout, per_worker=self.batch_size, start=start)
        return replica_batches(epoch.order, ends, consumed, layout, start, limit)

    # -- iterating ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self._follow_sampler()
        if self.replica_steps is not None and not self.evaluation:
            yield from self._iter_steps(self.replica_steps)
            return
        plan = self._plan()
        self._unclaimed, self._ahead = 0, False
        if plan:
            batches = self._load(plan) if self.timing is None else self.timing.batches(self._load(plan))
            for batch, item in zip(batches, plan):
                if not self.evaluation:
                    self.consumed = item.end
                yield self._hand_out(batch, item)
        self._weight = ONE
        if not self.evaluation:
            self.epoch, self.consumed = self.epoch + 1, 0

    def _iter_steps(self, shares: StepShares) -> Iterator[Any]:
        """Replica groups: one accumulation window at a time, cut over the groups alive at that step. The position
        moves when the step commits (`step_done`), so a dropped step's global batch is yielded again. Each step
        plans its own window only: the groups alive change from step to step."""
        epoch = self.epoch
        self._unclaimed, self._ahead = 0, False
        while self.epoch == epoch:
            if not self._plan(limit=1):  # the epoch's last step committed
                self.epoch, self.consumed = self.epoch + 1, 0
                break
            share, count = shares.begin()  # may recover this worker's state from a live group: position included
            if self.epoch != epoch:
                return  # recovered into a later epoch: that pass continues there
            layout = Layout(share, count, self.layout.grad_accum, self.layout.equal_shares)
            for item in self._plan(layout=layout, limit=layout.grad_accum):
                loaded = self._load([item])
                batch = next(iter(loaded if self.timing is None else self.timing.batches(loaded)))
                self._pending_end = item.end
                yield self._hand_out(batch, item)
        self._weight = ONE

    def _hand_out(self, batch: Any, item: Batch) -> Any:
        """`batch`, with what its loss is weighed by and where its rows' random draws start recorded first."""
        self._stamp, self._weight = next((self.step_state or step_state.active()).batches), item.weight
        self._unclaimed += 1
        randomness.set_rows_before(item.rows_before, self.step_state)
        return batch

    def step_done(self, committed: bool) -> None:
        """Replica groups: the step that trained on the batches yielded since the last call committed (the position
        moves past them) or was dropped (they come again)."""
        if committed and self._pending_end is not None:
            self.consumed = self._pending_end
        self._pending_end = None

    def peek(self) -> Any:
        """The batch the next iteration yields first, read here without moving the loader: its position, the
        batch it weighs the next loss by and the global RNGs a dataset's transform may draw from are as they were.
        What `run.prepare(..., example=loader.peek())` needs; iterating (`next(iter(loader))`) would use it up."""
        self._follow_sampler()
        plan = self._plan(limit=1)
        if not plan:
            raise ParatrainError(f"the loader is at the end of epoch {self.epoch}: nothing to peek at; iterate it "
                                 "once to start the next epoch, or peek before the loop")
        dataset, indices = self.loader.dataset, plan[0].indices
        np = numpy_or_none()
        py_state, np_state = random.getstate(), np.random.get_state() if np is not None else None
        try:
            with torch.random.fork_rng(devices=[]):
                getitems = getattr(dataset, "__getitems__", None)  # as torch's fetcher reads a batch
                rows = getitems(indices) if getitems is not None else [dataset[i] for i in indices]
                return self.loader.collate_fn(rows)
        finally:
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_state)

    def _load(self, plan: list[Batch]) -> DataLoader:
        """The inner DataLoader over this plan: made once (so persistent workers persist), re-pointed per pass."""
        self._batches.items = [b.indices for b in plan]
        if self._inner is None:
            src = self.loader
            extra = {k: getattr(src, k) for k in ("pin_memory_device", "in_order") if hasattr(src, k)}
            self._inner = DataLoader(
                src.dataset, batch_sampler=self._batches, num_workers=src.num_workers, collate_fn=src.collate_fn,
                pin_memory=src.pin_memory, timeout=src.timeout, worker_init_fn=src.worker_init_fn,
                multiprocessing_context=src.multiprocessing_context,
                prefetch_factor=src.prefetch_factor if src.num_workers > 0 else None,
                persistent_workers=src.persistent_workers, **extra,
            )
        # worker seeds: a function of (seed, replica, epoch), like the order (torch draws them from this)
        self._inner.generator = torch.Generator().manual_seed(self.seed * 1009 + self.replica * 7919 + self.epoch)
        return self._inner

    def claim(self) -> Weight:
        """The weight of the batch yielded last, for the micro-step that trains on it."""
        if self._unclaimed > 1:
            self._ahead = True  # the loop fetched more than one batch per micro-step (a prefetcher, a skip)
        self._unclaimed = 0
        if self._ahead and self._weight != ONE:
            raise ParatrainError(
                "this loop fetched batches ahead of the training step (more than one batch before a backward: a "
                "prefetcher, or a skipped batch), so paratrain cannot tell which batch this loss belongs to, and the "
                "short last batch must be weighted by its rows; iterate the prepared loader directly, one batch per "
                "step, or use DataLoader(drop_last=True) so that every batch weighs the same"
            )
        return self._weight

    # -- the tutorials' DistributedSampler.set_epoch on the user's own sampler object -------------
    def _sampler_epoch(self) -> int | None:
        sampler = self.loader.sampler
        return int(sampler.epoch) if isinstance(sampler, DistributedSampler) else None

    def _follow_sampler(self) -> None:
        now = self._sampler_epoch()
        if now is not None and now != self._followed:
            self._followed = now
            self.set_epoch(now)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and samples of it consumed, as global counts (valid for any world size)."""
        n = len(self.loader.dataset)  # type: ignore[arg-type]
        state = {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "size": n,
                 "shuffle": int(self.shuffle), "order": self.order.name}
        if self.view is not None:
            state["shards"] = indexed.fingerprint(self.view)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. The world size and per-worker batch may differ from the saving
        run: the not yet consumed samples of the epoch are re-divided among this run's replicas."""
        if self.view is not None:
            indexed.check_resume(self.view, state.get("shards"))
        if state.get("seed", self.seed) != self.seed:
            raise ParatrainError(
                f"checkpoint's data order was made with seed {state['seed']} but this run uses seed "
                f"{self.seed}; resume with {self.order.seed_option.replace('...', str(state['seed']))} to continue "
                "the same order"
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
        if state.get("order", self.order.name) != self.order.name:
            raise ParatrainError(
                f"checkpoint's data order came from {state['order']} but this loader's comes from {self.order.name}; "
                "build the DataLoader as the saving run did"
            )
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        self.epoch, self.consumed = epoch, 0
        length = len(self._draw().order)
        if not 0 <= consumed <= length:
            raise ParatrainError(f"checkpoint's data position {consumed} is outside an epoch of {length} samples")
        self.consumed = consumed


class EpochSampler:
    """`loader.sampler` of a prepared loader: `set_epoch(e)` sets the loader's epoch (a no-op for the epoch it
    is in, so a resumed run continues mid-epoch); iterating gives this replica's indices of the current epoch."""

    def __init__(self, loader: ShardedLoader) -> None:
        self._loader = loader

    @property
    def epoch(self) -> int:
        return self._loader.epoch

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        self._loader._follow_sampler()
        return iter([i for b in self._loader._plan(from_start=True) for i in b.indices])

    def __len__(self) -> int:
        self._loader._follow_sampler()
        return sum(len(b.indices) for b in self._loader._plan(from_start=True))


class _Batches:
    """The inner DataLoader's batch_sampler: the current pass's batches, replaced before each pass."""

    def __init__(self) -> None:
        self.items: list[list[Any]] = []

    def __iter__(self) -> Iterator[list[Any]]:
        return iter(list(self.items))

    def __len__(self) -> int:
        return len(self.items)


def claim_weight(loaders: Iterable[ShardedLoader]) -> Weight:
    """The weight of the batch the most recently iterated training loader yielded last (1.0 without one)."""
    latest = max((x for x in loaders if x._stamp), key=lambda x: x._stamp, default=None)
    return ONE if latest is None else latest.claim()


def _check_same_on_every_rank(epoch: Epoch, name: str, device: torch.device) -> None:
    """A user sampler must draw the same order on every rank (it may be seeded by rank, or not seedable)."""
    from .. import collectives

    if not collectives.active():
        return
    text = repr((epoch.order, epoch.ends)).encode()  # repr, not hash(): str hashes differ between processes
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")
    both = collectives.all_reduce(torch.tensor([digest, -digest], dtype=torch.int64), op="max", device=device)
    if int(both[0]) != -int(both[1]):
        raise ParatrainError(
            f"the sampler {name} draws a different order on different ranks, so the global batches would not be "
            "the same on every rank; make its order depend only on the seed (draw from torch's global RNG, "
            "`random`, NumPy's global RNG or its `generator` attribute, which paratrain seeds per epoch), not on "
            "the rank, or shard the data yourself and pass the plain DataLoader to the loop"
        )
