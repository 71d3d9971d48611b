"""Tier 1: a short last batch is weighted by rows, so every world size computes the one-process gradient.

The weights come from the loader alone (the order is deterministic, so no collective is needed); here the
replicas' micro-steps are run in one process and their gradients averaged as DDP averages them.
Tolerance: float32 gradients agree to 1e-6 absolute (sums in another order).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from paratrain import ParatrainError, ShardedLoader
from paratrain.data import Weight, claim_weight

X = torch.randn(103, 5, generator=torch.Generator().manual_seed(0))
Y = torch.randn(103, 1, generator=torch.Generator().manual_seed(1))


def _loaders(n: int, per_worker: int, replicas: int, accum: int = 1, **kw: Any) -> list[ShardedLoader]:
    data = TensorDataset(torch.arange(n), X[:n], Y[:n])
    return [ShardedLoader(DataLoader(data, batch_size=per_worker, shuffle=True, **kw), r, replicas, seed=4,
                          grad_accum=accum) for r in range(replicas)]


def _weights(loaders: list[ShardedLoader]) -> list[list[Weight]]:
    """Per step, each replica's claimed weight (the loop yields one batch, then its micro-step claims it)."""
    its, out = [iter(x) for x in loaders], []
    for _ in range(len(loaders[0])):
        step = []
        for it, loader in zip(its, loaders):
            next(it)
            step.append(loader.claim())
        out.append(step)
    return out


def test_full_batches_weigh_exactly_one_and_a_short_batch_by_its_rows() -> None:
    steps = _weights(_loaders(100, 4, 3))  # 8 x 12 + a tail of 4: shares 2 | 1 | 1
    assert all(w is Weight() or w == Weight() for step in steps[:-1] for w in step)
    assert steps[-1] == [Weight(1.5, 1.0), Weight(0.75, 1.0), Weight(0.75, 1.0)]
    assert _weights(_loaders(100, 6, 2))[-1] == [Weight(), Weight()]  # 2 | 2: even, untouched


@pytest.mark.parametrize("n", [100, 101, 103])
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_weighted_shares_give_the_one_process_gradient(n: int, replicas: int) -> None:
    """Each replica: mean loss over its share times its weight; gradients averaged over replicas (DDP)."""
    layer = torch.nn.Linear(5, 1)
    whole = _loaders(n, 12, 1)[0]
    parts = _loaders(n, 12 // replicas, replicas)
    its = [iter(x) for x in parts]
    for _, x, y in whole:
        want = torch.autograd.grad(torch.nn.functional.mse_loss(layer(x), y), list(layer.parameters()))
        got = [torch.zeros_like(g) for g in want]
        for it, loader in zip(its, parts):
            _, xs, ys = next(it)
            loss = torch.nn.functional.mse_loss(layer(xs), ys) * loader.claim().loss
            for acc, g in zip(got, torch.autograd.grad(loss, list(layer.parameters()))):
                acc += g / replicas
        assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-6


def test_accumulation_windows_are_weighted_by_their_rows() -> None:
    # 100 samples, global batch 12 per micro-step, 3 micro-steps per optimizer step: windows of 36, 36, 28
    steps = _weights(_loaders(100, 6, 2, accum=3))
    assert all(w == Weight() for step in steps[:6] for w in step)
    assert steps[6:] == [[Weight(36 / 28, 36 / 28)] * 2, [Weight(36 / 28, 36 / 28)] * 2, [Weight(12 / 28, 12 / 28)] * 2]


def test_an_epoch_that_is_not_whole_windows_is_refused_or_dropped() -> None:
    with pytest.raises(ParatrainError, match=r"grad_accum=2: an epoch of 9 batches.*drop_last=True\) \(drops the "
                                             r"last 4 samples"):
        _loaders(100, 6, 2, accum=2)
    kept = _loaders(100, 6, 2, accum=2, drop_last=True)  # drop_last drops the incomplete last window
    assert len(kept[0]) == 8 and all(w == Weight() for step in _weights(kept) for w in step)


def test_pipeline_replicas_refuse_an_uneven_share() -> None:
    data = DataLoader(TensorDataset(torch.arange(100)), batch_size=4)
    with pytest.raises(ParatrainError, match=r"3 pipeline replicas cannot share equally.*drop_last=True"):
        ShardedLoader(data, 0, 3, 0, equal_shares=True)
    ShardedLoader(DataLoader(TensorDataset(torch.arange(100)), batch_size=6), 0, 2, 0, equal_shares=True)  # 2 | 2
    ShardedLoader(DataLoader(TensorDataset(torch.arange(100)), batch_size=4, drop_last=True), 0, 3, 0,
                  equal_shares=True)


def test_a_loop_that_fetches_ahead_is_refused_at_the_short_batch() -> None:
    (loader,) = _loaders(100, 4, 3)[:1]
    it = iter(loader)
    next(it)
    for _ in range(7):  # a prefetcher: the next batch is fetched before this one's backward
        next(it)
        assert loader.claim() == Weight()  # full batches weigh the same, whichever this loss belongs to
    next(it)  # the short one
    with pytest.raises(ParatrainError, match="fetched batches ahead"):
        loader.claim()


def test_two_losses_per_batch_and_no_prepared_loader() -> None:
    (loader,) = _loaders(100, 4, 3)[2:]
    for _ in loader:
        first, second = claim_weight([loader]), claim_weight([loader])  # e.g. two backward calls per batch
        assert first == second
    assert first == Weight(0.75, 1.0)
    assert claim_weight([loader]) == Weight()  # the epoch is over
    assert claim_weight([]) == Weight()  # a plain DataLoader: losses count as they are


def test_the_most_recently_iterated_loader_decides() -> None:
    (a,) = _loaders(100, 4, 3)[1:2]
    (b,) = _loaders(48, 4, 3)[1:2]
    it = iter(a)
    for _ in range(9):
        next(it)
    next(iter(b))
    assert claim_weight([a, b]) == Weight()  # b's full batch, not a's short one


def test_prepare_loader_knows_the_runs_accumulation() -> None:
    import paratrain

    run = paratrain.setup(strategy="single", grad_accum=2)
    try:
        with pytest.raises(ParatrainError, match="grad_accum=2"):
            run.prepare_loader(DataLoader(TensorDataset(torch.arange(100)), batch_size=run.per_worker_batch(24)))
        run.prepare_loader(DataLoader(TensorDataset(torch.arange(96)), batch_size=run.per_worker_batch(24)))
    finally:
        run.close()
