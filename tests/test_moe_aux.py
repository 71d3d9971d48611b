"""A user MoE's load-balancing term computed over the tokens one rank sees (tests/moe_cases.py, `user-aux`) is refused
only where it reaches the loss: weighted 0 by the loop (or left out) it changes no gradient, so the run trains like
one process; weighted 0.01 it is refused by name, in the backward, as before (parallel/expert/router_stats.py)."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import moe_cases as cases
import pytest
import torch
from torch.nn import functional as F
from zoo.reference import chunk

import paratrain
from paratrain.errors import ParatrainError
from paratrain.parallel import step_state
from paratrain.parallel.expert import router_stats

REFUSED = r"blocks\.\d\.moe \(MoE\).*self\.aux.*the loss uses it.*global_rows"


def weighted_loss(out: Any, target: torch.Tensor, weight: float | None) -> torch.Tensor:
    """Cross-entropy plus `weight` times the auxiliary term (None: the term left out)."""
    logits, aux = out
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
    return loss if weight is None else loss + weight * aux


@pytest.mark.parametrize("weight", [0.0, None])
def test_a_term_the_loss_does_not_weigh_is_not_refused(weight: float | None) -> None:
    model = cases.build("user-aux")
    router_stats.install(model)
    x, y = cases.data()
    with step_state.using(step_state.StepState(rows=router_stats.Rows(0, 2, 1))):
        weighted_loss(model(x[:4]), y[:4], weight).backward()
    assert all(p.grad is not None for p in model.blocks[0].moe.router.parameters())


def test_a_weighted_term_is_refused_in_the_backward() -> None:
    model = cases.build("user-aux")
    router_stats.install(model)
    x, y = cases.data()
    with step_state.using(step_state.StepState(rows=router_stats.Rows(0, 2, 1))):
        loss = weighted_loss(model(x[:4]), y[:4], cases.AUX)  # the forward alone is not refused
        with pytest.raises(ParatrainError, match=REFUSED):
            loss.backward()


def _train(weight: float) -> tuple[str, list[float], dict[str, torch.Tensor]]:
    """The user MoE under ddp (what prepare or the loop said, the global losses, the final weights)."""
    run = paratrain.setup(strategy="ddp", seed=0, accelerator="cpu", timeout_s=60)
    try:
        replica, replicas = run.strategy.data_shard(run.ctx)
        model = cases.build("user-aux")
        optimizer = cases.optimizer(model)
        x, y = cases.data()
        model, optimizer = run.prepare(model, optimizer, example=chunk(x[:cases.GLOBAL_BATCH], replicas)[replica])
        losses = []
        for start in range(0, cases.ROWS, cases.GLOBAL_BATCH):
            xs = chunk(x[start:start + cases.GLOBAL_BATCH], replicas)[replica]
            ys = chunk(y[start:start + cases.GLOBAL_BATCH], replicas)[replica]
            losses.append(float(run.forward_backward(model, xs, ys, partial(weighted_loss, weight=weight))))
            optimizer.step()
            optimizer.zero_grad()
        state = {k: v.detach().clone() for k, v in run.unwrap(model).state_dict().items()}
        return "trained", losses, state
    except ParatrainError as exc:
        return str(exc), [], {}
    finally:
        run.close()


def _plain(weight: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    with step_state.using(step_state.StepState()):
        model = cases.build("user-aux")
        optimizer = cases.optimizer(model)
        x, y = cases.data()
        losses = []
        for start in range(0, cases.ROWS, cases.GLOBAL_BATCH):
            batch = slice(start, start + cases.GLOBAL_BATCH)
            loss = weighted_loss(model(x[batch]), y[batch], weight)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_ddp_trains_a_zero_weighted_term_like_one_process_and_refuses_a_weighted_one() -> None:
    results = paratrain.launch(_train, 0.0, nproc=2, timeout=120, accelerator="cpu", all_ranks=True)
    want_losses, want = _plain(0.0)
    for rank, (said, losses, state) in enumerate(results):
        assert said == "trained", f"rank {rank}: {said}"
        assert losses == pytest.approx(want_losses, abs=1e-5), f"rank {rank}"
        worst = max((float((state[k] - want[k]).abs().max()), k) for k in want)
        assert worst[0] < 1e-5, f"rank {rank}: weights differ from the plain loop's: {worst}"
    results = paratrain.launch(_train, cases.AUX, nproc=2, timeout=120, accelerator="cpu", all_ranks=True)
    for rank, (said, _, _) in enumerate(results):
        assert re.search(REFUSED, said), f"rank {rank}: {said}"
