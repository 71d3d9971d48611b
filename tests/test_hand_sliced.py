"""A loop that slices each global batch itself (no run.prepare_loader) and hands the slices to
run.forward_backward: uneven slices (21 rows as 8, 8 and 5 over 3 DDP workers) count by rows, so the run
reaches the plain-PyTorch loop's weights on the whole 21-row batches; even slices are untouched. The row counts
are exchanged only by runs without a training loader, decided the same way on every rank."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import zoo
from torch.utils.data import DataLoader, TensorDataset
from zoo.compare import mismatches
from zoo.reference import Optim, global_batches, run_reference

import paratrain

SIZES = (21, 21, 21)


def _slices(rows: int, parts: int, uneven: bool) -> list[slice]:
    cuts = [0, 8, 16, 21] if uneven else [round(rows * i / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


def _train(model_name: str, uneven: bool) -> dict[str, Any]:
    case = zoo.MODELS[model_name]
    run = paratrain.setup(strategy="ddp", seed=0, timeout_s=60, accelerator="cpu")
    try:
        model = case.build(0)
        model, optimizer = run.prepare(model, Optim().make(model.parameters(), case))
        mine = _slices(SIZES[0], run.world_size, uneven)[run.rank]
        losses, weights = [], []
        for inputs, targets in global_batches(case, 0, SIZES):
            losses.append(float(run.forward_backward(model, inputs[mine], targets[mine], case.loss_fn)))
            optimizer.step()
            optimizer.zero_grad()
            weights.append({k: v.detach().clone() for k, v in run.unwrap(model).state_dict().items()})
        return {"losses": losses, "weights": weights, "rows": mine.stop - mine.start}
    finally:
        run.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("uneven", [True, False], ids=["8-8-5", "7-7-7"])
def test_hand_sliced_batches_count_by_rows(uneven: bool) -> None:
    case = zoo.MODELS["mlp"]
    want = run_reference(case, global_batches(case, 0, SIZES))
    results = paratrain.launch(_train, "mlp", uneven, nproc=3, timeout=150, all_ranks=True, accelerator="cpu")
    assert [r["rows"] for r in results] == ([8, 8, 5] if uneven else [7, 7, 7])
    for r in results:
        assert not mismatches(r["losses"], r["weights"], want, case.tolerances["fp32"])


def _dropped_loader(keep_on: int) -> list[float]:
    case = zoo.MODELS["mlp"]
    run = paratrain.setup(strategy="ddp", seed=0, timeout_s=30, accelerator="cpu")
    try:
        model = case.build(0)
        model, optimizer = run.prepare(model, Optim().make(model.parameters(), case))
        inputs, targets = global_batches(case, 0, (8,))[0]
        loader = run.prepare_loader(DataLoader(TensorDataset(inputs, targets), batch_size=run.per_worker_batch(8)))
        x, y = next(iter(loader))
        _kept = loader if run.rank == keep_on else None  # this rank still holds it, as an uncollected cycle would
        del loader
        gc.collect()
        losses = []
        for _ in range(2):
            losses.append(float(run.forward_backward(model, x, y, case.loss_fn)))
            optimizer.step()
            optimizer.zero_grad()
        return losses
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_loader_dropped_after_its_first_batch_is_decided_alike_on_every_rank() -> None:
    """A loop takes one batch from its prepared loader, drops the loader and trains on that batch (the planner's
    validation does). Whether a process has collected the loader yet is its garbage collector's business: one
    rank deciding by it to exchange row counts, a collective the other skips, waited for the other until the
    timeout. Here one rank keeps the loader alive and the other has collected it; both train as one process."""
    case = zoo.MODELS["mlp"]
    batch = global_batches(case, 0, (8,))[0]
    want = run_reference(case, [batch, batch])
    per_rank = paratrain.launch(_dropped_loader, 1, nproc=2, timeout=100, all_ranks=True, accelerator="cpu")
    for losses in per_rank:
        assert losses == pytest.approx(want.losses, abs=case.tolerances["fp32"].loss)
