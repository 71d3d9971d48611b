"""Sharding logic, without processes: each replica's share is built exactly as a worker builds it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from paratrain import ParatrainError, ShardedLoader


def _loaders(n: int, per_worker: int, replicas: int, shuffle: bool = True, **kw: object) -> list[ShardedLoader]:
    data = TensorDataset(torch.arange(n))
    return [ShardedLoader(DataLoader(data, batch_size=per_worker, shuffle=shuffle, **kw), r, replicas, seed=3)  # type: ignore[arg-type]
            for r in range(replicas)]


def _epoch(loaders: list[ShardedLoader]) -> list[list[list[int]]]:
    """steps x replicas x indices for one epoch."""
    per_rank = [[b[0].tolist() for b in loader] for loader in loaders]
    assert len({len(p) for p in per_rank}) == 1, "replicas must run the same number of steps"
    return [list(step) for step in zip(*per_rank)]


@pytest.mark.parametrize("replicas", [2, 3])
def test_shards_are_disjoint_cover_the_data_and_change_each_epoch(replicas: int) -> None:
    loaders = _loaders(60, 4, replicas)
    epochs = [_epoch(loaders) for _ in range(3)]
    for steps in epochs:
        shards = [sum((step[r] for step in steps), []) for r in range(replicas)]
        flat = sum(shards, [])
        assert sorted(flat) == list(range(60))  # union is the dataset, nothing repeated
        assert len(set(flat)) == len(flat)
    first_shards = [sorted(sum((s[0] for s in e), [])) for e in epochs]
    assert first_shards[0] != first_shards[1] != first_shards[2]  # reshuffled without set_epoch


def test_global_batches_do_not_depend_on_world_size() -> None:
    one = _epoch(_loaders(48, 12, 1))
    for replicas in (2, 3, 4):
        many = _epoch(_loaders(48, 12 // replicas, replicas))
        assert [sorted(sum(step, [])) for step in many] == [sorted(step[0]) for step in one]


def test_evaluation_gives_each_sample_to_one_rank_without_padding() -> None:
    data = TensorDataset(torch.arange(11))
    loaders = [ShardedLoader(DataLoader(data, batch_size=2), r, 3, seed=0, evaluation=True) for r in range(3)]
    seen = [i for loader in loaders for b in loader for i in b[0].tolist()]
    assert sorted(seen) == list(range(11))
    assert [len(loader) for loader in loaders] == [2, 2, 2]


def test_tail_is_split_evenly_or_dropped() -> None:
    steps = _epoch(_loaders(10, 2, 2, shuffle=False))  # 2 full global batches of 4, tail of 2
    assert [len(s[0]) + len(s[1]) for s in steps] == [4, 4, 2]
    dropped = _epoch(_loaders(10, 2, 2, shuffle=False, drop_last=True))
    assert len(dropped) == 2


def test_position_resumes_mid_epoch() -> None:
    (loader,) = _loaders(40, 4, 1)
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(3)]
    state = loader.state_dict()
    rest = [b[0].tolist() for b in it]
    (fresh,) = _loaders(40, 4, 1)
    fresh.load_state_dict(state)
    assert [b[0].tolist() for b in fresh] == rest
    assert sorted(sum(first + rest, [])) == list(range(40))


def test_set_epoch_in_the_loop_changes_nothing_and_moves_to_another_epoch() -> None:
    plain, called = _loaders(30, 2, 3), _loaders(30, 2, 3)
    for epoch in range(3):
        for loader in called:
            loader.sampler.set_epoch(epoch)  # the tutorials' call each epoch: the epoch the loader is in
        assert _epoch(called) == _epoch(plain)
    for loader in called:
        loader.set_epoch(7)
    assert _epoch(called) != _epoch(plain)
    assert all(x.epoch == 8 for x in called)


def test_dataset_smaller_than_world_is_rejected() -> None:
    with pytest.raises(ParatrainError, match="at least one each"):
        _loaders(2, 1, 3)
