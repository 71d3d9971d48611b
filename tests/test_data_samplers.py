"""Tier 1: what a DataLoader asks for is honoured by the prepared loader, or refused with the fix.

Each replica's loader is built exactly as a worker builds it, with no process group; a "step" is every
replica's share of one global batch, joined in replica order.
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from paratrain import ParatrainError, ShardedLoader
from paratrain.data import epoch_order, order

N = 52  # 4 global batches of 12 and a tail of 4 (2 | 2 on 2 replicas, 2 | 1 | 1 on 3)
DATA = TensorDataset(torch.arange(N))


def _loaders(replicas: int, make: Callable[[int], DataLoader], seed: int = 3, **kw: Any) -> list[ShardedLoader]:
    """`make(rank)` builds rank r's DataLoader, as the user's script does on that rank."""
    return [ShardedLoader(make(r), r, replicas, seed, **kw) for r in range(replicas)]


def _steps(loaders: list[ShardedLoader]) -> list[list[int]]:
    """One pass (the rest of the current epoch): the global batch of each step."""
    per_rank = [[b[0].tolist() for b in loader] for loader in loaders]
    assert len({len(p) for p in per_rank}) == 1, "replicas must run the same number of steps"
    return [sum(step, []) for step in zip(*per_rank)]


def _dist(replicas: int, **kw: Any) -> list[ShardedLoader]:
    return _loaders(replicas, lambda r: DataLoader(DATA, batch_size=12 // replicas,
                                                   sampler=DistributedSampler(DATA, replicas, r, **kw)))


def _torch_order(epoch: int, seed: int = 5) -> list[int]:
    """What torch's own DistributedSampler yields on one replica (no padding, no striding)."""
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


# -- DistributedSampler ---------------------------------------------------------------------------------
def test_distributed_sampler_tutorial_loop_same_batches_at_any_world_size_new_order_each_epoch() -> None:
    runs = {}
    for replicas in (1, 2, 3):
        loaders = _dist(replicas, shuffle=True, seed=5)
        epochs = []
        for epoch in range(3):
            for loader in loaders:
                loader.sampler.set_epoch(epoch)  # the tutorials' call, on the prepared loader
            epochs.append(_steps(loaders))
        runs[replicas] = epochs
    assert runs[1] == runs[2] == runs[3]  # the same global batches, in the same order within each
    for epoch, steps in enumerate(runs[1]):
        assert sum(steps, []) == _torch_order(epoch)  # the sampler's own shuffle and seed, no padding duplicates
        assert [len(s) for s in steps] == [12, 12, 12, 12, 4]
    assert runs[1][0] != runs[1][1] != runs[1][2]


def test_distributed_sampler_shuffle_false_and_drop_last() -> None:
    assert sum(_steps(_dist(2, shuffle=False)), []) == list(range(N))
    dropped = _dist(3, shuffle=True, seed=5, drop_last=True)
    assert [len(s) for s in _steps(dropped)] == [12] * 4  # the short last global batch is dropped
    assert len(dropped[0]) == 4


def test_set_epoch_on_the_users_own_sampler_object_is_followed() -> None:
    samplers = [DistributedSampler(DATA, 2, r, shuffle=True, seed=5) for r in range(2)]
    loaders = _loaders(2, lambda r: DataLoader(DATA, batch_size=6, sampler=samplers[r]))
    for s in samplers:
        s.set_epoch(4)  # the ImageNet example's `train_sampler.set_epoch(epoch)`
    assert sum(_steps(loaders), []) == _torch_order(4)
    assert loaders[0].epoch == 5  # and the loader goes on from there


def test_distributed_sampler_resumes_mid_epoch_on_another_world_size() -> None:
    first = _dist(3, shuffle=True, seed=5)
    its = [iter(x) for x in first]
    done = [sum((next(it)[0].tolist() for it in its), []) for _ in range(2)]
    state = first[0].state_dict()
    assert state["consumed"] == 24 and state["order"] == "DistributedSampler"
    second = _dist(2, shuffle=True, seed=5)
    for loader in second:
        loader.load_state_dict(state)
        loader.sampler.set_epoch(0)  # the tutorial loop calls it at the top of the resumed epoch: no reset
    rest = _steps(second)
    assert done + rest == [_torch_order(0)[i : i + 12] for i in range(0, N, 12)]
    assert all(x.epoch == 1 and x.consumed == 0 for x in second)
    second[0].set_epoch(3)  # another epoch: from its start
    assert second[0].consumed == 0 and second[0].epoch == 3
    with pytest.raises(ParatrainError, match=r"resume with DistributedSampler\(seed=5\)"):
        _dist(2, shuffle=True, seed=6)[0].load_state_dict(state)


def test_loader_sampler_is_this_replicas_share() -> None:
    loaders = _dist(3, shuffle=True, seed=5)
    shares = [list(x.sampler) for x in loaders]
    assert sorted(sum(shares, [])) == list(range(N))  # each sample once: no padding
    assert [len(x.sampler) for x in loaders] == [len(s) for s in shares] == [18, 17, 17]
    assert loaders[0].dataset is DATA


# -- other samplers: their stream is the global order -----------------------------------------------------
class Halves(Sampler[int]):
    """A user sampler: shuffles each half with Python's `random`, and records set_epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        low, high = list(range(self.n // 2)), list(range(self.n // 2, self.n))
        random.shuffle(low)
        random.shuffle(high)
        return iter(high + low)

    def __len__(self) -> int:
        return self.n


SAMPLERS: dict[str, Callable[[], Any]] = {
    "weighted": lambda: WeightedRandomSampler([0.0 if i % 4 == 0 else 1.0 for i in range(N)], num_samples=40,
                                              generator=torch.Generator().manual_seed(99)),
    "subset": lambda: SubsetRandomSampler([*range(0, N, 2), 1, 3]),  # 28: a tail of 4
    "subset-of-a-tensor": lambda: SubsetRandomSampler(torch.tensor([*range(0, N, 2), 1, 3])),  # yields tensors
    "with-replacement": lambda: RandomSampler(DATA, replacement=True, num_samples=30),
    "user": lambda: Halves(N),
}


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_a_custom_samplers_stream_is_the_global_order_at_any_world_size(kind: str) -> None:
    runs = {}
    for replicas in (1, 2, 3):
        loaders = _loaders(replicas, lambda r, b=12 // replicas: DataLoader(DATA, batch_size=b,
                                                                             sampler=SAMPLERS[kind]()))
        runs[replicas] = [_steps(loaders) for _ in range(2)]
    assert runs[1] == runs[2] == runs[3]
    epoch0, epoch1 = (sum(steps, []) for steps in runs[1])
    assert epoch0 != epoch1  # drawn again, differently, each epoch
    assert len(epoch0) == len(SAMPLERS[kind]())
    if kind == "weighted":
        assert all(i % 4 for i in epoch0 + epoch1)  # its weights are honoured
    if kind.startswith("subset"):
        assert sorted(epoch0) == sorted([*range(0, N, 2), 1, 3])
    if kind == "user":
        assert set(epoch0[: N // 2]) == set(range(N // 2, N))


def test_drawing_a_sampler_leaves_every_rng_and_its_generator_as_they_were() -> None:
    generator = torch.Generator().manual_seed(99)
    sampler = WeightedRandomSampler([1.0] * N, num_samples=20, generator=generator)
    torch_state, py_state, gen_state = torch.get_rng_state(), random.getstate(), generator.get_state()
    (loader,) = _loaders(1, lambda r: DataLoader(DATA, batch_size=4, sampler=sampler))
    list(loader)
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    assert sampler.generator is generator and torch.equal(generator.get_state(), gen_state)


class Bucketed(Sampler[list[int]]):
    """A bucketing batch sampler: batches of varying size, shuffled by torch's global RNG."""

    sizes = [5, 9, 3, 12, 7, 16]

    def __iter__(self) -> Iterator[list[int]]:
        perm = torch.randperm(N).tolist()
        out, pos = [], 0
        for size in self.sizes:
            out.append(perm[pos : pos + size])
            pos += size
        return iter(out)

    def __len__(self) -> int:
        return len(self.sizes)


def test_a_batch_samplers_batches_are_global_batches_split_over_replicas() -> None:
    runs = {}
    for replicas in (1, 2, 3):
        loaders = _loaders(replicas, lambda r: DataLoader(DATA, batch_sampler=Bucketed()))
        runs[replicas] = [_steps(loaders) for _ in range(2)]
        assert [len(s) for s in runs[replicas][0]] == Bucketed.sizes
    assert runs[1] == runs[2] == runs[3]
    assert runs[1][0] != runs[1][1]


# -- loading options ------------------------------------------------------------------------------------
class Where(Dataset[dict[str, int]]):
    """Reports which worker process loaded each sample, and what worker_init_fn set there."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"i": i, "pid": os.getpid(), "init": int(os.environ.get("PT_TEST_INIT", "-1"))}


def _init(worker_id: int) -> None:
    os.environ["PT_TEST_INIT"] = str(100 + worker_id)


def _collate(items: list[dict[str, int]]) -> dict[str, list[int]]:
    return {k: [x[k] for x in items] for k in items[0]}


@pytest.mark.timeout(120)
def test_workers_collate_fn_and_persistent_workers_are_carried_over() -> None:
    (loader,) = _loaders(1, lambda r: DataLoader(
        Where(), batch_size=4, shuffle=True, num_workers=2, collate_fn=_collate, persistent_workers=True,
        prefetch_factor=3, worker_init_fn=_init, timeout=60, pin_memory=False, multiprocessing_context="fork"))
    try:
        epochs = [list(loader) for _ in range(2)]
        pids = [{p for b in e for p in b["pid"]} for e in epochs]
        assert all(isinstance(b, dict) for e in epochs for b in e)  # the user's collate_fn
        assert pids[0] == pids[1] and os.getpid() not in pids[0] and len(pids[0]) == 2  # the same 2 workers
        assert {i for b in epochs[0] for i in b["init"]} == {100, 101}  # worker_init_fn ran in each
        assert sorted(i for b in epochs[0] for i in b["i"]) == list(range(24))
        inner = loader._inner
        assert inner is not None and (inner.prefetch_factor, inner.timeout, inner.persistent_workers) == (3, 60, True)
    finally:
        del loader
        gc.collect()  # persistent workers end with their loader


def test_generator_is_replaced_by_the_seeded_order_and_said_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(order, "_SAID", set())  # said once per process: forget earlier tests
    with pytest.warns(UserWarning, match="generator= does not choose the order"):
        (loader,) = _loaders(1, lambda r: DataLoader(DATA, batch_size=4, shuffle=True,
                                                     generator=torch.Generator().manual_seed(1)))
    assert sum((b[0].tolist() for b in loader), []) == epoch_order(N, 3, 0, True)


# -- refusals, each naming its fix ------------------------------------------------------------------------
class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class OwnRng(Sampler[int]):
    """Keeps a random state of its own: a second draw from the same seed differs."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rng.sample(range(N), N))

    def __len__(self) -> int:
        return N


class MyDistributed(DistributedSampler):
    pass


REFUSED: dict[str, tuple[Callable[[], ShardedLoader], str]] = {
    "iterable-dataset": (lambda: ShardedLoader(DataLoader(Stream(), batch_size=2), 0, 1, 0),
                         "use a map-style Dataset"),
    "batch_size=None": (lambda: ShardedLoader(DataLoader(DATA, batch_size=None), 0, 1, 0), "give it a batch_size"),
    "num_replicas": (lambda: ShardedLoader(DataLoader(DATA, batch_size=6, sampler=DistributedSampler(DATA, 4, 0)),
                                           0, 2, 0), "build it with num_replicas=2"),
    "sampler-subclass": (lambda: ShardedLoader(DataLoader(DATA, batch_size=6, sampler=MyDistributed(DATA, 2, 0)),
                                               0, 2, 0), "orders the whole dataset"),
    "sharding-batch-sampler": (lambda: ShardedLoader(DataLoader(DATA, batch_sampler=BatchSampler(
        DistributedSampler(DATA, 2, 0), 6, False)), 0, 2, 0), "orders the whole dataset"),
    "own-rng-sampler": (lambda: ShardedLoader(DataLoader(DATA, batch_size=4, sampler=OwnRng()), 0, 1, 0),
                        "draw from torch's global RNG"),
    "small-batch": (lambda: ShardedLoader(DataLoader(DATA, batch_sampler=[[0, 1], [2]]), 0, 3, 0),
                    "make the batch_sampler's batches larger"),
    "tail-under-replicas": (lambda: ShardedLoader(DataLoader(TensorDataset(torch.arange(50)), batch_size=4), 0, 3, 0),
                            "use DataLoader\\(drop_last=True\\)"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_cannot_be_honoured_is_refused_with_the_fix(case: str) -> None:
    build, fix = REFUSED[case]
    with pytest.raises(ParatrainError, match=fix):
        build()
