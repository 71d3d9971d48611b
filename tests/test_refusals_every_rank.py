"""A refusal on one rank is raised on every rank, word for word, within moments (paratrain/agreement.py).

Two workers train a small DDP model; rank 1 alone refuses in setup, in prepare (before DDP's first broadcast,
which rank 0 is then blocked in, and after it, while rank 0 waits at prepare's end), in its first forward
(rank 0 goes on into DDP's gradient all-reduce) and in its first optimizer step. Every rank reports the same
`RefusedOnRank` naming rank 1 and its message. The collective timeout is far longer than the launch's limit,
so a rank left to time out fails the test instead of passing late.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
from helpers import toy_model
from torch import nn

import paratrain
from paratrain.config import make_config
from paratrain.errors import ParatrainError

pytestmark = pytest.mark.procs

REFUSAL = "toy refusal: rank 1 cannot do this; fix the toy"
CASES = ("setup", "prepare before DDP", "prepare after DDP", "first forward", "first optimizer step")
LONG_TIMEOUT_S = 600
"""The collective timeout of these runs: a rank left waiting for it outlives the launch's limit."""


class _RefusesOnRankOne(nn.Module):
    """The toy model, whose forward refuses on rank 1 only: rank 0 goes on into DDP's gradient all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.body = toy_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if int(os.environ["RANK"]) == 1:
            raise ParatrainError(REFUSAL)
        return self.body(x)  # type: ignore[no-any-return]


class _SGDRefusingOnRankOne(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if int(os.environ["RANK"]) == 1:
            raise ParatrainError(REFUSAL)
        return super().step(closure)


def _refuse(*_: Any, **__: Any) -> Any:
    raise ParatrainError(REFUSAL)


def _case(case: str) -> tuple[str, str]:
    """One run in which rank 1 refuses at `case`: (the error's class, its message) as this rank saw it."""
    outcome = _run(case)
    # The closed run and its DDP model (a reference cycle) hold the process group's connections: collected, they
    # close, and a peer still blocked in the group (DDP's all-reduce) is released, as when a refusing process ends.
    gc.collect()
    return outcome


def _run(case: str) -> tuple[str, str]:
    from paratrain import api

    one = int(os.environ["RANK"]) == 1
    patched = {"prepare before DDP": "RandomCalls", "prepare after DDP": "rebind"}.get(case)
    saved = getattr(api, patched) if patched else None
    if one and patched:
        setattr(api, patched, _refuse)
    run = None
    try:
        run = paratrain.setup(strategy="ddp", accelerator="cpu", timeout_s=LONG_TIMEOUT_S,
                              grad_accum=0 if one and case == "setup" else 1)
        model = _RefusesOnRankOne() if case == "first forward" else toy_model()
        optimizer = (_SGDRefusingOnRankOne if case == "first optimizer step" else torch.optim.SGD)(
            model.parameters(), lr=0.1)
        model, optimizer = run.prepare(model, optimizer)
        x, y = torch.randn(4, 16), torch.randn(4, 4)
        for _ in range(2):
            optimizer.zero_grad()
            run.forward_backward(model, x, y, nn.functional.mse_loss)
            optimizer.step()
        return "trained", ""
    except ParatrainError as exc:
        return type(exc).__name__, str(exc)
    finally:
        if patched:
            setattr(api, patched, saved)
        if run is not None:
            run.close()


def _every_case() -> dict[str, tuple[str, str]]:
    return {case: _case(case) for case in CASES}


@pytest.fixture(scope="module")
def reports() -> list[dict[str, tuple[str, str]]]:
    """Each rank's report of each case, from one launch (the cases run in turn on the same two workers)."""
    return paratrain.launch(_every_case, nproc=2, timeout=240, accelerator="cpu", all_ranks=True)  # type: ignore[no-any-return]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_a_refusal_on_rank_one_is_raised_on_every_rank_alike(reports: list[dict[str, tuple[str, str]]],
                                                             case: str) -> None:
    message = REFUSAL
    if case == "setup":
        with pytest.raises(ParatrainError) as refused:
            make_config({"grad_accum": 0})
        message = str(refused.value)
    want = ("RefusedOnRank", f"rank 1: {message}")
    assert [rank[case] for rank in reports] == [want, want], case


def test_one_process_raises_its_refusal_unchanged() -> None:
    """Without peers there is nothing to agree on: the refusal is raised as it was."""
    with pytest.raises(ParatrainError) as refused:
        paratrain.setup(strategy="single", accelerator="cpu", grad_accum=0)
    assert type(refused.value) is ParatrainError
    assert not str(refused.value).startswith("rank ")
