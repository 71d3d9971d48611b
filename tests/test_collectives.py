"""Collectives as the user calls them: no-ops on one process, exact reductions on several."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain import collectives


def test_one_process_returns_a_copy_and_names_bad_ops() -> None:
    x = torch.tensor([1.0, 2.0])
    out = collectives.all_reduce(x, "sum")
    assert torch.equal(out, x) and out is not x
    with pytest.raises(paratrain.ParatrainError, match="Did you mean 'mean'"):
        collectives.all_reduce(x, "maen")


def _reductions() -> dict[str, object]:
    run = paratrain.setup(strategy="ddp")
    r = run.rank
    out = {op: run.all_reduce(torch.tensor(float(r + 1)), op).item() for op in ("sum", "mean", "max", "min")}
    out["int_mean"] = run.all_reduce(torch.tensor(r + 2), "mean").item()  # integers average as float64
    out["lists"] = collectives.mean_over_world([float(r), 2.0 * r])
    out["world_max"] = collectives.max_over_world(float(r))
    run.close()
    return out


def test_reductions_over_three_workers() -> None:
    for out in paratrain.launch(_reductions, nproc=3, timeout=60, all_ranks=True):
        assert out["sum"] == 6.0 and out["mean"] == 2.0 and out["max"] == 3.0 and out["min"] == 1.0
        assert out["int_mean"] == 3.0
        assert out["lists"] == [1.0, 2.0] and out["world_max"] == 2.0


def _later() -> dict[str, object]:
    run = paratrain.setup(strategy="ddp")
    r = run.rank
    first = collectives.mean_later(torch.tensor(float(r)))  # never read: settled by the next call
    second = collectives.mean_later(torch.tensor(float(3 * r)), divide_by=1)  # a sum
    now = run.all_reduce(torch.tensor(1.0), "sum").item()  # an ordinary collective after them
    out = {"second": float(second), "now": now, "first": float(first)}
    collectives.mean_later(torch.tensor(1.0))  # left for the process group's teardown to settle
    run.close()
    return out


def test_mean_later_reduces_when_read_and_settles_unread_ones() -> None:
    for out in paratrain.launch(_later, nproc=3, timeout=60, all_ranks=True):
        assert out == {"second": 9.0, "now": 3.0, "first": 1.0}
    alone = collectives.mean_later(torch.tensor(4.0), divide_by=2)  # one process: no collective at all
    assert alone.item() == 2.0
